#!/usr/bin/env python3
"""`make mutants`: does the suite catch a realistic bug? Each mutant below is one small
change to ddptrain's code (its file, the exact original text, the mutated text) and the
tests that should catch it, in the fast tier and in the slow one. The script copies the
tree (the checkout as it is, uncommitted changes included; not .venv, runs or anything
git ignores) to a temporary folder, then for each mutant in turn plants it there, runs
the fast selection (`-m "not slow"`) and then the slow one (`-m slow`) against the copy's
`src/`, and puts the original text back. It prints a table: each mutant, whether the fast
and the slow tier caught it, and the first test that failed. The checkout is never
written to.

    make mutants                          # every mutant, fast then slow (long: slow tests)
    make mutants ARGS=--fast-only         # the fast selections alone (a few minutes)
    python scripts/mutants.py --only nan-flag --only qkv-layout
    python scripts/mutants.py --list

A mutant whose original text is not found exactly once fails the whole run before
anything is planted: the code moved or changed, so update the list. Before the mutants,
each selection runs once unmutated (the baseline): a test that fails without a mutant
would make every mutant look caught. Exit status: 0 when every mutant was caught by each
tier it is expected to be caught in (`expect`), 1 otherwise, 2 on a setup error.

Standard library only; pytest runs under the repository's `.venv` (or `--python`)."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
G = "tests/test_guards.py::"  # the fast guards of lines only slow tests (or none) covered


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the repository
    original: str  # exact text, found exactly once in the file
    mutated: str
    fast: tuple[str, ...]  # pytest arguments: test files and node ids (a "-k" expression too)
    slow: tuple[str, ...] = ()  # () : no slow test covers it
    expect: tuple[str, ...] = ("fast",)  # the tiers that must catch it
    what: str = ""  # the guarantee it breaks


MUTANTS: tuple[Mutant, ...] = (
    # ---- six that no test caught before tests/test_guards.py
    Mutant(
        "fields-list-length", "src/ddptrain/checkpoint/integrity.py",
        '        inner = ",".join(fields_text(v) for v in obj)\n',
        "        inner = str(len(obj))\n",
        fast=(G + "test_a_value_changed_inside_a_list_of_a_checkpoints_fields_is_damage",
              "tests/test_integrity.py::test_a_bit_flipped_in_any_field_is_damage_not_a_silent_resume"),
        slow=("tests/test_integrity.py::test_a_damaged_newest_pt_is_skipped_and_the_run_ends_bitwise_equal",),
        what="a value flipped inside a list of a checkpoint's non-tensor fields is damage",
    ),
    Mutant(
        "hang-seq", "src/ddptrain/observe/hang.py",
        '"seq": None if done is None else int(done) + 1,',
        '"seq": None if done is None else int(done),',
        fast=(G + "test_a_hang_record_numbers_the_collective_it_failed_in",
              "tests/test_observability.py::test_a_hang_report_names_the_ranks_that_wrote_no_record"),
        slow=("tests/test_faults.py::test_surviving_rank_exits_within_the_timeout[hangs]",),
        what="the hang line numbers the collective that failed: the last completed + 1",
    ),
    Mutant(
        "nan-flag", "src/ddptrain/train/stepping.py",
        "count, flag = both[:1], (both[1] > 0).to(own_flag.dtype)",
        "count, flag = both[:1], (both[1] > 1).to(own_flag.dtype)",
        fast=(G + "test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank",
              "tests/test_stepping.py"),
        slow=("tests/test_stepping.py::test_a_language_model_step_makes_one_collective_beyond_the_gradient_reduction",),
        what="a NaN on one rank skips the step on every rank (the token-count all-reduce)",
    ),
    Mutant(
        "rollback-boundary", "src/ddptrain/checkpoint/manager.py",
        "return max((f for f in found if f[0] < step), default=(0, None))[1]",
        "return max((f for f in found if f[0] <= step), default=(0, None))[1]",
        fast=(G + "test_a_spike_rolls_back_to_the_checkpoint_before_its_first_step_not_at_it",
              "tests/test_steer.py::test_on_spike_rollback_ends_with_the_weights_of_a_run_that_skips_the_spiked_steps"),
        what="a spike rolls back to a checkpoint before its first step, not one written at it",
    ),
    Mutant(
        "task-code-field", "src/ddptrain/config_values.py",
        '"collate", "model", "task", "optimizer", "scheduler",',
        '"collate", "model", "optimizer", "scheduler",',
        fast=(G + "test_each_stored_field_that_names_code_runs_only_when_named_again",
              G + "test_a_stored_task_function_is_not_imported_by_evaluate_or_predict",
              "tests/test_after.py::test_code_a_checkpoint_names_runs_only_when_the_command_names_it"),
        what="evaluate/predict import a stored `--task module:fn` only when the command names it",
    ),
    Mutant(
        "short-by-substring", "src/ddptrain/observe/hang.py",
        '    if path.startswith("<"):  # no file: `<frozen ...>`, `<string>`\n'
        "        return path\n"
        "    try:\n"
        "        inside = Path(path).resolve().relative_to(_PACKAGE)\n"
        "    except (ValueError, OSError, RuntimeError):  # elsewhere, or a loop of links\n"
        "        return path\n"
        '    return "ddptrain/" + inside.as_posix()\n',
        '    marker = os.sep + "ddptrain" + os.sep\n'
        '    return "ddptrain/" + path.split(marker, 1)[1] if marker in path else path\n',
        fast=(G + "test_the_hang_line_names_ddptrains_code_by_its_package_not_a_folder_name",
              "tests/test_observability.py::test_a_rank_stuck_in_its_own_code_notes_where_and_its_peers_report_it"),
        what="the hang line names ddptrain's code by the package's real path, not a folder name",
    ),
    # ---- five once caught only by the slow tier, now also by the fast one
    Mutant(
        "moe-regroup", "src/ddptrain/models/moe.py",
        "by_expert = [q * local + j for j in range(local) for q in range(ranks)]",
        "by_expert = [q * local + j for q in range(ranks) for j in range(local)]",
        fast=(G + "test_tokens_sent_to_their_experts_rank_come_back_as_the_whole_layer_"
                  "computes_them",
              G + "test_ddp_with_expert_parallelism_gives_the_gradients_of_the_global_mean"),
        slow=("tests/test_moe.py::test_experts_spread_over_two_ranks_train_as_ddp_and_resume_on_one",),
        expect=("fast", "slow"),
        what="--ep: the rows an all-to-all brings, by source rank, regrouped by expert",
    ),
    Mutant(
        "ep-grad-scale", "src/ddptrain/parallel/ddp.py",
        "p.register_hook(lambda grad: grad / world)",
        "p.register_hook(lambda grad: grad)",
        fast=(G + "test_ddp_with_expert_parallelism_gives_the_gradients_of_the_global_mean",),
        slow=("tests/test_moe.py::test_experts_spread_over_two_ranks_train_as_ddp_and_resume_on_one",),
        expect=("fast", "slow"),
        what="ddp --ep: an expert's gradient divided by the data-parallel ranks",
    ),
    Mutant(
        "qkv-layout", "src/ddptrain/models/gpt.py",
        "qkv.view(b, t, heads, 3, self.head_dim).unbind(3)",
        "qkv.view(b, t, 3, heads, self.head_dim).unbind(2)",
        fast=(G + "test_tp_ranks_each_computing_their_heads_equal_the_whole_attention",),
        slow=("tests/test_contracts.py::test_tp2_with_accumulation_equals_plain",),
        expect=("fast", "slow"),
        what="the GPT's fused q/k/v laid out head by head (a tp rank's rows are whole heads)",
    ),
    Mutant(
        "worker-stream-state", "src/ddptrain/data/iterable.py",
        "            return self.loader.state_dict()  # type: ignore[attr-defined]\n",
        "            return self.shard.state_dict()\n",
        fast=(G + "test_a_stateful_stream_in_two_loader_workers_resumes_mid_epoch_where_it_stood",),
        slow=("tests/test_guarantees.py::test_a_stateful_stream_in_two_loader_workers_resumes_mid_epoch_exactly",),
        expect=("fast", "slow"),
        what="a stream read by loader workers saves each worker's position",
    ),
    Mutant(
        "tied-alias-swapped", "src/ddptrain/checkpoint/streamed.py",
        "return items, {base_name(a): renamed.get(k, k) for a, k in aliases.items()}",
        "return items, {renamed.get(k, k): base_name(a) for a, k in aliases.items()}",
        fast=(G + "test_a_tied_alias_is_named_under_the_kept_tensors_exported_name",
              G + "test_two_ranks_export_a_tied_tensor_once_and_its_alias_reads_back_tied"),
        slow=("tests/test_export_streamed.py::test_two_ranks_send_each_tensor_whole_to_its_writer",),
        expect=("fast", "slow"),
        what="a streamed export records a tied tensor's alias -> the name it is written under",
    ),
    # ---- more the fast tier should catch
    Mutant(
        "tied-alias-unrenamed", "src/ddptrain/checkpoint/streamed.py",
        "return items, {base_name(a): renamed.get(k, k) for a, k in aliases.items()}",
        "return items, {base_name(a): k for a, k in aliases.items()}",
        fast=(G + "test_a_tied_alias_is_named_under_the_kept_tensors_exported_name",),
        what="an alias names the kept tensor by its exported name (a LoRA layer's plain name)",
    ),
    Mutant(
        "moe-renormalise", "src/ddptrain/models/moe.py",
        "weight = (weight / weight.sum(-1, keepdim=True)).to(x.dtype)",
        "weight = weight.to(x.dtype)",
        fast=("tests/test_moe.py::test_the_layer_is_the_dense_sum_of_each_tokens_chosen_experts",),
        what="a token's top-k expert weights renormalised over its k",
    ),
    Mutant(
        "safetensors-align", "src/ddptrain/checkpoint/streamed.py",
        "self.room = room + (-room) % 8",
        "self.room = room",
        fast=("tests/test_export_streamed.py::test_a_streamed_file_is_a_safetensors_file_with_its_checksums",),
        what="a streamed safetensors file's data starts 8-byte aligned",
    ),
    Mutant(
        "tensor-crc-sizes-only", "src/ddptrain/checkpoint/integrity.py",
        "        if crc != list(want):\n",
        "        if crc[0] != list(want)[0]:\n",
        fast=("tests/test_integrity.py",),
        what="a tensor of a checkpoint is checked by its CRC, not only its size",
    ),
    Mutant(
        "hang-report-writer", "src/ddptrain/observe/hang.py",
        "    if rank == min(records):\n",
        "    if rank == max(records):\n",
        fast=("tests/test_observability.py::test_a_hang_report_names_the_ranks_that_wrote_no_record",),
        what="the lowest rank that reported writes hang/report.txt",
    ),
    Mutant(
        "verdict-inverted", "src/ddptrain/train/stepping.py",
        "good = verdict if isinstance(verdict, bool) else not bool(verdict)",
        "good = verdict if isinstance(verdict, bool) else bool(verdict)",
        fast=("tests/test_stepping.py",),
        what="a device verdict (1.0: skipped) read as a skipped step, its window dropped",
    ),
)


# ---------------------------------------------------------------- the copy
_IGNORED = (".git", ".venv", ".venv-*", "runs", "__pycache__", ".pytest_cache", ".mypy_cache",
            ".ruff_cache", "*.egg-info", ".ci-out")


def copy_tree(dest: Path) -> None:
    """The checkout's files as they are now (tracked and untracked, not what git
    ignores) into `dest`; without git, the tree less the usual build and run folders."""
    try:
        listed = subprocess.run(
            ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others",
             "--exclude-standard"], check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        shutil.copytree(REPO, dest, symlinks=True, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(*_IGNORED))
        return
    for name in sorted({n for n in listed.decode().split("\0") if n}):
        source = REPO / name
        if not os.path.lexists(source) or source.is_dir():  # deleted, or a submodule
            continue
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)


def check_mutants(root: Path, mutants: list[Mutant]) -> list[str]:
    """Why each mutant cannot be planted in the tree at `root` (its text not found
    exactly once), as lines; empty when all can."""
    problems = []
    for m in mutants:
        path = root / m.file
        if not path.is_file():
            problems.append(f"{m.name}: {m.file} does not exist")
            continue
        count = path.read_text().count(m.original)
        if count != 1:
            found = "not found" if count == 0 else f"found {count} times"
            problems.append(f"{m.name}: its original text is {found} in {m.file} (the code "
                            f"moved or changed: update MUTANTS in {Path(__file__).name}):\n"
                            f"    {m.original.strip()[:200]!r}")
    return problems


def line_of(root: Path, m: Mutant) -> int:
    text = (root / m.file).read_text()
    return text[: text.index(m.original)].count("\n") + 1 + (m.original[:1] == "\n")


# ---------------------------------------------------------------- running pytest
@dataclass
class Outcome:
    caught: bool | None  # None: the selection could not tell (no test, an error of pytest)
    by: str  # the first test that failed, or why None
    seconds: float


def run_pytest(root: Path, python: str, tier: str, selection: tuple[str, ...],
               timeout_s: float, workers: int = 0) -> tuple[int, str, float]:
    marker = "not slow" if tier == "fast" else "slow"
    extra = ["-n", str(workers)] if workers and tier == "slow" else []
    command = [python, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", marker,
               *extra, *selection]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), env.get("PYTHONPATH")]))
    # no bytecode: a file planted and restored within one second, at one size, would
    # otherwise be read from the other's cached bytecode
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    t0 = time.monotonic()
    # a session of its own: on a timeout (or this script stopped) pytest goes with what it
    # started (ranks, loader workers)
    proc = subprocess.Popen(command, cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        _kill_session(proc)
        out, _ = proc.communicate()
        code, out = -1, f"timed out after {timeout_s:.0f} s\n{out}"
    except BaseException:
        _kill_session(proc)
        raise
    return code, out, time.monotonic() - t0


def _kill_session(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED ", "ERROR ")):
            return re.sub(r" - .*", "", line.split(" ", 1)[1]).strip()
    return "?"


def judge(code: int, output: str, seconds: float) -> Outcome:
    if code == 0:
        return Outcome(False, "", seconds)
    if code == 1:
        return Outcome(True, first_failure(output), seconds)
    if code == 2 and "error" in output.lower() and "collect" in output.lower():
        return Outcome(True, "collection error: " + first_failure(output), seconds)
    if code == 5:
        return Outcome(None, "no test selected (check the selection)", seconds)
    if code == -1:
        return Outcome(None, "timed out", seconds)
    return Outcome(None, f"pytest exit {code}", seconds)


def baseline(root: Path, python: str, tier: str, mutants: list[Mutant], timeout_s: float,
             workers: int) -> bool:
    """Each selection of `tier` unmutated: False (its output printed) if any fails."""
    chosen = [m.fast if tier == "fast" else m.slow for m in mutants]
    plain = sorted({arg for sel in chosen if "-k" not in sel for arg in sel})
    groups = [tuple(plain)] if plain else []
    groups += sorted({sel for sel in chosen if "-k" in sel})
    for selection in groups:
        code, out, seconds = run_pytest(root, python, tier, selection, timeout_s, workers)
        say(f"baseline, {tier} tier: exit {code} in {seconds:.0f} s")
        if code != 0:
            say(out[-6000:])
            say(f"the {tier} selection fails without any mutant: fix that first "
                "(or run with --no-baseline)")
            return False
    return True


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the table
def table(rows: list[tuple[Mutant, int, dict[str, Outcome]]], tiers: list[str]) -> str:
    def cell(o: Outcome | None) -> str:
        if o is None:
            return "-"
        return {True: "yes", False: "NO", None: "error"}[o.caught] + f" ({o.seconds:.0f} s)"

    head = ["mutant", "where", *(f"caught by {t}" for t in tiers),
            "first test that failed" + (" (fast | slow)" if len(tiers) > 1 else "")]
    body = []
    for m, line, outcome in rows:
        by = " | ".join(outcome[t].by or "-" if t in outcome else "-" for t in tiers)
        body.append([m.name, f"{m.file.removeprefix('src/ddptrain/')}:{line}",
                     *(cell(outcome.get(t)) for t in tiers), by])
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)),
                      *(fmt.format(*r) for r in body)])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", action="append", default=[], metavar="NAME",
                        help="run only this mutant (repeat, or NAME,NAME)")
    parser.add_argument("--fast-only", action="store_true", help="the fast selections alone")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip the unmutated run of the selections")
    parser.add_argument("--keep", action="store_true", help="keep the copy (its path printed)")
    parser.add_argument("--python", default=None,
                        help="the python that runs pytest (default: the repository's .venv)")
    parser.add_argument("--timeout", type=float, default=None,
                        help="seconds one pytest run may take (default: 600 for a fast "
                        "selection, 2400 for a slow one); past it, the run is an error")
    parser.add_argument("--workers", type=int, default=0,
                        help="pytest-xdist workers for the slow selections (default: none)")
    args = parser.parse_args(argv)
    # stopped (SIGTERM, as a CI runner or `timeout` stops it): the copy is still removed
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    chosen = list(MUTANTS)
    if args.only:
        wanted = [n for value in args.only for n in value.split(",") if n]
        known = {m.name for m in MUTANTS}
        unknown = [n for n in wanted if n not in known]
        if unknown:
            say(f"unknown mutant(s): {', '.join(unknown)}; known: {', '.join(sorted(known))}")
            return 2
        chosen = [m for m in MUTANTS if m.name in wanted]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file}: {m.what}\n    - {m.original.strip()}\n"
                  f"    + {m.mutated.strip()}\n    fast: {' '.join(m.fast)}\n"
                  f"    slow: {' '.join(m.slow) or '-'}")
        return 0
    problems = check_mutants(REPO, chosen)
    if problems:
        say("cannot plant:\n" + "\n".join(problems))
        return 2
    venv = REPO / ".venv" / "bin" / "python"
    python = args.python or (str(venv) if venv.exists() else sys.executable)
    if os.sep in python:  # run from the copy: a relative path (the Makefile's) made absolute
        python = os.path.abspath(python)  # (not resolved: a venv's python is a link)
    tiers = ["fast"] if args.fast_only else ["fast", "slow"]

    def limit(tier: str) -> float:
        return args.timeout or (600.0 if tier == "fast" else 2400.0)

    root = Path(tempfile.mkdtemp(prefix="ddptrain-mutants-")) / "tree"
    try:
        copy_tree(root)
        problems = check_mutants(root, chosen)
        if problems:
            say("cannot plant in the copy:\n" + "\n".join(problems))
            return 2
        where = subprocess.run(
            [python, "-c", "import ddptrain; print(ddptrain.__file__)"], cwd=root,
            env={**os.environ, "PYTHONPATH": str(root / "src")}, capture_output=True, text=True)
        if not where.stdout.strip().startswith(str(root)):
            say(f"the copy's ddptrain is not the one imported ({where.stdout.strip()} "
                f"{where.stderr.strip()[-500:]}): is ddptrain installed other than editable?")
            return 2
        say(f"copy: {root}; {len(chosen)} mutant(s), tiers: {', '.join(tiers)}")
        if not args.no_baseline:
            for tier in tiers:
                if any(m.fast if tier == "fast" else m.slow for m in chosen) and not baseline(
                        root, python, tier, chosen, limit(tier), args.workers):
                    return 2
        rows: list[tuple[Mutant, int, dict[str, Outcome]]] = []
        for m in chosen:
            path = root / m.file
            original = path.read_text()
            line = line_of(root, m)
            outcome: dict[str, Outcome] = {}
            try:
                path.write_text(original.replace(m.original, m.mutated, 1))
                for tier in tiers:
                    selection = m.fast if tier == "fast" else m.slow
                    if not selection:
                        continue
                    outcome[tier] = judge(*run_pytest(root, python, tier, selection,
                                                      limit(tier), args.workers))
                    o = outcome[tier]
                    say(f"{m.name} ({m.file}:{line}), {tier}: "
                        f"{ {True: 'caught', False: 'SURVIVED', None: 'error'}[o.caught]} "
                        f"in {o.seconds:.0f} s {o.by}")
            finally:
                path.write_text(original)
            rows.append((m, line, outcome))
        print(table(rows, tiers))
        missed = [m.name for m, _, o in rows
                  if any(t in o and o[t].caught is not True for t in m.expect if t in tiers)
                  or not any(o[t].caught for t in o)]
        if missed:
            print(f"\nnot caught where expected: {', '.join(missed)}")
        return 1 if missed else 0
    finally:
        if args.keep:
            say(f"kept: {root}")
        else:
            shutil.rmtree(root.parent, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
