"""What each section of `TrainingConfig` must hold: one check a section (`SECTION_CHECKS`,
in `SECTIONS`' order), each refusing only its own fields with one line naming the field,
the value and the fix. `TrainingConfig.validate` runs them; the names the flags take
(the built-in datasets, models, tasks, optimizers and schedulers) live here too."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddptrain.checkpoint_kind import CheckpointKind
from ddptrain.config_values import bad as _bad
from ddptrain.config_values import check_dataset, is_import_ref, mix_weights, step_ranges, val_sets
from ddptrain.errors import ConfigError
from ddptrain.layout import Layout

if TYPE_CHECKING:
    from ddptrain.config import TrainingConfig
    from ddptrain.config_sections import (
        CheckpointSection,
        DataSection,
        FinetuneSection,
        ModelSection,
        ObserveSection,
        OptimizationSection,
        ParallelSection,
        PrecisionSection,
        RuntimeSection,
        SteerSection,
    )

BUILTIN_DATASETS = ("breast_cancer", "digits", "diabetes", "synthetic", "chars")
BUILTIN_MODELS = ("auto", "mlp", "miniresnet", "gpt")
BUILTIN_TASKS = ("auto", "classification", "regression", "multilabel", "lm")
BUILTIN_OPTIMIZERS = ("sgd", "adamw")
BUILTIN_SCHEDULERS = ("cosine",)

SEED_MAX = 2**32 - 1  # numpy takes no seed < 0; + rank, epoch or a 32-bit hash stays < 2**64
WIDTH_MAX = 2**20  # --width: beyond it no built-in model's layer fits a host (see check_model)
DEFAULT_DATASET = "breast_cancer"
AUTO_BATCH = -1  # `--batch_size auto` as the config holds it, until launch plans it


def _at_least(c: object, minimum: float, fix: str, *names: str) -> None:
    for name in names:
        value = getattr(c, name)
        if value is not None and value < minimum:
            _bad(name, value, fix)

def check_data(c: DataSection) -> None:
    _at_least(c, 1, "use a whole number of at least 1", "block_size")
    if c.batch_size != AUTO_BATCH:
        _at_least(c, 1, "use a whole number of at least 1", "batch_size")
    _at_least(c, 0, "use a value of 0 or more", "num_workers")
    if c.synthetic_size < 2:
        _bad("synthetic_size", c.synthetic_size, "use at least 2 samples")
    if c.val_fraction is not None and not 0 < c.val_fraction < 1:
        _bad("val_fraction", c.val_fraction, "use a fraction between 0 and 1, e.g. 0.2")
    if c.mix and c.dataset != DEFAULT_DATASET:
        raise ConfigError(f"--mix and --dataset {c.dataset!r} both name the training "
                          "data: give every dataset in --mix, and no --dataset")
    for ds in [name for name, _ in mix_weights(c.mix)] or [c.dataset]:
        check_dataset(BUILTIN_DATASETS, ds, "mix" if c.mix else "dataset")
    if c.pack and c.block_size < 2:
        _bad("block_size", c.block_size, "--pack predicts each token of a window from "
             "those before it, and a window of 1 has none: use --block_size 2 or more")
    for _, ds in val_sets(c.val):
        check_dataset(BUILTIN_DATASETS, ds, "val")
    if c.collate is not None and not is_import_ref(c.collate):
        _bad("collate", c.collate, "give package.module:fn, a function of a list of samples")

def check_model(c: ModelSection) -> None:
    _at_least(c, 1, "use a whole number of at least 1", "width")
    if c.width > WIDTH_MAX:
        _bad("width", c.width, f"use at most {WIDTH_MAX:,} (a layer: width x width weights)")
    _at_least(c, 1, "use a whole number of at least 1, or leave it unset",
                   "num_classes", "in_channels", "image_size")
    _at_least(c, 0, "use a weight of 0 (off) or more", "moe_aux_weight")
    if c.num_classes is not None and c.num_classes < 2:
        _bad("num_classes", c.num_classes, "a classifier needs at least 2 classes")
    if c.model.startswith("hf:"):
        if not (Path(c.model[3:]) / "config.json").is_file():
            _bad("model", c.model, "give hf:DIR, a directory Hugging Face's "
                 "save_pretrained wrote (with its config.json)")
    elif not (c.model in BUILTIN_MODELS or is_import_ref(c.model)):
        _bad("model", c.model, f"choose one of {', '.join(BUILTIN_MODELS)}, module:fn "
             "or hf:DIR")
    if not (c.task in BUILTIN_TASKS or is_import_ref(c.task)):
        _bad("task", c.task, f"choose one of {', '.join(BUILTIN_TASKS)} or module:fn")

def check_optimization(c: OptimizationSection) -> None:
    _at_least(c, 1, "use a whole number of at least 1", "epochs", "grad_accum_steps")
    _at_least(c, 0, "use a value of 0 or more", "max_bad_steps", "weight_decay",
                   "momentum", "warmup_epochs")
    if not c.lr >= 0:  # 0 trains nothing: the start (--init_from) evaluated as it is
        _bad("lr", c.lr, "use a learning rate of 0 or more, such as 0.01")
    _at_least(c, 1, "use a whole number of samples", "global_batch_size")
    if c.max_grad_norm is not None and not c.max_grad_norm > 0:
        _bad("max_grad_norm", c.max_grad_norm, "use a positive norm, or leave it unset")
    if not (c.optimizer in BUILTIN_OPTIMIZERS or is_import_ref(c.optimizer)):
        _bad("optimizer", c.optimizer,
             f"choose one of {', '.join(BUILTIN_OPTIMIZERS)} or package.module:fn")
    if not (c.scheduler in BUILTIN_SCHEDULERS or is_import_ref(c.scheduler)):
        _bad("scheduler", c.scheduler, "use cosine or package.module:fn")
    for pattern, factor in c.lr_scale.items():
        number = isinstance(factor, (int, float)) and not isinstance(factor, bool)
        if not number or not factor > 0:
            _bad("lr_scale", f"{pattern}={factor}",
                 "give GLOB=FACTOR with a positive factor (to train nothing: --freeze)")

def check_parallel(c: ParallelSection) -> None:
    _at_least(c, 1, "use a whole number of at least 1 (1: off)",
              "dp_replicate", "tp", "pp", "cp")
    _at_least(c, 1e-3, "use a positive number of GiB, or leave it unset", "device_memory")
    if c.tp_plan is not None and not is_import_ref(c.tp_plan):
        _bad("tp_plan", c.tp_plan, "give package.module:fn, fn(model, tp_mesh)")
    if c.pp_split is not None and not is_import_ref(c.pp_split):
        _bad("pp_split", c.pp_split, "give package.module:fn, fn(model, stage, stages)")
    _at_least(c, 1, "use a whole number of at least 1", "pp_microbatches")
    _at_least(c, 1, "use a whole number of at least 1 (1: off)", "ep")
    others = max(c.pp, c.dp_replicate)
    if c.ep > 1 and (c.strategy == "zero" or others > 1):
        raise ConfigError(f"--ep {c.ep} runs under --strategy ddp or fsdp (with --tp "
                          "or not): drop --ep, or --pp, --dp_replicate and zero")

def check_precision(c: PrecisionSection) -> None:
    pass  # each field is a choice argparse and the dataclass's types already hold to

def check_finetune(c: FinetuneSection) -> None:
    if c.init_from is not None and not Path(c.init_from).exists():
        _bad("init_from", c.init_from, "give an existing .safetensors or .pt file, a "
             "run, DCP step or Hugging Face directory")
    for pattern in c.freeze:
        if not isinstance(pattern, str) or not pattern:
            _bad("freeze", pattern, "give glob patterns of parameter names, e.g. 'embed.*'")
    _at_least(c, 0, "use a whole number of 0 (off) or more", "lora_rank")
    if c.lora_alpha is not None and not c.lora_alpha > 0:
        _bad("lora_alpha", c.lora_alpha, "use a positive value, or leave it unset")
    if not 0 <= c.lora_dropout < 1:
        _bad("lora_dropout", c.lora_dropout, "use a probability in [0, 1)")
    given = [f for f in ("lora_alpha", "lora_targets", "lora_dropout") if getattr(c, f)]
    given += ["lora_quantize"] if c.lora_quantize != "off" else []
    if given and not c.lora_rank:
        _bad(given[0], getattr(c, given[0]), "it shapes the adapters of --lora_rank: "
             "give --lora_rank R too")
    if c.lora_quantize != "off" and importlib.util.find_spec("torchao") is None:
        _bad("lora_quantize", c.lora_quantize, "it needs torchao: pip install torchao")

def check_checkpoint(c: CheckpointSection) -> None:
    _at_least(c, 0, "use a value of 0 or more", "save_every", "save_every_steps",
                   "keep_last")
    if c.resume_from not in (None, "auto") and not Path(c.resume_from).exists():
        _bad("resume_from", c.resume_from,
             "give an existing checkpoint file or DCP step directory, or 'auto'")
    if not c.checkpoint_timeout_s > 0:
        _bad("checkpoint_timeout_s", c.checkpoint_timeout_s,
             "use a positive number of seconds")
    if c.preempt_exit_code is not None and not 1 <= c.preempt_exit_code <= 255:
        _bad("preempt_exit_code", c.preempt_exit_code, "use an exit code in 1..255")
    _at_least(c, 1e-6, "use a positive number of MB", "export_shard_mb")

def check_observe(c: ObserveSection) -> None:
    _at_least(c, 1, "use a whole number of at least 1", "log_interval")
    if c.straggler_factor != 0 and not c.straggler_factor > 1:
        _bad("straggler_factor", c.straggler_factor, "use a factor above 1, or 0 (off)")

def check_steer(c: SteerSection) -> None:
    if c.early_stopping < 0:
        _bad("early_stopping", c.early_stopping, "use a number of epochs, or 0 (off)")
    if c.early_stopping_min_delta < 0:
        _bad("early_stopping_min_delta", c.early_stopping_min_delta,
             "use a change of 0 or more")
    if c.spike_factor != 0 and not c.spike_factor > 1:
        _bad("spike_factor", c.spike_factor, "use a factor above 1, or 0 (off)")
    _at_least(c, 1, "use a whole number of at least 1", "spike_rows")
    _at_least(c, 0, "use a whole number of 0 or more", "max_rollbacks")
    if c.on_spike != "warn" and not c.spike_factor:
        _bad("on_spike", c.on_spike, "give --spike_factor above 1 too (0 is off)")
    step_ranges(c.skip_steps)
    if c.ema_decay is not None and not 0 < c.ema_decay < 1:
        _bad("ema_decay", c.ema_decay, "use a decay between 0 and 1, e.g. 0.999")

def check_runtime(c: RuntimeSection) -> None:
    if not 0 <= c.seed <= SEED_MAX:
        _bad("seed", c.seed, f"use a whole number in 0..{SEED_MAX}")
    if not c.timeout_s > 0:
        _bad("timeout_s", c.timeout_s, "use a positive number of seconds")


def check_across(c: TrainingConfig) -> None:
    """The rules that join fields of several sections, after each section's own."""
    if c.layout == "auto":
        named = [f"--{f} {getattr(c, f)}" for f in ("tp", "pp", "cp", "dp_replicate", "ep")
                 if getattr(c, f) != 1]
        if named:
            raise ConfigError(f"--layout auto chooses the layout, and {' '.join(named)} "
                              "names one: drop it, or drop --layout auto")
    if c.batch_size == AUTO_BATCH and c.global_batch_size is None:
        raise ConfigError("--batch_size auto keeps a global batch: give --global_batch_size")
    if c.batch_size == AUTO_BATCH and c.pp > 1:
        raise ConfigError("--batch_size auto does not plan --pp: name --batch_size")
    if c.pack and (c.pp > 1 or c.sequence_parallel):
        flag = "--pp" if c.pp > 1 else "--sequence_parallel"
        raise ConfigError(f"--pack keeps documents apart with a mask that {flag} does not "
                          f"pass on: drop --pack, or train without {flag}")
    clash = [f for f in ("float8",) if getattr(c, f) not in (1, "off")]
    if c.lora_rank and clash:
        raise ConfigError(f"--lora_rank with --{clash[0]} is unsupported: train the "
                          "adapters with --strategy ddp or fsdp, or --tp")
    split = "--strategy fsdp" if c.strategy == "fsdp" else (
        ("--tp" if c.tp > 1 else "--pp") if Layout.of(c).splits_model else None)
    if c.lora_quantize != "off" and split is not None:
        raise ConfigError(f"--lora_quantize {c.lora_quantize} with {split} is "
                          "unsupported: each rank keeps the whole quantized base; use "
                          "--strategy ddp or zero (4 bits a weight: 70B in about 36 GB)")
    if c.ep > 1 and c.checkpoint_format == "file":
        _bad("checkpoint_format", "file", "--ep spreads the experts over the ranks, each "
             "writing its own: use --checkpoint_format dcp (or auto)")
    if c.async_checkpoint and c.checkpoint_kind is CheckpointKind.FILE:
        _bad("async_checkpoint", True, "background saves write DCP step directories: add "
             "--checkpoint_format dcp (or use --strategy zero / fsdp)")
    if c.export_ema and c.ema_decay is None:
        _bad("export_ema", True, "add --ema_decay D: there is no average to export")
    sets = [name for name, _ in val_sets(c.val)]
    where, _, metric = (c.best_metric or "").rpartition("/")
    if c.best_metric is not None and (not metric or (where and where not in sets)):
        _bad("best_metric", c.best_metric, "give METRIC, or NAME/METRIC with NAME one "
             f"of --val's sets ({', '.join(sets) or 'none given'})")


# Each section's checks read its own fields alone (their types say so); `check_across`
# holds the rules between sections and runs last.
SECTION_CHECKS: dict[str, Callable[[Any], None]] = {
    "data": check_data, "model": check_model, "optimization": check_optimization,
    "parallel": check_parallel, "precision": check_precision, "finetune": check_finetune,
    "checkpoint": check_checkpoint, "observe": check_observe, "steer": check_steer,
    "runtime": check_runtime,
}
