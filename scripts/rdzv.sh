# Sourced by scripts/launch.sh and scripts/slurm/run.sh: the torchrun rendezvous settings
# that keep a launcher from outliving its job.
#
# A torchrun agent waits in a rendezvous for its peers: at the start, and after a failure
# (--max_restarts) for a node that left to come back. torch's default is 600 s for that, on
# top of the --timeout_s its workers already waited for the lost peer; so a host that is
# gone for good kept the other launcher alive ten more minutes. Here the wait is derived
# from the run's --timeout_s and capped, so every launcher ends within --timeout_s plus a
# bounded margin:
#   join_timeout       min(--timeout_s, 40 s)   (JOIN_TIMEOUT overrides)
#   last_call_timeout  min(join_timeout, 10 s)  extra wait for more nodes once the
#                                               minimum is there (elastic NNODES=MIN:MAX)
#   read_timeout       join_timeout             one store operation (a partitioned node's
#                                               agent otherwise waits 60 s on each)
# A rejoining node must start within join_timeout of its peer's workers stopping, and all
# nodes within join_timeout of each other at the start: raise JOIN_TIMEOUT if they cannot.
#
# Those settings do not bound everything: an agent whose rendezvous host became unreachable
# (a partition) blocks in a store read that never times out, its dead workers unreaped.
# `watch_agent` ends such an agent: no live worker for join_timeout + 15 s means the
# agent is stuck (a live one either has workers or gives up at join_timeout). So a host
# gone for good ends every launcher within --timeout_s + join_timeout + 20 s.

# rdzv_timeouts ARGS...: prints "join_timeout=J,last_call_timeout=L,read_timeout=J" for
# the ddptrain arguments given (it reads their --timeout_s; 600, ddptrain's default, else).
rdzv_timeouts() {
    local timeout=600 prev="" arg
    for arg in "$@"; do
        case "$arg" in
            --timeout_s=*) timeout="${arg#--timeout_s=}" ;;
            *) [[ "$prev" == --timeout_s ]] && timeout="$arg" ;;
        esac
        prev="$arg"
    done
    # A whole number of seconds, rounded up; a malformed value is ddptrain's to refuse.
    if [[ "$timeout" =~ ^[0-9]+(\.[0-9]*)?$ ]]; then
        local whole="${timeout%%.*}"
        [[ "$timeout" == *.* && "${timeout#*.}" =~ [1-9] ]] && whole=$((whole + 1))
        timeout="$whole"
    else
        timeout=600
    fi
    local join="${JOIN_TIMEOUT:-$((timeout < 40 ? timeout : 40))}"
    [[ "$join" =~ ^[0-9]+$ && "$join" -ge 1 ]] || join=1
    local last=$((join < 10 ? join : 10))
    echo "join_timeout=$join,last_call_timeout=$last,read_timeout=$join"
}

# torch 2.13's agents share the rank-0 agent's store with the workers, and then do not
# publish a later round's address to a node that rejoins: both wait for the join timeout
# and fail with DistStoreError. Without sharing, the workers' rank 0 hosts their own store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"

# watch_agent PID CONF EXIT_FILE: in the background, end torchrun PID once it has had no
# live worker for join_timeout (from CONF, rdzv_timeouts' output) + 15 s; the workers lost
# their peers, so EXIT_FILE, when empty, gets 3 (lost contact), ddptrain's code for it.
watch_agent() {
    local agent="$1" conf="$2" exit_file="$3" join limit idle=0
    join="${conf#*join_timeout=}"
    join="${join%%,*}"
    limit=$((join + 15))
    (
        while kill -0 "$agent" 2>/dev/null; do
            sleep 1
            # Workers are the agent's children; a dead one it never reaped is a zombie.
            if ps -o stat= --ppid "$agent" 2>/dev/null | grep -qv '^Z'; then
                idle=0
            else
                idle=$((idle + 1))
            fi
            if ((idle > limit)); then
                echo "ddptrain: error: torchrun (pid $agent) has had no worker for ${limit}s:" \
                    "its rendezvous cannot be reached or never completes; stopping it" >&2
                [[ -s "$exit_file" ]] || echo 3 >"$exit_file"
                kill -TERM "$agent" 2>/dev/null
                sleep 5
                kill -KILL "$agent" 2>/dev/null
                exit 0
            fi
        done
    ) &
}
