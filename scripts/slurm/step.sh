#!/usr/bin/env bash
# One Slurm task (one per node): run the command given, and if a SIGTERM reaches the step
# (Slurm's --signal=TERM@ before the time limit, a preemption, `scancel --signal=TERM`),
# leave the file MARKER so that the batch script knows to requeue. The signal reaches every
# process of the step; torchrun and its workers handle it themselves, so it is not forwarded.
# A torchrun left without workers (its rendezvous host gone) is ended: scripts/rdzv.sh.
#
#   srun bash scripts/slurm/step.sh MARKER python -m torch.distributed.run ...
set -uo pipefail
marker="$1"
shift
trap 'touch "$marker"' TERM
"$@" &
child=$!
if [[ -n "${DDPTRAIN_RDZV_CONF:-}" ]]; then
    # A torchrun whose rendezvous host is gone for good may block forever: end it.
    source "$(dirname "${BASH_SOURCE[0]}")/../rdzv.sh"
    watch_agent "$child" "$DDPTRAIN_RDZV_CONF" "${DDPTRAIN_EXIT_FILE:-/dev/null}"
fi
while :; do
    wait "$child"
    rc=$?
    # A trap ends `wait` early; the command is still checkpointing, so wait on.
    kill -0 "$child" 2>/dev/null || break
done
exit "$rc"
