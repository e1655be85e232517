"""Command line: `ddptrain train | export | doctor | plot`.

    ddptrain train --dataset digits --epochs 3                       # one process
    torchrun --standalone --nproc_per_node=2 -m ddptrain train       # two ranks, one node
    ddptrain export runs/ddptrain/checkpoints/latest.pt model.safetensors
    torchrun --standalone --nproc_per_node=2 -m ddptrain doctor      # check the cluster
    ddptrain plot runs/a runs/b -o curves.png                        # curves, overlaid

A wrong setting ends the run with one line, `ddptrain: error: ...`, and exit code 2; the
other exit codes are listed in `ddptrain.errors`.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Any

from ddptrain import __version__
from ddptrain.config import ConfigError, ErrorParser, TrainingConfig, dump_yaml, parse_config
from ddptrain.errors import EXIT_PEER_LOST, EXIT_USAGE, TrainingStopped


def prepare_run_dir(config: TrainingConfig) -> None:
    """Create the run directory and write the resolved config (rank 0, before the group)."""
    for directory, flag in ((config.run_dir, "output_dir"), (config.ckpt_dir, "checkpoint_dir")):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / f".write-test.{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"--{flag} {str(directory)!r} is not writable ({exc.strerror}): "
                "choose a directory you can write to"
            ) from None
    dump_yaml(config, config.run_dir / "config.yaml")


def train(config: TrainingConfig) -> dict[str, Any] | None:
    """Run training on this rank; returns the summary (rank 0) or None (other ranks)."""
    # Imported here so that `--help` and config errors answer without loading torch.
    from ddptrain.data import load_data
    from ddptrain.distributed import (
        read_cluster_env,
        resolve_backend,
        resolve_device,
        setup_distributed,
        teardown_distributed,
    )
    from ddptrain.log import setup_logging
    from ddptrain.trainer import resolve_precision

    cluster = read_cluster_env()
    setup_logging(cluster.rank)
    device = resolve_device(config, cluster.local_rank)
    resolve_backend(config, device)
    resolve_precision(config, device)
    if config.sync_bn and device.type == "cpu" and cluster.world_size > 1:
        raise ConfigError(
            "--sync_bn is invalid on CPU: SyncBatchNorm needs CUDA devices; drop the flag"
        )
    # Everything a user can get wrong is checked before the process group starts, so a
    # mistake ends the job at once instead of leaving peers waiting for a dead rank.
    data = load_data(config)
    if cluster.rank == 0:
        prepare_run_dir(config)
    ctx = setup_distributed(config, cluster)
    clean = False
    try:
        summary = _fit(config, ctx, data)
        clean = True
    except TrainingStopped:
        clean = True  # every rank stopped at the same agreed step
        raise
    finally:
        teardown_distributed(clean)
    if ctx.is_main:
        _write_curves(config)
    return summary if ctx.is_main else None


def _write_curves(config: TrainingConfig) -> None:
    """Leave `curves.png` in the run directory (rank 0), when matplotlib is installed."""
    import logging

    from ddptrain.plot import matplotlib_available, plot_runs

    log = logging.getLogger("ddptrain")
    if not matplotlib_available():
        log.info("matplotlib is not installed: no curves.png (pip install 'ddptrain[viz]')")
        return
    log.info("curves %s", plot_runs([config.run_dir], config.run_dir / "curves.png"))


def _fit(config: TrainingConfig, ctx: Any, data: Any) -> dict[str, Any]:
    """Build and run the trainer. Its model, optimizer and loaders die with this frame,
    before the process group is destroyed (see `teardown_distributed`)."""
    from ddptrain.trainer import Trainer

    return Trainer(config, ctx, data).fit()


def _print_summary(config: TrainingConfig, summary: dict[str, Any]) -> None:
    (config.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"done: {summary['epochs']} epochs, {summary['steps']} steps on "
        f"{summary['world_size']} rank(s) in {summary['train_time_s']:.1f}s "
        f"({summary['samples_per_sec']:,.0f} samples/s) | "
        f"val loss {summary['val_loss']:.4f} | val accuracy {summary['val_accuracy']:.4f} "
        f"(best {summary['best_val_accuracy']:.4f}) | run dir {config.run_dir}",
        flush=True,
    )


def _cmd_train(argv: list[str]) -> int:
    config = parse_config(argv)
    summary = train(config)
    if summary is not None:
        _print_summary(config, summary)
    return 0


def _cmd_export(argv: list[str]) -> int:
    from ddptrain.checkpoint import export_safetensors

    parser = ErrorParser(prog="ddptrain export", description="Export model weights to safetensors.")
    parser.add_argument("checkpoint", type=Path, help="a ddptrain checkpoint (.pt)")
    parser.add_argument("output", type=Path, help="the .safetensors file to write")
    args = parser.parse_args(argv)
    count = export_safetensors(args.checkpoint, args.output)
    print(f"wrote {count} tensors to {args.output}")
    return 0


def _cmd_plot(argv: list[str]) -> int:
    from ddptrain.plot import plot_runs

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
    from ddptrain.doctor import main as doctor_main

    return doctor_main(argv)


COMMANDS = {
    "train": _cmd_train, "export": _cmd_export, "doctor": _cmd_doctor, "plot": _cmd_plot,
}


def _lost_peer(exc: BaseException) -> bool:
    """A collective or the rendezvous store failed: a peer, not this process, is at fault."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistError):
        return True
    # gloo reports a dead or silent peer as a plain RuntimeError from its transport.
    text = str(exc)
    return isinstance(exc, RuntimeError) and "gloo/transport" in text


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
        return exc.exit_code
    except Exception as exc:
        if not _lost_peer(exc):
            raise
        _report(
            f"error: lost contact with the other ranks ({_first_line(exc)}): a peer died, "
            "hung longer than --timeout_s, or the network failed; restart the job with "
            "--resume_from auto"
        )
        return EXIT_PEER_LOST
    except KeyboardInterrupt:
        _report("interrupted")
        return 130


def _report(text: str) -> None:
    """One line on stderr; ranks other than 0 say who they are."""
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    prefix = "" if rank == "0" else f"[rank {rank}] "
    print(f"{prefix}ddptrain: {text}", file=sys.stderr, flush=True)
