"""Command line: `ddptrain train | export | doctor | plot | ray`.

    ddptrain train --dataset digits --epochs 3                       # one process
    torchrun --standalone --nproc_per_node=2 -m ddptrain train       # two ranks, one node
    ddptrain export runs/ddptrain/checkpoints/latest.pt model.safetensors
    torchrun --standalone --nproc_per_node=2 -m ddptrain doctor      # check the cluster
    ddptrain plot runs/a runs/b -o curves.png                        # curves, overlaid
    ddptrain ray --workers 2 --epochs 2                              # two Ray Train workers

A wrong setting ends the run with one line, `ddptrain: error: ...`, and exit code 2; the
other exit codes are listed in `ddptrain.errors`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import re
import sys
from pathlib import Path
from typing import Any

from ddptrain import __version__
from ddptrain.api import fit
from ddptrain.config import ErrorParser, TrainingConfig, parse_config
from ddptrain.errors import EXIT_PEER_LOST, EXIT_USAGE, ConfigError, TrainingStopped


def train(config: TrainingConfig) -> dict[str, Any] | None:
    """Run training on this rank; returns the summary (rank 0) or None (other ranks)."""
    summary = fit(config)
    return summary if _rank() == "0" else None


def _print_summary(config: TrainingConfig, summary: dict[str, Any]) -> None:
    best = summary["best_metric"]
    val = " | ".join(
        f"val {k.removeprefix('val_')} {v:.4f}" for k, v in summary.items()
        if k.startswith("val_") and isinstance(v, float)
    )
    best_value = summary.get(f"best_val_{best}")
    best_text = f"{best_value:.4f}" if isinstance(best_value, float) else "n/a"
    print(
        f"done: {summary['epochs']} epochs, {summary['steps']} steps on "
        f"{summary['world_size']} rank(s) in {summary['train_time_s']:.1f}s "
        f"({summary['samples_per_sec']:,.0f} samples/s) | {val} "
        f"(best {best} {best_text}, epoch {summary['best_epoch']}) | run dir {summary['run_dir']}",
        flush=True,
    )


def _cmd_train(argv: list[str]) -> int:
    config = parse_config(argv)
    # torch and the trainer's modules are hundreds of thousands of objects that live as
    # long as the process: frozen, the cyclic collector never walks them again (each full
    # collection, such as the one before the process group is destroyed, saves ~0.1 s).
    import ddptrain.train.trainer  # noqa: F401

    gc.freeze()
    summary = train(config)
    if summary is not None and not summary.get("dry_run") and not summary.get("already_finished"):
        _print_summary(config, summary)
    return 0


def _cmd_export(argv: list[str]) -> int:
    from ddptrain.checkpoint import export_safetensors

    parser = ErrorParser(prog="ddptrain export", description="Export model weights to safetensors.")
    parser.add_argument(
        "checkpoint", type=Path, help="a ddptrain checkpoint: a .pt file or a DCP step directory"
    )
    parser.add_argument("output", type=Path, help="the .safetensors file to write")
    args = parser.parse_args(argv)
    count = export_safetensors(args.checkpoint, args.output)
    print(f"wrote {count} tensors to {args.output}")
    return 0


def _cmd_plot(argv: list[str]) -> int:
    from ddptrain.observe.plot import plot_runs

    parser = ErrorParser(
        prog="ddptrain plot",
        description="Loss, accuracy, LR and throughput curves of one or more runs, overlaid.",
    )
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run directory")
    parser.add_argument(
        "-o", "--output", type=Path, default=Path("curves.png"), help="PNG file to write"
    )
    args = parser.parse_args(argv)
    print(f"wrote {plot_runs(args.run_dirs, args.output)}")
    return 0


def _cmd_doctor(argv: list[str]) -> int:
    from ddptrain.launch.doctor import main as doctor_main

    return doctor_main(argv)


def _cmd_ray(argv: list[str]) -> int:
    from ddptrain.launch.ray import RayFailed, run_on_ray

    try:
        config, summary = run_on_ray(argv, fit)
    except RayFailed as exc:
        _report(f"error: {exc}")
        return exc.exit_code
    if summary is not None and not summary.get("dry_run") and not summary.get("already_finished"):
        _print_summary(config, summary)
    return 0


COMMANDS = {
    "train": _cmd_train, "export": _cmd_export, "doctor": _cmd_doctor, "plot": _cmd_plot,
    "ray": _cmd_ray,
}


def _lost_peer(exc: BaseException) -> bool:
    """A collective or the rendezvous store failed: a peer, not this process, is at fault."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    # gloo reports a dead or silent peer as a plain RuntimeError from its transport; NCCL's
    # watchdog (a collective past --timeout_s, or a failed one) aborts the communicators,
    # and the next wait or collective raises (DistBackendError, or a RuntimeError).
    text = str(exc)
    return isinstance(exc, RuntimeError) and (
        any(sign in text for sign in _PEER_SIGNS) or bool(_NCCL_TIMEOUT.search(text))
    )


_PEER_SIGNS = (
    "gloo/transport", "pair closure", "Connection closed by peer", "Connection reset",
    "Watchdog caught collective operation timeout", "NCCL communicator was aborted",
)
_NCCL_TIMEOUT = re.compile(r"ProcessGroupNCCL.*(timed out|timeout)", re.IGNORECASE)


def _unused_parameters(exc: BaseException) -> str | None:
    """DDP's reducer on a model whose steps leave parameters out of the loss, as what to
    pass; None for any other error. (The peer rank may fail the same way, or lose this one.)"""
    text = str(exc)
    if not isinstance(exc, RuntimeError):
        return None
    if "not compatible with static_graph" in text:
        return (
            "the model used other parameters on this step than on the first, and "
            "--static_graph says it never does: use --find_unused_parameters instead"
        )
    if "mark a variable ready only once" in text:
        return (
            "a parameter got its gradient twice in one backward pass (a module reused, or "
            "reentrant activation checkpointing): add --static_graph if the model uses the "
            "same parameters on every step"
        )
    if "finished reduction in the prior iteration" not in text and (
        "not used in producing loss" not in text
    ):
        return None
    if "find_unused_parameters=True` is enabled" in text:
        return (
            "DDP could not follow the loss back to every output the model returned, though "
            "--find_unused_parameters is on: compute the loss from all of the model's "
            "outputs, or return only those the loss uses"
        )
    # names with TORCH_DISTRIBUTED_DEBUG=INFO, else indices
    names = re.search(r"Parameters which did not receive grad for rank \d+: ([^\n]+)", text)
    indices = re.search(r"Parameter indices which did not receive grad for rank \d+: ([\d ]+)",
                        text)
    which = (
        f" ({names.group(1).strip()[:120]})" if names
        else f" (parameter indices {indices.group(1).strip()})" if indices else ""
    )
    return (
        f"the model left parameters{which} out of the loss on a step, and DDP waits for "
        "their gradients: add --find_unused_parameters (or --static_graph if the same "
        "parameters go unused on every step)"
    )


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)  # drop the C++ source location
    return text.split(". This is typically")[0][:200]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            f"usage: ddptrain {{{','.join(COMMANDS)}}} [options]   (ddptrain CMD --help)\n\n"
            + (__doc__ or "")
        )
        return 0 if argv else EXIT_USAGE
    if argv[0] == "--version":
        print(f"ddptrain {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    try:
        if command is None:
            raise ConfigError(
                f"unknown command {argv[0]!r}: choose one of {', '.join(COMMANDS)}"
            )
        return command(argv[1:])
    except ConfigError as exc:
        _report(f"error: {exc}")
        return EXIT_USAGE
    except TrainingStopped as exc:
        _report(f"stopped: {exc}")
        _note_exit(exc.exit_code)
        return exc.exit_code
    except Exception as exc:
        unused = _unused_parameters(exc)
        if unused is not None:
            _report(f"error: {unused}")
            return EXIT_USAGE
        if not _lost_peer(exc):
            raise
        _report(
            f"error: lost contact with the other ranks ({_first_line(exc)}): a peer died, "
            "hung longer than --timeout_s, or the network failed; restart the job with "
            "--resume_from auto"
        )
        _note_exit(EXIT_PEER_LOST)
        return EXIT_PEER_LOST
    except KeyboardInterrupt:
        _report("interrupted")
        return 130


def _note_exit(code: int) -> None:
    """Tell a wrapping launcher why the workers stopped: torchrun itself reports any
    worker's non-zero exit as 1, so `scripts/launch.sh` reads the code from this file."""
    path = os.environ.get("DDPTRAIN_EXIT_FILE")
    if path and _rank() == "0":
        with contextlib.suppress(OSError):
            Path(path).write_text(f"{code}\n")


def _rank() -> str:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def _report(text: str) -> None:
    """One line on stderr; ranks other than 0 say who they are."""
    rank = _rank()
    prefix = "" if rank == "0" else f"[rank {rank}] "
    # One write per line: ranks share the launcher's stderr, and print() writes the text
    # and its newline separately, so two ranks' lines could run together.
    sys.stderr.write(f"{prefix}ddptrain: {text}\n")
    sys.stderr.flush()
