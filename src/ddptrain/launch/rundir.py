"""One run, one directory, one owner.

A run directory belongs to one run, named by its `run_id` (in `config.yaml`, in every
checkpoint and on every metrics row). A fresh run into a directory that already holds a
run is refused, so `--resume_from auto`, a torchrun restart and `--keep_last` pruning only
ever meet this run's checkpoints. While a job trains, its rank 0 holds an OS lock on
`<run_dir>/.lock` (`flock`): the kernel drops it when the holder dies, so a SIGKILLed job
leaves no stale lock, and a second job into the same directory is refused with the
holder's host and pid.

A start marks its directory only once every check of the start has passed (the trainer is
built, a resume's checkpoint accepted): `config.yaml` and `.job` are written then, and a
start that fails before its first step removes what it had created (`RunClaim`), so the
corrected command finds the directory as it was.

Without `--output_dir`, a fresh run gets its own directory `runs/<dataset>-<id>`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import socket
import stat
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import yaml

from ddptrain.config import TrainingConfig
from ddptrain.config_checks import AUTO_BATCH
from ddptrain.config_cli import dump_yaml
from ddptrain.config_values import names_code
from ddptrain.errors import ConfigError
from ddptrain.files import LOCK_NAME, LinkRefused, own_dir
from ddptrain.layout import Layout

JOB_FILE = ".job"  # the torchrun job (rendezvous id) that last trained in a directory
# Every name a run may write in its directory (besides its hidden lock, job and temporary
# files). A directory that holds none of ddptrain's runs (no `config.yaml` with a run id, no
# step checkpoint) but holds one of these holds someone else's file: a run there is refused
# before anything is written, so no user's file is replaced and no planted link followed.
RUN_NAMES = (
    "config.yaml", "metrics.jsonl", "summary.json", "finished.json", "model.safetensors",
    "model_raw.safetensors", "model_ema.safetensors", "hf", "adapter", "curves.png",
    "rollbacks.json", "hang", "oom", "profile", "tensorboard", "mlruns", "wandb", "checkpoints",
)
# ...and in its checkpoint directory, beside the `step_*` checkpoints that make it a run's.
CHECKPOINT_NAMES = ("latest.pt", "best.pt", "latest", "best")


def restarted(run_dir: Path | None = None) -> bool:
    """Whether this worker continues a job that already trained: torchrun restarted its
    group after a failure, or this node joined an elastic job (`--nnodes=MIN:MAX`) whose
    run directory this same job (same rendezvous id) already wrote."""
    if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        return True
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if not job or run_dir is None:
        return False
    try:
        return (run_dir / JOB_FILE).read_text().strip() == job
    except OSError:
        return False


def mark_job(run_dir: Path) -> None:
    """Record the torchrun job training in `run_dir`, for nodes that join it later."""
    job = os.environ.get("TORCHELASTIC_RUN_ID")
    if job:
        from ddptrain.files import atomic_write_text

        atomic_write_text(run_dir / JOB_FILE, job + "\n")


def resume_source(resume_from: str | None, run_dir: Path | None = None) -> str | None:
    """What a run resumes from: `--resume_from` on the first attempt; when the job goes
    on (a torchrun restart, a node joining) always its newest checkpoint (never back to
    an older PATH)."""
    return "auto" if restarted(run_dir) else resume_from


def job_token() -> str:
    """An id every rank of this job agrees on without talking: the launcher's job id
    (torchrun's run id, Slurm's job and step), else this process's start time and pid."""
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return os.environ["TORCHELASTIC_RUN_ID"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm{os.environ['SLURM_JOB_ID']}-{os.environ.get('SLURM_STEP_ID', '0')}"
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"


def default_output_dir(config: TrainingConfig) -> str:
    """`runs/<dataset>-<job>` for a run that names no directory of its own: a built-in
    set's name, a file's stem, or for `package.module:fn` the module's name and the
    function's (`runs/corpus_build-...`, not `runs/build-...`)."""
    if names_code("dataset", config.dataset):
        module, _, fn = config.dataset.rpartition(":")
        name = f"{module.rsplit('.', 1)[-1]}_{fn}"
    else:
        name = Path(config.dataset.split(":")[-1]).stem
    name = re.sub(r"[^A-Za-z0-9_.]+", "_", name)
    return str(Path("runs") / f"{name}-{job_token()}")


def resolve_layout(config: TrainingConfig, world_size: int) -> TrainingConfig:
    """The run's directory and accumulation, as this launch resolves them."""
    import dataclasses

    changes: dict[str, Any] = {}
    if config.output_dir is None:
        changes["output_dir"] = default_output_dir(config)
    g = config.global_batch_size
    if g is not None and config.batch_size != AUTO_BATCH:  # auto: planned later
        # Ranks that split a model (--tp, --pp) share their batch: data-parallel ranks.
        ranks = Layout.of(config, world_size).data_parallel
        per_step = ranks * config.batch_size
        if g % per_step:
            raise ConfigError(
                f"--global_batch_size {g} is not a multiple of {ranks} data-parallel rank(s) x "
                f"--batch_size {config.batch_size} = {per_step}: choose a global batch that "
                "is, or another --batch_size"
            )
        changes["grad_accum_steps"] = g // per_step
    return dataclasses.replace(config, **changes) if changes else config


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(4)}"


def holds_a_run(directory: Path, ckpt_dir: Path) -> bool:
    """Whether an earlier run of ddptrain wrote here: its `config.yaml` names a run id, or
    its checkpoint directory holds a step checkpoint."""
    if saved_run_id(directory) is not None:
        return True
    return ckpt_dir.is_dir() and any(ckpt_dir.glob("step_*"))


def foreign_names(directory: Path, ckpt_dir: Path) -> list[str]:
    """The names a run would write that someone else's files (or links) already hold, in a
    directory that holds no run of ddptrain's. An empty real `checkpoints/` is a start's
    own that stopped before its first checkpoint."""
    taken = [str(directory / n) for n in RUN_NAMES if os.path.lexists(directory / n)
             and not (directory / n == ckpt_dir and _empty_dir(ckpt_dir))]
    return taken + [str(ckpt_dir / n) for n in CHECKPOINT_NAMES
                    if os.path.lexists(ckpt_dir / n)]


def _empty_dir(path: Path) -> bool:
    try:
        return not path.is_symlink() and path.is_dir() and not os.listdir(path)
    except OSError:
        return False


def saved_run_id(directory: Path) -> str | None:
    """The run id in a run directory's `config.yaml`, if it has one."""
    try:
        data = yaml.safe_load((directory / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return None
    return data.get("run_id") if isinstance(data, dict) else None


def refuse_occupied(config: TrainingConfig) -> None:
    """A fresh run (no --resume_from) never writes into another run's directory, and no
    run writes over files that are not a run's (`foreign_names`)."""
    if holds_a_run(config.run_dir, config.ckpt_dir):
        if config.resume_from is None:
            raise ConfigError(
                f"--output_dir {str(config.run_dir)!r} already holds a run: continue it with "
                "--resume_from auto, or give a new --output_dir (nothing there was touched)"
            )
        return
    taken = foreign_names(config.run_dir, config.ckpt_dir)
    if taken:
        more = f" and {len(taken) - 1} more" if len(taken) > 1 else ""
        raise ConfigError(
            f"{taken[0]!r}{more} would be written by this run, but the directory holds no "
            "run of ddptrain's (someone else's file, or a link): give a new --output_dir "
            "(or --checkpoint_dir), or move them away (nothing there was touched)"
        )


def make_run_dirs(config: TrainingConfig) -> None:
    """Create the run and checkpoint directories, or say why they cannot be written."""
    for directory, flag in ((config.run_dir, "output_dir"), (config.ckpt_dir, "checkpoint_dir")):
        # the default checkpoints/ a real folder of the run's, never a link planted there
        inside = directory != config.run_dir and directory.is_relative_to(config.run_dir)
        try:
            own_dir(directory, config.run_dir if inside else None)
            fd, probe = tempfile.mkstemp(prefix=".write-test.", dir=directory)  # made new
            os.close(fd)
            os.unlink(probe)
        except LinkRefused:
            raise
        except OSError as exc:
            raise ConfigError(
                f"--{flag} {str(directory)!r} is not writable ({exc.strerror}): "
                "choose a directory you can write to"
            ) from None


class RunLock:
    """An exclusive `flock` on `<run_dir>/.lock`, held by rank 0 for the whole job."""

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / LOCK_NAME
        self._file: IO[str] | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = self._open()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            raise ConfigError(
                f"--output_dir {str(self.path.parent)!r} is in use by {holder}: wait for that "
                "job to end (or stop it), or give another --output_dir"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"host {socket.gethostname()} pid {os.getpid()}\n")
        f.flush()
        self._file = f

    def _open(self) -> IO[str]:
        """The lock file itself, never what a symlink in its place points to: a link or
        anything but a regular file is refused, its target untouched."""
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        refused = ConfigError(
            f"the lock file {str(self.path)!r} is a symlink or not a regular file: remove "
            "it (ddptrain creates its own), or give another --output_dir"
        )
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise refused from None
            raise ConfigError(
                f"cannot open the lock file {str(self.path)!r}: {exc.strerror}: give a "
                "writable --output_dir"
            ) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise refused
        return os.fdopen(fd, "r+")

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


class RunClaim:
    """Rank 0's claim on a run directory for one job (other ranks hold an inert one).

    `take` refuses another run's directory (a fresh run), notes what the run and
    checkpoint directories hold, creates them and takes the lock. `commit`, called once
    the trainer is built (every check of the start has passed), writes what says the
    directory holds this run: `config.yaml`, `.job`. `give_back`, for a start that fails
    before its first step, removes what this start created, so that the corrected command
    is not refused; a refused resume leaves the run's `config.yaml` and `.job` as they
    were, never written."""

    def __init__(self, config: TrainingConfig, main: bool) -> None:
        self.config, self.main = config, main
        self.lock = RunLock(config.run_dir)
        self.trained = False  # a step completed: the directory holds this run's work
        # once the run ended whole (exports and summary written): the checkpoint they came
        # from (`checkpoint.finished.ended_at`), recorded last, as the lock is let go
        self.ended: dict[str, Any] | None = None
        self._before: dict[Path, frozenset[str] | None] = {}

    def take(self) -> None:
        if not self.main:
            return
        config = self.config
        refuse_occupied(config)
        before: dict[Path, frozenset[str] | None] = {}
        for directory in (config.ckpt_dir, config.run_dir):
            with contextlib.suppress(OSError):  # unreadable: never given back
                before[directory] = (
                    frozenset(os.listdir(directory)) if directory.exists() else None
                )
        make_run_dirs(config)
        self.lock.acquire()
        self._before = before  # only a start that holds the lock gives anything back

    def commit(self) -> None:
        if self.main:
            dump_yaml(self.config, self.config.run_dir / "config.yaml")
            mark_job(self.config.run_dir)

    def give_back(self) -> None:
        """Remove what this start added to the run directory (held under its lock; the
        directory itself if this start made it) and a checkpoint directory it made, if
        still empty: nothing is checkpointed before the first step, and a
        `--checkpoint_dir` outside the run directory is not under the lock. The lock file
        goes before the lock is released: a job that opened it meanwhile is refused, one
        that opens it after creates its own."""
        if not self.main or self.trained or not self._before:
            return
        run_dir, ckpt_dir = self.config.run_dir, self.config.ckpt_dir
        if ckpt_dir in self._before and self._before[ckpt_dir] is None:
            with contextlib.suppress(OSError):
                ckpt_dir.rmdir()
        if run_dir not in self._before:
            return
        before = self._before[run_dir]
        if before is None:
            shutil.rmtree(run_dir, ignore_errors=True)
            return
        try:
            added = set(os.listdir(run_dir)) - before
        except OSError:
            return
        for name in added:
            path = run_dir / name
            with contextlib.suppress(OSError):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()

    def release(self) -> None:
        self.lock.release()
