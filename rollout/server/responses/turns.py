"""Turn: one `POST /v1/responses` request, read as the chat request it runs as.

    turn = turn_of(service, store, body, headers)   # every check done (400s naming the Responses field)

A Responses body is translated into a chat body and checked by the chat path's own parser (completions/protocol.py), so the
sampling fields, limits and refusals are the chat path's; an error names the field as the Responses body spells it
(`max_output_tokens`, `input`, `text.format`, ...). The messages are `instructions` (a system message), the stored
conversation of `previous_response_id` (its instructions left out, as OpenAI does), then `input` (items.py). The
prompt is rendered by the chat template (with `reasoning.effort` as chat's `reasoning_effort`, refused where the
template never reads it), or, when the turn continues a stored response with the same instructions and tools and
asks no effort, built from that response's prompt + the tokens the model sampled + the rendering of the new messages
(ChatFormat.continuation): the history is never re-tokenized, and the engine's prefix cache serves it.

Fields with no meaning on this server are refused by name: built-in tools, `background`, `conversation`, `prompt`
(stored prompt templates), `reasoning.summary`, `max_tool_calls`, `truncation: "auto"`, `include` other than
`message.output_text.logprobs` and `reasoning.encrypted_content`, `stream_options.include_obfuscation: true`.
`reasoning.encrypted_content` (what inspect-ai's `openai/` provider sends with `store: false`) is accepted: reasoning
items carry their text as `reasoning_text` content and no `encrypted_content`, and come back in `input` that way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..completions.chat import normalize
from ..completions.protocol import Request, parse
from ..completions.service import Prepared, Service, rendered_tools
from ..transport.errors import ApiError, bad_request
from .items import chat_tool_choice, chat_tools, messages_of
from .store import ResponseStore, StoredResponse

LOGPROBS = "message.output_text.logprobs"
ENCRYPTED = "reasoning.encrypted_content"  # accepted: reasoning items carry their text instead (items.py)
# the Responses fields, and what this server does with them (anything else: 400 "Unrecognized request argument")
TRANSLATED = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "tools", "tool_choice",
              "parallel_tool_calls", "stream", "stream_options", "include", "top_logprobs", "text", "reasoning",
              "previous_response_id", "store"}
INERT = {"metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier"}
REFUSED = {"background": (False,), "conversation": (), "prompt": (), "max_tool_calls": (), "truncation": ("disabled",),
           "context_management": ()}  # accepted only at these values (or null)
# the chat path's extensions, taken as they are
EXTENSIONS = {"seed", "top_k", "stop", "stop_token_ids", "ignore_eos", "return_token_ids", "return_tokens_as_token_ids",
              "episode_id", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
              "logit_bias"}
NAMES = {"messages": "input", "prompt_token_ids": "input", "max_completion_tokens": "max_output_tokens",
         "response_format": "text.format", "reasoning_effort": "reasoning.effort", "logprobs": "include"}


@dataclass(frozen=True)
class Turn:
    request: Request  # the chat request it runs as (prompt ids in, one choice)
    prepared: Prepared
    body: dict  # as given
    messages: list[dict]  # rendered: instructions, history, input
    history: list[dict]  # without instructions

    @property
    def logprobs(self) -> bool:
        """Logprobs asked for (`include` or `top_logprobs`)."""
        return self.request.logprobs

    @property
    def store(self) -> bool:
        return self.body.get("store") is not False

    def stored(self, body: dict, message: dict, completion_ids: list[int]) -> StoredResponse:
        return StoredResponse(body, self.messages, self.history + [message], rendered_tools(self.request),
                              self.prepared.prompts[0], completion_ids)


def turn_of(service: Service, store: ResponseStore, body: Any, headers: dict[str, str]) -> Turn:
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object")
    unknown = sorted(set(body) - TRANSLATED - INERT - set(REFUSED) - EXTENSIONS)
    if unknown:
        raise bad_request(unknown[0], f"Unrecognized request argument supplied: {unknown[0]}")
    _refuse(body)
    previous = _previous(store, body.get("previous_response_id"))
    if "input" not in body:
        raise bad_request("input", "input is required: a string or a list of input items")
    history = (previous.history if previous else []) + messages_of(body["input"])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions", "instructions must be a string")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history
    try:
        request = parse("chat", {"model": service.model_name} | _chat_body(body, messages), headers,
                        service.request_limits)
        prompt = _prompt(service, request, previous)
        request = dataclasses.replace(request, messages=None, prompts=[prompt])
        prepared = service.prepare(request)
    except ApiError as error:
        raise renamed(error) from None
    return Turn(request, prepared, body, messages, history)


def _refuse(body: dict) -> None:
    for name, allowed in REFUSED.items():
        if body.get(name) is not None and body[name] not in allowed:
            raise bad_request(name, f"{name}={body[name]!r} is not supported by this server (it has no meaning "
                              f"here). Fix: leave it out")
    include = body.get("include") or []
    if not isinstance(include, list) or any(i not in (LOGPROBS, ENCRYPTED) for i in include):
        raise bad_request("include", f"include={include!r} is not supported: this server can include only "
                          f"{LOGPROBS!r} and {ENCRYPTED!r} (it runs no built-in tools; its reasoning items carry "
                          "their text, never encrypted)")
    _refuse_options(body)


def _refuse_options(body: dict) -> None:
    """The parts of `reasoning`, `text` and `stream_options` that have no meaning here."""
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise bad_request("reasoning", "reasoning must be {\"effort\": ...}")
    for name in ("summary", "generate_summary"):
        if reasoning.get(name) is not None:
            raise bad_request(f"reasoning.{name}", "reasoning summaries are not supported: nothing here writes "
                              "them. Fix: leave it out")
    text = body.get("text") or {}
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise bad_request("text", "text must be {\"format\": {...}}")
    if text.get("verbosity") is not None:
        raise bad_request("text.verbosity", "verbosity is not supported: nothing here steers how long the model "
                          "writes. Fix: leave it out (max_output_tokens bounds the length)")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_obfuscation"} or options.get("include_obfuscation"):
        raise bad_request("stream_options", "stream_options takes only include_obfuscation: false (this server "
                          "does not pad its events)")


def _previous(store: ResponseStore, response_id: Any) -> StoredResponse | None:
    if response_id is None:
        return None
    stored = store.get(response_id) if isinstance(response_id, str) else None
    if stored is None:
        raise ApiError(400, f"Previous response with id {response_id!r} not found: this server keeps the newest "
                       f"{store.capacity} responses created with store=true, in memory. Fix: send the whole "
                       "conversation as input instead", "previous_response_id", "previous_response_not_found")
    return stored


def _chat_body(body: dict, messages: list[dict]) -> dict:
    """The chat request the Responses body means (checked by the chat path's parser)."""
    chat = {k: body[k] for k in EXTENSIONS | {"model", "temperature", "top_p", "stream", "parallel_tool_calls"}
            if body.get(k) is not None}
    chat["messages"] = messages
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    tools, choice = chat_tools(body.get("tools")), chat_tool_choice(body.get("tool_choice"))
    chat |= {"tools": tools} if tools else {}
    chat |= {"tool_choice": choice} if choice is not None else {}
    top = body.get("top_logprobs")
    if LOGPROBS in (body.get("include") or []) or top:
        chat |= {"logprobs": True} | ({"top_logprobs": top} if top is not None else {})
    text_format = (body.get("text") or {}).get("format")
    if text_format is not None and text_format != {"type": "text"}:
        chat["response_format"] = _response_format(text_format)
    effort = (body.get("reasoning") or {}).get("effort")
    if effort is not None:
        chat["reasoning_effort"] = effort
    return chat


def _response_format(text_format: Any) -> Any:
    """Responses' `text.format` as chat's `response_format` (the json_schema fields are nested there)."""
    if isinstance(text_format, dict) and text_format.get("type") == "json_schema":
        inner = {k: v for k, v in text_format.items() if k != "type"}
        return {"type": "json_schema", "json_schema": inner}
    return text_format


def _prompt(service: Service, request: Request, previous: StoredResponse | None) -> list[int]:
    tools, messages = rendered_tools(request), request.messages
    if request.template:  # reasoning.effort: rendered afresh with it, refused by name where the template never reads it
        return service.chat.render(messages, tools, **request.template)
    k = len(previous.messages) + 1 if previous else 0
    if previous and previous.tools == tools and len(messages) > k and \
            normalize(messages[:k]) == normalize(previous.messages + previous.history[-1:]):
        ids = service.chat.continuation(previous.messages, messages, tools, previous.prompt_ids,
                                        previous.completion_ids)
        if ids is not None:
            return ids
    return service.chat.render(messages, tools)


def renamed(error: ApiError) -> ApiError:
    """An error of the chat request, naming the field as the Responses body spells it."""
    param = error.param or ""
    for chat, name in NAMES.items():
        if param == chat or param.startswith((chat + ".", chat + "[")):
            error.message = error.message.replace(chat, name)
            error.param = name + param[len(chat):]
            break
    return error
