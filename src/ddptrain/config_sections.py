"""The sections of a run's settings, one dataclass each: its fields, their defaults and
help text. `TrainingConfig` (`ddptrain.config`) is all of them together (it inherits every
section), so `config.lr` reads as ever, and a component that needs one section takes that
section's type: `plan_mesh(config: ParallelSection, ...)` can read nothing else, and the
type checker says so.

`ddptrain train --help` shows a group a section, in `SECTIONS`' order, and a `--config` file
may nest its fields under their section's name (`optimization: {lr: 0.1}`) or give them
flat, as config.yaml does. Every field but the internal ones is in exactly one
(tests/test_config.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from ddptrain.config_checks import AUTO_BATCH, DEFAULT_DATASET


def _f(default: Any, help: str, **metadata: Any) -> Any:
    return field(default=default, metadata={"help": help, **metadata})



@dataclass
class DataSection:
    """What the model reads and how it is batched."""

    dataset: str = _f(
        DEFAULT_DATASET,
        "breast_cancer | digits | diabetes | synthetic | chars | path/to/data.npz (arrays x, "
        "y) | path/to/x.npy (y.npy beside it, memory-mapped) | package.module:fn | "
        "chat:PATH (chats or prompt/completion rows, trained on the replies alone) | "
        "text:PATH (documents in --text_field); PATH: a file or glob of .jsonl, .jsonl.gz or "
        ".parquet files, tokenized by --tokenizer",
    )
    tokenizer: str | None = _f(
        None,
        "hf:DIR, the tokenizer (save_pretrained's files, read from DIR alone) that turns a "
        "chat: or text: dataset into token ids (default: --model hf:DIR's own)",
    )
    text_field: str = _f("text", "the field of a text: dataset's rows that holds the document")
    dataset_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "key=value arguments for a module:fn dataset"})
    mix: list[str] = field(default_factory=list, metadata={"metavar": "DATASET=WEIGHT", "help":
        "train on several datasets (each as --dataset takes it) drawn by weight, e.g. "
        "chars=0.7 mymod:code=0.3: a seeded draw per sample position, the same at any world "
        "size; their validation sets are joined. Replaces --dataset"})
    val: list[str] = field(default_factory=list, metadata={"metavar": "NAME=DATASET", "help":
        "more validation sets, each a dataset as --dataset takes it (its validation part), "
        "e.g. heldout=mymod:heldout: their figures are NAME/METRIC in the val rows"})
    collate: str | None = _f(
        None,
        "package.module:fn turning a list of samples into a batch (padding variable-length "
        "samples); used by every DataLoader, training and evaluation",
    )
    block_size: int = _f(64, "tokens per sample of the chars dataset (the GPT context), "
                         "and of each window --pack fills")
    pack: bool = _f(False, "pack the dataset's token documents end to end into --block_size "
                    "windows, each document attending and positioned on its own")
    val_fraction: float | None = _f(
        None,
        "share of the data held out for validation, fixed by --seed (default 0.2; refused "
        "for a module:fn dataset that returns its own validation set)",
    )
    synthetic_size: int = _f(50_000, "number of samples of the synthetic dataset")
    batch_size: int = _f(
        64, "samples per rank per micro-step; auto: the largest micro-batch that fits, "
        "planned at launch for a language model as `ddptrain plan` plans it, keeping the "
        "global batch (--global_batch_size), and --oom_backoff",
        words={"auto": AUTO_BATCH},
    )
    oom_backoff: bool = _f(
        False, "an out-of-memory in the first steps halves --batch_size and doubles "
        "--grad_accum_steps (the same global batch, the same result) instead of ending the "
        "run (set by --batch_size auto)",
    )
    num_workers: int = _f(
        0, "DataLoader worker processes per rank (0: in-memory batches are sliced in-process)"
    )
    drop_last: bool = _f(False, "drop each epoch's incomplete last batch instead of training on it")


@dataclass
class ModelSection:
    """The model and what it learns."""

    model: str = _f(
        "auto",
        "auto (gpt for token windows, miniresnet for images, else mlp) | mlp | miniresnet | "
        "gpt | module:fn | hf:DIR (a Hugging Face save_pretrained directory)",
    )
    model_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "key=value arguments for a module:fn model"})
    task: str = _f(
        "auto",
        "auto (integer targets: classification, float: regression, token windows: lm) | "
        "classification | regression | multilabel | lm | module:fn",
    )
    task_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "key=value arguments for a module:fn task"})
    num_classes: int | None = _f(None, "number of classes (default: from the dataset)")
    in_channels: int | None = _f(None, "image channels (default: from the dataset)")
    image_size: int | None = _f(None, "image side in pixels (default: from the dataset)")
    width: int = _f(
        64, "MiniResNet stem channels (stages use 1x, 2x, 4x) / MLP hidden units / GPT width"
    )
    sync_bn: bool = _f(False, "convert BatchNorm layers to SyncBatchNorm")
    moe_aux_weight: float = _f(0.01, "weight of a mixture of experts' load-balancing loss "
                               "(its routers'), added to the training loss")
    moe_aux_scope: Literal["global", "local"] = _f(
        "global", "the balancing loss's token counts: global (summed over the data-parallel "
        "ranks first, so N ranks balance as one process of the global batch) | local "
        "(each rank's own tokens)",
    )


@dataclass
class OptimizationSection:
    """The optimizer, its schedule and the step."""

    epochs: int = _f(10, "number of epochs")
    optimizer: str = _f(
        "sgd",
        "sgd | adamw | package.module:fn, called fn(config, model, **optimizer_args), "
        "returning an optimizer over the model's parameters (named as in your model)",
    )
    optimizer_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "key=value arguments for a module:fn optimizer"})
    lr: float = _f(0.01, "peak learning rate")
    momentum: float = _f(0.9, "SGD momentum")
    weight_decay: float = _f(1e-4, "weight decay")
    lr_scale: dict[str, float] = field(
        default_factory=dict,
        metadata={"help": "GLOB=FACTOR ...: the learning rate of the parameters whose names "
                  "match, times FACTOR (the first matching pattern counts)", "glob_keys": True},
    )
    decay_all: bool = _f(
        False, "weight decay on every parameter (default: none on biases and normalisation "
        "weights)",
    )
    scheduler: str = _f(
        "cosine",
        "cosine (linear warm-up, then cosine to 0) | package.module:fn, called fn(config, "
        "optimizer, total_steps=, steps_per_epoch=, warmup_steps=, **scheduler_args), "
        "stepped once per optimizer step",
    )
    scheduler_args: dict[str, Any] = field(default_factory=dict, metadata={
        "help": "key=value arguments for a module:fn scheduler"})
    warmup_epochs: float = _f(0.0, "linear warm-up length in epochs, then cosine decay to 0")
    scale_lr: bool = _f(False, "linear scaling rule: lr x world_size x grad_accum_steps "
                        "(global / per-rank batch)")
    max_grad_norm: float | None = _f(None, "clip the global gradient norm to this value")
    max_bad_steps: int = _f(5, "stop after N optimizer steps in a row with non-finite "
                            "gradients (0: never check)")
    grad_accum_steps: int = _f(1, "micro-steps per optimizer step (all-reduce on the last only)")
    global_batch_size: int | None = _f(
        None,
        "samples per optimizer step over all ranks; sets --grad_accum_steps to "
        "G / (world size x --batch_size), so the run is the same on any world size",
    )


@dataclass
class ParallelSection:
    """How the model is spread over the ranks.
    The device mesh: world size = pp x dp_replicate x (data-parallel shards) x tp
    (`ddptrain.layout.Layout`)."""

    layout: Literal["flags", "auto"] = _f(
        "flags", "flags: the layout --strategy, --dp_replicate, --tp, --pp and --ep name | "
        "auto: `ddptrain plan`'s first choice for this world and the device's memory, with "
        "its micro-batch (a language model; the global batch kept), chosen at launch and "
        "kept by a resume",
    )
    device_memory: float | None = _f(
        None, "--layout auto, --batch_size auto: GiB a rank may hold (default: the GPU's "
        "memory; on a CPU the host's over its local ranks); a tenth of it is kept free",
    )
    strategy: Literal["ddp", "zero", "fsdp"] = _f(
        "ddp",
        "how the model is spread over 2+ ranks: ddp (replicas) | zero (DDP, optimizer state "
        "sharded) | fsdp (FSDP2: parameters, gradients and optimizer state sharded)",
    )
    fsdp_wrap: str | None = _f(
        None,
        "fsdp: comma-separated module class names sharded one by one (default: the model's "
        "repeated blocks); with --activation_checkpointing, under any strategy, the blocks "
        "it recomputes",
    )
    reshard_after_forward: bool = _f(
        True, "fsdp: free gathered parameters after forward (ZeRO-3); no: keep them (ZeRO-2)"
    )
    fsdp_cpu_offload: bool = _f(False, "fsdp on GPU: keep sharded parameters on the CPU")
    dp_replicate: int = _f(
        1,
        "fsdp: replicas of the model, each sharded over world size / (dp_replicate x tp x "
        "pp) ranks (HSDP: shards stay inside a node, replicas all-reduce across nodes)",
    )
    tp: int = _f(
        1,
        "tensor parallelism: ranks that split each layer (attention heads, MLP) and see the "
        "same batch; inside a node",
    )
    tp_plan: str | None = _f(
        None,
        "package.module:fn, fn(model, tp_mesh) parallelizes a model that is not the "
        "built-in GPT under --tp",
    )
    sequence_parallel: bool = _f(
        False,
        "built-in GPT under --tp: norms and residual stream split by sequence over the tp "
        "ranks (their activations / tp, same traffic; the sequence length must divide)",
    )
    pp: int = _f(
        1,
        "pipeline parallelism: ranks that each hold a stage of the model's layers, in "
        "order (the outermost mesh dimension: stages may cross nodes)",
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved1f1b"] = _f(
        "1f1b",
        "--pp: the pipeline schedule; interleaved1f1b gives each rank two stages "
        "(a smaller bubble, more messages)",
    )
    pp_microbatches: int | None = _f(
        None,
        "--pp: micro-batches each batch is cut into as it flows through the stages "
        "(default: --pp; must divide --batch_size)",
    )
    pp_split: str | None = _f(
        None,
        "package.module:fn, fn(model, stage, stages) returns that stage's module for a "
        "model that is not the built-in GPT under --pp",
    )
    cp: int = _f(
        1,
        "context parallelism: ranks that split each sequence of a language model (Ulysses: "
        "an all-to-all turns sequence shards into head shards around attention, and back); "
        "they see the same batch; --block_size and the attention heads (/ --tp) must divide",
    )
    ep: int = _f(1, "expert parallelism: each mixture-of-experts layer's experts spread over "
                 "this many data-parallel ranks (a divisor of their number; ddp or fsdp), tokens "
                 "sent to them and back with an all-to-all; 1: every rank holds every expert")
    find_unused_parameters: bool = _f(
        False,
        "ddp, zero: a model whose steps leave some parameters out of the loss (a branch "
        "not taken): DDP looks for them each step instead of waiting for their gradients",
    )
    static_graph: bool = _f(
        False,
        "ddp, zero: the model uses the same parameters on every step (some may never be "
        "used); DDP then skips the per-step search. Not with gradient accumulation",
    )


@dataclass
class PrecisionSection:
    """Precision, memory and speed."""

    use_amp: bool = _f(True, "mixed precision on CUDA; on CPU only with --amp_dtype bfloat16")
    amp_dtype: Literal["auto", "float16", "bfloat16"] = _f(
        "auto", "autocast dtype (auto: bfloat16 on GPUs with native bf16, else float16 + "
        "GradScaler; off on CPU)"
    )
    float8: Literal["off", "tensorwise", "rowwise"] = _f(
        "off", "train the linear layers in float8 (torchao, `pip install torchao`): "
        "tensorwise (one scale per tensor; under fsdp the all-gather is float8 too) or "
        "rowwise (a scale per row: closer to bf16, slower); GPUs of compute capability "
        "8.9+ (H100, L4, RTX 4090), and the CPU, where it is emulated (for tests)"
    )
    tf32: Literal["auto", "on", "off"] = _f(
        "auto", "float32 matmuls and convolutions in TF32 on GPUs that have it (compute "
        "capability 8.0+): auto (on there, as most training tools do; about 1e-3 of "
        "relative error), on, off (IEEE float32)"
    )
    activation_checkpointing: Literal["off", "block", "selective"] = field(
        default="off", metadata={"bare": "block", "help": (
            "recompute activations in backward, in the repeated blocks (the blocks fsdp "
            "shards; --fsdp_wrap names them): block (the flag alone: each block's whole "
            "forward again; least memory) or selective (per op: the outputs of matmuls and "
            "attention are kept, the cheap ops between them recomputed)")},
    )
    compile: bool = _f(
        False, "torch.compile the model (inductor; the first steps pay the compilation)"
    )
    channels_last: bool = _f(False, "channels_last memory format for image models and inputs")


@dataclass
class FinetuneSection:
    """Where the weights start, and which train."""

    init_from: str | None = _f(
        None,
        "start from these weights only (fresh optimizer, schedule and progress): a "
        ".safetensors file, a run directory, a .pt checkpoint, a DCP step directory or a "
        "Hugging Face save_pretrained directory; a resume wins over it",
    )
    init_strict: bool = _f(
        True, "--init_from must fit the model exactly (false: load what fits, log the rest)"
    )
    freeze: list[str] = field(
        default_factory=list,
        metadata={"help": "GLOB ...: parameters whose names match are not trained (no "
                  "gradients, not in the optimizer, not reduced); a pattern matching "
                  "nothing is an error"},
    )
    lora_rank: int = _f(0, "train LoRA adapters of this rank on the model's linear layers, "
                        "the model frozen (peft: `pip install 'ddptrain[lora]'`); 0: off")
    lora_alpha: float | None = _f(None, "the adapters' scale is alpha / rank (default 2 x rank)")
    lora_dropout: float = _f(0.0, "dropout on the adapters' input")
    lora_targets: list[str] = field(default_factory=list, metadata={"help": "GLOB ...: the "
        "linear layers (module names) the adapters wrap; default: those in the repeated blocks"})
    lora_quantize: Literal["off", "nf4"] = _f(
        "off", "QLoRA: keep the adapted layers' frozen weights in 4-bit NormalFloat (nf4, "
        "torchao; ddp, zero or one process), dequantized as each layer computes")


@dataclass
class CheckpointSection:
    """The run directory, checkpoints and what the run leaves."""

    output_dir: str | None = _f(
        None,
        "run directory: config.yaml, metrics.jsonl, checkpoints (default: a new "
        "runs/<dataset>-<id> for each fresh run)",
    )
    checkpoint_dir: str | None = _f(None, "checkpoint directory (default: OUTPUT_DIR/checkpoints)")
    save_every: int = _f(1, "checkpoint every N epochs (0: only the final one)")
    save_every_steps: int = _f(0, "also checkpoint every N optimizer steps (0: off)")
    keep_last: int = _f(0, "keep only the newest K checkpoints (0: keep all)")
    resume_from: str | None = _f(
        None, "checkpoint to resume from: a .pt file, a DCP step directory, or 'auto' (newest)"
    )
    checkpoint_format: Literal["auto", "file", "dcp"] = _f(
        "auto",
        "file: one .pt written by rank 0 | dcp: a step directory, every rank writes its shard "
        "(auto: dcp under zero and fsdp, and under ddp once the model and optimizer "
        "state pass 2 GiB; file otherwise)",
    )
    async_checkpoint: bool = _f(
        False, "dcp: write checkpoints in the background while training goes on"
    )
    checkpoint_timeout_s: float = _f(
        1800.0, "how long ranks wait for a checkpoint write before calling the storage "
        "stuck (apart from --timeout_s: a slow save is not a lost peer)",
    )
    preempt_exit_code: int | None = _f(
        None,
        "exit code after a SIGTERM stop and its checkpoint (default: 143 on Kubernetes, "
        "whose ExitCode restart policy retries 128-255; 75 elsewhere, EX_TEMPFAIL)",
    )
    export: Literal["last", "best"] = _f(
        "last", "the weights model.safetensors (and hf/) hold at the end: the last step's, or "
        "those of the best validation epoch's checkpoint (as after --early_stopping)",
    )
    export_ema: bool = _f(
        False, "with --ema_decay: model.safetensors holds the EMA weights (the raw ones go "
        "to model_raw.safetensors)",
    )
    export_shard_mb: float = _f(5000, "largest weight file of hf/ in MB (transformers' "
                                "max_shard_size): a bigger model gets several, each by one rank")


@dataclass
class ObserveSection:
    """Logs, curves, trackers and the profiler."""

    log_interval: int = _f(10, "optimizer steps between train metric lines")
    tensorboard: bool = _f(
        True, "write TensorBoard event files when the tensorboard package is installed"
    )
    curves: bool = _f(
        True, "draw curves.png at the end (rank 0, in a child process: about a CPU-second; "
        "--no-curves for sweeps); needs matplotlib (ddptrain[viz])",
    )
    tracker: Literal["none", "mlflow", "wandb"] = _f(
        "none", "experiment tracker: mlflow logs params, metrics and artifacts to "
        "MLFLOW_TRACKING_URI (default: a store in the run directory); wandb to Weights & "
        "Biases (files in <run_dir>/wandb; WANDB_MODE=offline works without a network)",
    )
    enable_profiling: bool = _f(False, "record a torch.profiler trace on rank 0")
    straggler_factor: float = _f(
        3.0, "name a rank (log line, 'stragglers' in metrics.jsonl and the summary) whose wait "
        "for its batches per step stays above this many times the other ranks' median, and "
        "above a tenth of the step, for 3 metric syncs running (0: off)",
    )
    memory_snapshot: bool = _f(
        False, "CUDA: record the allocator's history from the start; an out-of-memory error "
        "dumps it to oom/rank<R>.pickle (https://pytorch.org/memory_viz)",
    )


@dataclass
class SteerSection:
    """Stopping early, loss spikes and averaging the weights."""

    early_stopping: int = _f(
        0, "finish the run after N epochs without improvement of the task's best "
        "validation metric (0: off)",
    )
    early_stopping_min_delta: float = _f(
        0.0, "with --early_stopping: the least change of the metric that counts as one"
    )
    best_metric: str | None = _f(
        None, "the validation figure that chooses the best epoch and drives --early_stopping: "
        "METRIC (the --dataset's set) or NAME/METRIC (a --val set); the task's metric or "
        "loss (default: the task's metric on the --dataset's set)",
    )
    spike_factor: float = _f(
        5.0, "warn of a loss spike: a train row's loss above this many times the median of "
        "the rows before it, for --spike_rows rows running (0: off)",
    )
    spike_rows: int = _f(1, "with --spike_factor: the train rows running that make a spike")
    on_spike: Literal["warn", "stop", "rollback"] = _f(
        "warn", "warn: a warning line; stop: also stop the run at the next agreed step, with "
        "a checkpoint and the spike as its stop_reason; rollback: every rank goes back to the "
        "newest checkpoint before the spike and on from there, the spike's steps skipped "
        "(as --skip_steps), at most --max_rollbacks times",
    )
    max_rollbacks: int = _f(3, "with --on_spike rollback: the rollbacks a run may make; a "
                            "spike after them ends the run (exit 4)")
    skip_steps: list[str] = field(default_factory=list, metadata={"metavar": "STEPS", "help":
        "STEP or FIRST-LAST ...: optimizer steps whose batches are read but not trained on "
        "(no forward, no update; the schedule goes on): to step past data that spiked the loss"})
    ema_decay: float | None = _f(
        None, "keep an exponential moving average of the weights with this decay (e.g. "
        "0.999), validated each epoch (val ema_* figures) and exported as "
        "model_ema.safetensors",
    )


@dataclass
class RuntimeSection:
    """Processes, devices and the run itself."""

    device: Literal["auto", "cpu", "cuda"] = _f("auto", "cuda when available, else cpu")
    backend: Literal["auto", "nccl", "gloo"] = _f("auto", "nccl with CUDA, gloo without")
    timeout_s: float = _f(600.0, "process-group timeout: a rank waiting longer for a peer fails")
    seed: int = _f(42, "seed of weights, data split, shuffling and workers (0..4294967295)")
    dry_run: bool = _f(False, "print the run's plan and resolved config, then exit")
    run_id: str | None = _f(None, "the run's id (set by ddptrain on a fresh start, kept on resume)")


# The sections in `--help`'s order: name -> the section's dataclass
SECTION_TYPES: dict[str, type] = {
    "data": DataSection,
    "model": ModelSection,
    "optimization": OptimizationSection,
    "parallel": ParallelSection,
    "precision": PrecisionSection,
    "finetune": FinetuneSection,
    "checkpoint": CheckpointSection,
    "observe": ObserveSection,
    "steer": SteerSection,
    "runtime": RuntimeSection,
}
# name -> (title, its fields' names): what `--help`, `--config` and the checks read
def _title(section: type) -> str:
    """The docstring's first line as `--help` shows it: `what the model reads ...`."""
    first = (section.__doc__ or "").split("\n")[0].rstrip(".")
    return first[:1].lower() + first[1:]


SECTIONS: dict[str, tuple[str, tuple[str, ...]]] = {
    name: (_title(cls), tuple(f.name for f in dataclasses.fields(cls)))
    for name, cls in SECTION_TYPES.items()
}
