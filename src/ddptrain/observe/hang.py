"""When a rank loses its peers: who stopped, in which collective, at which step, where.

torch's flight recorder is on in every run (`TORCH_FR_BUFFER_SIZE`, set before the
process group starts; a value the user set is kept): each rank keeps its last
collectives, with a sequence number per process group. A rank whose collective fails
(a peer died, or did not come within --timeout_s) writes what it knows into the run
directory, `hang/rank<R>.json`:

- the collective it was in (`all_reduce`, from its own stack) and on which group, its
  number there (the last one the recorder saw completed, plus one), the line of ddptrain
  or user code that called it, the step and epoch;
- its last collectives as the recorder holds them, and every thread's Python stack.

Then it reads its peers' records for a few seconds (they fail within moments of each
other) and names the ranks that wrote none as the ones that did not reach the collective
(stopped, dead, or still in their own code), or the rank that ended on an error of its own
(a sample that raised, a DataLoader worker killed, out of memory), which records its line
(`cli`). Records from before this process started (an earlier attempt) are left out.
A rank stuck in its own code writes no record; `StallWatch` notes where it is instead,
and the line names that place. The lowest rank that reported writes `hang/report.txt`,
and each ends with one line:

    ddptrain: error: lost contact with the other ranks (Timed out waiting 600000ms for
    recv operation to complete): rank 1 did not reach all_reduce #1042 of the default group
    (after step 87), which rank 0 waited in at ddptrain/train/metrics.py:212
    (reduce_snapshots): it stopped, died or stayed in its own code; report:
    runs/x/hang/report.txt; restart the job with --resume_from auto

`ddptrain diagnose RUN_DIR` prints the report again (or makes it from the records).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import pickle
import socket
import sys
import sysconfig
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

from ddptrain.errors import ConfigError
from ddptrain.files import atomic_write_text, read_regular
from ddptrain.observe.startup import process_age

FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
FR_ENTRIES = 2000  # collectives each rank remembers: a few KB of host memory
RECORDS_WAIT_S = 3.0  # how long a rank that failed waits for its peers' records
RECORD_LIMIT = 8 << 20  # bytes of a record read at most (a few hundred KB in practice)
REPORT_LIMIT = 64 << 20  # ... of report.txt (a line per rank)
MAX_WORLD = 1 << 20  # the most ranks a record may say its job had

# Where this rank is: the trainer's run directory and its `Progress` (read, not written,
# a step: steps and epochs completed).
POSITION: dict[str, Any] = {"run_dir": None, "progress": None}
# torch's code: its installed folder (as imported, and its real path), not any folder
# named torch
def _installed(package: str) -> tuple[str, ...]:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return (os.sep + package + os.sep,)  # not installed: no frame is its
    folder = Path(spec.origin).parent
    return tuple({str(folder) + os.sep, str(folder.resolve()) + os.sep})


_TORCH = _installed("torch")
# ddptrain's own code: the package as imported, its folder's real path (the folder a
# checkout is in may be named ddptrain too, and so may a user's)
_PACKAGE = Path(__file__).resolve().parent.parent
_STDLIB = sysconfig.get_paths()["stdlib"]


def enable_flight_recorder(environ: Any = None) -> None:
    """Before the process group starts: keep each rank's last collectives."""
    env = os.environ if environ is None else environ
    env.setdefault(FR_BUFFER, str(FR_ENTRIES))


def record_dir(run_dir: Path) -> Path:
    return run_dir / "hang"


def write_record(exc: BaseException | None, rank: int, world_size: int,
                 own_error: str | None = None) -> Path | None:
    """This rank's record of the collective `exc` broke, or of its `own_error` (its line
    when it ends on an error of its own), in the run directory (None: no run directory
    yet, or it cannot be written)."""
    run_dir = POSITION.get("run_dir")
    if run_dir is None or (world_size < 2 and exc is None):
        return None
    op, group, where = _failed_call(exc.__traceback__ if exc is not None else None)
    recorder, progress = _recorder(), POSITION.get("progress")
    status = recorder.get("pg_status", {}).get(group or "0", {})
    done = status.get("last_completed_collective")
    entries = [_entry(e) for e in recorder.get("entries", [])[-20:]]
    last = next((e for e in reversed(entries) if e["retired"] and e["collective_seq_id"] == done
                 and str((e["process_group"] or ["0"])[0]) == (group or "0")), None)
    record = {
        "rank": rank, "world_size": world_size, "host": socket.gethostname(),
        "pid": os.getpid(), "time": time.time(), "step": getattr(progress, "step", None),
        "epochs_done": getattr(progress, "epoch", None), "op": op, "group": group or "0",
        "seq": None if done is None else int(done) + 1, "where": where,
        "error": own_error or (str(exc).strip().splitlines() or [""])[0][:300],
        "own_error": own_error is not None,
        "last_done": None if last is None else (
            f"{str(last['profiling_name']).split(':')[-1]} #{done} at {last['called_at']}"),
        "collectives": entries,
        "stacks": _stacks(),
    }
    path = record_dir(Path(run_dir)) / f"rank{rank}.json"
    try:  # hang/ a real folder of the run's: never written through a link (`files.own_dir`)
        atomic_write_text(path, json.dumps(record, indent=1, default=str), under=Path(run_dir))
    except OSError:
        return None
    return path


class StallWatch:
    """A rank stuck in its own code (a loop, a sleep, a read that never returns) writes no
    record: it is not in a collective that fails. This daemon thread notes where it is
    instead: once the rank's step count has not moved for half of --timeout_s (its peers
    give up after the whole), `hang/stalled<R>.json` holds the step and the innermost line
    of ddptrain or user code its main thread is in, and its stack; the peers' report
    names that line for a rank that wrote no record. The note goes when the steps move on
    (a long validation or save). Nothing is read or written while steps move."""

    def __init__(self, run_dir: Path, rank: int, world_size: int, timeout_s: float) -> None:
        self.run_dir, self.path = run_dir, record_dir(run_dir) / f"stalled{rank}.json"
        self.rank, self.limit, self.alone = rank, timeout_s / 2, world_size < 2
        self._main = threading.main_thread()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="ddptrain-stall-watch",
                                        daemon=True)

    def __enter__(self) -> StallWatch:
        if not self.alone:  # one process has no peers to wait for it
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()

    def _watch(self) -> None:
        last, since, noted = None, time.monotonic(), False
        while not self._stop.wait(min(5.0, self.limit / 4)):
            step = getattr(POSITION.get("progress"), "step", None)
            if step != last:
                last, since = step, time.monotonic()
                if noted:
                    self.path.unlink(missing_ok=True)
                    noted = False
            elif not noted and time.monotonic() - since >= self.limit:
                noted = self._note(step)

    def _note(self, step: int | None) -> bool:
        frame = sys._current_frames().get(self._main.ident or -1)
        stack = traceback.format_stack(frame)[-12:] if frame is not None else []
        while frame is not None and _not_ours(frame.f_code.co_filename):
            frame = frame.f_back
        note = {"rank": self.rank, "time": time.time(), "step": step,
                "where": _at(frame) if frame is not None else None, "stack": stack}
        with contextlib.suppress(OSError):
            atomic_write_text(self.path, json.dumps(note, indent=1, default=str),
                              under=self.run_dir)
        return True


def _not_ours(filename: str) -> bool:
    """torch's, Python's own library's, or no file's (`<frozen ...>`)."""
    library = filename.startswith(_STDLIB) and "site-packages" not in filename
    return filename.startswith(_TORCH) or library or filename.startswith("<")


def culprit_line(run_dir: Path, world_size: int, rank: int,
                 wait_s: float = RECORDS_WAIT_S) -> str | None:
    """After this rank wrote its record: its peers' for up to `wait_s`, then one line
    naming the ranks that did not report; the lowest rank that reported writes the
    report. None when there is no record of this rank."""
    folder = record_dir(run_dir)
    deadline = time.monotonic() + wait_s
    # A record from before this process started is an earlier attempt's (a resumed run)
    since = time.time() - process_age() - 1.0
    skipped: dict[str, str] = {}  # a file not of ddptrain's shape: named in the report
    records = read_records(folder, since, skipped=skipped)
    while len(records) < world_size and time.monotonic() < deadline:
        time.sleep(0.1)
        records = read_records(folder, since, records, skipped=skipped)
    if rank not in records:
        return None
    stalled = read_records(folder, since, prefix="stalled", skipped=skipped)
    text, line = report(records, world_size, stalled, skipped)
    report_file = folder / "report.txt"
    if rank == min(records):
        with contextlib.suppress(OSError):
            atomic_write_text(report_file, text, under=Path(run_dir))
    return f"{line}; report: {report_file}"


def read_records(folder: Path, since: float = 0.0,
                 known: dict[int, dict[str, Any]] | None = None, prefix: str = "rank",
                 skipped: dict[str, str] | None = None) -> dict[int, dict[str, Any]]:
    """The ranks' records in `folder` (or with `prefix="stalled"` their `StallWatch`
    notes), by rank; those written before `since` left out. The ranks in `known` are not
    read again: a rank polling for its peers' records reads each file once, not once a
    poll (hundreds of ranks on a shared filesystem). A file that is no record of
    ddptrain's shape (a link, not a regular file, not JSON, not an object with the fields
    the report reads, of their types) is left out, and named with why in `skipped`.
    Nothing is read through a link: a `folder` that is one holds no records."""
    records = dict(known or {})
    if os.path.islink(folder):
        return records
    for path in sorted(folder.glob(f"{prefix}*.json")):
        number = path.stem[len(prefix):]
        if not (number.isascii() and number.isdigit()) or int(number) in records:
            continue
        why = None
        try:
            record = json.loads(read_regular(path, RECORD_LIMIT))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                continue  # gone since the listing
            why = _unreadable(exc)
        except ValueError:
            why = "not JSON"
        else:
            timed = isinstance(record, dict) and _number(record.get("time"))
            if timed and record["time"] < since:
                continue  # an earlier attempt's
            why = _shape_fault(record, int(number), prefix == "stalled")
        if why is not None:
            if skipped is not None:
                skipped[str(path)] = why
            continue
        records[int(number)] = record
        if skipped is not None:
            skipped.pop(str(path), None)
    return records


# The fields of a record (`write_record`) and of a note (`StallWatch`) that the report
# reads, each with its types and whether it must be there.
_INT, _NONE, _NUM = "a whole number", "null", "a number"
_RECORD_FIELDS: dict[str, tuple[tuple[str, ...], bool]] = {
    "rank": ((_INT,), True), "world_size": ((_INT,), True), "host": (("text",), True),
    "step": ((_INT, _NONE), True), "op": (("text", _NONE), True), "group": (("text",), True),
    "seq": ((_INT, _NONE), False), "where": (("text", _NONE), True),
    "error": (("text",), True), "own_error": (("true or false",), False),
    "last_done": (("text", _NONE), False), "time": ((_NUM,), False),
}
_NOTE_FIELDS: dict[str, tuple[tuple[str, ...], bool]] = {
    "rank": ((_INT,), True), "step": ((_INT, _NONE), True),
    "where": (("text", _NONE), True), "time": ((_NUM,), False),
}


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _kind(value: Any) -> str:
    """`value`'s JSON kind, as the field tables name them."""
    if value is None:
        return _NONE
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, int):
        return _INT
    if isinstance(value, float):
        return _NUM
    if isinstance(value, str):
        return "text"
    return "a list" if isinstance(value, list) else "an object"


def _shape_fault(record: Any, number: int, note: bool) -> str | None:
    """Why `record`, read from the file of rank `number`, is no record (`note`: no
    `StallWatch` note) of ddptrain's; None when it is one."""
    if not isinstance(record, dict):
        return f"{_kind(record)} in JSON, not an object: not a record ddptrain wrote"
    for key, (kinds, required) in (_NOTE_FIELDS if note else _RECORD_FIELDS).items():
        if key not in record:
            if required:
                return f"no {key!r} field: not a record ddptrain wrote"
            continue
        kind = _kind(record[key])
        if kind not in kinds and not (kind == _INT and _NUM in kinds):
            return (f"its {key!r} is {kind}, not {' or '.join(kinds)}: not a record "
                    "ddptrain wrote")
    if record["rank"] != number:
        return f"it says rank {record['rank']}, not the {number} of its name"
    if not note and not 0 <= number < record["world_size"] <= MAX_WORLD:
        return (f"its world_size {record['world_size']} does not hold rank {number} (or is "
                f"over {MAX_WORLD})")
    return None


def _unreadable(exc: OSError) -> str:
    """Why a file was not read, from `read_regular`'s error."""
    if exc.errno == errno.ELOOP:
        return "a symbolic link"
    if exc.errno == errno.EINVAL:
        return "not a regular file (a directory, device, FIFO or socket)"
    return f"unreadable ({exc.strerror or exc})"


def report(records: dict[int, dict[str, Any]], world_size: int,
           stalled: dict[int, dict[str, Any]] | None = None,
           skipped: dict[str, str] | None = None) -> tuple[str, str]:
    """The report's text and its one-line summary, from the records there are, and where
    the ranks that wrote none were stuck when they noted it (`StallWatch`); each file in
    `skipped` (path: why) named below the table, its rank's row as if it wrote none."""
    silent = [r for r in range(world_size) if r not in records]
    stuck = {r: (stalled or {})[r] for r in silent if (stalled or {}).get(r, {}).get("where")}
    ended = [r for r in sorted(records) if records[r].get("own_error")]
    waiting = [r for r in sorted(records) if r not in ended]
    first = records[(waiting or ended)[0]]
    call = f"{first['op'] or 'collective'}"
    if first.get("seq") is not None:
        call += f" #{first['seq']}"
    call += " of the default group" if first.get("group") == "0" else f" of group {first['group']}"
    step = f" (after step {first['step']})" if first.get("step") is not None else ""
    where = f" at {first['where']}" if first.get("where") else ""
    if first.get("last_done") and not first.get("op"):  # the recorder saw only what ended
        where += f", next after {first['last_done']}"
    if ended:
        own = records[ended[0]]
        line = (f"{_ranks(ended)} ended on {'its' if len(ended) == 1 else 'their'} own "
                f"error (rank {ended[0]}: {own['error'][:160]})")
        if waiting:
            line += f", and {_ranks(waiting)} waited for it in {call}{step}{where}"
    elif silent:
        one = len(silent) == 1
        line = (f"{_ranks(silent)} did not reach {call}{step}, which {_ranks(waiting)} waited "
                f"in{where}: ")
        line += "; ".join(
            f"rank {r} has been in {note['where']} since step {note['step']}"
            for r, note in stuck.items()
        ) if stuck else (f"{'it' if one else 'they'} stopped, died or stayed in "
                         f"{'its' if one else 'their'} own code")
    else:
        line = (f"every rank reported a failed {call}{step}{where}: none stopped first "
                "(the network, the store, or every rank at once)")
    lines = [line, "", "rank  host  step  collective  called at  error"]
    for r in range(world_size):
        rec = records.get(r)
        if rec is None and r in stuck:
            note = stuck[r]
            lines.append(f"{r}  -  {note['step']}  -  {note['where']}  in its own code, no "
                         f"collective (its stack: hang/stalled{r}.json)")
            continue
        if rec is None:
            lines.append(f"{r}  -  -  -  -  no record (stopped, dead, or not yet failed)")
            continue
        seq = "" if rec.get("seq") is None else f" #{rec['seq']}"
        lines.append(f"{r}  {rec['host']}  {rec['step']}  {rec['op']}{seq} (group "
                     f"{rec['group']})  {rec['where']}  {rec['error']}")
    lines += ["", "Each rank's last collectives and Python stacks: hang/rank<R>.json"]
    lines += [f"skipped {path}: {why}" for path, why in sorted((skipped or {}).items())]
    return "\n".join(lines) + "\n", line


def diagnose(run_dir: Path) -> str | None:
    """The report of the run's last hang, made again from its records if need be (None:
    no records). Nothing is read through a link, nor what is not a regular file: such a
    `hang/` or `report.txt`, or a run with no record it can read, is a `ConfigError`
    naming it; a record it cannot read is named in the report."""
    folder = record_dir(run_dir)
    if os.path.islink(folder):
        raise ConfigError(f"{str(folder)!r} is a symbolic link: ddptrain reads no hang "
                          "records through it; remove it")
    report_file = folder / "report.txt"
    if os.path.lexists(report_file):
        try:
            return read_regular(report_file, REPORT_LIMIT)
        except OSError as exc:
            raise ConfigError(
                f"{str(report_file)!r}: {_unreadable(exc)}, not read; remove it, and "
                "ddptrain diagnose makes the report again from the records"
            ) from None
    skipped: dict[str, str] = {}
    records = read_records(folder, skipped=skipped)
    if not records:
        if skipped:
            path, why = min(skipped.items())
            more = f" (and {len(skipped) - 1} more)" if len(skipped) > 1 else ""
            raise ConfigError(f"{str(folder)!r} holds no hang record ddptrain can read: "
                              f"{path}: {why}{more}")
        return None
    world = max(int(r["world_size"]) for r in records.values())
    stalled = read_records(folder, prefix="stalled", skipped=skipped)
    return report(records, max(world, max(records) + 1), stalled, skipped)[0]


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _failed_call(tb: TracebackType | None) -> tuple[str | None, str | None, str | None]:
    """The collective (torch.distributed's function) the traceback failed in, its group's
    name, and the line outside torch that called it."""
    frames = list(_walk(tb))
    op = group = None
    ours = [f for f in frames if not f.f_code.co_filename.startswith(_TORCH)]
    where = _at(ours[-1]) if ours else None  # a collective C++ runs (DDP's): its caller
    for i, frame in enumerate(frames):
        code = frame.f_code
        if code.co_filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
            op = code.co_name
            pg = frame.f_locals.get("group")
            group = _group_name(pg)
            callers = [f for f in frames[:i] if not f.f_code.co_filename.startswith(_TORCH)]
            where = _at(callers[-1]) if callers else where
            break
    return op, group, where


def _at(frame: Any) -> str:
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def _walk(tb: TracebackType | None) -> Any:
    while tb is not None:
        yield tb.tb_frame
        tb = tb.tb_next


def _group_name(pg: Any) -> str | None:
    if pg is None:
        return None
    try:
        import torch.distributed as dist

        return str(dist.distributed_c10d._get_process_group_name(pg))
    except Exception:  # a group torch no longer knows
        return None


def _short(path: str) -> str:
    """A frame's file as the report names it: one of ddptrain's own modules (a file in
    the imported package's real folder, `_PACKAGE`) as `ddptrain/...`; any other file,
    a user's module in a checkout folder named `ddptrain` too, as it is."""
    if path.startswith("<"):  # no file: `<frozen ...>`, `<string>`
        return path
    try:
        inside = Path(path).resolve().relative_to(_PACKAGE)
    except (ValueError, OSError, RuntimeError):  # elsewhere, or a loop of links
        return path
    return "ddptrain/" + inside.as_posix()


def _recorder() -> dict[str, Any]:
    """torch's flight recorder, as it dumps itself ({} when it is off or unreadable)."""
    try:
        import torch

        dump = torch._C._distributed_c10d._dump_fr_trace  # type: ignore[attr-defined]
        return pickle.loads(dump())  # torch's own bytes
    except Exception:
        return {}


def _entry(e: dict[str, Any]) -> dict[str, Any]:
    frames = [f for f in e.get("frames") or []
              if not str(f.get("filename", "")).startswith(_TORCH)]
    keep = ("process_group", "collective_seq_id", "profiling_name", "state", "retired",
            "input_sizes", "time_created_ns")
    out = {k: e.get(k) for k in keep}
    out["called_at"] = (f"{_short(str(frames[0]['filename']))}:{frames[0]['line']} "
                        f"({frames[0]['name']})") if frames else None
    return out


def _stacks() -> dict[str, list[str]]:
    names = {t.ident: t.name for t in __import__("threading").enumerate()}
    return {
        f"{names.get(ident, 'thread')} ({ident})": traceback.format_stack(frame)[-12:]
        for ident, frame in sys._current_frames().items()
    }
