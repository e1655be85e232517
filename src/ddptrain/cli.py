"""Command line: `ddptrain train | export | doctor | plan | plot | evaluate | predict | ray |
diagnose | tokenize`.

    ddptrain train --dataset digits --epochs 3                       # one process
    torchrun --standalone --nproc_per_node=2 -m ddptrain train       # two ranks, one node
    ddptrain export runs/ddptrain/checkpoints/latest.pt model.safetensors
    torchrun --standalone --nproc_per_node=2 -m ddptrain doctor      # check the cluster
    ddptrain plan --model hf:DIR --nodes 8 --gpu H100                # what fits, what is fastest
    ddptrain plot runs/a runs/b -o curves.png                        # curves, overlaid
    ddptrain evaluate runs/ddptrain --output metrics.json            # a trained model's metrics
    ddptrain predict runs/ddptrain --dataset digits --output p.npy   # ... and its outputs
    ddptrain ray --workers 2 --epochs 2                              # two Ray Train workers
    ddptrain diagnose runs/ddptrain                                  # who a lost peer was
    ddptrain tokenize --dataset chat:chats.jsonl --tokenizer hf:DIR  # token ids stored once

A wrong setting ends the run with one line, `ddptrain: error: ...`, and exit code 2; the
other exit codes are listed in `ddptrain.errors`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddptrain import __version__
from ddptrain.api import fit
from ddptrain.config import TrainingConfig
from ddptrain.config_cli import ErrorParser, parse_config
from ddptrain.errors import (
    EXIT_INTERRUPTED,
    EXIT_IO,
    EXIT_PEER_LOST,
    EXIT_USAGE,
    ConfigError,
    PeerLost,
    TrainingStopped,
    UnusedParameters,
)


def train(config: TrainingConfig) -> dict[str, Any] | None:
    """Run training on this rank; returns the summary (rank 0) or None (other ranks).
    Rank 0 prints the done line as soon as the run is trained and exported, before the
    job waits for its curves.png."""

    def done(summary: dict[str, Any]) -> None:
        if _rank() == "0":
            _print_summary(config, summary)

    summary = fit(config, on_done=done)
    return summary if _rank() == "0" else None


def _print_summary(config: TrainingConfig, summary: dict[str, Any]) -> None:
    best = summary["best_metric"]
    val = " | ".join(
        f"val {k.removeprefix('val_')} {v:.4f}" for k, v in summary.items()
        if k.startswith("val_") and isinstance(v, float)
    )
    best_value = summary.get(f"best_val_{best}")
    best_text = f"{best_value:.4f}" if isinstance(best_value, float) else "n/a"
    epochs = f"{summary['epochs']} epochs"
    if summary.get("stopped_early"):  # by early stopping, or a hook
        epochs = f"stopped early after epoch {summary['stopped_at_epoch']} of {epochs}"
    print(
        f"done: {epochs}, {summary['steps']} steps on "
        f"{summary['world_size']} rank(s) in {summary['train_time_s']:.1f}s "
        f"({summary['samples_per_sec']:,.0f} samples/s) | {val} "
        f"(best {best} {best_text}, epoch {summary['best_epoch']}) | run dir {summary['run_dir']}",
        flush=True,
    )


def _cmd_train(argv: list[str]) -> int:
    from ddptrain.launch.signals import stop_at_once_on_signals

    with stop_at_once_on_signals():  # but in the training loop, which agrees on a stop
        return _train(argv)


def _train(argv: list[str]) -> int:
    config = parse_config(argv)
    # torch and the trainer's modules are hundreds of thousands of objects that live as
    # long as the process: frozen, the cyclic collector never walks them again (each full
    # collection, such as the one before the process group is destroyed, saves ~0.1 s).
    import ddptrain.train.trainer  # noqa: F401

    gc.freeze()
    train(config)
    return 0


def _cmd_export(argv: list[str]) -> int:
    from ddptrain.checkpoint import export_safetensors
    from ddptrain.checkpoint.export import export_checkpoint_adapter

    parser = ErrorParser(prog="ddptrain export", description="Export model weights to safetensors "
                         "(a LoRA run's adapters merged, as its model.safetensors).")
    parser.add_argument(
        "checkpoint", type=Path, help="a ddptrain checkpoint: a .pt file, a DCP step directory "
        "(or the checkpoints/latest or best naming one), or a run directory (its newest)"
    )
    parser.add_argument("output", type=Path, help="the .safetensors file to write (with "
                        "--adapter_only: the directory)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the output file if it exists")
    parser.add_argument("--adapter_only", action="store_true",
                        help="a LoRA run's checkpoint: write peft's adapter directory (as the "
                        "run's adapter/), not the merged model")
    args = parser.parse_args(argv)
    checkpoint = args.checkpoint
    from ddptrain.checkpoint.finished import write_errno
    from ddptrain.checkpoint.kind import resolve_checkpoint
    from ddptrain.train.predict import check_writable

    check_writable(args.output, "output")  # a read-only filesystem: one line before any work
    if resolve_checkpoint(checkpoint).holds_config:
        from ddptrain.train.inference import newest_checkpoint

        checkpoint = newest_checkpoint(checkpoint)  # a run directory
    try:
        export = export_checkpoint_adapter if args.adapter_only else export_safetensors
        count = export(checkpoint, args.output, args.overwrite)
    except Exception as exc:  # a write that fails (a full disk): one line, as train's
        code = write_errno(exc)
        if code is None:
            raise
        denied = code in (errno.EROFS, errno.EACCES, errno.EPERM)  # as an unwritable --output_dir
        _report(f"error: could not write {str(args.output)!r}: {os.strerror(code)} (errno "
                f"{code}) (nothing was left there): "
                f"{'' if denied else 'free space or '}give another output")
        return EXIT_USAGE if denied else EXIT_IO
    print(f"wrote {count} {'adapter ' if args.adapter_only else ''}tensors to {args.output}")
    return 0


def _cmd_plot(argv: list[str]) -> int:
    from ddptrain.files import check_output
    from ddptrain.observe.plot import plot_runs

    parser = ErrorParser(
        prog="ddptrain plot",
        description="Loss, accuracy, LR and throughput curves of one or more runs, overlaid.",
    )
    parser.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="run directory")
    parser.add_argument(
        "-o", "--output", type=Path, default=Path("curves.png"), help="PNG file to write"
    )
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the output file if it exists")
    args = parser.parse_args(argv)
    check_output(args.output, "--output", args.overwrite)
    print(f"wrote {plot_runs(args.run_dirs, args.output, args.overwrite)}")
    return 0


def _after_args(argv: list[str], prog: str, what: str, output_help: str,
                more: Callable[[argparse.ArgumentParser], Any] | None = None,
                ) -> tuple[Any, list[str]]:
    """`SOURCE [--split] [--output] [ddptrain train flags]`: the source first, then this
    command's own flags (`more(parser)` adds any others); every other flag overrides the
    run's config."""
    parser = ErrorParser(
        prog=prog,
        description=f"{what} Any `ddptrain train` flag (e.g. --dataset, --batch_size) "
        "overrides the run's config.yaml.",
    )
    parser.add_argument(
        "source", metavar="RUN|CHECKPOINT",
        help="a run directory, a checkpoint (.pt file or DCP step directory), or a "
        "model.safetensors beside its config.yaml",
    )
    parser.add_argument(
        "--split", default=None, choices=("val", "train", "all"),
        help="which samples: val (the run's validation set), train, or all (every sample: "
        "a dataset ddptrain would split, whole and in its order; a (train, val) pair, train "
        "then val). Default: all for a --dataset other than the run's, else val",
    )
    parser.add_argument("--output", type=Path, default=None, help=output_help)
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the --output file if it exists")
    parser.add_argument(
        "--trust_checkpoint_code", action="store_true",
        help="import and call the module:fn names the run's config stores (a --model, "
        "--dataset, ... function), and let its stored --model_args (--dataset_args, "
        "--task_args) run a directory's own code (trust_remote_code), without naming them "
        "again: only for a source you trust",
    )
    if more is not None:
        more(parser)
    if argv and argv[0] in ("-h", "--help"):
        parser.print_help()
        return None, []
    if not argv or argv[0].startswith("-"):
        raise ConfigError(f"give the run directory or checkpoint first: {prog} RUN|CHECKPOINT ...")
    args, rest = parser.parse_known_args(argv)
    return args, rest


def _cmd_evaluate(argv: list[str]) -> int:
    from ddptrain.api_after import evaluate

    args, rest = _after_args(
        argv, "ddptrain evaluate", "The task's metrics of a trained model over a whole set.",
        "a JSON file to write the metrics to",
    )
    if args is None:
        return 0
    figures = evaluate(args.source, split=args.split, output=args.output, argv=rest,
                       trust_checkpoint_code=args.trust_checkpoint_code,
                       overwrite=args.overwrite)
    if _rank() == "0":
        print(f"evaluate {args.source} ({_evaluated(figures)}" + (
            f" | wrote {args.output}" if args.output else ""), flush=True)
    return 0


def _evaluated(figures: dict[str, float]) -> str:
    """`40 samples; extra 12): loss 0.5 | accuracy 0.8 | extra/loss 0.7 | ...`: the sets'
    sizes, then their figures as training's console line names them (NAME/METRIC)."""
    sizes = [f"{k.rpartition('/')[0]} {v:.0f}" for k, v in figures.items() if "/samples" in k]
    text = " | ".join(f"{k} {v:.6g}" for k, v in figures.items()
                      if k.rpartition("/")[2] != "samples")
    return "; ".join([f"{figures.get('samples', 0)} samples", *sizes]) + f"): {text}"


def _cmd_predict(argv: list[str]) -> int:
    from ddptrain.api_after import predict

    args, rest = _after_args(
        argv, "ddptrain predict",
        "The model's outputs for every sample of a set, one row per sample, in order (with "
        "a chat:PATH dataset of prompts and a .jsonl --output: the assistant's replies).",
        "the file to write: .npy, .pt or .jsonl (required)", more=_generation_flags,
    )
    if args is None:
        return 0
    if args.output is None:
        raise ConfigError("predict needs --output: a .npy, .pt or .jsonl file to write")
    predict(args.source, args.output, split=args.split, argv=rest,  # it logs what it wrote
            trust_checkpoint_code=args.trust_checkpoint_code, overwrite=args.overwrite,
            max_new_tokens=args.max_new_tokens)
    return 0


def _generation_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max_new_tokens", type=int, default=None, metavar="N",
        help="with a chat:PATH --dataset of prompts and a .jsonl --output, each line is the "
        "assistant's reply, generated greedily: at most N tokens of it (default 64)",
    )


def _cmd_doctor(argv: list[str]) -> int:
    from ddptrain.launch.doctor import main as doctor_main

    return doctor_main(argv)


def _cmd_plan(argv: list[str]) -> int:
    from ddptrain.launch.planner import main as plan_main

    return plan_main(argv)


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


def _cmd_diagnose(argv: list[str]) -> int:
    from ddptrain.observe.hang import diagnose

    parser = ErrorParser(
        prog="ddptrain diagnose",
        description="The report of a run's last lost peer or hang: which rank did not reach "
        "which collective, at which step, and where the others waited (hang/report.txt).",
    )
    parser.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="run directory")
    args = parser.parse_args(argv)
    if not args.run_dir.is_dir():
        raise ConfigError(f"{str(args.run_dir)!r} is not a directory: give a run directory")
    text = diagnose(args.run_dir)
    if text is None:
        raise ConfigError(f"{str(args.run_dir)!r} holds no hang records (hang/rank<R>.json): "
                          "no rank of this run lost its peers")
    print(text, end="")
    return 0


def _cmd_tokenize(argv: list[str]) -> int:
    from ddptrain.config import TrainingConfig
    from ddptrain.data.tokenized import tokenize_to_files
    from ddptrain.log import setup_logging

    helps = {f.name: f.metadata["help"] for f in dataclasses.fields(TrainingConfig)}
    helps["dataset"] = ("chat:PATH or text:PATH, as ddptrain train takes it (PATH: a file or "
                        "glob of .jsonl, .jsonl.gz or .parquet files)")
    helps["model"] = "hf:DIR, whose directory's tokenizer is used when --tokenizer is not given"
    parser = ErrorParser(
        prog="ddptrain tokenize",
        description="Tokenize a chat: or text: dataset once and store its token ids, "
        "memory-mapped, with their checksums, beside its files (ddptrain_tokens/): a run "
        "over the same files and tokenizer reads them instead of tokenizing.",
    )
    for name in ("dataset", "tokenizer", "model", "text_field"):
        parser.add_argument(f"--{name}", default="text" if name == "text_field" else None,
                            required=name == "dataset", help=helps[name])
    args = parser.parse_args(argv)
    setup_logging(0)
    where = tokenize_to_files(args.dataset, args.tokenizer, args.model, args.text_field)
    print(f"tokens of {args.dataset} in {where}", flush=True)
    return 0


COMMANDS = {
    "train": _cmd_train, "export": _cmd_export, "doctor": _cmd_doctor, "plan": _cmd_plan,
    "plot": _cmd_plot,
    "evaluate": _cmd_evaluate, "predict": _cmd_predict,
    "ray": _cmd_ray, "diagnose": _cmd_diagnose, "tokenize": _cmd_tokenize,
}


# A rank that lost its peers has said so; it waits this long before it exits, so that a
# launcher sees the rank that failed end first: torchrun names the first worker it sees
# end as the root cause and stops the others, and the failing rank may still be ending
# its DataLoader workers when its peers notice its closed sockets.
PEER_LOST_LINGER_S = 3.0


def main(argv: list[str] | None = None) -> int:
    """Run a command; a run that fails leaves no DataLoader worker behind."""
    from_command = False
    try:
        code = _main(sys.argv[1:] if argv is None else argv)
        from_command = True
    finally:
        if not from_command or code:
            _end_workers()
    if code == EXIT_PEER_LOST and _world_size() != 1:  # (waiting for the peers' records counts)
        time.sleep(max(0.0, PEER_LOST_LINGER_S - (time.monotonic() - _peer_lost_at)))
    return code


_peer_lost_at = 0.0  # when this rank found its peers lost (monotonic seconds)


def _own_end(text: str) -> None:
    """A rank that ends mid-training on its own error records it, so that its peers'
    lines say so rather than that it vanished (`observe.hang`)."""
    hang = sys.modules.get("ddptrain.observe.hang")  # loaded once a run trained
    if hang is not None and hang.POSITION["run_dir"] is not None:
        hang.write_record(None, _rank_number(0), _world_size(), own_error=text)


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_STEP_NUM_TASKS", "1")))


def _end_workers() -> None:
    if "torch" in sys.modules:  # only a run that started one can have a worker
        from ddptrain.data.loader import end_worker_processes

        end_worker_processes()


def _main(argv: list[str]) -> int:
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
        from ddptrain.launch.failures import own_errors

        with own_errors(tell=_tell_peer_lost):  # torch's errors outside `fit` too, as fit's
            return command(argv[1:])
    except UnusedParameters as exc:  # as DDP's reducer error always was: no record, no note
        _report(f"error: {exc}")
        return EXIT_USAGE
    except ConfigError as exc:
        _report(f"error: {exc}")
        _own_end(str(exc))
        _note_exit(EXIT_USAGE)
        return EXIT_USAGE
    except PeerLost as exc:
        from ddptrain.launch.signals import signals_deferred

        global _peer_lost_at
        _peer_lost_at = exc.found_at
        if not exc.told:  # (told as it was found, while signals waited: launch.failures)
            with signals_deferred():  # torchrun stops the other workers as the first one ends
                _tell_peer_lost(exc)
        return EXIT_PEER_LOST
    except TrainingStopped as exc:
        _report(f"{exc.said_as}: {exc}")
        if getattr(exc, "alone", False):  # this rank's own failure (an export it wrote)
            _own_end(str(exc))
        _note_exit(exc.exit_code)
        return exc.exit_code
    except KeyboardInterrupt as exc:
        code = getattr(exc, "exit_code", EXIT_INTERRUPTED)  # a signal outside training
        _report(f"stopped: {exc}" if str(exc) else "interrupted")
        _note_exit(code)
        return code


def _tell_peer_lost(exc: PeerLost) -> None:
    _report(f"error: {exc}")
    _note_exit(EXIT_PEER_LOST)


def _note_exit(code: int) -> None:
    from ddptrain.launch.signals import note_exit

    note_exit(code)


def _rank() -> str:
    return os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))


def _rank_number(unknown: int) -> int:
    return int(_rank()) if _rank().isdigit() else unknown


def _report(text: str) -> None:
    """One line on stderr; ranks other than 0 say who they are."""
    rank = _rank()
    prefix = "" if rank == "0" else f"[rank {rank}] "
    # One write per line: ranks share the launcher's stderr, and print() writes the text
    # and its newline separately, so two ranks' lines could run together.
    sys.stderr.write(f"{prefix}ddptrain: {text}\n")
    sys.stderr.flush()
    _tell_agent(f"ddptrain: {text}")


def _tell_agent(line: str) -> None:
    """Leave the line in torchrun's error file for this rank (TORCHELASTIC_ERROR_FILE, in the
    form torchrun reads), so that `ddprun` (`launch.torchrun`) can say the root cause's line
    again last, after the lines of the ranks the job then stopped. Only under `ddprun`
    (`SAY_LAST`): plain torchrun would print the line again inside its own report."""
    from ddptrain.launch.signals import SAY_LAST

    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or not os.environ.get(SAY_LAST):
        return
    with contextlib.suppress(OSError), open(path, "w") as f:
        json.dump({"message": line, "timestamp": int(time.time())}, f)
