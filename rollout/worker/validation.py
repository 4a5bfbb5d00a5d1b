"""Turning a generate call's inputs into validated token-id prompts (and constrained rows' compiled grammars), before
anything is submitted."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..base.errors import invalid, preview
from ..base.params import SamplingParams
from ..engine import Grammars


def to_token_lists(prompts: Sequence[Any], tokenizer: Any, chat_template: bool) -> list[list[int]]:
    """Accept token-id lists, strings (with a tokenizer) or chat messages (with a tokenizer and its template)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise invalid("prompts", type(prompts).__name__, "must be a list of prompts",
                      "pass a list, e.g. [[1, 2, 3]] or ['some text']")
    return [_one(p, i, tokenizer, chat_template) for i, p in enumerate(prompts)]


def _one(prompt: Any, index: int, tokenizer: Any, chat_template: bool) -> list[int]:
    where = f"prompt {index}"
    if isinstance(prompt, str) or (chat_template and _is_messages(prompt)):
        if tokenizer is None:
            raise invalid("prompt", preview(prompt), "text prompts need a tokenizer",
                          "pass tokenizer=... to RolloutWorker, or give token ids", where, index)
        return _encode(prompt, tokenizer, chat_template)
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                        for t in prompt):
        raise invalid("prompt", preview(prompt), "must be a list of int token ids, a string, or chat messages",
                      "pass token ids such as [1, 2, 3]", where, index)
    return list(prompt)


def _is_messages(prompt: Any) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def _encode(prompt: Any, tokenizer: Any, chat_template: bool) -> list[int]:
    if chat_template:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return list(ids)
    return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])


def sampling_per_prompt(sampling: SamplingParams | Sequence[SamplingParams] | None,
                        num_prompts: int) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * num_prompts
    if isinstance(sampling, SamplingParams):
        return [sampling] * num_prompts
    params = list(sampling)
    if len(params) != num_prompts:
        raise invalid("sampling", f"{len(params)} SamplingParams", f"must be one per prompt ({num_prompts})",
                      "pass a single SamplingParams for all prompts, or exactly one per prompt")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise invalid("sampling", type(p).__name__, "must be a SamplingParams", "wrap it in SamplingParams(...)",
                          f"prompt {i}", i)
    return params


def check_prompt(ids: list[int], params: SamplingParams, index: int, vocab_size: int, max_context: int | None,
                 max_request_tokens: int) -> None:
    """Every rule a prompt must meet before submission; the error names the prompt, the field and the fix."""
    where = f"prompt {index}"
    if not ids:
        raise invalid("prompt", ids, "must contain at least one token", "drop empty prompts before generate", where,
                      index)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise invalid("prompt", f"token id {bad[0]}", f"ids must be in [0, {vocab_size})",
                      "tokenize with the model's own tokenizer", where, index)
    total = len(ids) + params.max_new_tokens
    if max_context is not None and total > max_context:
        raise invalid("max_new_tokens", params.max_new_tokens,
                      f"prompt length {len(ids)} + max_new_tokens exceeds the model context of {max_context}",
                      f"use max_new_tokens <= {max(max_context - len(ids), 0)} or a shorter prompt", where, index)
    if total > max_request_tokens:
        raise invalid("max_new_tokens", params.max_new_tokens,
                      f"prompt length {len(ids)} + max_new_tokens exceeds what the KV cache can hold for one "
                      f"request ({max_request_tokens} tokens)",
                      "raise WorkerConfig.num_blocks or kv_cache_memory_mb, or lower max_new_tokens", where, index)
    for token in params.stop_token_ids or ():
        if token >= vocab_size:
            raise invalid("stop_token_ids", token, f"ids must be in [0, {vocab_size})",
                          "use the model's own token ids", where, index)
    for token, _ in params.logit_bias or ():
        if token >= vocab_size:
            raise invalid("logit_bias", token, f"ids must be in [0, {vocab_size})", "use the model's own token ids",
                          where, index)
    if params.top_logprobs > vocab_size:
        raise invalid("top_logprobs", params.top_logprobs, f"the vocabulary has only {vocab_size} tokens",
                      f"ask for at most {vocab_size} alternatives", where, index)


def prepare_call(prompts: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None,
                 tokenizer: Any, chat_template: bool, vocab_size: int, max_context: int | None,
                 max_request_tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """A whole generate call, validated before anything runs: (token lists, one SamplingParams per prompt)."""
    token_lists = to_token_lists(prompts, tokenizer, chat_template)
    params = sampling_per_prompt(sampling, len(token_lists))
    for i, (ids, p) in enumerate(zip(token_lists, params)):
        check_prompt(ids, p, i, vocab_size, max_context, max_request_tokens)
    return token_lists, params


def compile_structured(engine: Any, tokenizer: Any, vocab_size: int, params: SamplingParams, stop: tuple[int, ...],
                       index: int) -> None:
    """A constrained prompt's checks, and its grammar compiled for the engine (once per distinct value)."""
    where, kind = f"prompt {index}", params.structured.kind
    if engine.captures:
        raise invalid("structured", kind, "needs sync batching: under CUDA graphs the engine prepares a step before "
                      "the token of the step in flight is known, and so its grammar's mask",
                      "use WorkerConfig(cuda_graphs=\"off\") for constrained rows", where, index)
    if tokenizer is None:
        raise invalid("structured", kind, "needs the model's tokenizer (grammars are compiled against it)",
                      "pass tokenizer=... to RolloutWorker", where, index)
    if not stop:
        raise invalid("stop_token_ids", stop, "a constrained row needs a stop id to end on once its grammar is "
                      "complete", "pass stop_token_ids, or give the model an EOS id", where, index)
    if engine.grammars is None:
        engine.grammars = Grammars(tokenizer, vocab_size)
    engine.grammars.compile(params.structured)
