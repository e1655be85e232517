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
#   NNODES [1]            nodes in the job; 1 uses torchrun --standalone (no address needed)
#   NPROC_PER_NODE        ranks per node [number of GPUs, or 1 without GPUs]
#   NODE_RANK             0..NNODES-1; 0 is the node at MASTER_ADDR (required if NNODES>1)
#   MASTER_ADDR, MASTER_PORT [29500]  the c10d rendezvous endpoint, on node 0
#   RDZV_ID [ddptrain]    job id of the rendezvous: the same on every node, new per job
#   MAX_RESTARTS [0]      torchrun restarts of the worker group after a failure
#   LOCAL_ADDR            this node's address as the others reach it (torchrun --local_addr)
#   COMMAND [train]       the ddptrain command to run: train | doctor
#   PYTHON                interpreter with ddptrain installed [the repo's .venv, else PATH]
set -euo pipefail

die() {
    echo "launch.sh: error: $*" >&2
    exit 2
}

NNODES="${NNODES:-1}"
MASTER_PORT="${MASTER_PORT:-29500}"
RDZV_ID="${RDZV_ID:-ddptrain}"
MAX_RESTARTS="${MAX_RESTARTS:-0}"
COMMAND="${COMMAND:-train}"

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    NPROC_PER_NODE=1
    if command -v nvidia-smi >/dev/null 2>&1; then
        gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
        [[ "$gpus" -gt 0 ]] && NPROC_PER_NODE="$gpus"
    fi
fi

for var in NNODES NPROC_PER_NODE MASTER_PORT MAX_RESTARTS; do
    [[ "${!var}" =~ ^[0-9]+$ ]] || die "$var=${!var} is not a whole number"
done
[[ "$NNODES" -ge 1 ]] || die "NNODES=$NNODES: use 1 or more nodes"
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

# `python -m torch.distributed.run` is torchrun, run by the interpreter that has ddptrain.
args=(--nproc_per_node="$NPROC_PER_NODE" --max_restarts="$MAX_RESTARTS")
if [[ "$NNODES" -eq 1 ]]; then
    # Standalone: a private rendezvous on a free local port, nothing to configure.
    args+=(--standalone --nnodes=1)
else
    MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
    # A name that resolves to loopback (many /etc/hosts map the host's own name there) is
    # as unreachable from the other nodes as 127.0.0.1 itself.
    resolved="$(getent ahostsv4 "$MASTER_ADDR" 2>/dev/null | awk 'NR == 1 { print $1 }' || true)"
    shown="$MASTER_ADDR"
    [[ -n "$resolved" && "$resolved" != "$MASTER_ADDR" ]] && shown="$MASTER_ADDR ($resolved)"
    case "$MASTER_ADDR|$resolved" in
        127.*|localhost*|::1*|*"|127."*)
            die "NNODES=$NNODES but MASTER_ADDR=$shown, a" \
                "loopback address: each node would wait for the others on itself. Set" \
                "MASTER_ADDR to node 0's address that every node can reach" \
                "(e.g. MASTER_ADDR=10.0.0.1), or use NNODES=1" ;;
    esac
    [[ -n "${NODE_RANK:-}" ]] ||
        die "NNODES=$NNODES needs NODE_RANK: 0 on the node at MASTER_ADDR=$MASTER_ADDR," \
            "1..$((NNODES - 1)) on the others"
    [[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] ||
        die "NODE_RANK=$NODE_RANK: use 0..$((NNODES - 1))"
    # Node 0 hosts the rendezvous store. torchrun would guess that from the host name,
    # which fails when names resolve to loopback or MASTER_ADDR is one of several
    # addresses of the host; NODE_RANK says it for sure.
    is_host=$([[ "$NODE_RANK" -eq 0 ]] && echo 1 || echo 0)
    args+=(
        --nnodes="$NNODES"
        --rdzv_backend=c10d --rdzv_endpoint="$MASTER_ADDR:$MASTER_PORT"
        --rdzv_id="$RDZV_ID" --rdzv_conf="is_host=$is_host"
    )
    [[ -n "${LOCAL_ADDR:-}" ]] && args+=(--local_addr="$LOCAL_ADDR")
fi

# torchrun reports any worker's non-zero exit as 1; the workers leave their own code (75:
# stopped by SIGTERM after a checkpoint, 130: by Ctrl-C) in this file, and it becomes ours.
exit_file="$(mktemp "${TMPDIR:-/tmp}/ddptrain-exit.XXXXXXXX")"
export DDPTRAIN_EXIT_FILE="$exit_file"
"$PYTHON" -m torch.distributed.run "${args[@]}" -m ddptrain "$COMMAND" "$@" &
child=$!
trap 'kill -TERM "$child" 2>/dev/null' TERM
trap 'kill -INT "$child" 2>/dev/null' INT
while :; do
    rc=0
    wait "$child" || rc=$?
    kill -0 "$child" 2>/dev/null || break  # a trap ended `wait` early: wait again
done
if [[ "$rc" -ne 0 && -s "$exit_file" ]]; then
    rc="$(<"$exit_file")"
fi
rm -f "$exit_file"
exit "$rc"
