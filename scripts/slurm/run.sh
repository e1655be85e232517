#!/usr/bin/env bash
# The body of the sbatch scripts (train.sbatch, train_cpu.sbatch): one torchrun per node,
# c10d rendezvous on the first node of the allocation, requeue after a preemption.
#
# Environment: DDPTRAIN_ROOT [the submit directory]  the ddptrain checkout (for .venv)
#              PYTHON [ROOT/.venv/bin/python, else python3 on PATH]
#              NPROC_PER_NODE [GPUs on the node; CPU variant: --cpus-per-task, else 1]
#              RDZV_PORT [29500; in a job array, one derived from the task's job id]
#              MAX_REQUEUES [3]   COMMAND [train]   JOIN_TIMEOUT (scripts/rdzv.sh)
#
# In a job array (sbatch --array) each task is a job of its own: it requeues itself
# (ARRAYJOB_TASK), and `--output_dir DIR` becomes DIR/task_<array index>, one run directory
# per task, which that task's requeues resume.
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
# The tasks of an array may share a node: each needs a port of its own.
default_port=29500
[[ -n "${SLURM_ARRAY_TASK_ID:-}" ]] && default_port=$((20000 + SLURM_JOB_ID % 10000))
port="${RDZV_PORT:-$default_port}"
source "$root/scripts/rdzv.sh"

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
job="$SLURM_JOB_ID"
args=("$@")
if [[ -n "${SLURM_ARRAY_TASK_ID:-}" && -n "${SLURM_ARRAY_JOB_ID:-}" ]]; then
    # `scontrol requeue` takes an array task as ARRAYJOB_TASK; the run directory is the
    # task's own, so that the tasks never share (or fight over) one.
    job="${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
    for i in "${!args[@]}"; do
        if [[ "${args[$i]}" == --output_dir ]] && ((i + 1 < ${#args[@]})); then
            args[i + 1]="${args[i + 1]%/}/task_$SLURM_ARRAY_TASK_ID"
        elif [[ "${args[$i]}" == --output_dir=* ]]; then
            args[i]="${args[$i]%/}/task_$SLURM_ARRAY_TASK_ID"
        fi
    done
fi

# A SIGTERM to the steps (the --signal=TERM@ lead before the time limit, a preemption,
# `scancel --signal=TERM JOB.0`) is noted by step.sh in this file; one to the batch shell
# as well (`scancel --signal=TERM --full JOB`) by the trap below. The trap must not pass it
# on to srun: srun answers SIGTERM by killing the step at once, checkpoint or not.
# Unique per run: job ids repeat across clusters that share a /tmp.
marker="$(mktemp -u "${TMPDIR:-/tmp}/ddptrain-preempted.$SLURM_JOB_ID.XXXXXXXX")"
# The ranks leave the job's code here (that of the rank that failed of itself; 75: stopped by
# SIGTERM after a checkpoint): srun reports the highest of its nodes'. In the submit
# directory, which every node shares.
exit_file="${SLURM_SUBMIT_DIR:-$PWD}/.ddptrain-exit.$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}"
rm -f "$exit_file"
export DDPTRAIN_EXIT_FILE="$exit_file"
trap 'touch "$marker"' TERM

# step.sh stops a torchrun stuck without workers (scripts/rdzv.sh: watch_agent).
export DDPTRAIN_RDZV_CONF="$(rdzv_timeouts "${args[@]}")"
echo "ddptrain slurm: job $job restart ${SLURM_RESTART_COUNT:-0}:" \
    "$SLURM_NNODES node(s) x $NPROC_PER_NODE rank(s), rendezvous $head:$port"
srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
    bash "$root/scripts/slurm/step.sh" "$marker" \
    "$PYTHON" -m ddptrain.launch.torchrun \
    --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --rdzv_backend=c10d --rdzv_endpoint="$head:$port" --rdzv_id="$SLURM_JOB_ID" \
    --rdzv_conf="$DDPTRAIN_RDZV_CONF" \
    -m ddptrain "$COMMAND" "${extra[@]}" "${args[@]}" &
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
        "$job to resume from its last checkpoint"
    rm -f "$exit_file"
    scontrol requeue "$job"
    exit 0
fi
if [[ -s "$exit_file" ]]; then
    read -r rc _ <"$exit_file" || true  # "CODE ROUND": ddptrain.launch.signals.note_exit
fi
rm -f "$exit_file"
echo "ddptrain slurm: step ended (exit $rc)" >&2
exit "$rc"
