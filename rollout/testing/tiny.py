"""Tiny causal LMs built locally, for tests, examples, the demo and benchmarks.

Nothing is downloaded: a byte-level BPE tokenizer is trained in-process on a small built-in corpus, a Llama- or
Qwen2-style model (or a mixture of experts: Qwen3-MoE, OLMoE, Mixtral; `MOE_ARCHS`) is initialised from a config with a fixed seed, both are saved with `save_pretrained`, and callers
load them back through the ordinary `from_pretrained` path so the real loading code is exercised.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]

_WORDS = ("the a one two three four five six seven eight nine ten zero plus minus equals answer question is "
          "what how many apple apples cat cats dog dogs red blue green big small yes no count add sum total "
          "number numbers first second last word words letter letters short long sky sea tree trees").split()

# name -> (hidden, layers, heads, kv_heads, intermediate, vocab)
SIZES = {
    "tiny": (64, 2, 4, 2, 128, 512),
    "small": (256, 4, 8, 4, 688, 2048),
    "25m": (512, 6, 8, 4, 1536, 8192),
    "100m": (768, 12, 12, 4, 2048, 16384),
    "350m": (1024, 24, 16, 4, 2816, 32768),
}


# mixtures of experts: (experts, experts per token) at every size; each expert has the dense intermediate size / 2
MOE_ARCHS = {"qwen3_moe": (8, 2), "olmoe": (8, 2), "mixtral": (4, 2)}
ARCHS = ("llama", "qwen2", *MOE_ARCHS)


def _corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    gen = torch.Generator().manual_seed(seed)
    lines = []
    for _ in range(num_lines):
        length = int(torch.randint(3, 16, (1,), generator=gen))
        idx = torch.randint(0, len(_WORDS), (length,), generator=gen).tolist()
        nums = " ".join(str(int(x)) for x in torch.randint(0, 100, (2,), generator=gen))
        lines.append(" ".join(_WORDS[i] for i in idx) + " " + nums)
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0, extra_special_tokens: tuple[str, ...] = ()):
    """Train a byte-level BPE tokenizer in-process and wrap it as a `PreTrainedTokenizerFast`.

    `extra_special_tokens` join the special tokens before training, so every id stays below `vocab_size`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = SPECIAL_TOKENS + list(extra_special_tokens)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(seed=seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", additional_special_tokens=specials[3:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_config(arch: str, size: str, vocab_size: int, eos_id: int, bos_id: int, pad_id: int,
                 tie_word_embeddings: bool, max_position_embeddings: int):
    from transformers import AutoConfig

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is invalid: must be one of {list(ARCHS)}. Fix: pick one of those.")
    hidden, layers, heads, kv_heads, inter, _ = SIZES[size]
    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=inter,
                  max_position_embeddings=max_position_embeddings, eos_token_id=eos_id, bos_token_id=bos_id,
                  pad_token_id=pad_id, tie_word_embeddings=tie_word_embeddings)
    if arch in MOE_ARCHS:
        experts, top_k = MOE_ARCHS[arch]
        common.update(num_experts_per_tok=top_k, intermediate_size=inter // 2)
        if arch == "mixtral":
            common.update(num_local_experts=experts)
        else:
            common.update(num_experts=experts, norm_topk_prob=True)
        if arch == "qwen3_moe":
            common.update(moe_intermediate_size=inter // 2, decoder_sparse_step=1, mlp_only_layers=[])
    return AutoConfig.for_model(arch, **common)


def build_tiny_model(path: str | os.PathLike, arch: str = "llama", size: str = "tiny", seed: int = 0,
                     tie_word_embeddings: bool = False, max_position_embeddings: int = 1024,
                     init_std: float = 0.2) -> Path:
    """Build, save and return the directory of a tiny model and its tokenizer. Idempotent for the same arguments.

    `init_std` is larger than usual so that a random tiny model has peaked, varied next-token distributions (top-k /
    top-p truncation then really truncates, and greedy differs from sampling).
    """
    from transformers import AutoModelForCausalLM

    if size not in SIZES:
        raise ValueError(f"size={size!r} is invalid: must be one of {sorted(SIZES)}. Fix: pick one of those.")
    path = Path(path)
    spec = dict(format=2, arch=arch, size=size, seed=seed, tie=tie_word_embeddings, max_pos=max_position_embeddings,
                init_std=init_std)
    marker = path / "rollout_tiny.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        return path
    tokenizer = build_tokenizer(SIZES[size][5], seed=seed)
    # the toy corpus saturates BPE merges early: larger sizes pad the vocabulary so their embeddings have the
    # advertised size (ids past the tokenizer's are valid model ids; they decode to nothing)
    config = build_config(arch, size, max(len(tokenizer), SIZES[size][5]), tokenizer.eos_token_id, tokenizer.bos_token_id,
                          tokenizer.pad_token_id, tie_word_embeddings, max_position_embeddings)
    config.initializer_range = init_std
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    marker.write_text(json.dumps(spec))
    return path


def load_tiny_model(path: str | os.PathLike, attn_implementation: str = "sdpa", dtype=torch.float32):
    """Load a saved tiny model and tokenizer through the normal `from_pretrained` path."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer
