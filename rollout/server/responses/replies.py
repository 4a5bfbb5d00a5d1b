"""The answer to a `POST /v1/responses` turn: the `response` object, or its server-sent events.

    body = await complete(service, store, turn, generation)        # the response object (stored unless store=false)
    async for event in events(service, store, turn, generation):   # "event: <type>\\ndata: {...}\\n\\n" strings

The turn runs as one chat choice (completions/service.py: the same engine call, stop strings, tool parsing and episode recording
as Chat Completions); its assistant message becomes output items (items.py). Status is "completed", or "incomplete"
with `incomplete_details.reason: "max_output_tokens"` when the token budget (or the context) cut it. `usage` counts
every token sampled. Extensions, unless `return_token_ids: false`: `prompt_token_ids`, `token_ids`, `token_versions`,
`policy_version`, and with logprobs asked `token_logprobs` (one float per token id: the engine's exact log p under
log_softmax(logits / T), a call's markup included); `tool_call_error` when the parser rejected the call the model
wrote (its markup is then the message's text).

Streaming sends OpenAI's events, each with a `sequence_number`: `response.created`, `response.in_progress`; the
message item's `output_item.added` and `content_part.added` when its first text comes, `output_text.delta` as text
comes (with tools, until a call begins: completions.chat.ContentStream), then `output_text.done`, `content_part.done`,
`output_item.done`; per call `output_item.added`, `function_call_arguments.delta` (the whole arguments: they are
parsed once the call is closed) and `.done`, `output_item.done`; last `response.completed` (or `response.incomplete`)
with the whole response.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ..completions.bodies import chat_logprobs
from ..completions.service import Service
from ..rollouts.choices import Choice, Diverged, StreamedChoice
from ..transport.errors import ApiError
from .items import message_item, new_id, output_items, responses_tools, text_part
from .store import ResponseStore
from .turns import Turn


async def complete(service: Service, store: ResponseStore, turn: Turn, generation) -> dict:
    outcome = await service.outcome(turn.request, turn.prepared, generation)
    choice = outcome.choices[0]
    body = response_body(turn, new_id("resp"), int(time.time()), choice, outcome.cached_tokens,
                         _output(turn, choice, new_id("msg")))
    _keep(store, turn, body, choice)
    return body


def _output(turn: Turn, choice: Choice, message_id: str, text: str | None = None,
            opened: bool = False) -> list[dict]:
    """The output items; `text`: the message's text as it streamed (None: the parsed message's content); `opened`:
    the message item was streamed first."""
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    message = dict(choice.message) | ({"content": text} if text is not None else {})
    return output_items(message, _text_logprobs(turn, choice), status, message_id, opened)


def _text_logprobs(turn: Turn, choice: Choice) -> list[dict] | None:
    """The output_text's logprobs: the turn's tokens when they are all its text (not a call's or reasoning's)."""
    message = choice.message
    if not turn.logprobs or message.get("tool_calls") or message.get("reasoning_content") or choice.tool_call_error:
        return None
    return chat_logprobs(choice.token_ids, choice.logprobs, turn.prepared.detok, choice.top)["content"]


def response_body(turn: Turn, rid: str, created: int, choice: Choice | None, cached_tokens: int,
                  output: list[dict]) -> dict:
    """The response object (`choice` None: still in progress, nothing sampled yet)."""
    req, given = turn.request, turn.body
    status = "in_progress" if choice is None else \
        "incomplete" if choice.finish_reason == "length" else "completed"
    body: dict[str, Any] = {
        "id": rid, "object": "response", "created_at": created, "model": req.model, "status": status,
        "output": output, "error": None, "background": False,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": given.get("instructions"), "tools": responses_tools(given.get("tools")),
        "tool_choice": given.get("tool_choice", "auto"), "parallel_tool_calls": given.get("parallel_tool_calls", True),
        "temperature": req.temperature, "top_p": req.top_p, "max_output_tokens": given.get("max_output_tokens"),
        "top_logprobs": given.get("top_logprobs"), "previous_response_id": given.get("previous_response_id"),
        "store": turn.store, "metadata": given.get("metadata") or {}, "truncation": "disabled",
        "text": given.get("text") or {"format": {"type": "text"}}, "reasoning": given.get("reasoning"),
        "usage": None if choice is None else _usage(len(turn.prepared.prompts[0]), choice.sampled, cached_tokens)}
    if choice is not None and req.return_token_ids:
        body |= {"prompt_token_ids": turn.prepared.prompts[0], "token_ids": choice.token_ids,
                 "token_versions": choice.token_versions, "policy_version": choice.policy_version}
        body |= {"token_logprobs": choice.logprobs} if turn.logprobs else {}
    if choice is not None and choice.tool_call_error:
        body["tool_call_error"] = choice.tool_call_error
    return body


def stored(store: ResponseStore, response_id: str, delete: bool) -> dict:
    """GET /v1/responses/{id}: the stored response; DELETE: forget it (OpenAI's deletion object)."""
    kept = store.get(response_id)
    if kept is None or (delete and not store.delete(response_id)):
        raise ApiError(404, f"No response with id {response_id!r} is stored here (this server keeps the newest "
                       f"{store.capacity} responses created with store=true, in memory)", "response_id", "not_found")
    return {"id": response_id, "object": "response", "deleted": True} if delete else kept.body


def _usage(input_tokens: int, output_tokens: int, cached_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": input_tokens + output_tokens}


def _keep(store: ResponseStore, turn: Turn, body: dict, choice: Choice) -> None:
    if turn.store:
        store.put(body["id"], turn.stored(body, choice.message, choice.token_ids))


class _Events:
    """Server-sent events, numbered in order."""

    def __init__(self) -> None:
        self.number = 0

    def __call__(self, kind: str, **fields) -> str:
        event = {"type": kind, "sequence_number": self.number, **fields}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n"


async def events(service: Service, store: ResponseStore, turn: Turn, generation) -> AsyncIterator[str]:
    event, rid, created = _Events(), new_id("resp"), int(time.time())
    skeleton = response_body(turn, rid, created, None, 0, [])
    yield event("response.created", response=skeleton)
    yield event("response.in_progress", response=skeleton)
    text = _StreamedText(turn, service, new_id("msg"), event)
    try:
        while (item := await generation.progress.get()) is not None:
            for out in text.advance(*item[2:]):
                yield out
        outcome = await service.outcome(turn.request, turn.prepared, generation)
        choice = outcome.choices[0]
        for out in text.finish(choice):
            yield out
        output = _output(turn, choice, text.item_id, text.sent + text.rest, text.opened)
        for index, item in enumerate(output):
            for out in _item_events(event, index, item, text.opened):
                yield out
        body = response_body(turn, rid, created, choice, outcome.cached_tokens, output)
        _keep(store, turn, body, choice)
        yield event(f"response.{body['status'] if body['status'] == 'incomplete' else 'completed'}", response=body)
    except Diverged as error:
        yield _error(event, ApiError(500, f"{error}: a weight update with in_flight=\"abort\" restarted it on new "
                                     "weights, and streamed text cannot be taken back. Fix: retry the request",
                                     code="aborted_by_weight_update", type="server_error"))
    except ApiError as error:
        yield _error(event, error)
    finally:
        generation.cancel()


class _StreamedText:
    """The message item's text while the turn streams: opened at its first text, deltas as text comes."""

    def __init__(self, turn: Turn, service: Service, item_id: str, event: _Events) -> None:
        self.turn, self.item_id, self.event = turn, item_id, event
        self.state = StreamedChoice(0, turn.prepared.detok)
        self.content = service.content_stream(turn.request, turn.prepared.prompts[0])
        self.opened, self.sent, self.rest = False, "", ""
        self.pending: list[dict] = []  # logprob entries of tokens whose text has not been sent

    def advance(self, ids: list[int], logprobs: list[float], versions: list[int], top, final: bool = False) -> list:
        delta = self.state.advance(ids, logprobs, versions, top, final)
        if delta is None:
            return []
        if self.content is None:
            text = delta.text
            if self.turn.logprobs:  # a token's entry goes with the first text after it (a text-only turn)
                self.pending += chat_logprobs(delta.token_ids, delta.logprobs, self.turn.prepared.detok,
                                              delta.top)["content"]
        else:
            text = self.content.advance(self.state.token_ids, self.state.sent_text)
        if not text and not (final and self.pending):
            return []
        out = [] if self.opened else self._open()
        entries, self.pending = self.pending, []
        self.sent += text
        return out + [self.event("response.output_text.delta", item_id=self.item_id, output_index=0,
                                 content_index=0, delta=text, logprobs=entries)]

    def finish(self, choice: Choice) -> list:
        """The last of the text: the rest of the row (no tools) or of the parsed message's content (tools)."""
        if self.content is None:
            return self.advance(choice.token_ids, choice.logprobs, choice.token_versions, choice.top, final=True)
        self.state.advance(choice.token_ids, choice.logprobs, choice.token_versions, choice.top, final=True)
        rest = self.content.finish(choice.message.get("content"))
        if not rest or not self.opened:
            self.rest = rest  # sent whole by the item's events, or nothing to send
            return []
        self.sent += rest
        return [self.event("response.output_text.delta", item_id=self.item_id, output_index=0, content_index=0,
                           delta=rest, logprobs=[])]

    def _open(self) -> list:
        self.opened = True
        return [self.event("response.output_item.added", output_index=0,
                           item=message_item(self.item_id, None, None, "in_progress")),
                self.event("response.content_part.added", item_id=self.item_id, output_index=0, content_index=0,
                           part=text_part("", None))]


def _item_events(event: _Events, index: int, item: dict, opened: bool) -> list[str]:
    """The events that finish an output item (and, unless its text already streamed, start it)."""
    out = []
    if item["type"] == "message":
        part = item["content"][0]
        if not opened:
            out += [event("response.output_item.added", output_index=index,
                          item=message_item(item["id"], None, None, "in_progress")),
                    event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                          part=text_part("", None))]
            if part["text"]:
                out.append(event("response.output_text.delta", item_id=item["id"], output_index=index,
                                 content_index=0, delta=part["text"], logprobs=part["logprobs"]))
        out += [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=part["text"], logprobs=part["logprobs"]),
                event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                      part=part)]
    elif item["type"] == "reasoning":
        out.append(event("response.output_item.added", output_index=index, item=dict(item, status="in_progress")))
    else:
        started = dict(item, arguments="", status="in_progress")
        out += [event("response.output_item.added", output_index=index, item=started),
                event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                      delta=item["arguments"]),
                event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                      name=item["name"], arguments=item["arguments"])]
    return out + [event("response.output_item.done", output_index=index, item=item)]


def _error(event: _Events, error: ApiError) -> str:
    """An error event: OpenAI's fields, and the error object (the openai client raises it as an APIError)."""
    body = error.body()["error"]
    return event("error", code=body["code"], message=body["message"], param=body["param"], error=body)
