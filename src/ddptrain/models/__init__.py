"""Models: the built-in networks and `create_model`, which builds the one `--model` names
(a built-in, a user's `package.module:fn` given the data's facts, or a Hugging Face
directory, `hf:DIR`)."""

from __future__ import annotations

from ddptrain.models.factory import build_model, create_model
from ddptrain.models.gpt import GPT, GPTConfig, build_gpt
from ddptrain.models.hf import hf_dir, is_hf_model, is_hf_ref
from ddptrain.models.nets import MLP, MiniResNet

__all__ = [
    "GPT", "MLP", "GPTConfig", "MiniResNet", "build_gpt", "build_model", "create_model", "hf_dir",
    "is_hf_model", "is_hf_ref",
]
