"""Experiment trackers, as step hooks (`--tracker`).

    ddptrain train --tracker mlflow --output_dir runs/a            # store: runs/a/mlruns
    MLFLOW_TRACKING_URI=http://mlflow:5000 ddptrain train --tracker mlflow
    MLFLOW_ALLOW_FILE_STORE=true mlflow ui --backend-store-uri runs/a/mlruns   # full mlflow
    WANDB_MODE=offline ddptrain train --tracker wandb --output_dir runs/b   # runs/b/wandb

    from ddptrain import fit
    fit(config, tracker="mlflow")                # or fit(config, hooks=[MLflowTracker()])

One ddptrain run is one MLflow run, written by rank 0 only:

- params: the resolved config; dict settings are flattened (`dataset_args.root`);
- metrics: every numeric field of every metrics row except `step` (the x-axis), named
  `<split>/<field>`: `train/loss`, `train/lr`, `val/accuracy`, `val/train_loss` (the
  epoch's training loss, which the trainer reports on the validation row), `val/epoch`;
- artifacts, at the end: `config.yaml`, `curves.png`, `model.safetensors`, `summary.json`;
- tags: `mlflow.runName` (the run directory's name) and `ddptrain.run_dir`.

The store is `MLFLOW_TRACKING_URI` when set, otherwise `<run_dir>/mlruns`: a file store,
the one local store that works with `mlflow-skinny` alone (MLflow's sqlite store needs
SQLAlchemy and Alembic, which only the full `mlflow` package brings). MLflow 3 keeps the
file store behind `MLFLOW_ALLOW_FILE_STORE=true`; ddptrain sets that default in its own
process when it picks this store, and whoever opens the store later needs it too (or
`mlflow migrate-filestore` to move it into a database). The experiment is
`MLFLOW_EXPERIMENT_NAME`, else `ddptrain`.

How a run ends: FINISHED after training completes; KILLED when it stops on SIGTERM or
Ctrl-C (a checkpoint exists: `--resume_from auto` continues it); FAILED after any other
error. A resume continues the same MLflow run (its id is kept in every checkpoint) and
sets it RUNNING again. Params cannot change within an MLflow run, so a setting that
differs in the resumed session (`epochs`, `resume_from`) keeps its first value as a
param and gets a `resumed.<name>` tag with the value the latest session used.

Metric rows are buffered and sent in batches: at every validation row, at least every
`flush_every_s` seconds, and at the end; a row itself costs a few microseconds. A store
that fails mid-run costs that batch and a warning, never the training run.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import numbers
import os
import re
import sys
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.errors import ConfigError, Preempted
from ddptrain.files import refuse_link
from ddptrain.observe.hooks import Hook, RunView

if TYPE_CHECKING:
    from mlflow.tracking import MlflowClient

    from ddptrain.config import TrainingConfig
    from ddptrain.context import DistributedContext


log = logging.getLogger("ddptrain")
MISSING_MLFLOW = (
    "--tracker mlflow needs the mlflow package: pip install 'ddptrain[mlflow]' "
    "(mlflow-skinny is enough)"
)

MISSING_WANDB = "--tracker wandb needs the wandb package: pip install 'ddptrain[wandb]'"


DEFAULT_EXPERIMENT = "ddptrain"
FLUSH_EVERY_S = 10.0
# Files of the run directory that go into the run's artifacts, when present at the end.
ARTIFACTS = ("config.yaml", "curves.png", "model.safetensors", "summary.json")
_MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
_MAX_TAG_LEN = 8000  # and on a tag value
# What MLflow accepts in a metric or param name; anything else becomes "_", since one bad
# name would make the store reject the whole batch it is in.
_UNSAFE_NAME = re.compile(r"[^\w./\- :]")


def tracker_hooks(config: TrainingConfig, ctx: DistributedContext) -> list[Hook]:
    """The hooks `--tracker` asks for (rank 0 only: one run, one writer)."""
    if config.tracker == "none":
        return []
    # Checked on every rank, so that all of them stop together instead of the others
    # waiting for rank 0 at the first collective.
    require_tracker(config.tracker)
    if not ctx.is_main:
        return []
    return [MLflowTracker() if config.tracker == "mlflow" else WandbTracker()]


def require_tracker(name: str) -> None:
    """Raise ConfigError unless the tracker's package can be imported (without importing
    it: that takes a second or two, and only rank 0 needs it)."""
    if name == "mlflow":
        require_mlflow()
    elif name == "wandb" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(MISSING_WANDB)


def require_mlflow() -> None:
    if importlib.util.find_spec("mlflow") is None:
        raise ConfigError(MISSING_MLFLOW)


def default_tracking_uri(run_dir: Path) -> str:
    """`MLFLOW_TRACKING_URI`, else a file store in the run directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (
        refuse_link(Path(run_dir) / "mlruns").resolve().as_uri())


def flatten_params(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Config fields as MLflow params: nested dicts become `outer.inner`, every value a
    string of at most MLflow's 6000 characters."""
    params: dict[str, str] = {}
    for name, value in values.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict) and value:
            params.update(flatten_params(value, f"{key}."))
        else:
            params[_safe_name(key)] = _clip(str(value), _MAX_PARAM_LEN)
    return params


def row_metrics(row: dict[str, Any]) -> dict[str, float]:
    """The MLflow metrics of a metrics row: `<split>/<field>` -> value (at the row's step)."""
    split = row.get("split", "train")
    return {
        _safe_name(f"{split}/{name}"): float(value)
        for name, value in row.items()
        # bool is an int to Python, but "True" is not a figure to plot
        if name not in ("split", "step") and isinstance(value, numbers.Real)
        and not isinstance(value, bool)
    }


class MLflowTracker(Hook):
    """Logs the run to MLflow (see the module docstring). Pass it in `fit(hooks=...)` to
    choose the store, experiment or run name in code; it does nothing on ranks other
    than 0, so the same hook list can go to every rank."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        experiment: str | None = None,
        run_name: str | None = None,
        flush_every_s: float = FLUSH_EVERY_S,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.flush_every_s = flush_every_s
        self.run_id: str | None = None
        self._saved_uri: str | None = None
        self._client: MlflowClient | None = None
        # (step, time in ms, metrics) per row; made into MLflow Metrics only when sent
        self._pending: list[tuple[int, int, dict[str, float]]] = []
        self._last_flush = 0.0
        self._ended = False

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        if self.run_id is None:
            return {}
        return {"run_id": self.run_id, "tracking_uri": self.tracking_uri or ""}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id") or None
        self._saved_uri = state.get("tracking_uri") or None

    # ------------------------------------------------------------------ hook points
    def on_fit_start(self, run: RunView) -> None:
        if not run.is_main:
            return
        from mlflow.tracking import MlflowClient

        config = run.config
        if self.tracking_uri is None:
            self.tracking_uri = default_tracking_uri(config.run_dir)
        if self.tracking_uri.startswith("file:"):
            # A file store is refused without this opt-in in MLflow 3 (see the module
            # docstring); an explicit MLFLOW_ALLOW_FILE_STORE=false still wins.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = client = MlflowClient(self.tracking_uri)
        params = flatten_params(config.to_dict())
        if not (self.run_id and self._continue_run(client, params)):
            self._start_run(client, config.run_dir, params)
        self._ended = False
        self._last_flush = time.monotonic()
        log.info("mlflow: run %s in %s", self.run_id, self.tracking_uri)

    def on_row(self, run: RunView, row: dict[str, Any]) -> None:
        if self._client is None:
            return
        self._pending.append((int(row["step"]), int(time.time() * 1000), row_metrics(row)))
        # A validation row closes an epoch: worth seeing at once, and rare enough.
        if row.get("split") == "val" or time.monotonic() - self._last_flush >= self.flush_every_s:
            self._flush()

    def on_fit_end(self, run: RunView, summary: dict[str, Any]) -> None:
        if self._client is None or self.run_id is None:
            return
        from mlflow.entities import RunStatus

        self._flush()
        try:
            run_dir = run.config.run_dir
            for name in ARTIFACTS:
                if (run_dir / name).is_file():
                    self._client.log_artifact(self.run_id, str(run_dir / name))
            if not (run_dir / "summary.json").is_file():
                self._client.log_dict(self.run_id, _plain(summary), "summary.json")
            self._client.set_terminated(self.run_id, RunStatus.to_string(RunStatus.FINISHED))
            self._ended = True
        except Exception:  # the model is trained and saved: the tracker must not undo that
            log.exception("mlflow: could not log the artifacts of run %s", self.run_id)

    def close(self) -> None:
        """End a run that `on_fit_end` did not: KILLED after a stop that can be resumed
        (SIGTERM, Ctrl-C), FAILED after anything else."""
        if self._client is None or self.run_id is None or self._ended:
            return
        # close() runs in the trainer's `finally`, where the error on its way out is
        # still visible: it tells a stop from a crash.
        error = sys.exc_info()[1]
        status = "KILLED" if isinstance(error, (Preempted, KeyboardInterrupt)) else "FAILED"
        self._flush()
        try:
            self._client.set_terminated(self.run_id, status)
        except Exception as exc:  # must not hide the error that ended training
            log.warning("mlflow: could not mark run %s %s: %s", self.run_id, status, exc)
        self._ended = True

    # ------------------------------------------------------------------ internals
    def _start_run(self, client: MlflowClient, run_dir: Path, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        run_dir = Path(run_dir).resolve()
        run = client.create_run(
            self._experiment_id(client), run_name=self.run_name or run_dir.name,
            tags={"ddptrain.run_dir": _clip(str(run_dir), _MAX_TAG_LEN)},
        )
        self.run_id = run.info.run_id
        client.log_batch(self.run_id, params=[Param(k, v) for k, v in params.items()])

    def _continue_run(self, client: MlflowClient, params: dict[str, str]) -> bool:
        """Reopen the run of the checkpoint; False (and a warning) when this store does
        not have it, e.g. after MLFLOW_TRACKING_URI changed."""
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException

        assert self.run_id is not None
        try:
            run = client.get_run(self.run_id)
        except MlflowException:
            run = None
        if run is None or run.info.lifecycle_stage != "active":
            where = f" (it was in {self._saved_uri})" if self._saved_uri else ""
            log.warning(
                "mlflow: the checkpoint's run %s is not in %s%s: logging to a new run",
                self.run_id, self.tracking_uri, where,
            )
            self.run_id = None
            return False
        client.update_run(self.run_id, status="RUNNING")
        logged = run.data.params
        client.log_batch(
            self.run_id,
            params=[Param(k, v) for k, v in params.items() if k not in logged],
            tags=[
                RunTag(_safe_name(f"resumed.{k}"), _clip(v, _MAX_TAG_LEN))
                for k, v in params.items() if k in logged and logged[k] != v
            ],
        )
        return True

    def _experiment_id(self, client: MlflowClient) -> str:
        from mlflow.exceptions import MlflowException

        name = self.experiment or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            try:
                return client.create_experiment(name)
            except MlflowException:
                # Another run created it in the meantime (same store, same moment).
                experiment = client.get_experiment_by_name(name)
                if experiment is None:
                    raise
        if experiment.lifecycle_stage != "active":
            raise ConfigError(
                f"MLflow experiment {name!r} in {self.tracking_uri} is deleted: restore it "
                "(mlflow experiments restore) or set MLFLOW_EXPERIMENT_NAME to another name"
            )
        return experiment.experiment_id

    def _flush(self) -> None:
        self._last_flush = time.monotonic()
        if not self._pending or self._client is None or self.run_id is None:
            return
        from mlflow.entities import Metric

        batch = [
            Metric(name, value, timestamp, step)
            for step, timestamp, metrics in self._pending for name, value in metrics.items()
        ]
        self._pending = []
        try:
            self._client.log_batch(self.run_id, metrics=batch)
        except Exception as exc:
            # The store is outside this process (a server, a shared disk): a failure
            # there costs these figures, not the training run. MLflow's HTTP client has
            # already retried transient errors by now, so the batch is not kept.
            log.warning("mlflow: %d metric values not logged: %s", len(batch), exc)


@functools.lru_cache(maxsize=4096)  # the same few field names come in every row
def _safe_name(name: str) -> str:
    return _UNSAFE_NAME.sub("_", name)


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _plain(value: Any) -> Any:
    """JSON-safe copy of a summary (numpy or torch scalars become str if need be)."""
    return json.loads(json.dumps(value, default=str))


class WandbTracker(Hook):
    """Logs the run to Weights & Biases as `MLflowTracker` logs it to MLflow: the resolved
    config, every row's `<split>/<field>` figures at its step, and `config.yaml`,
    `curves.png`, `model.safetensors` and `summary.json` as one artifact (`run-files`),
    with the summary's figures as the run's summary. Files go under `<run_dir>/wandb`
    (`WANDB_MODE=offline` writes only there; `wandb sync` uploads them later). The project
    is `WANDB_PROJECT`, else `ddptrain`. A resume continues the same W&B run: its id is in
    every checkpoint (rank 0 only, like every tracker)."""

    def __init__(self, project: str | None = None, run_name: str | None = None) -> None:
        self.project, self.run_name = project, run_name
        self.run_id: str | None = None
        self._run: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id") or None

    def on_fit_start(self, run: RunView) -> None:
        if not run.is_main:
            return
        import wandb

        refuse_link(Path(run.config.run_dir) / "wandb")
        run_dir = Path(run.config.run_dir).resolve()
        # The ddptrain run's id (kept across resumes) is the W&B run's too.
        self.run_id = self.run_id or run.config.run_id or uuid.uuid4().hex[:12]
        self._run = wandb.init(
            project=self.project or os.environ.get("WANDB_PROJECT") or DEFAULT_EXPERIMENT,
            id=self.run_id, resume="allow", dir=str(run_dir),
            name=self.run_name or run_dir.name, config=run.config.to_dict(),
            settings=wandb.Settings(silent=True, console="off"),
            allow_val_change=True,
        )
        log.info("wandb: run %s in %s", self.run_id, run_dir / "wandb")

    def on_row(self, run: RunView, row: dict[str, Any]) -> None:
        if self._run is not None:
            self._run.log(row_metrics(row), step=int(row["step"]))

    def on_fit_end(self, run: RunView, summary: dict[str, Any]) -> None:
        if self._run is None:
            return
        import wandb

        try:
            run_dir = run.config.run_dir
            files = wandb.Artifact(f"run-files-{self.run_id}", type="run-files")
            for name in ARTIFACTS:
                if (run_dir / name).is_file():
                    files.add_file(str(run_dir / name), name=name)
            self._run.log_artifact(files)
            self._run.summary.update(
                {k: v for k, v in _plain(summary).items() if isinstance(v, (int, float))}
            )
            self._run.finish(exit_code=0)
        except Exception:  # the model is trained and saved: the tracker must not undo that
            log.exception("wandb: could not log the artifacts of run %s", self.run_id)
        self._run = None

    def close(self) -> None:
        """Finish a run that `on_fit_end` did not (a stop or an error) with exit code 1."""
        if self._run is None:
            return
        try:
            self._run.finish(exit_code=1)
        except Exception as exc:  # must not hide the error that ended training
            log.warning("wandb: could not finish run %s: %s", self.run_id, exc)
        self._run = None
