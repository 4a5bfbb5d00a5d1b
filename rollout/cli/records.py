"""The JSONL line formats of `rollout generate` and `rollout score`: what a line may hold, and the row written back.

Contract: an input line is a JSON object. Its prompt is `prompt` (text; chat messages with --chat-template) or
`prompt_ids`; for scoring, its completion is `completion` or `completion_ids`. Sampling fields on a generate line
override the flags for that line. Every other field is kept and copied to the output row, which adds its results
under names the input must not already use. Checks here need no model (they run in the pre-validation pass); the
model's own checks (vocabulary, context length) run in the worker or the scorer.
"""

from __future__ import annotations

from typing import Any

from ..base.errors import InvalidArgument, preview
from ..base.params import SamplingParams
from .jsonl import FieldError, Record

SAMPLING_FIELDS = ("n", "temperature", "top_k", "top_p", "max_new_tokens", "stop_token_ids", "ignore_eos", "seed",
                   "top_logprobs", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
                   "min_new_tokens", "logit_bias")
GENERATE_OUTPUT = ("completions", "completion_ids", "logprobs", "finish_reason", "policy_version")
ALTERNATIVES = "alternatives"  # lines with top_logprobs > 0: per sample, per token, [[id, logprob], ...]
SCORE_OUTPUT = ("logprobs", "logprob_sum")
# Names other engines give sampling controls: refused with the right name, not silently kept as plain data.
MISNAMED = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens", "stop": "stop_token_ids",
            "num_samples": "n", "best_of": "n", "num_return_sequences": "n", "do_sample": "temperature (0 = greedy)",
            "sampling": "top-level fields such as temperature"}


# ---------------------------------------------------------------------------------------------- generate
def check_generate(data: dict, base: dict, chat_template: bool) -> None:
    _check_one_of(data, "prompt")
    if "prompt" in data:
        prompt = data["prompt"]
        messages = chat_template and isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt)
        if not (isinstance(prompt, str) and prompt) and not messages:
            kinds = "a non-empty string or a list of chat messages" if chat_template else "a non-empty string"
            fix = "pass --chat-template for chat messages" if isinstance(prompt, list) and not chat_template \
                else "give the text, or token ids as \"prompt_ids\""
            raise FieldError("prompt", f"{preview(prompt)} is invalid: must be {kinds}. Fix: {fix}")
    else:
        _check_ids(data, "prompt_ids")
    for key in data:
        if key in MISNAMED:
            raise FieldError(key, f"is not a rollout sampling field. Fix: use {MISNAMED[key]}")
    _check_reserved(data, GENERATE_OUTPUT + (ALTERNATIVES,))
    sampling_for(data, base, None)


def sampling_for(data: dict, base: dict, index: int | None) -> SamplingParams:
    """The line's SamplingParams: the flags, overridden by the line's own fields. With --seed S and no `seed` on
    the line, record i samples with seed S + i (reproducible across chunk sizes, resumes and worker counts)."""
    own = {k: v for k, v in data.items() if k in SAMPLING_FIELDS}
    if isinstance(own.get("logit_bias"), dict):  # JSON object keys are strings: {"50256": -100}
        own["logit_bias"] = {int(k) if isinstance(k, str) and k.isdigit() else k: v
                             for k, v in own["logit_bias"].items()}
    values = {**base, **own}
    if "seed" in base and "seed" not in own and index is not None:
        values["seed"] = base["seed"] + index
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as e:
        raise FieldError(field_of(e), str(e)) from None


def generate_prompt(data: dict) -> Any:
    return data["prompt"] if "prompt" in data else data["prompt_ids"]


def generate_rows(chunk: list[Record], batch, tokenizer: Any) -> list[dict]:
    """One row per record: its fields, plus one entry per sample in each output list (sample order)."""
    rows = [dict(r.data, **{k: [] for k in GENERATE_OUTPUT}) for r in chunk]
    texts = batch.completion_texts(tokenizer) if tokenizer is not None else None
    for i, ids in enumerate(batch.completion_token_lists()):
        row = rows[int(batch.prompt_index[i])]
        if texts is not None:
            row["completions"].append(texts[i])
        row["completion_ids"].append(ids)
        row["logprobs"].append(floats(batch.logprobs[i, : len(ids)]))
        row["finish_reason"].append(batch.finish_reason[i])
        row["policy_version"].append(int(batch.policy_version[i]))
        if batch.top_ids is not None:
            tops = zip(batch.top_ids[i, : len(ids)].tolist(), batch.top_logprobs[i, : len(ids)].tolist())
            lists = [[[t, v] for t, v in zip(top_ids, values) if t >= 0] for top_ids, values in tops]
            if lists and lists[0]:  # the line asked (a line that did not has none at any token)
                row.setdefault(ALTERNATIVES, []).append(lists)
    if texts is None:  # no tokenizer: ids only
        for row in rows:
            del row["completions"]
    return rows


# ---------------------------------------------------------------------------------------------- score
def check_score(data: dict) -> None:
    for name in ("prompt", "completion"):
        _check_one_of(data, name)
        if name in data and not (isinstance(data[name], str) and data[name]):
            raise FieldError(name, f"{preview(data[name])} is invalid: must be a non-empty string. Fix: give the "
                                   f"text, or token ids as \"{name}_ids\"")
        if f"{name}_ids" in data:
            _check_ids(data, f"{name}_ids")
    temp = data.get("temperature", 0.0)
    if isinstance(temp, bool) or not isinstance(temp, (int, float)) or not temp >= 0 or temp == float("inf"):
        raise FieldError("temperature", f"{preview(temp)} is invalid: must be a finite number >= 0. Fix: use the "
                                        "temperature the completion was sampled at (0 = the raw distribution)")
    _check_reserved(data, SCORE_OUTPUT)


def score_inputs(chunk: list[Record], temperature: float) -> tuple[list[Any], list[Any], list[float]]:
    """Prompts, completions and temperatures (a line's own `temperature` wins over the flag)."""
    def get(r: Record, name: str) -> Any:
        return r.data[name] if name in r.data else r.data[f"{name}_ids"]

    return ([get(r, "prompt") for r in chunk], [get(r, "completion") for r in chunk],
            [float(r.data.get("temperature", temperature)) for r in chunk])


def score_rows(chunk: list[Record], scores: list) -> list[dict]:
    return [dict(r.data, logprobs=floats(s), logprob_sum=float(s.double().sum())) for r, s in zip(chunk, scores)]


# ---------------------------------------------------------------------------------------------- shared
def floats(values) -> list[float]:
    """float32 values in their shortest round-trip form: exact, and about half the bytes of a float64 repr."""
    return [float(s) for s in values.float().cpu().numpy().astype(str)]


def field_of(error: Exception) -> str:
    """The field an InvalidArgument names; "sampling" for any other error (e.g. SamplingParams' TypeError for an
    unknown keyword)."""
    return error.field if isinstance(error, InvalidArgument) else "sampling"


def _check_one_of(data: dict, name: str) -> None:
    if (name in data) == (f"{name}_ids" in data):
        raise FieldError(name, f"each line needs exactly one of \"{name}\" (text) and \"{name}_ids\" (token ids). "
                               f"Fix: e.g. {{\"{name}_ids\": [12, 7, 99]}}")


def _check_ids(data: dict, field: str) -> None:
    ids = data[field]
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                       for t in ids):
        raise FieldError(field, f"{preview(ids)} is invalid: must be a non-empty list of non-negative int token ids. "
                                "Fix: e.g. [12, 7, 99]")


def _check_reserved(data: dict, outputs: tuple[str, ...]) -> None:
    for key in outputs:
        if key in data:
            raise FieldError(key, "is a field this command writes, so the input must not have it. Fix: rename or "
                                  "drop it (to feed an output file back in, remove the added fields)")
