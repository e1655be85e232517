"""`evaluate` and `predict`: the Python API of what a run trained (the `ddptrain
evaluate` and `ddptrain predict` commands call them). Each rebuilds the trained model from
the run's stored config on every rank, after checking the command against it, and
resolves the run as `fit` does (`api.resolve_run`); torch's failures are raised as
ddptrain's own errors (`launch.failures`).

    from ddptrain import evaluate, predict

    figures = evaluate("runs/digits")                    # {'loss': ..., 'samples': 359}
    predict("runs/digits", "preds.pt", batch_size=128)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ddptrain import api
from ddptrain.config import TrainingConfig
from ddptrain.config_values import OBJECT_FIELDS
from ddptrain.errors import ConfigError
from ddptrain.launch.failures import own_errors

log = logging.getLogger("ddptrain")


def evaluate(
    source: str | Path, *, split: str | None = None, output: str | Path | None = None,
    model: Any = None, datasets: Any = None, task: Any = None, collate: Any = None,
    argv: Sequence[str] = (), trust_checkpoint_code: bool = False, overwrite: bool = False,
    **fields: Any,
) -> dict[str, float]:
    """The task's figures for a trained model over every sample of a set once, the same
    on any world size: `source` is a run directory, a checkpoint (`.pt` or a DCP step
    directory) or a `model.safetensors` beside its `config.yaml`. The model and data are
    rebuilt from the run's config; `argv` (`ddptrain train` flags) and then `fields`
    override it (another `dataset`, say); `model`, `datasets`, `task` and `collate` are
    as in `fit`. `split` picks the set: `val` (the run's validation set), `train` or `all`
    (every sample: a dataset ddptrain would split, whole and in its order; a pair's train
    then val); by default `all` where `argv` or `fields` name a dataset other than the
    run's, else `val`. `output`:
    a JSON file rank 0 writes the figures to (an existing file only with `overwrite`).
    Returns them on every rank.

    Code the run's config names (`--model mymod:build`, a `--dataset` function, ...) is
    imported only if `argv`, `fields` or an argument here names that field again, or with
    `trust_checkpoint_code`: evaluating a downloaded checkpoint runs no code of its own.
    Each `--val NAME=DATASET` set that applies is reported as NAME/METRIC (`train.after`)."""
    from ddptrain.train import after
    from ddptrain.train.inference import check_split, describe_split

    if split is not None:
        check_split(split)
    if output is not None:
        after.check_figures_output(Path(output), overwrite)

    def work(run: api.Resolved, ctx: Any, module: Any, sets: Any, split: str) -> dict[str, float]:
        figures = after.evaluate_sets(module, sets, run.config, run.task, run.precision, ctx,
                                      run.data.collate)
        log.info("evaluate: %d samples (%s)", figures.get("samples", 0),
                 describe_split(run.data, split, _data_name(run.config)))
        return figures

    figures, source_path, config, rank, split = _after_training(
        source, argv, fields, model, datasets, task, collate, work, "ddptrain evaluate",
        trust_checkpoint_code, split, pick=after.pick_sets,
        own=after.command_flags(source, split, output, overwrite),
    )
    if output is not None and rank == 0:
        after.write_figures(Path(output), figures, source_path, config, split, overwrite)
    return figures


def predict(
    source: str | Path, output: str | Path, *, split: str | None = None, model: Any = None,
    datasets: Any = None, collate: Any = None, argv: Sequence[str] = (),
    trust_checkpoint_code: bool = False, overwrite: bool = False,
    max_new_tokens: int | None = None, **fields: Any,
) -> int:
    """Write a trained model's outputs for every sample of a set to `output` (`.npy`,
    `.pt` or `.jsonl`), one row per sample in the set's order, on any world size (rank 0
    writes, a round of batches at a time); the samples' targets, if any, are not used.
    `source`, `argv`, `fields`, `model`, `datasets`, `collate`, `split`,
    `trust_checkpoint_code` and `overwrite` are as in `evaluate` (so a `--dataset` other
    than the run's is predicted whole). Logs how many rows it wrote of how many the data
    holds; returns the number of rows.

    A `chat:` dataset written to a `.jsonl` file is a file of prompts: each line of
    `output` is then `{"index": i, "prompt": ..., "reply": "..."}`, the assistant's reply
    generated greedily (`train.generate`), at most `max_new_tokens` tokens (default 64),
    for every row of the dataset's files in their order (`split` may only be `all`)."""
    from ddptrain.train import after
    from ddptrain.train.generate import (
        MAX_NEW_TOKENS,
        Prompts,
        check_max_new_tokens,
        generate_replies,
        prompt_data,
        wants_replies,
    )
    from ddptrain.train.inference import check_split, describe_split
    from ddptrain.train.predict import check_output, predict_set

    out = Path(output)
    check_output(out, overwrite)
    if split is not None:
        check_split(split)
    new_tokens = MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens
    check_max_new_tokens(new_tokens)

    def prompts(config: TrainingConfig) -> Any:
        if datasets is not None or not wants_replies(config, out):
            if max_new_tokens is not None:
                raise ConfigError(f"--max_new_tokens {max_new_tokens} applies to replies, and "
                                  "there are none to generate: give a chat:PATH --dataset of "
                                  "prompts and a .jsonl --output, or drop the flag")
            return None
        if split not in (None, "all"):
            raise ConfigError(f"--split {split} is invalid with prompts to answer "
                              f"(--dataset {config.dataset} and a .jsonl --output): every "
                              "row of the files is answered; drop --split")
        return prompt_data(config)

    def pick(data: Any, split: str) -> Any:
        return data.train if isinstance(data.train, Prompts) else after.pick_rows(data, split)

    def work(run: api.Resolved, ctx: Any, module: Any, dataset: Any, split: str) -> int:
        if isinstance(dataset, Prompts):
            rows = generate_replies(module, dataset, run.config, run.precision, ctx, out,
                                    new_tokens, overwrite)
            log.info("predict: wrote %d replies (%s) to %s", rows, run.config.dataset, out)
            return rows
        rows = predict_set(module, dataset, run.config, run.precision, ctx, out,
                           run.data.collate, overwrite)
        log.info("predict: wrote %d rows (%s) to %s", rows,
                 describe_split(run.data, split, _data_name(run.config)), out)
        return rows

    rows, _, _, _, _ = _after_training(
        source, argv, fields, model, datasets, None, collate, work, "ddptrain predict",
        trust_checkpoint_code, split, needs=("model", "dataset", "collate"),  # no task
        pick=pick, own=after.command_flags(source, split, out, overwrite), own_data=prompts,
    )
    return int(rows)


def _data_name(config: TrainingConfig) -> str:
    """The data as the user named it: `--dataset`, `--mix`, or the objects given to the API."""
    if "dataset" in config.given_in_python:
        return "the datasets given"
    mixed = ", ".join(str(entry).rpartition("=")[0] for entry in config.mix)  # DATASET=WEIGHT
    return f"the --mix of {mixed}" if config.mix else config.dataset


@own_errors()  # torch's failures raised as ddptrain's errors, as `fit` raises them
def _after_training(
    source: str | Path, argv: Sequence[str], fields: dict[str, Any], model: Any,
    datasets: Any, task: Any, collate: Any, work: Callable[[api.Resolved, Any, Any, Any, str], Any],
    prog: str, trust_code: bool, split: str | None, needs: Sequence[str] = tuple(OBJECT_FIELDS),
    *, pick: Callable[[Any, str], Any], own: Sequence[str],
    own_data: Callable[[TrainingConfig], Any] | None = None,
) -> tuple[Any, Path, TrainingConfig, int, str]:
    """Check the command and the run's stored config (`prepare`; `own`: `command_flags`),
    load the data and pick its set (`pick`), then rebuild the trained model on every rank,
    load its weights and call `work(run, ctx, module, picked, split)` in a process group.
    `own_data(config)`: the data bundle to use in place of the config's own, or None to
    load that as `fit` does."""
    from ddptrain.launch.process_group import setup_distributed, teardown_distributed
    from ddptrain.train.after import prepare
    from ddptrain.train.inference import build_model, load_weights

    if isinstance(collate, str):
        fields, collate = {**fields, "collate": collate}, None
    # (a task named by a string names the field as --task does)
    objects = {"model": model, "dataset": datasets, "task": task, "collate": collate}
    given = [name for name, obj in objects.items() if obj is not None]
    found, config, split = prepare(Path(source), argv, fields, prog, given, trust_code, needs,
                                   split, None if given or fields else own)
    bundle = own_data(config) if own_data is not None else None
    run = (api.resolve_run(config, datasets, task, model, collate) if bundle is None
           else _resolve_with(config, bundle))
    picked = pick(run.data, split)
    ctx = setup_distributed(run.config, run.cluster, run.device, run.backend)
    run.startup.mark("group")
    clean = False
    try:
        factory = None
        if model is not None and not api.is_module(model):
            factory = functools.partial(api.call_model_factory, model, run.config, run.data,
                                        run.task)
        module = build_model(run.config, run.data, run.task, ctx.device,
                             model if api.is_module(model) else factory)
        load_weights(module, found.weights, ctx, run.config)
        result = work(run, ctx, module, picked, split)
        clean = True
    finally:
        teardown_distributed(clean)
    return result, found.weights, run.config, run.cluster.rank, split


def _resolve_with(config: TrainingConfig, data: Any) -> api.Resolved:
    """The launch resolved as `api.resolve_run` resolves it, over the given data bundle
    (prompts to answer, which no training loader reads) instead of the config's data."""
    from ddptrain.launch.cluster import read_cluster_env
    from ddptrain.launch.process_group import resolve_backend, resolve_device
    from ddptrain.log import setup_logging
    from ddptrain.observe.startup import Phases
    from ddptrain.parallel import resolve_strategy
    from ddptrain.train import resolve_precision, resolve_task

    startup = Phases()
    startup.mark("imports")
    cluster = read_cluster_env()
    setup_logging(cluster.rank)
    device = resolve_device(config, cluster.local_rank, cluster.local_world_size)
    backend = resolve_backend(config, device) if cluster.world_size > 1 else None
    precision = resolve_precision(config, device)
    precision.apply()
    strategy = resolve_strategy(config, cluster.world_size, device, cluster.local_world_size)
    task = resolve_task(config, data.facts)
    startup.mark("data")
    return api.Resolved(config, cluster, device, backend, precision, strategy, data, task,
                        startup)
