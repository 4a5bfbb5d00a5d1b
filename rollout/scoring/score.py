"""Offline re-scoring: teacher-forced logprobs of stored (prompt, completion) pairs, exact and padding-free.

Contract:
- Row i is `log_softmax(logits / T)[completion token]` for each completion token of pair i, float32 on the CPU,
  equal to a plain per-sequence forward of prompt + completion (<= 1e-5 in fp32). T = 0 means greedy: the raw
  distribution (T = 1), as the engine reports it.
- Pairs are packed in input order into one-row batches of at most `max_batch_tokens` fed tokens (packing.py);
  sequences are isolated by a block-diagonal causal mask (sdpa, eager) or the varlen kernels (flash). A pair longer
  than the budget is scored alone in its own batch. Only the rows of logits that predict completion tokens are
  computed (`logits_to_keep`), and they are turned into fp32 logprobs a chunk of rows at a time.
- Every pair is validated before any of its compute: `score` / `score_details` check all pairs first; `score_iter`
  checks each pair as it is read, before the batch holding it runs, so earlier results are already out.
- The model runs in eval mode under no_grad for each batch only; every module's training flag, the grad mode and
  the attention implementation are restored after each batch (the model may be a trainer's).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import torch

from ..base.errors import check_int, invalid, preview
from ..model.loading import load_model
from ..moe import Router, Routing, capture_routing, find_routers, routing_dtype
from .packing import Pack, Pair, batches, block_causal_mask, build_pack

DEFAULT_MAX_BATCH_TOKENS = 2048
LOGPROB_CHUNK_ROWS = 1024  # rows of fp32 vocabulary-wide temporaries alive at once
MASKED_ATTENTION = {"sdpa": torch.bool, "eager": None}  # None: the model's dtype, additive mask


@dataclass(frozen=True)
class TokenScores:
    """Scores of one completion, one entry per completion token, under log_softmax(logits / T)."""

    logprobs: torch.Tensor  # [C] float32: logprob of each completion token
    entropy: torch.Tensor | None = None  # [C] float32: entropy (nats) of the distribution it was drawn from
    top_ids: torch.Tensor | None = None  # [C, k] int64: the k most likely tokens at each step
    top_logprobs: torch.Tensor | None = None  # [C, k] float32: their logprobs
    routing: torch.Tensor | None = None  # [P + C - 1, layers, top_k]: the experts of every fed position (MoE)
    ranks: torch.Tensor | None = None  # [C] int64 (with top_k): 1 + how many tokens are more likely than this one

    def __post_init__(self) -> None:
        n = self.logprobs.shape[0]
        for name in ("entropy", "top_ids", "top_logprobs", "ranks"):
            value = getattr(self, name)
            if value is not None and value.shape[0] != n:
                raise invalid(name, f"{value.shape[0]} rows", f"must have one row per completion token ({n})",
                              "build TokenScores from one completion's rows")


def score(model_or_path: Any, prompts: Sequence[Any], completions: Sequence[Any],
          temperature: float | Sequence[float] = 1.0, tokenizer: Any = None,
          max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, return_routing: bool = False, top_k: int = 0):
    """Teacher-forced logprobs of each completion given its prompt: one float32 [len(completion)] tensor per pair.

    Prompts and completions are token-id lists (or 1-D tensors), or strings with a tokenizer (encoded without
    special tokens, as the worker encodes text prompts). `temperature` is one float or one per pair.
    `return_routing=True` (mixtures of experts): returns `(logprobs, routing)`, `routing` a `rollout.moe.Routing`
    with the experts this forward chose at every fed position of each pair (prompt and completion but its last
    token), in the layout `RolloutBatch.routing` has; a model without routers the recorder understands is refused
    before anything runs. `top_k=k > 0`: returns `(logprobs, top)`, `top[i]` the pair's `(top_ids [C, k] int64,
    top_logprobs [C, k] float32, ranks [C] int64)`: the k most likely tokens at each step and the rank of each
    completion token (1 = the most likely), from the same log-softmax as its logprob (what the server's prompt
    logprobs are); not together with `return_routing`.
    """
    if top_k and return_routing:
        raise invalid("top_k", top_k, "cannot be combined with return_routing=True",
                      "ask for the alternatives and the routing in two calls")
    model, tokenizer = load_model(model_or_path, tokenizer)
    rows = score_details(model, prompts, completions, temperature, tokenizer, max_batch_tokens,
                         entropy=False, top_k=top_k, return_routing=return_routing)
    logprobs = [row.logprobs for row in rows]
    if top_k:
        return logprobs, [(row.top_ids, row.top_logprobs, row.ranks) for row in rows]
    if not return_routing:
        return logprobs
    routers = find_routers(model)
    first = routers[0]
    return logprobs, Routing(tuple(r.name for r in routers), first.num_experts, first.top_k,
                             tuple(row.routing for row in rows))


def score_details(model_or_path: Any, prompts: Sequence[Any], completions: Sequence[Any],
                  temperature: float | Sequence[float] = 1.0, tokenizer: Any = None,
                  max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, entropy: bool = True,
                  top_k: int = 0, return_routing: bool = False) -> list[TokenScores]:
    """`score`, plus per-token entropy and the `top_k` most likely alternatives with each token's rank (each costs one
    pass over the rows), and with `return_routing` each pair's experts (`TokenScores.routing`)."""
    temps = _check_lists(prompts, completions, temperature)
    model, tokenizer = load_model(model_or_path, tokenizer)
    _check_options(model, max_batch_tokens, top_k)
    routers = find_routers(model) if return_routing else None
    return list(_run(model, _pairs(model, prompts, completions, temps, tokenizer), max_batch_tokens, entropy, top_k,
                     routers))


def check_pairs(model: Any, prompts: Sequence[Any], completions: Sequence[Any],
                temperature: float | Sequence[float] = 1.0, tokenizer: Any = None) -> list[Pair]:
    """Every pair checked (and text tokenized) as `score` checks it before any compute, against `model`'s vocabulary
    and context: only its config and embedding shapes are read, so a meta-device copy will do (a fleet validates
    on the caller's side this way). A bad pair is an InvalidArgument with its `index`."""
    return _pairs(model, prompts, completions, _check_lists(prompts, completions, temperature), tokenizer)


def score_iter(model_or_path: Any, pairs: Iterable[tuple[Any, Any]], temperature: float = 1.0,
               tokenizer: Any = None, max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS, entropy: bool = False,
               top_k: int = 0) -> Iterator[TokenScores]:
    """Stream `TokenScores` for an iterable of (prompt, completion) pairs, in input order, one batch at a time.

    Memory is bounded by the token budget whatever the number of pairs: the iterable is read only as far as the
    batch being scored. The options are checked (and a path loaded) now; each pair when it is read. A bad pair
    raises a ValueError naming its index after every earlier pair's result has been yielded.
    """
    (temp,) = _temperatures(temperature, 1)
    model, tokenizer = load_model(model_or_path, tokenizer)
    _check_options(model, max_batch_tokens, top_k)
    limits = _limits(model)
    checked = (_pair(i, *_two(i, item), temp, tokenizer, limits) for i, item in enumerate(pairs))
    return _run(model, checked, max_batch_tokens, entropy, top_k)


# ---------------------------------------------------------------------------------------------- the batch loop
def _run(model, pairs: Iterable[Pair], max_batch_tokens: int, entropy: bool, top_k: int,
         routers: list[Router] | None = None) -> Iterator[TokenScores]:
    for group in batches(pairs, max_batch_tokens):
        pack = build_pack(group)
        with _scoring_mode(model) as attn, capture_routing(model) if routers else contextlib.nullcontext() as seen:
            logits = _kept_logits(model, pack, attn)  # [R, V] in the model's dtype
            rows = _token_scores(logits, pack, entropy, top_k)
        if routers:  # one forward: (fed tokens, layers, top_k), cut at the sequence boundaries
            experts = seen[0].to(routing_dtype(routers[0].num_experts)).split(pack.cu_seq_lens.diff().tolist())
            rows = [dataclasses.replace(row, routing=part.clone()) for row, part in zip(rows, experts)]
        yield from rows


def _kept_logits(model, pack: Pack, attn: str) -> torch.Tensor:
    """One forward of the packed row; returns only the rows of logits that predict completion tokens."""
    device = model.get_input_embeddings().weight.device
    kwargs: dict[str, Any] = dict(input_ids=pack.input_ids[None].to(device),
                                  position_ids=pack.position_ids[None].to(device), use_cache=False)
    if _is_flash(attn):  # varlen kernels: sequences isolated by their boundaries, no mask (cannot run on CPU)
        cu = pack.cu_seq_lens.to(device)
        kwargs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=pack.max_seq_len,
                      max_length_k=pack.max_seq_len)
    else:  # position ids alone do not isolate packed sequences under sdpa/eager: pass the block-diagonal mask
        kwargs["attention_mask"] = block_causal_mask(pack.cu_seq_lens, MASKED_ATTENTION[attn] or model.dtype,
                                                     device)
    keep = pack.keep.to(device)
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return model(**kwargs, logits_to_keep=keep).logits[0]
    return model(**kwargs).logits[0, keep]  # a model without logits_to_keep: [T, V] materialised, then sliced


def _token_scores(logits: torch.Tensor, pack: Pack, entropy: bool, top_k: int) -> list[TokenScores]:
    """fp32 log_softmax(logits / T) a chunk of rows at a time; returns one TokenScores per sequence, in order."""
    targets = pack.targets.to(logits.device)
    temps = pack.temperatures.to(logits.device)
    parts: dict[str, list[torch.Tensor]] = {"logprobs": [], "entropy": [], "top_ids": [], "top_logprobs": [],
                                            "ranks": []}
    for start in range(0, logits.shape[0], LOGPROB_CHUNK_ROWS):
        end = start + LOGPROB_CHUNK_ROWS
        logp = torch.log_softmax(logits[start:end].float() / temps[start:end, None], dim=-1)  # [r, V] fp32
        chosen = logp.gather(1, targets[start:end, None])  # [r, 1]
        parts["logprobs"].append(chosen.squeeze(1))
        if entropy:  # 0 * log 0 -> nan where a logit is -inf: count it as 0
            parts["entropy"].append(-(logp.exp() * logp).nan_to_num(0.0).sum(-1))
        if top_k:
            values, ids = logp.topk(top_k, dim=-1)
            parts["top_logprobs"].append(values)
            parts["top_ids"].append(ids)
            parts["ranks"].append((logp > chosen).sum(-1) + 1)
    fields = {k: torch.cat(v).cpu().split(pack.num_targets) for k, v in parts.items() if v}
    return [TokenScores(**{k: v[s].clone() for k, v in fields.items()}) for s in range(len(pack.num_targets))]


@contextlib.contextmanager
def _scoring_mode(model):
    """Eval mode, no_grad and an attention that packs; every module's flag and the attention restored after."""
    flags = [(module, module.training) for module in model.modules()]
    impl = model.config._attn_implementation
    attn = _packed_attention(model, impl)
    try:
        model.eval()
        if attn != impl:  # e.g. a paged or custom engine attention: run the packed forward under its base kernel
            model.set_attn_implementation(attn)
        with torch.no_grad():
            yield attn
    finally:
        if model.config._attn_implementation != impl:
            model.set_attn_implementation(impl)
        for module, training in flags:
            module.training = training


def _packed_attention(model, impl: str) -> str:
    """The attention to pack under: flash (varlen kernels), sdpa or eager (block-diagonal mask); else sdpa."""
    base = impl.removeprefix("paged|")
    if _is_flash(base):
        if model.get_input_embeddings().weight.device.type != "cuda":
            raise invalid("attn_implementation", impl, "the flash varlen path needs the model on a CUDA device",
                          "move the model to CUDA, or call model.set_attn_implementation('sdpa')")
        return base
    return base if base in MASKED_ATTENTION else "sdpa"


def _is_flash(impl: str) -> bool:
    from transformers.utils.generic import is_flash_attention_requested

    return is_flash_attention_requested(requested_attention_implementation=impl)


# ---------------------------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class _Limits:
    vocab_size: int
    max_context: int | None


def _limits(model) -> _Limits:
    text = model.config.get_text_config()
    vocab = model.get_input_embeddings().num_embeddings
    head = model.get_output_embeddings()
    if head is not None and getattr(head, "out_features", None):
        vocab = min(vocab, head.out_features)
    return _Limits(vocab, getattr(text, "max_position_embeddings", None))


def _check_lists(prompts: Any, completions: Any, temperature: Any) -> list[float]:
    """The checks of a whole call (lists of equal length); returns one temperature per pair."""
    for name, value in (("prompts", prompts), ("completions", completions)):
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise invalid(name, type(value).__name__, "must be a list with one entry per pair",
                          "pass e.g. prompts=[[1, 2]], completions=[[3, 4]]")
    if len(prompts) != len(completions):
        raise invalid("completions", f"{len(completions)} completions", f"must be one per prompt ({len(prompts)})",
                      "pass exactly one completion for each prompt")
    return _temperatures(temperature, len(prompts))


def _pairs(model, prompts: Sequence[Any], completions: Sequence[Any], temps: list[float], tokenizer: Any) -> list[Pair]:
    limits = _limits(model)
    return [_pair(i, p, c, t, tokenizer, limits) for i, (p, c, t) in enumerate(zip(prompts, completions, temps))]


def _pair(index: int, prompt: Any, completion: Any, temperature: float, tokenizer: Any, limits: _Limits) -> Pair:
    where = f"pair {index}"
    ids = {name: _ids(name, value, tokenizer, index) for name, value in (("prompt", prompt),
                                                                         ("completion", completion))}
    for name, tokens in ids.items():
        if not tokens:
            raise invalid(name, tokens, "must contain at least one token",
                          f"drop pairs with an empty {name} before scoring", where, index)
        for pos, token in enumerate(tokens):
            if not 0 <= token < limits.vocab_size:
                raise invalid(name, f"token id {token} at position {pos}", f"ids must be in [0, {limits.vocab_size})",
                              "tokenize with the scoring model's own tokenizer", where, index)
    total = len(ids["prompt"]) + len(ids["completion"])
    if limits.max_context is not None and total > limits.max_context:
        raise invalid("prompt+completion", f"{total} tokens", f"must fit the model's context of {limits.max_context}",
                      "truncate the prompt or drop the pair", where, index)
    return Pair(index, tuple(ids["prompt"]), tuple(ids["completion"]), temperature)


def _ids(name: str, value: Any, tokenizer: Any, index: int) -> list[int]:
    where = f"pair {index}"
    if isinstance(value, str):
        if tokenizer is None:
            raise invalid(name, preview(value), "text needs a tokenizer",
                          "pass tokenizer=..., a checkpoint directory that holds one, or token ids", where, index)
        return list(tokenizer(value, add_special_tokens=False)["input_ids"])
    if hasattr(value, "tolist"):  # a torch tensor or numpy array
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, Integral) and not isinstance(t, bool)
                                                        for t in value):
        raise invalid(name, preview(value), "must be a list of int token ids or a string",
                      "pass token ids such as [1, 2, 3]", where, index)
    return [int(t) for t in value]


def _two(index: int, item: Any) -> tuple[Any, Any]:
    if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
        raise invalid("pair", preview(item), "must be a (prompt, completion) pair",
                      "yield 2-tuples such as ([1, 2], [3, 4])", f"pair {index}", index)
    return item[0], item[1]


def _temperatures(temperature: Any, count: int) -> list[float]:
    temps = [temperature] * count if isinstance(temperature, (int, float)) else temperature
    if isinstance(temps, (str, bytes)) or not isinstance(temps, Sequence) or len(temps) != count:
        raise invalid("temperature", preview(temperature), f"must be one number or one per pair ({count})",
                      "pass e.g. temperature=1.0", "")
    for i, t in enumerate(temps):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise invalid("temperature", t, "must be a finite number >= 0 (0 = greedy: the raw distribution)",
                          "pass the temperature the completions were sampled at, e.g. 1.0",
                          f"pair {i}" if count > 1 else "", i if count > 1 else None)
    return [float(t) for t in temps]


def _check_options(model, max_batch_tokens: int, top_k: int) -> None:
    _packed_attention(model, model.config._attn_implementation)  # refuses flash off CUDA now, not mid-stream
    check_int("max_batch_tokens", max_batch_tokens, 1, "use e.g. 2048 on CPU, 8192-32768 on GPU")
    check_int("top_k", top_k, 0, "use 0 for no alternatives, or e.g. 5", maximum=_limits(model).vocab_size)
