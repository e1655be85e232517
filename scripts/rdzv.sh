# Sourced by scripts/launch.sh and scripts/slurm/run.sh: the torchrun rendezvous settings
# that keep a launcher from outliving its job.
#
# A torchrun agent waits in a rendezvous for its peers: at the start, and after a failure
# (--max_restarts) for a node that left to come back. torch's default is 600 s for that, on
# top of the --timeout_s its workers already waited for the lost peer; so a host that is
# gone for good kept the other launcher alive ten more minutes. Here the wait is derived
# from the run's --timeout_s and capped, so every launcher ends within --timeout_s plus a
# bounded margin:
#   join_timeout       min(--timeout_s, 45 s)   (JOIN_TIMEOUT overrides)
#   last_call_timeout  min(join_timeout, 10 s)  extra wait for more nodes once the
#                                               minimum is there (elastic NNODES=MIN:MAX)
#   read_timeout       join_timeout             one store operation (a partitioned node's
#                                               agent otherwise waits 60 s on each)
# A rejoining node must start within join_timeout of its peer's workers stopping, and all
# nodes within join_timeout of each other at the start: raise JOIN_TIMEOUT if they cannot.

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
    local join="${JOIN_TIMEOUT:-$((timeout < 45 ? timeout : 45))}"
    [[ "$join" =~ ^[0-9]+$ && "$join" -ge 1 ]] || join=1
    local last=$((join < 10 ? join : 10))
    echo "join_timeout=$join,last_call_timeout=$last,read_timeout=$join"
}

# torch 2.13's agents share the rank-0 agent's store with the workers, and then do not
# publish a later round's address to a node that rejoins: both wait for the join timeout
# and fail with DistStoreError. Without sharing, the workers' rank 0 hosts their own store.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE="${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}"
