#!/usr/bin/env bash
# One Slurm task (one per node): run the command given, and if a SIGTERM reaches the step
# (Slurm's --signal=TERM@ before the time limit, a preemption, `scancel --signal=TERM`),
# leave the file MARKER so that the batch script knows to requeue. The signal reaches every
# process of the step; torchrun and its workers handle it themselves, so it is not forwarded.
#
#   srun bash scripts/slurm/step.sh MARKER python -m torch.distributed.run ...
set -uo pipefail
marker="$1"
shift
trap 'touch "$marker"' TERM
"$@" &
child=$!
while :; do
    wait "$child"
    rc=$?
    # A trap ends `wait` early; the command is still checkpointing, so wait on.
    kill -0 "$child" 2>/dev/null || break
done
exit "$rc"
