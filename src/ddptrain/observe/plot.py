"""Training curves from run directories: loss, the task's metric, learning rate, throughput.

    ddptrain plot runs/a runs/b -o curves.png     # several runs overlaid, one colour each

Each run directory's `metrics.jsonl` is read; train rows are drawn as solid lines, the
per-epoch validation rows as dashed lines with markers (each `--val` set in a line style of
its own, labelled "val NAME"), against the optimizer step. Every
`ddptrain train` also leaves its own `curves.png` in its run directory, drawn by a child
process while the job tears down (`draw_in_background`) and waited for before the job
releases the directory (`wait_for_drawings`): when the job ends its directory is whole.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

from ddptrain.config import ConfigError

log = logging.getLogger("ddptrain")
# (row field, panel title, also draw the validation rows' field of the same name); METRIC
# stands for the run's first task metric (accuracy, mse, f1, perplexity, ...).
METRIC = "<metric>"
PANELS: tuple[tuple[str, str, bool], ...] = (
    ("loss", "loss", True),
    (METRIC, METRIC, True),
    ("lr", "learning rate", False),
    ("samples_per_sec", "throughput (samples/s, all ranks)", False),
)


def task_metric(rows: list[dict[str, Any]]) -> str | None:
    """The first figure of the task in a run's validation rows that is not the loss
    itself (regression's mse is)."""
    from ddptrain.observe.fields import is_bookkeeping

    for row in rows:
        if row.get("split") == "val":
            for name, value in row.items():
                if (not is_bookkeeping(name) and not name.startswith("train_")
                        and "/" not in name  # a --val set's figure
                        and isinstance(value, (int, float)) and value != row.get("loss")):
                    return name
    return None


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The rows of `run_dir/metrics.jsonl`; a line cut by a crash is skipped."""
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {str(run_dir)!r} does not exist: check the path")
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(
            f"run directory {str(run_dir)!r} has no metrics.jsonl: give a ddptrain run directory"
        )
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def val_sets(rows: list[dict[str, Any]]) -> list[str]:
    """The names of a run's more validation sets (`--val NAME=DATASET`): their figures
    are NAME/METRIC in the validation rows, in the order first seen."""
    names = (k.split("/", 1)[0] for r in rows if r.get("split") == "val" for k in r
             if "/" in k and k.endswith("/loss"))
    return list(dict.fromkeys(names))


# the line styles of the more validation sets (the run's own is dashed)
SET_STYLES = (":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)))


def _series(rows: list[dict[str, Any]], split: str, field: str) -> tuple[list[int], list[float]]:
    picked = [r for r in rows if r.get("split") == split and isinstance(r.get(field), (int, float))]
    return [int(r["step"]) for r in picked], [float(r[field]) for r in picked]


def plot_runs(run_dirs: list[Path], out: Path, overwrite: bool = True) -> Path:
    """Draw every run's curves into one figure of four panels and save it as `out` (an
    existing `out` replaced only with `overwrite`)."""
    import matplotlib.pyplot as plt

    from ddptrain.files import staged

    fig = draw_runs(run_dirs)
    with staged(out, overwrite) as tmp:  # readers never see a half-drawn file
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return out


def draw_runs(run_dirs: list[Path]) -> Any:
    """The figure of `plot_runs`: loss, the task's metric, learning rate and throughput."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed, none opened
    import matplotlib.pyplot as plt

    runs = [(d, read_metrics(d)) for d in run_dirs]
    metrics = [task_metric(rows) or "accuracy" for _, rows in runs]
    # Runs of different tasks share the metric panel: its title names every metric drawn
    # and each run's lines say which is theirs.
    named = list(dict.fromkeys(metrics))
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5), constrained_layout=True)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((run_dir, rows), metric) in enumerate(zip(runs, metrics, strict=True)):
        colour = colours[i % len(colours)]
        name = run_dir.resolve().name
        for ax, (panel, title, with_val) in zip(axes.flat, PANELS, strict=True):
            field = metric if panel == METRIC else panel
            label = f"{name} {metric}" if panel == METRIC and len(named) > 1 else name
            steps, values = _series(rows, "train", field)
            if steps:
                ax.plot(steps, values, color=colour, linewidth=1.4, label=f"{label} train")
            if with_val:
                sets = [("val", field, "--")] + [
                    (f"val {s}", f"{s}/{field}", SET_STYLES[j % len(SET_STYLES)])
                    for j, s in enumerate(val_sets(rows))]
                for what, key, style in sets:
                    steps, values = _series(rows, "val", key)
                    if steps:
                        ax.plot(steps, values, color=colour, linestyle=style, marker="o",
                                markersize=3, label=f"{label} {what}")
            ax.set_title(" / ".join(named) if panel == METRIC else title)
    for ax in axes.flat:
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend(fontsize="small")
    return fig


def matplotlib_available() -> bool:
    """Whether matplotlib is installed, without importing it (a tenth of a second)."""
    return importlib.util.find_spec("matplotlib") is not None


# The `ddptrain plot` children this process started and has not waited for yet (children
# are the process's own, like subprocess's list of them, whoever started them).
_drawing: list[tuple[subprocess.Popen[bytes], Path]] = []


def draw_in_background(run_dir: Path, out: Path) -> None:
    """Start drawing `run_dir`'s curves into `out` in a child process: matplotlib's
    imports and the rendering (about a second on a small CPU) overlap with what this
    process does next. `wait_for_drawings` collects it."""
    proc = subprocess.Popen(  # the run's own file, in the directory it holds: `_draw`
        [sys.executable, "-m", "ddptrain.observe.plot", str(run_dir), str(out)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    _drawing.append((proc, out))


def wait_for_drawings(timeout_s: float = 120.0) -> None:
    """Wait for every drawing this process started; a failed one is one warning line."""
    while _drawing:
        proc, out = _drawing.pop(0)
        try:
            _, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            log.warning("curves: drawing %s took over %.0fs and was stopped", out, timeout_s)
            continue
        if proc.returncode:
            lines = err.decode(errors="replace").strip().splitlines() or ["no output"]
            log.warning("curves: %s was not drawn (%s)", out, lines[-1][:200])
        else:  # named when it was started (`Curves`): the done line may be out already
            log.debug("curves %s drawn", out)


def _draw(argv: list[str]) -> int:
    """`python -m ddptrain.observe.plot RUN_DIR OUT`: a run's own curves, drawn for the
    run that holds `RUN_DIR` (`draw_in_background`); a failure is one line on stderr."""
    try:
        plot_runs([Path(argv[0])], Path(argv[1]))
    except ConfigError as exc:
        print(f"ddptrain: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_draw(sys.argv[1:]))
