"""The sections of `TrainingConfig`'s fields (`ddptrain.config`)."""

from __future__ import annotations

# The sections the fields belong to, in `--help`'s order: `ddptrain train --help` shows a
# group a section, and a `--config` file may nest its fields under their section's name
# (`optimization: {lr: 0.1}`) or give them flat, as config.yaml does. Every field but the
# internal ones is in exactly one (tests/test_config.py).
SECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    "data": ("what the model reads and how it is batched", (
        "dataset", "dataset_args", "mix", "val", "collate", "block_size", "pack",
        "val_fraction",
        "synthetic_size",
        "batch_size", "num_workers", "drop_last",
    )),
    "model": ("the model and what it learns", (
        "model", "model_args", "task", "task_args", "num_classes", "in_channels", "image_size",
        "width", "sync_bn", "moe_aux_weight",
    )),
    "optimization": ("the optimizer, its schedule and the step", (
        "epochs", "optimizer", "optimizer_args", "lr", "momentum", "weight_decay", "lr_scale",
        "decay_all", "scheduler", "scheduler_args", "warmup_epochs", "scale_lr",
        "max_grad_norm", "max_bad_steps", "grad_accum_steps", "global_batch_size",
    )),
    "parallel": ("how the model is spread over the ranks", (
        "strategy", "fsdp_wrap", "reshard_after_forward", "fsdp_cpu_offload", "dp_replicate",
        "tp", "tp_plan", "sequence_parallel", "pp", "pp_schedule", "pp_microbatches",
        "pp_split", "ep", "find_unused_parameters", "static_graph",
    )),
    "precision": ("precision, memory and speed", (
        "use_amp", "amp_dtype", "float8", "tf32", "activation_checkpointing", "compile",
        "channels_last",
    )),
    "finetune": ("where the weights start, and which train", (
        "init_from", "init_strict", "freeze", "lora_rank", "lora_alpha", "lora_dropout",
        "lora_targets", "lora_quantize",
    )),
    "checkpoint": ("the run directory, checkpoints and what the run leaves", (
        "output_dir", "checkpoint_dir", "save_every", "save_every_steps", "keep_last",
        "resume_from", "checkpoint_format", "async_checkpoint", "checkpoint_timeout_s",
        "preempt_exit_code", "export", "export_ema", "export_shard_mb",
    )),
    "observe": ("logs, curves, trackers and the profiler", (
        "log_interval", "tensorboard", "curves", "tracker", "enable_profiling",
        "straggler_factor", "memory_snapshot",
    )),
    "steer": ("stopping early, loss spikes and averaging the weights", (
        "early_stopping", "early_stopping_min_delta", "best_metric", "spike_factor",
        "spike_rows", "on_spike", "max_rollbacks", "skip_steps", "ema_decay",
    )),
    "runtime": ("processes, devices and the run itself", (
        "device", "backend", "timeout_s", "seed", "dry_run", "run_id",
    )),
}
