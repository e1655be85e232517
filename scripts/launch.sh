#!/usr/bin/env bash
# Start `ddptrain train` (or another ddptrain command) under torchrun on this node.
#
#   scripts/launch.sh --epochs 5                                   # one node, standalone
#   NPROC_PER_NODE=2 scripts/launch.sh --epochs 5                  # one node, 2 ranks
#   # two nodes: run on each, NODE_RANK=0 on the node whose address is MASTER_ADDR
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/launch.sh --epochs 5   # on 10.0.0.1
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 scripts/launch.sh --epochs 5   # on the other
#   COMMAND=doctor NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/launch.sh
#
# Environment (defaults in brackets):
#   NNODES [1]            nodes in the job; 1 uses torchrun --standalone (no address needed);
#                         MIN:MAX for an elastic job
#   NPROC_PER_NODE        ranks per node [number of GPUs, or 1 without GPUs]
#   NODE_RANK             0..NNODES-1; 0 is the node at MASTER_ADDR (required if NNODES>1)
#   MASTER_ADDR, MASTER_PORT [29500]  the c10d rendezvous endpoint, on node 0
#   RDZV_ID [ddptrain]    job id of the rendezvous: the same on every node, new per job
#   RDZV_ENDPOINT, RDZV_CONF   host:port of the rendezvous [MASTER_ADDR:MASTER_PORT], and
#                         extra torchrun --rdzv_conf settings (key=value,...)
#   JOIN_TIMEOUT          seconds an agent waits for its peers [min(--timeout_s, 40)]: see
#                         scripts/rdzv.sh
#   MAX_RESTARTS [0]      torchrun restarts of the worker group after a failure
#   LOCAL_ADDR            this node's address as the others reach it (torchrun --local_addr)
#   COMMAND [train]       the ddptrain command to run: train | doctor
#   PYTHON                interpreter with ddptrain installed [the repo's .venv, else PATH]
#
# In a Kubeflow PyTorchJob (or Trainer v2 JobSet) pod the operator's PET_NNODES,
# PET_NPROC_PER_NODE (PET_N_PROC_PER_NODE), PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT
# and, for elastic jobs, PET_RDZV_ENDPOINT, PET_RDZV_ID, PET_RDZV_CONF, PET_MAX_RESTARTS stand
# for the variables above (a variable above, when set, wins).
set -euo pipefail

die() {
    echo "launch.sh: error: $*" >&2
    exit 2
}

# Kubeflow's training operator describes the job in torchrun's PET_* variables.
NNODES="${NNODES:-${PET_NNODES:-1}}"
NPROC_PER_NODE="${NPROC_PER_NODE:-${PET_NPROC_PER_NODE:-${PET_N_PROC_PER_NODE:-}}}"
NODE_RANK="${NODE_RANK:-${PET_NODE_RANK:-}}"
MASTER_ADDR="${MASTER_ADDR:-${PET_MASTER_ADDR:-}}"
MASTER_PORT="${MASTER_PORT:-${PET_MASTER_PORT:-29500}}"
RDZV_ENDPOINT="${RDZV_ENDPOINT:-${PET_RDZV_ENDPOINT:-}}"
RDZV_ID="${RDZV_ID:-${PET_RDZV_ID:-ddptrain}}"
RDZV_CONF="${RDZV_CONF:-${PET_RDZV_CONF:-}}"
MAX_RESTARTS="${MAX_RESTARTS:-${PET_MAX_RESTARTS:-0}}"
COMMAND="${COMMAND:-train}"

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
        [[ "$gpus" -gt 0 ]] && NPROC_PER_NODE="$gpus"
    fi
fi

for var in NPROC_PER_NODE MASTER_PORT MAX_RESTARTS ${JOIN_TIMEOUT:+JOIN_TIMEOUT}; do
    [[ "${!var}" =~ ^[0-9]+$ ]] || die "$var=${!var} is not a whole number"
done
# NNODES is a count, or MIN:MAX nodes for an elastic job.
[[ "$NNODES" =~ ^[0-9]+(:[0-9]+)?$ ]] || die "NNODES=$NNODES is not a whole number (or MIN:MAX)"
min_nodes="${NNODES%%:*}"
max_nodes="${NNODES##*:}"
[[ "$min_nodes" -ge 1 && "$max_nodes" -ge "$min_nodes" ]] ||
    die "NNODES=$NNODES: use 1 or more nodes (MIN:MAX with MIN <= MAX)"
[[ "$NPROC_PER_NODE" -ge 1 ]] || die "NPROC_PER_NODE=$NPROC_PER_NODE: use 1 or more"

# The interpreter: an explicit PYTHON, else the repo's own venv, else the one on PATH.
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$repo/.venv/bin/python" ]]; then
        PYTHON="$repo/.venv/bin/python"
    else
        PYTHON="$(command -v python3 || command -v python || true)"
    fi
fi
[[ -n "$PYTHON" ]] || die "no python found: set PYTHON=/path/to/python (with ddptrain installed)"

source "$repo/scripts/rdzv.sh"
# torchrun (`ddptrain.launch.torchrun`, below), run by the interpreter that has ddptrain.
# torchrun reads PET_* itself as the defaults of its flags; every flag it needs is given
# here, so what it reads is what this script decided.
args=(--nproc_per_node="$NPROC_PER_NODE" --max_restarts="$MAX_RESTARTS")
if [[ "$NNODES" == 1 ]]; then
    # Standalone: a private rendezvous on a free local port, nothing to configure.
    args+=(--standalone --nnodes=1)
else
    # Elastic (MIN:MAX) jobs may name the rendezvous host instead (PET_RDZV_ENDPOINT);
    # the agent on that host then finds out from its host name that it holds the store.
    endpoint="${RDZV_ENDPOINT:-${MASTER_ADDR:-127.0.0.1}:$MASTER_PORT}"
    rdzv_host="${endpoint%:*}"
    [[ "$endpoint" == *:* ]] || endpoint="$endpoint:$MASTER_PORT"
    # A name that resolves to loopback (many /etc/hosts map the host's own name there) is
    # as unreachable from the other nodes as 127.0.0.1 itself.
    resolved="$(getent ahostsv4 "$rdzv_host" 2>/dev/null | awk 'NR == 1 { print $1 }' || true)"
    shown="$rdzv_host"
    [[ -n "$resolved" && "$resolved" != "$rdzv_host" ]] && shown="$rdzv_host ($resolved)"
    what="MASTER_ADDR"
    [[ -n "$RDZV_ENDPOINT" ]] && what="RDZV_ENDPOINT"
    case "$rdzv_host|$resolved" in
        127.*|localhost*|::1*|*"|127."*)
            die "NNODES=$NNODES but $what=$shown, a" \
                "loopback address: each node would wait for the others on itself. Set" \
                "MASTER_ADDR to node 0's address that every node can reach" \
                "(e.g. MASTER_ADDR=10.0.0.1), or use NNODES=1" ;;
    esac
    conf="$(rdzv_timeouts "$@")"
    if [[ -n "$NODE_RANK" ]]; then
        [[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$max_nodes" ]] ||
            die "NODE_RANK=$NODE_RANK: use 0..$((max_nodes - 1))"
        # Node 0 hosts the rendezvous store. torchrun would guess that from the host name,
        # which fails when names resolve to loopback or MASTER_ADDR is one of several
        # addresses of the host; NODE_RANK says it for sure.
        conf="is_host=$([[ "$NODE_RANK" -eq 0 ]] && echo 1 || echo 0),$conf"
    elif [[ -z "$RDZV_ENDPOINT" ]]; then
        die "NNODES=$NNODES needs NODE_RANK: 0 on the node at MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}," \
            "1..$((max_nodes - 1)) on the others"
    fi
    # The user's RDZV_CONF comes last: torchrun keeps the last value of a key.
    args+=(
        --nnodes="$NNODES"
        --rdzv_backend=c10d --rdzv_endpoint="$endpoint"
        --rdzv_id="$RDZV_ID" --rdzv_conf="$conf${RDZV_CONF:+,$RDZV_CONF}"
    )
    [[ -n "${LOCAL_ADDR:-}" ]] && args+=(--local_addr="$LOCAL_ADDR")
fi

# The ranks and the agent leave the job's code in this file, and it becomes ours: that of the
# rank that failed of itself, not of those the job then stopped; 75 (143 on Kubernetes) when
# SIGTERM stopped the job after a checkpoint, which torchrun's agent cannot report; 130: Ctrl-C.
exit_file="$(mktemp "${TMPDIR:-/tmp}/ddptrain-exit.XXXXXXXX")"
export DDPTRAIN_EXIT_FILE="$exit_file"
# torchrun's agent, reporting a failed job as ddptrain does (src/ddptrain/launch/torchrun.py):
# the ranks' own lines last, with their code, not torchrun's traceback.
"$PYTHON" -m ddptrain.launch.torchrun "${args[@]}" -m ddptrain "$COMMAND" "$@" &
child=$!
watchdog=""
if [[ "$NNODES" != 1 ]]; then
    watch_agent "$child" "$conf" "$exit_file"
    watchdog=$!
fi
trap 'kill -TERM "$child" 2>/dev/null' TERM
trap 'kill -INT "$child" 2>/dev/null' INT
while :; do
    rc=0
    wait "$child" || rc=$?
    kill -0 "$child" 2>/dev/null || break  # a trap ended `wait` early: wait again
done
# (a watchdog that saw the agent end first is gone already: not a failure, under set -e)
if [[ -n "$watchdog" ]]; then kill "$watchdog" 2>/dev/null || true; fi
if [[ "$rc" -ne 0 && -s "$exit_file" ]]; then
    read -r rc _ <"$exit_file" || true  # "CODE ROUND": ddptrain.launch.signals.note_exit
fi
rm -f "$exit_file"
exit "$rc"
