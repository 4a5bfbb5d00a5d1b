"""Tiny models built locally (nothing downloaded) for tests, examples, benchmarks and the demo.

`build_tiny_model` saves a model and a tokenizer trained in-process; `load_tiny_model` loads them back through the
normal `from_pretrained` path, so the real loading code is exercised. `ReplayDrafts` stands in for the engine's draft
index with a plain run's tokens (speculation whose drafts are right). May import torch, tokenizers and
transformers' public model classes; nothing else of rollout.
"""

from .chat import build_chat_tokenizer, build_reasoning_chat_tokenizer
from .replay import ReplayDrafts
from .teach import teach
from .tiny import ARCHS, MOE_ARCHS, SIZES, build_config, build_tiny_model, build_tokenizer, load_tiny_model

__all__ = ["ARCHS", "MOE_ARCHS", "ReplayDrafts", "SIZES", "build_chat_tokenizer", "build_config",
           "build_reasoning_chat_tokenizer", "build_tiny_model", "build_tokenizer", "load_tiny_model", "teach"]
