"""`ddptrain doctor`: check that every rank of a job can see every other, and how fast.

Run it under the launcher the training job will use:

    ddptrain doctor                                                     # this process only
    torchrun --standalone --nproc_per_node=2 -m ddptrain doctor         # 2 ranks, one node
    COMMAND=doctor NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 scripts/launch.sh   # per node
    srun --ntasks=4 python -m ddptrain doctor                           # Slurm tasks

Rank 0 prints the torch version, the process-group backends this build has, the devices,
the detected launcher, the network interface the ranks talk over and the identity of
every rank (host, address, pid, rank, local rank, device), then times an all-reduce of a
few sizes and reports its latency and bus bandwidth (NCCL-tests' convention: algorithm
bandwidth x 2(n-1)/n, the bytes each rank's link carries in a ring all-reduce). A rank
that cannot be reached within `--timeout_s` ends it with one error line and exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ddptrain.config import ConfigError
from ddptrain.config_cli import ErrorParser
from ddptrain.launch.cluster import ClusterEnv, read_cluster_env
from ddptrain.layout import Layout

EXIT_UNREACHABLE = 1
_SIOCGIFADDR = 0x8915  # Linux ioctl: the IPv4 address of an interface
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30}


@dataclass(frozen=True)
class Interface:
    name: str | None  # None: unknown (not Linux, or no interface holds the address)
    address: str | None
    why: str  # how it was chosen


@dataclass(frozen=True)
class Identity:
    hostname: str
    address: str | None
    pid: int
    rank: int
    local_rank: int
    device: str


# ---------------------------------------------------------------------- network
def interface_address(name: str) -> str | None:
    """IPv4 address of interface `name` (None if it has none or does not exist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_of(address: str) -> str | None:
    """Name of the local interface that holds `address`."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def route_source(dest: str) -> str | None:
    """The local address the kernel would send from to reach `dest` (no packet is sent:
    connecting a UDP socket only picks a route)."""
    try:
        infos = socket.getaddrinfo(dest, 9, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])
            return str(s.getsockname()[0])
    except OSError:
        return None


def choose_interface(env: Mapping[str, str], master_addr: str | None) -> Interface:
    """The interface the ranks' traffic leaves through: the one the backend is told to use,
    else the one that routes to MASTER_ADDR."""
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        value = env.get(var, "")
        # NCCL accepts "^lo,docker" (exclude) and "=eth0" (exact); the first plain name
        # is the one to report.
        names = [n.lstrip("=") for n in value.split(",") if n and not value.startswith("^")]
        if names:
            return Interface(names[0], interface_address(names[0]), f"{var}={value}")
    if not master_addr:
        return Interface(None, None, "no MASTER_ADDR: a single process talks to nobody")
    source = route_source(master_addr)
    name = interface_of(source) if source else None
    return Interface(name, source, f"routes to MASTER_ADDR={master_addr}")


def _loopback_warning(cluster: ClusterEnv, env: Mapping[str, str]) -> str | None:
    """gloo without GLOO_SOCKET_IFNAME binds to the address of the host name; when that is
    loopback, ranks on other hosts can never connect."""
    local_world = int(env.get("LOCAL_WORLD_SIZE", cluster.world_size))
    if cluster.world_size <= local_world or env.get("GLOO_SOCKET_IFNAME"):
        return None
    host = socket.gethostname()
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return f"host name {host!r} does not resolve: set GLOO_SOCKET_IFNAME=<interface>"
    if addr.startswith("127."):
        return (
            f"host name {host!r} resolves to {addr}, and gloo binds there unless told: "
            "ranks on other hosts cannot reach it; set GLOO_SOCKET_IFNAME=<interface>"
        )
    return None


# ---------------------------------------------------------------------- report
def parse_size(text: str) -> int:
    raw = text.strip().upper()
    digits = raw.rstrip("KMGB")
    unit = raw[len(digits):]
    if not digits.isdigit() or unit not in _UNITS or int(digits) * _UNITS[unit] < 4:
        raise ConfigError(f"--sizes {text!r} is invalid: use byte counts such as 4K,1M,16M (>= 4)")
    return int(digits) * _UNITS[unit] // 4 * 4  # whole float32 elements


def _human(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


def bus_bandwidth(nbytes: int, seconds: float, world_size: int) -> float:
    """Bus bandwidth in GB/s of an all-reduce of `nbytes` that took `seconds`."""
    return nbytes / seconds * 2 * (world_size - 1) / world_size / 1e9


def _devices() -> str:
    import torch

    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        return f"{len(names)} CUDA: " + ", ".join(names)
    return f"cpu ({os.cpu_count()} cores), no CUDA device"


def _backends() -> str:
    import torch.distributed as dist

    have = {
        "gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    return " ".join(f"{k}={'yes' if v else 'no'}" for k, v in have.items())


def _time_all_reduce(
    sizes: Sequence[int], warmup: int, iters: int, device: Any, world_size: int
) -> list[dict[str, float]]:
    """Seconds per all-reduce of each size: the slowest rank's mean over `iters`."""
    import torch
    import torch.distributed as dist

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    rows = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(buf)
        sync()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(buf)
        sync()
        elapsed = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
        # The collective is as slow as its slowest rank; report that rank's time.
        elapsed = elapsed.to(device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        seconds = float(elapsed.item())
        rows.append({
            "bytes": nbytes, "latency_us": seconds * 1e6,
            "algbw_gbps": nbytes / seconds / 1e9,
            "busbw_gbps": bus_bandwidth(nbytes, seconds, world_size),
        })
    return rows


def _print(lines: list[str]) -> None:
    print("\n".join(lines), flush=True)


# ---------------------------------------------------------------------- command
def build_parser() -> ErrorParser:
    parser = ErrorParser(
        prog="ddptrain doctor",
        description="Check the ranks of a job can reach each other; time an all-reduce.",
    )
    parser.add_argument("--timeout_s", type=float, default=60.0,
                        help="seconds to wait for every rank before giving up (default: 60)")
    parser.add_argument("--backend", choices=("auto", "nccl", "gloo"), default="auto",
                        help="process-group backend (default: auto, as train)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="device of the test tensors (default: auto, as train)")
    parser.add_argument("--sizes", default="4K,1M,16M",
                        help="all-reduce message sizes in bytes (default: 4K,1M,16M)")
    parser.add_argument("--strategy", choices=("ddp", "zero", "fsdp"), default="ddp",
                        help="the strategy the job will train with (default: ddp)")
    parser.add_argument("--parameters", default=None, metavar="COUNT",
                        help="model parameters, e.g. 125M: print the bytes per rank the "
                             "strategy implies")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="adamw",
                        help="optimizer, for the state it keeps (default: adamw)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree of the job, for the bytes per rank")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline stages of the job, for the bytes per rank")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel degree of the job (each sequence split over it: "
                        "its activations / cp), for the bytes per rank")
    parser.add_argument("--dp_replicate", type=int, default=1,
                        help="HSDP replicas of the job (--strategy fsdp), for the bytes per rank")
    parser.add_argument("--experts", default=None, metavar="COUNT",
                        help="of --parameters, those in a mixture's experts, e.g. 45B")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel degree of the job (--experts spread over it)")
    parser.add_argument("--world_size", type=int, default=None,
                        help="ranks of the job, for the bytes per rank (default: this launch's)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per size")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations per size")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    if not args.timeout_s > 0:
        raise ConfigError(f"--timeout_s {args.timeout_s!r} is invalid: use a positive number")
    if args.warmup < 0 or args.iters < 1:
        raise ConfigError("--warmup must be 0 or more and --iters at least 1")

    import torch

    from ddptrain.config import TrainingConfig
    from ddptrain.launch.process_group import resolve_device

    cluster = read_cluster_env()
    config = TrainingConfig(device=args.device, backend=args.backend, timeout_s=args.timeout_s)
    device = resolve_device(config, cluster.local_rank, cluster.local_world_size)
    iface = choose_interface(os.environ, cluster.master_addr)
    me = Identity(socket.gethostname(), iface.address, os.getpid(), cluster.rank,
                  cluster.local_rank, str(device))
    where = (
        f"MASTER_ADDR={cluster.master_addr} MASTER_PORT={cluster.master_port}"
        if cluster.world_size > 1 else "no rendezvous"
    )
    header = [
        "ddptrain doctor",
        f"torch      {torch.__version__}",
        f"backends   {_backends()}",
        f"devices    {_devices()}",
        f"launcher   {cluster.source}: world size {cluster.world_size}, {where}"
        + _slurm_note(os.environ),
        f"interface  {iface.name or 'unknown'} ({iface.address or 'no address'}), {iface.why}",
    ]
    header.append(_memory_line(args, cluster.world_size, device))
    warning = _loopback_warning(cluster, os.environ)
    if warning:
        header.append(f"warning    {warning}")
    if cluster.world_size == 1:
        _print([*header, "ranks      1", "  " + _identity_line(me),
                "all-reduce skipped: world size 1 (launch with torchrun or srun for more ranks)"])
        return 0
    return _run_group(args, config, cluster, me, header, sizes)


def _memory_line(args: argparse.Namespace, world_size: int, device: Any) -> str:
    """The strategy and its layout (`--tp`, `--pp`, `--dp_replicate` over `--world_size` ranks),
    and what it implies per rank for a model of `--parameters`."""
    from ddptrain.config import TrainingConfig
    from ddptrain.config_sections import ParallelSection
    from ddptrain.parallel import resolve_strategy
    from ddptrain.parallel.memory import format_bytes, optimizer_slots

    for flag in ("tp", "pp", "cp", "dp_replicate", "world_size", "ep"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ConfigError(f"--{flag} {value} is invalid: use a positive number of ranks")
    degrees = ParallelSection(tp=args.tp, pp=args.pp, cp=args.cp, dp_replicate=args.dp_replicate,
                              ep=args.ep)
    if args.world_size is None and world_size == 1 and Layout.of(degrees).world_size > 1:
        flags = " ".join(f"--{f} {getattr(args, f)}" for f in ("tp", "pp", "cp", "dp_replicate")
                         if getattr(args, f) > 1)
        raise ConfigError(
            f"{flags} is the layout of a job of "
            "several ranks and this doctor runs as one process: add --world_size N (the "
            "job's ranks), or launch the doctor as the job is launched"
        )
    world_size = args.world_size or world_size
    config = TrainingConfig(strategy=args.strategy, optimizer=args.optimizer, tp=args.tp,
                            pp=args.pp, cp=args.cp, dp_replicate=args.dp_replicate,
                            ep=args.ep).validate()
    choice = resolve_strategy(config, world_size, device)  # a layout that does not fit: one line
    if args.parameters is None:
        return f"strategy   {choice.label} (give --parameters 125M for the bytes per rank)"
    count = _count("parameters", args.parameters)
    experts = _count("experts", args.experts) if args.experts is not None else 0
    if experts > count:
        raise ConfigError(f"--experts {args.experts} is more than --parameters "
                          f"{args.parameters}: give the experts' share of the model")
    figures = choice.rank_bytes(count, optimizer_slots(config), experts=experts)
    spread = (f" ({experts:,} in experts, spread over {args.ep} ranks)" if experts and
              args.ep > 1 else f" ({experts:,} in experts)" if experts else "")
    return (f"strategy   {choice.label} on {world_size} rank(s), {count:,} parameters{spread}, "
            f"{args.optimizer}: {format_bytes(figures)}")


def _count(flag: str, value: str) -> int:
    """A parameter count such as 125M or 7B."""
    text = value.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    try:
        return int(float(digits) * scale)
    except ValueError:
        raise ConfigError(
            f"--{flag} {value!r} is invalid: use a count such as 125M or 7B"
        ) from None


def _slurm_note(env: Mapping[str, str]) -> str:
    """The Slurm job around this process, if any (torchrun inside sbatch shows here)."""
    if "SLURM_JOB_ID" not in env:
        return ""
    nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "?"
    return f" (Slurm job {env['SLURM_JOB_ID']} on {nodes})"


def _identity_line(who: Identity) -> str:
    return (
        f"rank {who.rank:>3}  local {who.local_rank:>2}  host {who.hostname}  "
        f"addr {who.address or '?'}  pid {who.pid}  device {who.device}"
    )


def _run_group(
    args: Any, config: Any, cluster: ClusterEnv, me: Identity, header: list[str],
    sizes: list[int],
) -> int:
    import torch.distributed as dist

    from ddptrain.launch.process_group import setup_distributed, teardown_distributed

    t0 = time.perf_counter()
    clean = False
    try:
        try:
            ctx = setup_distributed(config, cluster)
            gathered: list[Any] = [None] * cluster.world_size
            dist.all_gather_object(gathered, asdict(me))
            startup = time.perf_counter() - t0
            # A peer that dies mid-test fails the collectives here, after the timeout.
            rows = _time_all_reduce(sizes, args.warmup, args.iters, ctx.device, ctx.world_size)
        except (ConfigError, RuntimeError, TimeoutError, OSError) as exc:
            _unreachable(cluster, args.timeout_s, time.perf_counter() - t0, exc)
            return EXIT_UNREACHABLE
        clean = True
    finally:
        with contextlib.suppress(Exception):
            teardown_distributed(clean)
    if cluster.rank == 0:
        ranks = sorted((Identity(**g) for g in gathered), key=lambda i: i.rank)
        hosts = {(r.hostname, r.address) for r in ranks}
        lines = [
            *header,
            f"ranks      {len(ranks)} on {len(hosts)} host(s) "
            f"(group up in {startup:.2f}s, backend {ctx.backend})",
            *("  " + _identity_line(r) for r in ranks),
            f"all-reduce float32, {args.warmup} warm-up + {args.iters} timed iterations, "
            f"slowest rank:",
            f"  {'size':>10}  {'latency':>12}  {'algbw':>11}  {'busbw':>11}",
        ]
        for row in rows:
            lines.append(
                f"  {_human(int(row['bytes'])):>10}  {row['latency_us']:>9.1f} us"
                f"  {row['algbw_gbps']:>6.3f} GB/s  {row['busbw_gbps']:>6.3f} GB/s"
            )
        lines.append(f"ok: all {len(ranks)} ranks reached each other")
        _print(lines)
    return 0


def _unreachable(cluster: ClusterEnv, timeout: float, waited: float, exc: BaseException) -> None:
    text = str(exc).strip()
    first = (text.splitlines()[0] if text else type(exc).__name__).rstrip(".")
    if isinstance(exc, ConfigError):
        advice = first  # setup_distributed already says what happened and what to do
    else:
        advice = (
            f"{first[:300]}; check that every rank was started, that MASTER_ADDR is "
            "reachable from every node, that the ports are open, and "
            "GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME"
        )
    print(
        f"[rank {cluster.rank}] ddptrain doctor: error: not all {cluster.world_size} ranks "
        f"were reachable within --timeout_s {timeout:g} (gave up after {waited:.1f}s, "
        f"MASTER_ADDR={cluster.master_addr}, MASTER_PORT={cluster.master_port}): {advice}",
        file=sys.stderr, flush=True,
    )
