#!/usr/bin/env bash
# The body of the sbatch scripts (train.sbatch, train_cpu.sbatch): one torchrun per node,
# c10d rendezvous on the first node of the allocation, requeue after a preemption.
#
# Environment: DDPTRAIN_ROOT [the submit directory]  the ddptrain checkout (for .venv)
#              PYTHON [ROOT/.venv/bin/python, else python3 on PATH]
#              NPROC_PER_NODE [GPUs on the node; CPU variant: --cpus-per-task, else 1]
#              RDZV_PORT [29500]   MAX_REQUEUES [3]   COMMAND [train]
set -uo pipefail

die() {
    echo "ddptrain slurm: error: $*" >&2
    exit 2
}

[[ -n "${SLURM_JOB_ID:-}" ]] || die "not inside a Slurm job: submit with sbatch"
root="${DDPTRAIN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$root/.venv/bin/python" ]]; then
        PYTHON="$root/.venv/bin/python"
    else
        PYTHON="$(command -v python3 || true)"
    fi
fi
[[ -n "$PYTHON" ]] || die "no python: set PYTHON or DDPTRAIN_ROOT (a checkout with .venv)"
COMMAND="${COMMAND:-train}"

# Head node: the first host of the allocation. It hosts the rendezvous store.
head="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
[[ -n "$head" ]] || die "scontrol show hostnames $SLURM_JOB_NODELIST gave no host"
port="${RDZV_PORT:-29500}"

if [[ -z "${NPROC_PER_NODE:-}" ]]; then
    if [[ "${DDPTRAIN_DEVICE:-gpu}" == cpu ]]; then
        NPROC_PER_NODE="${SLURM_CPUS_PER_TASK:-1}"
    elif [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
        NPROC_PER_NODE="$SLURM_GPUS_ON_NODE"
    else
        NPROC_PER_NODE="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
        [[ "$NPROC_PER_NODE" -gt 0 ]] ||
            die "no GPU on $(hostname): request GPUs (--gres=gpu:N) or use train_cpu.sbatch"
    fi
fi

extra=()
if [[ "$COMMAND" == train ]]; then
    # A requeued job continues from its newest checkpoint; a flag given later wins.
    extra=(--resume_from auto)
fi

# A SIGTERM to the steps (the --signal=TERM@ lead before the time limit, a preemption,
# `scancel --signal=TERM JOB.0`) is noted by step.sh in this file; one to the batch shell
# as well (`scancel --signal=TERM --full JOB`) by the trap below. The trap must not pass it
# on to srun: srun answers SIGTERM by killing the step at once, checkpoint or not.
# Unique per run: job ids repeat across clusters that share a /tmp.
marker="$(mktemp -u "${TMPDIR:-/tmp}/ddptrain-preempted.$SLURM_JOB_ID.XXXXXXXX")"
# Rank 0 leaves its exit code here (75: stopped by SIGTERM after a checkpoint): torchrun
# reports any worker's failure as 1. In the submit directory, which every node shares.
exit_file="${SLURM_SUBMIT_DIR:-$PWD}/.ddptrain-exit.$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"
rm -f "$exit_file"
export DDPTRAIN_EXIT_FILE="$exit_file"
trap 'touch "$marker"' TERM

echo "ddptrain slurm: job $SLURM_JOB_ID restart ${SLURM_RESTART_COUNT:-0}:" \
    "$SLURM_NNODES node(s) x $NPROC_PER_NODE rank(s), rendezvous $head:$port"
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
    bash "$root/scripts/slurm/step.sh" "$marker" \
    "$PYTHON" -m torch.distributed.run \
    --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$head:$port" --rdzv_id="$SLURM_JOB_ID" \
    -m ddptrain "$COMMAND" "${extra[@]}" "$@" &
step=$!
while :; do
    wait "$step"
    rc=$?
    kill -0 "$step" 2>/dev/null || break  # the trap ended `wait` early
done
preempted=0
[[ -e "$marker" ]] && preempted=1
rm -f "$marker"
[[ "$rc" -eq 0 ]] && { rm -f "$exit_file"; exit 0; }

if [[ "$preempted" -eq 1 && "${SLURM_RESTART_COUNT:-0}" -lt "${MAX_REQUEUES:-3}" ]]; then
    echo "ddptrain slurm: step ended by a preemption signal (exit $rc): requeueing job" \
        "$SLURM_JOB_ID to resume from its last checkpoint"
    rm -f "$exit_file"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
if [[ -s "$exit_file" ]]; then
    rc="$(<"$exit_file")"
fi
rm -f "$exit_file"
echo "ddptrain slurm: step ended (exit $rc)" >&2
exit "$rc"
