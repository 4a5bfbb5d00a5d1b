"""The JSON bodies the server answers with: OpenAI's chat.completion / text_completion objects and their streamed
chunks, plus the extensions every choice carries (unless the request says `return_token_ids: false`):

    token_ids        the sampled token ids of the choice (vLLM's name)
    token_versions   the policy version whose weights produced each of them
    policy_version   the oldest of those (the version of the whole choice when no update landed mid-way)
    prompt_token_ids the prompt as the engine saw it (chat: top level, as vLLM; completions: in each choice)

`logprobs` values are the engine's exact full-vocabulary log p(token) under log_softmax(logits / T) (T = 1 for
greedy), the same numbers `RolloutBatch.logprobs` holds; `top_logprobs` lists (when asked) are the k most likely tokens
of that same log-softmax at each position, read off the engine's own sampling step (`RolloutBatch.top_ids`), and in
completions the chosen token too when it is not among them (k + 1 entries; `logprobs: 0`: it alone, as vLLM). The
prompt's logprobs (completions `echo` with `logprobs`; `prompt_logprobs`: chat at the top level, completions in each
choice, as vLLM puts them) are teacher-forced by the rollout side's `score` (prompts.py).
"""

from __future__ import annotations

from typing import Any

from ..rollouts.choices import Choice, Delta, Detokenizer, IncrementalText, Top
from .prompts import PromptScores, echo_logprobs, joined, legacy_top, vllm_prompt_logprobs
from .protocol import Request


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def _entry(detok: Detokenizer, token: int, value: float) -> dict:
    return {"token": detok.name(token), "logprob": value, "bytes": list(detok.piece(token).encode("utf-8"))}


def chat_logprobs(ids: list[int], logprobs: list[float], detok: Detokenizer, top: list[Top] | None = None) -> dict:
    content = []
    for i, (token, value) in enumerate(zip(ids, logprobs)):
        alternatives = [] if top is None else [_entry(detok, t, v) for t, v in zip(*top[i])]
        content.append({**_entry(detok, token, value), "top_logprobs": alternatives})
    return {"content": content}


def completion_logprobs(ids: list[int], logprobs: list[float], detok: Detokenizer, offsets: list[int],
                        top: list[Top] | None = None) -> dict:
    """`offsets`: where each token's text begins in the choice's `text` (Detokenizer.offsets). With `logprobs: 0`
    (`top` None) each position's `top_logprobs` holds the chosen token alone, as vLLM's (k + 1 entries, k = 0): TRL's
    VLLMClient reads it position by position."""
    top = top or [([], [])] * len(ids)
    alternatives = [legacy_top(detok, token, value, *item) for token, value, item in zip(ids, logprobs, top)]
    return {"tokens": [detok.name(t) for t in ids], "token_logprobs": list(logprobs), "top_logprobs": alternatives,
            "text_offset": offsets}


def extensions(request: Request, ids: list[int], versions: list[int], choice: Choice | None = None) -> dict:
    """The token-id fields of a choice (`choice` given: the whole one, with its policy version) or of a delta."""
    if not request.return_token_ids:
        return {}
    out: dict[str, Any] = {"token_ids": ids, "token_versions": versions}
    if choice is not None:
        out["policy_version"] = choice.policy_version
    return out


def chat_response(request: Request, rid: str, created: int, model: str, choices: list[Choice],
                  detok: Detokenizer, cached_tokens: int, scores: list[PromptScores] | None = None) -> dict:
    out_choices = []
    for c in choices:
        out_choices.append({
            "index": c.index, "message": c.message, "finish_reason": c.finish_reason,
            "logprobs": chat_logprobs(c.token_ids, c.logprobs, detok, c.top) if request.logprobs else None,
            **extensions(request, c.token_ids, c.token_versions, c), **_rejected(c)})
    body = {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": out_choices,
            "usage": usage(len(choices[0].prompt_ids), sum(c.sampled for c in choices), cached_tokens)}
    if request.return_token_ids:
        body["prompt_token_ids"] = choices[0].prompt_ids
    if request.prompt_logprobs is not None:
        body["prompt_logprobs"] = vllm_prompt_logprobs(choices[0].prompt_ids, scores[0].first(request.prompt_logprobs),
                                                       detok)
    return body


def completion_response(request: Request, rid: str, created: int, model: str, choices: list[Choice],
                        detok: Detokenizer, cached_tokens: int, scores: list[PromptScores] | None = None) -> dict:
    out_choices = []
    for c in choices:
        mine = scores[c.index // request.n] if scores is not None else None
        prompt_text = _prompt_text(request, c, detok) if request.echo else ""
        logprobs = None
        if request.logprobs:
            offsets = [len(prompt_text) + at for at in detok.offsets(c.token_ids, c.text)]
            logprobs = completion_logprobs(c.token_ids, c.logprobs, detok, offsets, c.top)
            if request.echo:
                prompt = echo_logprobs(c.prompt_ids, mine.first(request.top_logprobs), detok, request.top_logprobs,
                                       prompt_text)
                logprobs = joined(prompt, logprobs)
        item = {"index": c.index, "text": prompt_text + c.text, "finish_reason": c.finish_reason,
                "logprobs": logprobs, **extensions(request, c.token_ids, c.token_versions, c)}
        if request.return_token_ids:
            item["prompt_token_ids"] = c.prompt_ids
        if request.prompt_logprobs is not None:
            item["prompt_logprobs"] = vllm_prompt_logprobs(c.prompt_ids, mine.first(request.prompt_logprobs), detok)
        out_choices.append(item)
    prompt_tokens = sum(len(c.prompt_ids) for c in choices[:: request.n])
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": out_choices,
            "usage": usage(prompt_tokens, sum(c.sampled for c in choices), cached_tokens)}


def _rejected(choice: Choice) -> dict:
    """`tool_call_error` on a choice whose call the parser rejected (its content is the markup as written)."""
    return {"tool_call_error": choice.tool_call_error} if choice.tool_call_error else {}


def _prompt_text(request: Request, choice: Choice, detok: Detokenizer) -> str:
    """What `echo` returns of the prompt: the text sent, or the decoded ids."""
    given = request.prompts[choice.index // request.n] if request.prompts is not None else None
    return given if isinstance(given, str) else detok.text(choice.prompt_ids)


class Chunks:
    """The streamed chunks of one request (`data: {...}` events; the app adds `data: [DONE]`)."""

    def __init__(self, request: Request, rid: str, created: int, model: str, detok: Detokenizer) -> None:
        self.request, self.rid, self.created, self.model, self.detok = request, rid, created, model, detok
        self.object = "chat.completion.chunk" if request.kind == "chat" else "text_completion"
        self.offsets: dict[int, int] = {}  # completions: text offset of each choice so far
        self.streamed: dict[int, tuple[list[int], IncrementalText]] = {}  # completions: each choice's ids so far

    def _chunk(self, choices: list[dict], **extra) -> dict:
        return {"id": self.rid, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def start(self, index: int, prompt_ids: list[int]) -> dict | None:
        """Chat: the first chunk of a choice (the role); prompt ids ride on choice 0's."""
        if self.request.kind != "chat":
            return None
        extra = {"prompt_token_ids": prompt_ids} if self.request.return_token_ids and index == 0 else {}
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], **extra)

    def delta(self, index: int, delta: Delta, prompt_ids: list[int]) -> dict:
        """Tokens of a choice as they come (with tools, `delta.text` is the content until a call begins)."""
        req = self.request
        ext = extensions(req, delta.token_ids, delta.token_versions)
        if req.kind == "chat":
            body: dict[str, Any] = {"content": delta.text} if delta.text else {}
            lp = chat_logprobs(delta.token_ids, delta.logprobs, self.detok, delta.top) if req.logprobs else None
            return self._chunk([{"index": index, "delta": body, "logprobs": lp, "finish_reason": None, **ext}])
        offset = self.offsets.get(index, 0)
        self.offsets[index] = offset + len(delta.text)
        lp = None
        if req.logprobs:  # offsets into the whole text streamed (a stop string cut after them can leave them past it)
            before, decoded = self.streamed.setdefault(index, ([], IncrementalText(self.detok)))
            offsets = self.detok.offsets(delta.token_ids, None, decoded, before)
            before += delta.token_ids
            lp = completion_logprobs(delta.token_ids, delta.logprobs, self.detok, offsets, delta.top)
        first = {"prompt_token_ids": prompt_ids} if req.return_token_ids and offset == 0 and delta.token_ids else {}
        return self._chunk([{"index": index, "text": delta.text, "logprobs": lp, "finish_reason": None, **ext,
                             **first}])

    def finish(self, choice: Choice, content: str | None = None) -> dict:
        """The last chunk of a choice: its finish reason, policy version, and (chat with tools) the rest of the
        message: `content`, what is left of its content after what streamed, and its calls."""
        req = self.request
        ext = {"policy_version": choice.policy_version} if req.return_token_ids else {}
        if req.kind == "chat":
            body: dict[str, Any] = {}
            if req.parses_tools:
                message = choice.message or {}
                body = {k: v for k, v in message.items() if k not in ("role", "content")}
                body |= {"content": content} if content else {}
                if body.get("tool_calls"):
                    body["tool_calls"] = [{"index": i, **c} for i, c in enumerate(body["tool_calls"])]
            return self._chunk([{"index": choice.index, "delta": body, "logprobs": None,
                                 "finish_reason": choice.finish_reason, **ext, **_rejected(choice)}])
        return self._chunk([{"index": choice.index, "text": "", "logprobs": None,
                             "finish_reason": choice.finish_reason, **ext}])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
        return self._chunk([], usage=usage(prompt_tokens, completion_tokens, cached_tokens))
