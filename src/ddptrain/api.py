"""The Python API: the whole `ddptrain train` lifecycle as one call.

    from ddptrain import TrainingConfig, fit

    summary = fit(TrainingConfig(epochs=3, output_dir="runs/mine"),
                  model=MyNet(), datasets=(train_set, val_set))

Run the script as it is for one process, or under `torchrun --nproc_per_node=N` for N
ranks: `fit` reads the launcher's environment, starts and tears down the process group,
and returns the summary (the same global figures on every rank). `model` is an
`nn.Module` or a factory `fn(config, **facts)` (under fsdp a factory's model is built on
the meta device and sharded before any rank allocates it; an instance is sharded as it
is); `datasets` a `(train, val)` pair, one
dataset to split by `val_fraction`, or a factory; `task` a `Task` or a built-in name;
`hooks` observe and steer the run (`ddptrain.Hook`, each call given a `ddptrain.RunView`).
Left out, each comes from the config, as on the command line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.config import TrainingConfig
from ddptrain.config_values import OBJECT_FIELDS
from ddptrain.errors import ConfigError, TrainingStopped
from ddptrain.launch.failures import own_errors
from ddptrain.launch.rundir import (
    RunClaim,
    new_run_id,
    resolve_layout,
    resume_source,
    saved_run_id,
)
from ddptrain.layout import Layout

if TYPE_CHECKING:  # torch and what needs it load once a run starts, not for `--help`
    import torch

    from ddptrain.data import DataBundle
    from ddptrain.launch.cluster import ClusterEnv
    from ddptrain.observe.startup import Phases
    from ddptrain.parallel import StrategyChoice
    from ddptrain.train import Precision, Task

log = logging.getLogger("ddptrain")


@dataclass(frozen=True)
class Resolved:
    """What one launch decided before its process group starts, each thing once: the
    config, who this process is, its device, backend, precision, strategy, data and task."""

    config: TrainingConfig
    cluster: ClusterEnv
    device: torch.device
    backend: str | None  # None: world size 1, no process group
    precision: Precision
    strategy: StrategyChoice
    data: DataBundle
    task: Task
    startup: Phases  # the seconds of each start-up phase, marked as it ends


def fit(
    config: TrainingConfig | None = None,
    *,
    model: Any = None,
    datasets: Any = None,
    task: Any = None,
    hooks: Sequence[Any] = (),
    collate: Any = None,
    val: Mapping[str, Any] | None = None,
    on_done: Callable[[dict[str, Any]], None] | None = None,
    **fields: Any,
) -> dict[str, Any]:
    """Train on this rank and return the run's summary. `fields` override `config`;
    `collate` is a function of a list of samples (or a `module:fn` ref, as `--collate`);
    `model` a module, a function that builds one, or a name as `--model` takes it; `val`
    more validation sets by name (`--val`), each a Dataset or a name as `--dataset` takes
    it; `on_done` is called with the summary once the run is trained and exported and its
    process group is gone, before the job waits for its curves.png and lets go of the
    directory (the CLI's done line)."""
    if isinstance(collate, str):
        fields, collate = {**fields, "collate": collate}, None
    named = {k: v for k, v in (val or {}).items() if isinstance(v, str)}
    if named:
        fields = {**fields, "val": [*fields.get("val", []), *(f"{k}={v}" for k, v in
                                                               named.items())]}
    more_val = {k: v for k, v in (val or {}).items() if k not in named}
    if isinstance(model, str):
        fields, model = {**fields, "model": model}, None
    run = resolve_run(_resolve_config(config, fields), datasets, task, model, collate,
                      more_val)
    # config.yaml and the checkpoints say which fields Python objects stood in for
    given = _given(model, datasets, task, collate)
    run = dataclasses.replace(run, config=dataclasses.replace(run.config, given_in_python=given))
    config = run.config
    if config.dry_run:
        if run.cluster.rank == 0:
            _print_dry_run(run, model)
        return {"dry_run": True}
    finished = _finished_summary(run, model)
    if finished is not None:
        return finished
    _refuse_unfit_init(run, model)
    with own_errors(), claim_run_dir(run) as claim:  # torch's errors raised as ddptrain's
        summary = _run_in_group(dataclasses.replace(run, config=claim.config), model, hooks, claim)
        if on_done is not None:
            on_done(summary)
        return summary


def resolve_run(
    config: TrainingConfig, datasets: Any = None, task: Any = None, model: Any = None,
    collate: Any = None, more_val: Mapping[str, Any] | None = None,
) -> Resolved:
    """Everything a user can get wrong, checked before the process group starts, so a
    mistake ends the job at once instead of leaving peers waiting for a dead rank."""
    # Imported here so that `--help` and config errors answer without loading torch.
    from ddptrain.data import bundle_datasets, load_data, with_collate
    from ddptrain.data.mix import with_val_sets
    from ddptrain.data.sources import with_val_objects
    from ddptrain.launch.autolayout import choose, wanted
    from ddptrain.launch.cluster import read_cluster_env
    from ddptrain.launch.process_group import resolve_backend, resolve_device
    from ddptrain.log import setup_logging
    from ddptrain.observe.startup import Phases
    from ddptrain.parallel import resolve_strategy
    from ddptrain.train import ranking, resolve_precision, resolve_task

    startup = Phases()
    startup.mark("imports")
    cluster = read_cluster_env()
    setup_logging(cluster.rank)
    config = resolve_layout(config, cluster.world_size)
    config = _goes_on(config, cluster.rank)
    device = resolve_device(config, cluster.local_rank, cluster.local_world_size)
    backend = resolve_backend(config, device) if cluster.world_size > 1 else None
    precision = resolve_precision(config, device)
    precision.apply()  # TF32 or IEEE float32 matmuls for everything this process runs
    strategy = resolve_strategy(config, cluster.world_size, device, cluster.local_world_size)
    if config.tracker != "none":
        from ddptrain.observe.trackers import require_tracker

        require_tracker(config.tracker)
    if config.memory_snapshot and device.type != "cuda":
        raise ConfigError(
            f"--memory_snapshot records CUDA's allocator, and this run is on {device.type}: "
            "drop the flag"
        )
    if config.sync_bn and device.type == "cpu" and cluster.world_size > 1:
        raise ConfigError(
            "--sync_bn is invalid on CPU: SyncBatchNorm needs CUDA devices; drop the flag"
        )
    num_labels = _num_labels(model)
    if datasets is None:
        data = load_data(config, num_labels)
    else:
        made = datasets(config) if callable(datasets) else datasets
        data = bundle_datasets(made, config, num_labels)
        if config.val:
            data = with_val_sets(data, config, lambda other: load_data(other, num_labels))
    if more_val:
        data = with_val_objects(data, config, more_val)
    data = with_collate(data, config, collate)
    if config.channels_last and not data.is_image:
        raise ConfigError(
            f"--channels_last needs image data (N, C, H, W), and --dataset {config.dataset!r} "
            f"gives samples of shape {data.input_shape}: drop the flag"
        )
    if wanted(config):  # `--layout auto`, `--batch_size auto`: planned for this world
        config = choose(config, data.facts.vocab_size, cluster.world_size,
                        cluster.local_world_size, device, own_model=model is not None,
                        iterable=data.iterable)
        strategy = resolve_strategy(config, cluster.world_size, device,
                                    cluster.local_world_size)
    if model is None and (Layout.of(config).splits_model or config.ep > 1 or config.cp > 1):
        from ddptrain.models.factory import model_shape
        from ddptrain.parallel.resolve import check_model_layout

        tokens = data.input_shape[0] if data.input_shape else None
        check_model_layout(config, model_shape(config, data), tokens)
    if not hasattr(task, "loss"):  # a built-in name, or None: the config's --task
        task = resolve_task(config if task is None else _with_task(config, task), data.facts)
    ranking(config, task)  # --best_metric names a figure the task has
    startup.mark("data")
    return Resolved(config, cluster, device, backend, precision, strategy, data, task, startup)


@contextlib.contextmanager
def claim_run_dir(run: Resolved) -> Iterator[RunClaim]:
    """Rank 0 refuses another run's directory and takes the directory's lock; yields the
    claim, its config with the run id. `config.yaml` (with the run id) and `.job` are
    written by `claim.commit()` once the trainer is built; a start that fails before its
    first step leaves the directory as it found it. On the way out the curves drawing
    finishes before the lock goes, and then `finished.json` (`claim.ended`) is written,
    last: a finished job's directory is whole, and says so."""
    main = run.cluster.rank == 0
    claim = RunClaim(run.config, main)
    failed = True
    try:
        claim.take()
        if main:
            claim.config = _with_run_id(run.config)
            log.info("run %s in %s", claim.config.run_id, claim.config.run_dir)
        yield claim
        failed = False
    finally:
        from ddptrain.observe.plot import wait_for_drawings

        wait_for_drawings()  # curves.png, drawn while the group tore down: in before the lock goes
        try:
            if failed:
                claim.give_back()
            elif main and claim.ended is not None:
                from ddptrain.checkpoint.finished import write_finished

                write_finished(claim.config.run_dir, claim.ended)
        finally:
            claim.release()


def _run_in_group(
    run: Resolved, model: Any, hooks: Sequence[Any], claim: RunClaim | None = None
) -> dict[str, Any]:
    """Start the process group, train, and tear it down whatever happens."""
    from ddptrain.launch.process_group import setup_distributed, teardown_distributed

    ctx = setup_distributed(run.config, run.cluster, run.device, run.backend)
    run.startup.mark("group")
    clean = False
    try:
        summary = _fit(run, ctx, model, hooks, claim)
        clean = True
    except TrainingStopped:
        clean = True  # every rank stopped at the same agreed step
        raise
    finally:
        teardown_distributed(clean, ctx)
    return summary


def _goes_on(config: TrainingConfig, rank: int) -> TrainingConfig:
    """A job that goes on (torchrun restarted its workers, or this node joined it) resumes
    from its newest checkpoint, whatever `--resume_from` said for the first attempt."""
    source = resume_source(config.resume_from, config.run_dir)
    if source == config.resume_from:
        return config
    if rank == 0:
        log.warning("the job goes on (torchrun restart or a node joined): resuming from the "
                    "newest checkpoint")
    return dataclasses.replace(config, resume_from=source)


def _with_run_id(config: TrainingConfig) -> TrainingConfig:
    """A fresh run gets a new id; a resumed one keeps the id its directory records."""
    if config.resume_from is None:  # also when --config repeats a run
        return dataclasses.replace(config, run_id=new_run_id())
    run_id = saved_run_id(config.run_dir) or config.run_id or new_run_id()
    return dataclasses.replace(config, run_id=run_id)


def _finished_summary(run: Resolved, model: Any) -> dict[str, Any] | None:
    """A resume of a run that already finished: say so, touch nothing, return its summary.
    A checkpoint of another model, task or optimizer is refused first: "finished" would
    claim a run this command never asked for. A run that trained to its end but whose
    exports were not all written (a kill, a SIGTERM or a full disk during them: no
    `finished.json` naming its final checkpoint) has not finished: None, and the run goes
    on to write them from that checkpoint."""
    import json

    import torch

    from ddptrain.checkpoint import find_resumable, load_named
    from ddptrain.checkpoint.finished import FINISHED, exports_current

    config = run.config
    source = config.resume_from
    if source is None:
        return None
    if source == "auto":
        found = find_resumable(config.ckpt_dir, torch.device("cpu"))
    else:
        found = load_named(Path(source), torch.device("cpu"))
    if found is None:
        return None
    path, payload = found
    stopped = payload.get("history", {}).get("stop")  # a hook finished it (early stopping)
    unfinished = payload["epoch"] < config.epochs or payload.get("samples_in_epoch")
    if unfinished and not stopped:
        return None
    _refuse_another_model(run, model, path, payload)
    if not exports_current(config.run_dir, payload):
        log.info("the run in %s trained to its end (%s), but its exports were not all written "
                 "(no %s naming that checkpoint: stopped during the export?): writing them "
                 "from it", config.run_dir, path.name, FINISHED)
        return None
    if stopped:
        log.info(
            "the run in %s already finished: it stopped early (%s): nothing to do, its "
            "files are untouched", config.run_dir, stopped["reason"],
        )
    else:
        log.info(
            "the run in %s already finished (%d of %d epochs): nothing to do, its files "
            "are untouched; raise --epochs to train on",
            config.run_dir, payload["epoch"], config.epochs,
        )
    summary_file = config.run_dir / "summary.json"
    if summary_file.is_file():
        return dict(json.loads(summary_file.read_text()), already_finished=True)
    return {"already_finished": True, "epochs": payload["epoch"], "steps": payload["step"]}


def _refuse_another_model(run: Resolved, model: Any, path: Path, payload: dict[str, Any]) -> None:
    """The checks a resume makes, made without training: the task and optimizer, and the
    weights against this command's model, built on the meta device (no memory, no init)."""
    from ddptrain.checkpoint.common import check_model_state
    from ddptrain.checkpoint.schema import refuse_incompatible

    config, task = run.config, run.task
    refuse_incompatible(payload, config.to_dict(), task.name, str(path))
    saved = payload.get("model_state_dict")
    if saved is None:  # a DCP step directory: its weights are checked as they load
        return
    check_model_state(_meta_model(run, model), saved, path)


def _print_dry_run(run: Resolved, model: Any) -> None:
    """The plan and the resolved config, from the same builders a real run uses."""
    import yaml

    from ddptrain.models.moe import expert_parameters
    from ddptrain.train import as_trained, format_plan, make_plan

    config, data, task = run.config, run.data, run.task
    model, frozen, freed = as_trained(_meta_model(run, model), config)
    n = sum(p.numel() for p in expert_parameters(model))  # a mixture's: what --ep spreads
    plan = make_plan(
        config, data, run.cluster.world_size, str(run.device), run.backend or "none",
        run.precision.describe(), task.name, sum(p.numel() for p in model.parameters()),
        run.strategy, frozen=frozen, freed=freed,
        experts=(n, run.strategy.rank_bytes(n, 0, experts=n)["params"]) if n else None,
    )
    print(f"{format_plan(plan, config)}\n\n# resolved config\n"
          + yaml.safe_dump(config.to_dict(), sort_keys=False), end="", flush=True)


def _meta_model(run: Resolved, model: Any) -> Any:
    """This command's model without its memory or its initialisation: built on the meta
    device (a given instance as it is)."""
    import torch

    from ddptrain.models import create_model
    from ddptrain.train import head_size

    if is_module(model):
        return model
    config, data, task = run.config, run.data, run.task
    with torch.device("meta"):
        if model is not None:
            return call_model_factory(model, config, data, task)
        outputs = head_size(task, data.facts)
        return create_model(config, data, outputs, torch.device("meta"), task=task.name)


def _refuse_unfit_init(run: Resolved, model: Any) -> None:
    """`--init_from` checked against this command's model before the process group
    starts (and before the run directory is touched): names and shapes, and the file's
    checksums. Skipped when the run resumes (a resume wins); a start whose checkpoints
    all turn out unusable is checked again as it loads."""
    from ddptrain.checkpoint import find_resumable
    from ddptrain.checkpoint.init import check_fit

    config = run.config
    if config.init_from is None or config.resume_from not in (None, "auto"):
        return
    if config.resume_from == "auto":
        import torch

        if find_resumable(config.ckpt_dir, torch.device("cpu")) is not None:
            return
    try:
        module = _meta_model(run, model)
    except Exception as exc:  # a model that cannot be built on meta: checked as it loads
        log.debug("--init_from is checked once the model is built (%s)", exc)
        return
    check_fit(module, Path(config.init_from), config.init_strict)


def _given(model: Any, datasets: Any, task: Any, collate: Any) -> list[str]:
    """The config fields Python objects stand in for (a name as a string is the field's)."""
    objects = {"model": model, "dataset": datasets, "collate": collate,
               "task": task if hasattr(task, "loss") else None}
    return [name for name in OBJECT_FIELDS if objects[name] is not None]


def _with_task(config: TrainingConfig, task: str) -> TrainingConfig:
    return dataclasses.replace(config, task=task)


def _resolve_config(config: TrainingConfig | None, fields: dict[str, Any]) -> TrainingConfig:
    if config is None:
        config = TrainingConfig(**fields)
    elif fields:
            config = dataclasses.replace(config, **fields)
    return config.validate()


def _fit(
    run: Resolved, ctx: Any, model: Any, hooks: Sequence[Any], claim: RunClaim | None
) -> dict[str, Any]:
    """Build and run the trainer; once it is built (every check of the start passed, a
    resume's checkpoint accepted) the claim marks the directory as this run's. Its model,
    optimizer and loaders die with this frame, before the process group is destroyed
    (see `teardown_distributed`)."""
    from ddptrain.observe import oom
    from ddptrain.train import Trainer
    from ddptrain.train.plan import Resolved as Parts

    if model is not None and not is_module(model):
        # Called by the trainer, seeded, where the strategy builds (fsdp: on meta first)
        model = functools.partial(call_model_factory, model, run.config, run.data, run.task)
    parts = Parts(run.config, run.precision, run.strategy, run.data, run.task, run.startup)
    if run.config.memory_snapshot:
        oom.record_history(run.device)
    trainer = Trainer(parts, ctx, module=model, hooks=hooks)
    if claim is not None:
        claim.commit()  # every rank has read the directory's job (resolve_run) by now
    try:
        summary = trainer.fit()
        if claim is not None:
            claim.ended = trainer.ended  # (rank 0's) recorded once the group is down
        return summary
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if not oom.is_out_of_memory(exc):
            raise
        raise oom.report(exc, trainer) from None
    finally:
        if claim is not None:
            claim.trained = trainer.first_step_s is not None


def _num_labels(model: Any) -> int | None:
    """The classes a given model says it has: a Hugging Face model's `config.num_labels`."""
    if model is None or not is_module(model):
        return None
    labels = getattr(getattr(model, "config", None), "num_labels", None)
    return labels if isinstance(labels, int) and labels >= 2 else None


def is_module(obj: Any) -> bool:
    from torch import nn

    return isinstance(obj, nn.Module)


def call_model_factory(factory: Callable[..., Any], config: TrainingConfig, data: Any,
                        task: Any) -> Any:
    from ddptrain.plugins import accepted
    from ddptrain.train import head_size

    facts = {**data.facts.as_kwargs(), "outputs": head_size(task, data.facts)}
    return factory(config, **accepted(factory, facts))
