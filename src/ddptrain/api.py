"""The Python API: the whole `ddptrain train` lifecycle as one call.

    from ddptrain import TrainingConfig, fit

    summary = fit(TrainingConfig(epochs=3, output_dir="runs/mine"),
                  model=MyNet(), datasets=(train_set, val_set))

Run the script as it is for one process, or under `torchrun --nproc_per_node=N` for N
ranks: `fit` reads the launcher's environment, starts and tears down the process group,
and returns the summary (the same global figures on every rank). `model` is an
`nn.Module` or a factory `fn(config, **facts)`; `datasets` a `(train, val)` pair, one
dataset to split by `val_fraction`, or a factory; `task` a `Task` or a built-in name;
`hooks` observe the run (`ddptrain.Hook`). Left out, each comes from the config, as on
the command line.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddptrain.config import TrainingConfig
from ddptrain.errors import ConfigError, TrainingStopped
from ddptrain.rundir import (
    RunLock,
    mark_job,
    new_run_id,
    refuse_occupied,
    resolve_layout,
    resume_source,
    saved_run_id,
)

log = logging.getLogger("ddptrain")


def make_run_dirs(config: TrainingConfig) -> None:
    """Create the run and checkpoint directories, or say why they cannot be written."""
    for directory, flag in ((config.run_dir, "output_dir"), (config.ckpt_dir, "checkpoint_dir")):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(
                f"--{flag} {str(directory)!r} is not writable ({exc.strerror}): "
                "choose a directory you can write to"
            ) from None


def fit(
    config: TrainingConfig | None = None,
    *,
    model: Any = None,
    datasets: Any = None,
    task: Any = None,
    hooks: Sequence[Any] = (),
    **fields: Any,
) -> dict[str, Any]:
    """Train on this rank and return the run's summary. `fields` override `config`."""
    # Imported here so that `--help` and config errors answer without loading torch.
    from ddptrain.data import bundle_datasets, load_data
    from ddptrain.distributed import (
        read_cluster_env,
        resolve_backend,
        resolve_device,
        setup_distributed,
        teardown_distributed,
    )
    from ddptrain.log import setup_logging
    from ddptrain.precision import resolve_precision

    config = _resolve_config(config, fields)
    cluster = read_cluster_env()
    setup_logging(cluster.rank)
    config = resolve_layout(config, cluster.world_size)
    config = _goes_on(config, cluster.rank)
    device = resolve_device(config, cluster.local_rank)
    resolve_backend(config, device)
    resolve_precision(config, device)
    if config.tracker == "mlflow":
        from ddptrain.trackers import require_mlflow

        require_mlflow()
    if config.sync_bn and device.type == "cpu" and cluster.world_size > 1:
        raise ConfigError(
            "--sync_bn is invalid on CPU: SyncBatchNorm needs CUDA devices; drop the flag"
        )
    # Everything a user can get wrong is checked before the process group starts, so a
    # mistake ends the job at once instead of leaving peers waiting for a dead rank.
    if datasets is None:
        data = load_data(config)
    else:
        made = datasets(config) if callable(datasets) else datasets
        data = bundle_datasets(made, config)
    if config.channels_last and not data.is_image:
        raise ConfigError(
            f"--channels_last needs image data (N, C, H, W), and --dataset {config.dataset!r} "
            f"gives samples of shape {data.input_shape}: drop the flag"
        )
    if config.dry_run:
        if cluster.rank == 0:
            _print_dry_run(config, data, cluster.world_size, device, model, task)
        return {"dry_run": True}
    finished = _finished_summary(config)
    if finished is not None:
        return finished
    lock = RunLock(config.run_dir)
    if cluster.rank == 0:
        if config.resume_from is None:
            refuse_occupied(config)
        make_run_dirs(config)
        lock.acquire()
    try:
        if cluster.rank == 0:
            from ddptrain.config import dump_yaml

            config = _with_run_id(config)
            dump_yaml(config, config.run_dir / "config.yaml")
            log.info("run %s in %s", config.run_id, config.run_dir)
        ctx = setup_distributed(config, cluster)
        if ctx.is_main:  # every rank has read the directory's job by now
            mark_job(config.run_dir)
        clean = False
        try:
            summary = _fit(config, ctx, data, model, task, hooks)
            clean = True
        except TrainingStopped:
            clean = True  # every rank stopped at the same agreed step
            raise
        finally:
            teardown_distributed(clean)
    finally:
        from ddptrain.plot import wait_for_drawings

        wait_for_drawings()  # curves.png, drawn while the group tore down: in before the lock goes
        lock.release()
    return summary


def _goes_on(config: TrainingConfig, rank: int) -> TrainingConfig:
    """A job that goes on (torchrun restarted its workers, or this node joined it) resumes
    from its newest checkpoint, whatever `--resume_from` said for the first attempt."""
    import dataclasses

    source = resume_source(config.resume_from, config.run_dir)
    if source == config.resume_from:
        return config
    if rank == 0:
        log.warning("the job goes on (torchrun restart or a node joined): resuming from the "
                    "newest checkpoint")
    return dataclasses.replace(config, resume_from=source)


def _with_run_id(config: TrainingConfig) -> TrainingConfig:
    """A fresh run gets a new id; a resumed one keeps the id its directory records."""
    import dataclasses

    if config.resume_from is None:  # also when --config repeats a run
        return dataclasses.replace(config, run_id=new_run_id())
    run_id = saved_run_id(config.run_dir) or config.run_id or new_run_id()
    return dataclasses.replace(config, run_id=run_id)


def _finished_summary(config: TrainingConfig) -> dict[str, Any] | None:
    """A resume of a run that already finished: say so, touch nothing, return its summary."""
    import json

    import torch

    from ddptrain.checkpoint import find_resumable, load_checkpoint

    source = config.resume_from
    if source is None:
        return None
    if source == "auto":
        found = find_resumable(config.ckpt_dir, torch.device("cpu"))
        payload = found[1] if found else None
    else:
        payload = load_checkpoint(Path(source), torch.device("cpu"))
    if payload is None or payload["epoch"] < config.epochs or payload.get("samples_in_epoch"):
        return None
    log.info(
        "the run in %s already finished (%d of %d epochs): nothing to do, its files are "
        "untouched; raise --epochs to train on", config.run_dir, payload["epoch"], config.epochs,
    )
    summary_file = config.run_dir / "summary.json"
    if summary_file.is_file():
        return dict(json.loads(summary_file.read_text()), already_finished=True)
    return {"already_finished": True, "epochs": payload["epoch"], "steps": payload["step"]}


def _print_dry_run(
    config: TrainingConfig, data: Any, world_size: int, device: Any, model: Any, task: Any
) -> None:
    """The plan and the resolved config, from the same builders a real run uses."""
    import yaml

    from ddptrain.distributed import resolve_backend
    from ddptrain.models import create_model
    from ddptrain.plan import format_plan, make_plan
    from ddptrain.precision import resolve_precision
    from ddptrain.tasks import head_size, resolve_task

    if not hasattr(task, "loss"):
        task = resolve_task(config if task is None else _with_task(config, task), data.facts)
    if model is None:
        model = create_model(config, data, head_size(task, data.facts), device)
    elif not _is_module(model):
        model = _call_model_factory(model, config, data, task)
    plan = make_plan(
        config, data, world_size, str(device),
        resolve_backend(config, device) if world_size > 1 else "none",
        resolve_precision(config, device).describe(), task.name,
        sum(p.numel() for p in model.parameters()),
    )
    print(f"{format_plan(plan, config)}\n\n# resolved config\n"
          + yaml.safe_dump(config.to_dict(), sort_keys=False), end="", flush=True)


def _with_task(config: TrainingConfig, task: str) -> TrainingConfig:
    import dataclasses

    return dataclasses.replace(config, task=task)


def _resolve_config(config: TrainingConfig | None, fields: dict[str, Any]) -> TrainingConfig:
    if config is None:
        config = TrainingConfig(**fields)
    elif fields:
        import dataclasses

        config = dataclasses.replace(config, **fields)
    return config.validate()


def _fit(
    config: TrainingConfig, ctx: Any, data: Any, model: Any, task: Any, hooks: Sequence[Any]
) -> dict[str, Any]:
    """Build and run the trainer. Its model, optimizer and loaders die with this frame,
    before the process group is destroyed (see `teardown_distributed`)."""
    from ddptrain.tasks import resolve_task
    from ddptrain.trainer import Trainer

    if isinstance(task, str):
        task = resolve_task(_with_task(config, task), data.facts)
    if model is not None and not _is_module(model):
        model = _call_model_factory(model, config, data, task)
    return Trainer(config, ctx, data, module=model, task=task, hooks=hooks).fit()


def _is_module(obj: Any) -> bool:
    from torch import nn

    return isinstance(obj, nn.Module)


def _call_model_factory(factory: Callable[..., Any], config: TrainingConfig, data: Any,
                        task: Any) -> Any:
    from ddptrain.plugins import accepted
    from ddptrain.tasks import head_size, resolve_task

    task = task or resolve_task(config, data.facts)
    facts = {**data.facts.as_kwargs(), "outputs": head_size(task, data.facts)}
    return factory(config, **accepted(factory, facts))
