"""Files that readers see whole or not at all, outputs that replace nothing unasked, and
files checked before they are trusted.

Every file ddptrain writes into a run directory (checkpoints, config.yaml, summary.json,
metrics.jsonl when it is rewritten on resume, model.safetensors) goes through
`atomic_write`: a temporary name beside the target, fsync, rename into place, fsync of the
directory. A crash leaves the old file or the new one, never a torn one. A user's output
(`predict`, `evaluate`, `export`, `plot`) is checked first (`check_output`) and linked into
place without replacing a file (`publish`); devices and FIFOs are never read as weights
(`refuse_special`); a directory's files can carry their checksums (`SUMS_FILE`).

Nothing is written through a link: a temporary file is created new (`O_EXCL`, `O_NOFOLLOW`),
a file renamed over a link replaces the link, and a directory ddptrain names inside a run
directory (`hang/`, `oom/`, `hf/`, a checkpoint's step) is a real directory, each level
checked (`own_dir`), never a link planted to send the write elsewhere. Which names a run
may write, and so which an earlier owner of the directory must not hold, is
`launch.rundir.RUN_NAMES`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO, TextIO

from ddptrain.errors import ConfigError

# A run directory's lock: a live job holds an exclusive `flock` on it (`RunLock`).
LOCK_NAME = ".lock"


def temp_name(path: Path) -> Path:
    """A per-process temporary name beside `path` (hidden, so globs of results skip it)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LinkRefused(ConfigError, OSError):
    """A name ddptrain writes is a symlink, or not what it should be: nothing was written
    through it. An `OSError` too, so that a failure path that gives up on an unwritable
    record gives up on this one the same way."""


def own_dir(directory: Path, under: Path | None = None) -> Path:
    """`directory`, created where missing, each level below `under` (the run directory the
    user named, itself trusted) a real directory: a symlink or a file planted there is
    refused, its target untouched. Without `under`, `directory` alone is made."""
    if under is None:
        directory.mkdir(parents=True, exist_ok=True)
        return directory
    under.mkdir(parents=True, exist_ok=True)
    here = under
    for part in directory.relative_to(under).parts:
        here = here / part
        with contextlib.suppress(FileExistsError):
            os.mkdir(here)
        mode = os.lstat(here).st_mode
        if stat.S_ISLNK(mode) or not stat.S_ISDIR(mode):
            raise _not_a_folder(here)
    return directory


def _not_a_folder(path: Path) -> LinkRefused:
    return LinkRefused(f"{str(path)!r} is a symlink or not a directory: ddptrain writes "
                       "nothing through it; remove it (ddptrain makes its own), or use "
                       "another directory")


def refuse_link(path: Path) -> Path:
    """`path`, a folder another library will write (TensorBoard's, the profiler's, MLflow's
    or W&B's in a run directory), if it is a real folder or not there yet: a link or a file
    planted at its name is refused."""
    if os.path.islink(path) or (os.path.lexists(path) and not path.is_dir()):
        raise _not_a_folder(path)
    return path


def create_new(path: Path, mode: int = 0o644) -> int:
    """A file descriptor of a file created here and now, for writing: never one that
    existed, never a link's target (`O_EXCL` refuses any name that exists, links too)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    return os.open(path, flags, mode)


@contextlib.contextmanager
def staged(path: Path, overwrite: bool = True, under: Path | None = None) -> Iterator[Path]:
    """Yield a temporary path to write, created new beside `path` (a stale temporary or a
    link at its name removed first, never followed); on success it is fsynced and moved to
    `path` (`publish`). `under`: `path`'s folders below it must be real ones (`own_dir`)."""
    own_dir(path.parent, under)
    tmp = temp_name(path)
    tmp.unlink(missing_ok=True)  # a link removed is a link not followed
    os.close(create_new(tmp))
    try:
        yield tmp
        with tmp.open("rb+") as f:
            os.fsync(f.fileno())
        publish(tmp, path, overwrite)
    finally:
        tmp.unlink(missing_ok=True)


def remove(path: Path) -> None:
    """Remove `path`: a link or a file unlinked (a link's target untouched), a directory
    with what it holds (`rmtree` follows no link inside)."""
    if os.path.islink(path) or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path)


@contextlib.contextmanager
def staged_dir(out: Path, under: Path | None = None) -> Iterator[Path]:
    """Yield an empty directory beside `out` to write; on success it replaces `out`
    (the old one removed, the new one renamed into place: a crash while it is written
    leaves the old one whole). A link at either name is removed, never followed."""
    own_dir(out.parent, under)
    partial = out.with_name(f".{out.name}.partial")
    if os.path.lexists(partial):
        remove(partial)
    os.mkdir(partial)
    try:
        yield partial
        if os.path.lexists(out):
            remove(out)
        os.replace(partial, out)
        fsync_dir(out.parent)
    finally:
        if os.path.lexists(partial):
            with contextlib.suppress(OSError):
                remove(partial)


def publish(tmp: Path, path: Path, overwrite: bool = True) -> None:
    """Move the written `tmp` to `path` atomically. Without `overwrite`, a file that
    appeared at `path` meanwhile is kept and the move refused (a hard link fails where a
    name exists; a filesystem without links gets a check just before the rename)."""
    appeared = ConfigError(f"{str(path)!r} appeared while it was written: it was left as "
                           "it is; give another name, or --overwrite")
    if overwrite:
        os.replace(tmp, path)
    else:
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise appeared from None
        except OSError:  # no hard links here
            if os.path.lexists(path):
                raise appeared from None
            os.replace(tmp, path)
        else:
            tmp.unlink()
    fsync_dir(path.parent)


def refuse_special(path: Path, what: str) -> None:
    """Refuse to read what is not a regular file or a directory (a device such as
    /dev/zero reads forever, a FIFO blocks until someone writes), before it is opened."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # the reader says what is missing or unreadable
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ConfigError(f"{what} {str(path)!r} is not a regular file (a device, FIFO or "
                          "socket): give a file")


def check_output(path: Path, flag: str, overwrite: bool, directory: bool = False) -> None:
    """Refuse, before any work, an output the user did not ask to replace (`--overwrite`),
    one that is not a regular file (with `directory`: not a directory), or one inside (or
    that is) a run directory a live run holds."""
    if os.path.lexists(path):
        if not overwrite:
            raise ConfigError(f"{flag} {str(path)!r} exists: give another name, or add "
                              "--overwrite to replace it")
        if path.is_symlink() or not (path.is_dir() if directory else path.is_file()):
            kind = ("a directory" if directory
                    else "a regular file (a directory, link, device or FIFO)")
            raise ConfigError(f"{flag} {str(path)!r} is not {kind}: give a "
                              f"{'directory' if directory else 'file'} name")
    for folder in [path.absolute()] * directory + list(path.absolute().parents):
        holder = live_holder(folder)
        if holder is not None:
            raise ConfigError(
                f"{flag} {str(path)!r} is inside the run directory {str(folder)!r}, which a "
                f"live run holds ({holder}): write it elsewhere, or after that run ends"
            )


def live_holder(run_dir: Path) -> str | None:
    """Who holds `run_dir`'s lock ("host H pid P"), if a live job does; None for a
    directory no job holds (or that is no run directory)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(run_dir / LOCK_NAME, flags)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            return f.read().strip() or "another process"
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def atomic_write(path: Path, write: Callable[[BinaryIO], object],
                 overwrite: bool = True, under: Path | None = None) -> None:
    """Call `write(file)` on a temporary file and move the result to `path` atomically."""
    with staged(path, overwrite, under) as tmp, tmp.open("wb") as f:
        write(f)


def atomic_write_text(path: Path, text: str, overwrite: bool = True,
                      under: Path | None = None) -> None:
    atomic_write(path, lambda f: f.write(text.encode()), overwrite, under)


def open_append(path: Path) -> TextIO:
    """`path` opened to append, created if missing: the file itself, never a link's
    target (a link at `path` is refused)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise LinkRefused(f"{str(path)!r} is a symlink: ddptrain writes nothing through "
                              "it; remove it") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise LinkRefused(f"{str(path)!r} is not a regular file: remove it")
    return os.fdopen(fd, "a")


def open_regular(path: Path) -> int:
    """A descriptor to read the regular file `path` itself: a link (never followed), a
    device or a FIFO (never blocked on) is `OSError`."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", str(path))
    return fd


def read_regular(path: Path, limit: int = 1 << 20) -> str:
    """The text of `path` if it is a regular file (`open_regular`), at most `limit` bytes."""
    with os.fdopen(open_regular(path), "rb") as f:
        return f.read(limit).decode(errors="replace")


# ---------------------------------------------------------------------- checked files
CHUNK = 64 << 20  # bytes read at a time when a file is checked
# A directory's checksums of its files ({name: [bytes, crc32]}), beside them: written with
# an exported Hugging Face directory (`hf/`), checked before its weights are used.
SUMS_FILE = "ddptrain_checksums.json"


def file_crc(path: Path) -> list[int]:
    """[bytes, crc32] of a file, read once in chunks."""
    crc, size = 0, 0
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return [size, crc]


def files_damage(directory: Path, expected: dict[str, list[int]], names: list[str]) -> str | None:
    """What is wrong with the files `names` of `directory` against `expected`, or None."""
    for name in names:
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        want = list(expected[name])
        if size != want[0]:
            return f"{name} holds {size} bytes, {want[0]} were written (truncated or grown)"
        if file_crc(path) != want:
            return f"{name} does not match its checksum"
    return None


def summed_names(directory: Path) -> list[str]:
    """The names in `directory` its `SUMS_FILE` must list: every one a loader may read
    (weights, their index, configs, tokenizer files, code), all but hidden names and
    Markdown."""
    return sorted(n for n in os.listdir(directory)
                  if n != SUMS_FILE and not n.startswith(".") and not n.endswith(".md"))


def write_sums(directory: Path, names: list[str] | None = None) -> None:
    """Record the checksums of `directory`'s files `names` (None: `summed_names`, as
    `sums_damage` expects) in its `SUMS_FILE`."""
    names = summed_names(directory) if names is None else names
    sums = {name: file_crc(directory / name) for name in sorted(names)}
    atomic_write_text(directory / SUMS_FILE, json.dumps(sums, indent=1) + "\n")


def sums_damage(directory: Path, share: tuple[int, int] = (0, 1),
                weights: bool = True) -> str | None:
    """What is wrong with `directory`'s files against its `SUMS_FILE`, or None (also for a
    directory without one: another tool wrote it). A name it does not list that a loader
    may read (`summed_names`: a weight file or index added, a config) is damage too.
    `share` (rank, ranks): only every ranks-th file from the rank-th, sorted by name (the
    ranks split the reading); `weights` False: only the files other than `*.safetensors`
    (small: what a model built on the meta device reads before its weights are checked)."""
    path = directory / SUMS_FILE
    if not path.is_file():
        return None
    try:
        expected = json.loads(path.read_text())
        added = [n for n in summed_names(directory) if n not in expected]
        if added:
            return (f"{added[0]} is not among the files its {SUMS_FILE} lists (added after "
                    "the export)")
        # Checked once per process while the files stay as they are (a model built on
        # the meta device and then filled, `--init_from` reading shapes and then weights).
        listed = sorted(n for n in expected if weights or not n.endswith(".safetensors"))
        mine = listed[share[0]::share[1]]
        key = (share, weights, *((n, *_stamp(directory / n)) for n in [SUMS_FILE, *mine]))
        if key not in _whole:
            damage = files_damage(directory, expected, mine)
            if damage is not None:
                return damage
            _whole.add(key)
        return None
    except (ValueError, TypeError, IndexError, OSError):
        return f"its {SUMS_FILE} cannot be read"


def _stamp(path: Path) -> tuple[int, int, int]:
    try:
        st = os.stat(path)
    except OSError:
        return (-1, -1, -1)
    return (st.st_ino, st.st_size, st.st_mtime_ns)


_whole: set[tuple[Any, ...]] = set()
