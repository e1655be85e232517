"""ddptrain: a DistributedDataParallel training pipeline, correct on N ranks."""

__version__ = "0.1.0"
