"""Service: what the server does with one parsed request, apart from HTTP.

    prepared = service.prepare(request)        # prompt ids and SamplingParams, every check done (400s raised here)
    body = await service.complete(request, prepared)          # the chat.completion / text_completion object
    async for event in service.stream(request, prepared):     # the chunks, then "[DONE]"

A request becomes one engine call: its prompts (one for chat; one or more for completions), each with the request's
SamplingParams. Chat prompts are rendered by the tokenizer's chat template; a chat request of an episode whose
messages continue the episode's last call (the same messages, the assistant message the server returned, then new
ones) is prompted with that call's prompt + the tokens the model sampled + the rendering of the new messages, so
its history is never re-tokenized and its prefix is in the engine's prefix cache.

A request that asks for its prompt's logprobs (`echo` with `logprobs`, `prompt_logprobs`) has them scored after its
completion by the rollout side's `score` (prompts.py); with `max_tokens: 0` nothing is generated at all.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import CancelledError
from dataclasses import dataclass
from typing import Any

from ...base.params import SamplingParams
from ..rollouts.backend import Generation
from ..rollouts.choices import Choice, Detokenizer, Diverged, StreamedChoice, choice_of
from ..rollouts.episodes import EpisodeRecorder
from ..transport.errors import ApiError, bad_request, from_value_error
from ..transport.limits import RequestLimits
from .bodies import Chunks, chat_response, completion_response
from .chat import ChatFormat, ContentStream, normalize, same_message
from .prompts import PromptScorer, PromptScores
from .protocol import Request

API_NAMES = {"max_new_tokens": "max_tokens", "prompt": "prompt_token_ids",  # rollout's field -> the request's
             "min_new_tokens": "min_tokens"}


@dataclass(frozen=True)
class Limits:
    """What the rollout side can hold: token ids below `vocab_size`; prompt + completion <= `max_tokens`."""

    vocab_size: int
    max_tokens: int
    stop_ids: tuple[int, ...]  # the model's EOS


@dataclass(frozen=True)
class Prepared:
    prompts: list[list[int]]
    sampling: SamplingParams | None  # None: max_tokens 0, nothing to generate (the prompt is only scored)
    detok: Detokenizer


@dataclass(frozen=True)
class Outcome:
    choices: list[Choice]
    cached_tokens: int  # prompt tokens the prefix cache served
    prompt_scores: list[PromptScores] | None  # per prompt, when the request asked for its prompt's logprobs


class Service:
    def __init__(self, backend: Any, chat: ChatFormat, recorder: EpisodeRecorder, model_name: str,
                 limits: Limits, scorer: PromptScorer | None = None,
                 request_limits: RequestLimits | None = None) -> None:
        self.backend, self.chat, self.recorder = backend, chat, recorder
        self.model_name, self.limits, self.scorer = model_name, limits, scorer
        self.request_limits = request_limits or RequestLimits()
        self.tokenizer = chat.tokenizer

    # ------------------------------------------------------------------ checks
    def prepare(self, request: Request) -> Prepared:
        if request.model is not None and request.model != self.model_name:
            raise ApiError(404, f"The model `{request.model}` does not exist. Fix: use `{self.model_name}` "
                           "(GET /v1/models)", "model", "model_not_found")
        if request.parses_tools and not self.chat.can_parse_tools:
            raise bad_request("tools", "this tokenizer has no response_template, so tool calls cannot be parsed. "
                              "Fix: set one (e.g. trl.chat_template_utils.add_response_schema(tokenizer)) before "
                              "serving, or send tool_choice=\"none\"")
        if request.stop and self.tokenizer is None:
            raise bad_request("stop", "stop strings need a tokenizer. Fix: use stop_token_ids")
        prompts = self._prompts(request)
        for ids in prompts:
            bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
            if bad:
                raise bad_request(self._prompt_field(request), f"token id {bad[0]} is outside the vocabulary "
                                  f"[0, {self.limits.vocab_size})")
        sampling = self._sampling(request, max(len(p) for p in prompts))
        hidden = () if request.skip_special_tokens or request.include_stop or sampling is None \
            else sampling.stop_token_ids
        detok = Detokenizer(self.tokenizer, request.stop, request.tokens_as_ids, request.skip_special_tokens,
                            request.include_stop, request.adjustments.get("min_new_tokens", 0), hidden)
        return Prepared(prompts, sampling, detok)

    def _prompts(self, request: Request) -> list[list[int]]:
        if request.messages is not None:
            if request.template:  # rendered as asked (an episode's continuation assumes the default rendering)
                return [self.chat.render(request.messages, rendered_tools(request), **request.template)]
            return [self._continuation(request) or self.chat.render(request.messages, rendered_tools(request))]
        if any(isinstance(p, str) for p in request.prompts) and self.tokenizer is None:
            raise bad_request("prompt", "text prompts need a tokenizer. Fix: send token ids")
        return [list(self.tokenizer(p, add_special_tokens=False)["input_ids"]) if isinstance(p, str) else p
                for p in request.prompts]

    def _continuation(self, request: Request) -> list[int] | None:
        last = self.recorder.last(request.episode_id) if request.episode_id is not None else None
        messages = request.messages
        tools = rendered_tools(request)
        if last is None or last.tools != tools or len(messages) <= len(last.messages) + 1:
            return None
        k = len(last.messages)
        if normalize(messages[:k]) != normalize(last.messages):
            return None
        for choice in last.choices:
            if choice.message is not None and same_message(messages[k], choice.message):
                return self.chat.continuation(last.messages, messages, tools, last.prompt_ids,
                                              choice.token_ids)
        return None

    def _sampling(self, request: Request, prompt_len: int) -> SamplingParams | None:
        limit = self.limits.max_tokens
        room = limit - prompt_len
        field = self._prompt_field(request)
        if request.max_tokens == 0 and room >= 0:  # only the prompt is scored
            return None
        if room < 1:
            raise bad_request(field, f"This model's maximum context length is {limit} tokens, and the prompt has "
                              f"{prompt_len}: no room for a completion. Fix: shorten the prompt",
                              "context_length_exceeded")
        max_tokens = request.max_tokens if request.max_tokens is not None else room
        if max_tokens > room:
            name = request.max_tokens_param
            raise bad_request(name, f"This model's maximum context length is {limit} tokens. However, you requested "
                              f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} for the "
                              f"completion). Fix: use {name} <= {room}", "context_length_exceeded")
        try:
            structured = request.format.structured(rendered_tools(request), self.chat.call_markup)
            return SamplingParams(n=request.n, temperature=request.temperature, top_k=request.top_k,
                                  top_p=request.top_p, max_new_tokens=max_tokens, seed=request.seed,
                                  stop_token_ids=self._stop_ids(request), top_logprobs=request.top_logprobs,
                                  structured=structured, **request.adjustments)
        except ValueError as error:
            raise from_value_error(error, API_NAMES) from None

    def _stop_ids(self, request: Request) -> tuple[int, ...]:
        ids = [] if request.ignore_eos else list(self.limits.stop_ids)
        if request.kind == "chat" and not request.ignore_eos:
            ids += self.chat.end_of_turn
        ids += request.stop_token_ids or ()
        ids += self._single_call_stop(request)
        for text in request.stop:  # a stop string that is one token also stops the engine at once
            encoded = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(encoded) == 1 and self.tokenizer.decode(encoded) == text:
                ids += encoded
        return tuple(dict.fromkeys(ids))

    def _single_call_stop(self, request: Request) -> list[int]:
        """parallel_tool_calls=false with calls the model may make ("auto"): the call's closing markup stops the row,
        so at most one call is written (a forced call is constrained to one: formats.py)."""
        if request.format.parallel_tool_calls or not request.parses_tools or request.format.forces_call:
            return []
        markup = self.chat.call_markup
        close = self.tokenizer(markup[1], add_special_tokens=False)["input_ids"] if markup else []
        if len(close) != 1:
            raise bad_request("parallel_tool_calls", "parallel_tool_calls=false with tool_choice=\"auto\" stops a "
                              "row at the end of its first call, and this template's call markup is not one token. "
                              "Fix: send tool_choice=\"required\" (constrained to one call), or leave "
                              "parallel_tool_calls out")
        return close

    @staticmethod
    def _prompt_field(request: Request) -> str:
        return request.prompt_param

    # ------------------------------------------------------------------ running
    async def start(self, request: Request, prepared: Prepared) -> Generation | None:
        if prepared.sampling is None:
            return None
        try:
            return await self.backend.start(prepared.prompts, [prepared.sampling] * len(prepared.prompts),
                                            request.stream)
        except ValueError as error:  # the rollout side's own checks (the KV cache's limit, ...)
            raise from_value_error(error, API_NAMES) from None

    async def complete(self, request: Request, prepared: Prepared, generation: Generation | None) -> dict:
        outcome = await self.outcome(request, prepared, generation)
        rid, created = _ids(request)
        build = chat_response if request.kind == "chat" else completion_response
        return build(request, rid, created, self.model_name, outcome.choices, prepared.detok, outcome.cached_tokens,
                     outcome.prompt_scores)

    async def outcome(self, request: Request, prepared: Prepared, generation: Generation | None) -> "Outcome":
        """The request's choices (recorded under its episode), once its generation is over, and its prompt scores."""
        if generation is None:  # max_tokens 0
            choices, cached = self._empty_choices(request, prepared), 0
        else:
            try:
                batch = await _result(generation)
            finally:
                generation.cancel()  # a no-op once it is over; else the client left: stop its work
            choices, cached = self._choices(request, prepared, batch), int(batch.stats.get("reused_tokens", 0))
            self._record(request, choices)
        return Outcome(choices, cached, await self._prompt_scores(request, prepared))

    async def _prompt_scores(self, request: Request, prepared: Prepared) -> list[PromptScores] | None:
        if not request.scores_prompt:
            return None
        if self.scorer is None:
            raise bad_request("prompt_logprobs" if request.prompt_logprobs is not None else "echo",
                              "this server has no scorer for prompt logprobs. Fix: serve a RolloutWorker or "
                              "RolloutFleet (their score(...) computes them)")
        top_k = max(request.top_logprobs if request.echo else 0, request.prompt_logprobs or 0)
        return await self.scorer.score(prepared.prompts, request.temperature, top_k)

    @staticmethod
    def _empty_choices(request: Request, prepared: Prepared) -> list[Choice]:
        """max_tokens 0: each prompt's n choices without a token (finish_reason "length", as OpenAI answers)."""
        return [Choice(i, list(prepared.prompts[i // request.n]), [], [], [], [], "length", "",
                       message={"role": "assistant", "content": ""} if request.kind == "chat" else None)
                for i in range(request.n * len(prepared.prompts))]

    async def stream(self, request: Request, prepared: Prepared, generation: Generation) -> AsyncIterator[dict | str]:
        rid, created = _ids(request)
        chunks = Chunks(request, rid, created, self.model_name, prepared.detok)
        n = request.n
        states = {i: StreamedChoice(i, prepared.detok) for i in range(n * len(prepared.prompts))}
        contents = {i: self.content_stream(request, prepared.prompts[i // n]) for i in states}
        try:
            for i in states:
                chunk = chunks.start(i, prepared.prompts[i // n])
                if chunk is not None:
                    yield chunk
            while (item := await generation.progress.get()) is not None:
                p, s, ids, logprobs, versions, top = item
                delta = states[p * n + s].advance(ids, logprobs, versions, top)
                if delta is not None:
                    yield chunks.delta(p * n + s, _content(delta, contents[p * n + s], states[p * n + s]),
                                       prepared.prompts[p])
            batch = await _result(generation)
            choices = self._choices(request, prepared, batch)
            for c in choices:
                delta = states[c.index].advance(c.token_ids, c.logprobs, c.token_versions, c.top, final=True)
                content = contents[c.index]
                if delta is not None and content is None:
                    yield chunks.delta(c.index, delta, c.prompt_ids)
                elif delta is not None:  # with tools the final message's content ends the stream's content
                    delta.text = ""
                    yield chunks.delta(c.index, delta, c.prompt_ids)
                yield chunks.finish(c, content.finish(c.message["content"]) if content is not None else None)
            if request.include_usage:
                yield chunks.usage(sum(len(p) for p in prepared.prompts), sum(c.sampled for c in choices),
                                   int(batch.stats.get("reused_tokens", 0)))
            self._record(request, choices)
            yield "[DONE]"
        except Diverged as error:
            yield ApiError(500, f"{error}: it restarted on new weights (an in_flight=\"abort\" weight update, or an "
                           "engine restart after an update), and streamed tokens cannot be taken back. Fix: retry the request, or update with "
                           "in_flight=\"recompute\"/\"wait\" while streaming", code="aborted_by_weight_update",
                           type="server_error").body()
        except ApiError as error:
            yield error.body()
        finally:
            generation.cancel()

    def content_stream(self, request: Request, prompt: list[int]) -> ContentStream | None:
        """With tools parsed: what of a streamed turn's text is content (until a call begins)."""
        return ContentStream(self.tokenizer, prompt, request.tools) if request.parses_tools else None

    def _choices(self, request: Request, prepared: Prepared, batch) -> list[Choice]:
        choices = []
        for i, row in enumerate(batch.rows()):
            choice = choice_of(i, row, prepared.detok)
            if request.kind == "chat":
                cut = choice.finish_reason == "length"
                choice.message, choice.tool_call_error = self.chat.message(
                    choice.token_ids, choice.text, choice.prompt_ids, rendered_tools(request), cut)
                if choice.message.get("tool_calls") and not cut:  # a cut turn stays "length", as OpenAI's
                    choice.finish_reason = "tool_calls"
            choices.append(choice)
        return choices

    def _record(self, request: Request, choices: list[Choice]) -> None:
        if request.episode_id is None:
            return
        n = request.n
        for start in range(0, len(choices), n):
            group = choices[start: start + n]
            self.recorder.record(request.episode_id, group[0].prompt_ids, group, request.messages,
                                 rendered_tools(request))


def rendered_tools(request: Request) -> list[dict] | None:
    """The tools the chat template renders and the parser reads: none with tool_choice "none" (the model is not
    told about them, so it does not write calls that would come back as text)."""
    return request.tools if request.parses_tools else None


def _content(delta, content, state: StreamedChoice):
    """A streamed delta whose text is, with tools, the content that may be sent now (text until a call begins)."""
    if content is not None:
        delta.text = content.advance(state.token_ids, state.sent_text)
    return delta


async def _result(generation: Generation):
    try:
        return await generation.result()
    except CancelledError:
        raise ApiError(503, "the request was cancelled (the server is closing)", code="cancelled",
                       type="server_error") from None
    except RuntimeError as error:  # a sample failed past the worker's retries
        raise ApiError(500, f"generation failed: {error}", code="generation_failed", type="server_error") from None


def _ids(request: Request) -> tuple[str, int]:
    prefix = "chatcmpl" if request.kind == "chat" else "cmpl"
    return f"{prefix}-{uuid.uuid4().hex}", int(time.time())
