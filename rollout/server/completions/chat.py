"""ChatFormat: OpenAI chat messages to token ids through the tokenizer's own chat template, and sampled token ids back
to an assistant message through its own `parse_response`.

- `render(messages, tools)`: messages as OpenAI sends them (content parts, tool calls whose `arguments` is a JSON
  string, the `developer` role) are put in the shape chat templates read (text content, `arguments` as an object,
  `developer` as `system`, a tool message's `name` from the call it answers), then rendered with the generation
  prompt.
- `end_of_turn`: the token that closes an assistant turn in this template (`<|im_end|>`, `<|eot_id|>`, ...), found
  by rendering a one-turn chat: chat requests stop on it as well as on the model's EOS.
- `message(ids, prompt, tools, cut)`: the assistant message of a completion. With tools, `tokenizer.parse_response`
  (its `response_template`) splits content and tool calls; a completion the parser rejects, or whose calls are not
  `{"name": <string>, "arguments": <object or string>}` (valid JSON of another shape), is content with its markup
  kept as the model wrote it (special tokens included, the closing end of turn left out) and a `tool_call_error`
  saying why: a call the server returns can always be sent back, and a harness can see that the model tried one.
  A turn `max_tokens` cut inside a call keeps the calls it completed before it (the unfinished rest is left out).
- `ContentStream`: the content of a turn with tools while it streams, read by the tokenizer's own streaming parser
  (`get_response_parser`): text streams as it comes and stops where a call begins.
- `continuation(...)`: the next prompt of an episode built from the tokens the model actually sampled, plus the
  rendering of the messages that came after them (see docs/serve.md, "Episodes"): no re-tokenized history.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from typing import Any

from ..rollouts.choices import IncrementalText
from ..transport.errors import bad_request

LOG = logging.getLogger("rollout")


class ChatFormat:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.atomic_ids = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})  # always tokenized alone
        self.end_of_turn = self._end_of_turn()

    @property
    def can_render(self) -> bool:
        return self.tokenizer is not None and bool(getattr(self.tokenizer, "chat_template", None))

    @property
    def can_parse_tools(self) -> bool:
        return getattr(self.tokenizer, "response_template", None) is not None

    @property
    def call_markup(self) -> tuple[str, str] | None:
        """(open, close) around one tool call whose content is its JSON, as the response template reads calls; None
        when it reads them otherwise (a forced call cannot be constrained to its markup then)."""
        fields = (getattr(self.tokenizer, "response_template", None) or {}).get("fields") or {}
        calls = fields.get("tool_calls") or {}
        if calls.get("content") != "json" or not calls.get("open") or not calls.get("close"):
            return None
        return calls["open"], calls["close"]

    # ------------------------------------------------------------------ messages -> ids
    def render(self, messages: list[dict], tools: list[dict] | None, add_generation_prompt: bool = True,
               **template: Any) -> list[int]:
        """`template`: more keywords for the chat template (continue_final_message, enable_thinking, ...)."""
        if not self.can_render:
            raise bad_request("messages", "this model's tokenizer has no chat template. Fix: send prompt_token_ids, "
                              "or use /v1/completions with a text prompt")
        self._check_reads(template)
        try:
            ids = self.tokenizer.apply_chat_template(normalize(messages), tools=tools or None, tokenize=True,
                                                     add_generation_prompt=add_generation_prompt, return_dict=False,
                                                     **template)
        except Exception as error:  # a template's own raise_exception, a missing field, ...
            raise bad_request("messages", f"the chat template could not render these messages: "
                              f"{type(error).__name__}: {error}") from None
        return list(ids)

    def _check_reads(self, template: dict[str, Any]) -> None:
        """A template keyword the chat template never reads would change nothing: refused by name."""
        source = str(self.tokenizer.chat_template)
        for name in template:
            if name != "continue_final_message" and name not in source:
                field = name if name == "reasoning_effort" else f"chat_template_kwargs.{name}"
                raise bad_request(field, f"{field} means nothing for this model: its chat template never reads "
                                  f"`{name}`. Fix: leave it out")

    def _end_of_turn(self) -> tuple[int, ...]:
        """The last added token the template writes after an assistant message's content (its end of turn)."""
        if not self.can_render:
            return ()
        try:
            user = [{"role": "user", "content": "hi"}]
            head = self.render(user, None)
            both = self.render(user + [{"role": "assistant", "content": "ok"}], None, add_generation_prompt=False)
        except Exception as error:  # a template that cannot render a one-turn chat: no end of turn to stop on
            LOG.warning("the chat template could not render a one-turn chat (%s: %s): chat requests stop on the "
                        "model's EOS only", type(error).__name__, error)
            return ()
        if both[: len(head)] != head:
            return ()
        closing = [t for t in both[len(head):] if t in self.atomic_ids]
        return (closing[-1],) if closing else ()

    # ------------------------------------------------------------------ ids -> message
    def message(self, ids: list[int], text: str, prompt: list[int],
                tools: list[dict] | None, cut: bool = False) -> tuple[dict, str | None]:
        """(the assistant message of a completion, why its tool call was rejected or None). `text`: its decoded
        text, stop strings already cut. `cut`: max_tokens (or the context) ended the turn: a call it cut mid-way
        is left out, and the calls it completed before are kept."""
        if not tools:
            return {"role": "assistant", "content": text}, None
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if ids and ids[-1] == eos and eos not in self.end_of_turn:  # a turn the model's EOS ended: the response
            ids = ids[:-1]  # template reads up to its own end of turn, and would keep the EOS as content
        try:
            parsed = self.tokenizer.parse_response(ids, prefix=prompt, tools=tools)
        except ValueError as error:  # the model's call did not parse: its markup stays visible
            complete = self._complete_calls(ids, prompt, tools) if cut else None
            if complete is not None:
                return complete, None
            return self._raw(ids), f"the tool call did not parse: {str(error).splitlines()[0]}"
        calls = parsed.get("tool_calls") if isinstance(parsed, dict) else None
        if not calls:
            return {"role": "assistant", "content": text}, None
        if not all(map(_is_call, calls)):
            return self._raw(ids), "the tool call is not {\"name\": <string>, \"arguments\": <object or string>}"
        message = {k: v for k, v in parsed.items() if k not in ("role", "tool_calls")}
        message.setdefault("content", None)
        return {"role": "assistant", **message, "tool_calls": [openai_call(c) for c in calls]}, None

    def _complete_calls(self, ids: list[int], prompt: list[int], tools: list[dict]) -> dict | None:
        """A turn cut inside a call: the message of its tokens up to the end of its last complete call (the call
        markup's close, as the model wrote it), when that has calls; None otherwise."""
        markup = self.call_markup
        close = list(self.tokenizer(markup[1], add_special_tokens=False)["input_ids"]) if markup else []
        end = next((i + len(close) for i in range(len(ids) - len(close), -1, -1)
                    if close and ids[i: i + len(close)] == close), None)
        if end is None:
            return None
        try:
            parsed = self.tokenizer.parse_response(ids[:end], prefix=prompt, tools=tools)
        except ValueError:
            return None
        calls = parsed.get("tool_calls") if isinstance(parsed, dict) else None
        if not calls or not all(map(_is_call, calls)):
            return None
        message = {k: v for k, v in parsed.items() if k not in ("role", "tool_calls")}
        message.setdefault("content", None)
        return {"role": "assistant", **message, "tool_calls": [openai_call(c) for c in calls]}

    def _raw(self, ids: list[int]) -> dict:
        """The turn as written, markup and all, without the token that closed it."""
        end = set(self.end_of_turn) | {getattr(self.tokenizer, "eos_token_id", None)}
        kept = ids[:-1] if ids and ids[-1] in end else ids
        return {"role": "assistant", "content": self.tokenizer.decode(kept, skip_special_tokens=False)}

    # ------------------------------------------------------------------ episodes
    def continuation(self, before: list[dict], messages: list[dict], tools: list[dict] | None,
                     context: list[int], completion: list[int]) -> list[int] | None:
        """The prompt of a turn whose `messages` continue `before` (the previous call's messages) with the
        assistant message the server returned for `completion`, then new messages: `context` (that call's prompt)
        + `completion` (its sampled ids) + the rendering of the new messages. None when that is not the chat the
        template renders: the completion did not end on an end-of-turn token, or rendering the new messages
        changes the tokens before them (a template that is not prefix-preserving); the caller renders afresh."""
        k = len(before) + 1
        if not completion or completion[-1] not in self.atomic_ids or len(messages) <= k:
            return None
        start = len(self.render(before, tools))
        closed = self.render(messages[:k], tools, add_generation_prompt=False)
        cut = next((i + 1 for i in range(len(closed) - 1, start - 1, -1) if closed[i] == completion[-1]), None)
        if cut is None:
            return None
        after = self.render(messages, tools)
        if after[:cut] != closed[:cut]:
            return None
        return context + completion + after[cut:]


class ContentStream:
    """The content of one streamed turn with tools. The tokenizer's streaming parser (`get_response_parser`) reads
    the turn as it is written (special tokens included); content streams while it is the text the parser puts in the
    `content` region and `StreamedChoice` has cleared (stop strings, half characters), and stops for good where a call
    begins. Whitespace at the end is held back (the parsed content of a turn with a call drops it). A turn whose text
    is not its content from the start (a reasoning region before it) streams nothing until `finish`. Each step costs
    the new text only: the parser and the decode are incremental, and the comparison starts where the sent text ends."""

    def __init__(self, tokenizer: Any, prompt: list[int], tools: list[dict]) -> None:
        self.parser = tokenizer.get_response_parser(prefix=prompt, tools=tools)
        self.decoded = IncrementalText(_Written(tokenizer))
        self.fed, self.content, self.sent, self.calling, self.parted = 0, "", "", False, False

    def advance(self, ids: list[int], text: str) -> str:
        """The content to send now: `ids` the turn's tokens so far, `text` what `StreamedChoice` has cleared."""
        if not self.calling:
            written = self.decoded.update(ids)
            try:
                events = self.parser.feed(written[self.fed:])
            except ValueError:  # a call's region closed unparsable: a call began all the same
                events = [{"type": "region_open", "field": "tool_calls"}]
            self.fed = len(written)
            for event in events:
                self.calling = self.calling or (event["type"] == "region_open" and event["field"] == "tool_calls")
                if not self.calling and event["type"] == "region_chunk" and event["field"] == "content":
                    self.content += event["text"]
        if self.parted:
            return ""
        start = len(self.sent)
        ahead, cleared = self.content[start:], text[start:len(self.content) + 1]
        common = os.path.commonprefix([ahead, cleared])
        if len(common) < min(len(ahead), len(cleared)):  # the texts part ways for good (a region before the content)
            self.calling = self.parted = True
            return ""
        delta = common.rstrip()
        self.sent += delta
        return delta

    def finish(self, content: str | None) -> str:
        """What is left to send of the final message's content (nothing if it does not extend what was sent)."""
        content = content or ""
        return content[len(self.sent):] if content.startswith(self.sent) else ""


class _Written:
    """A turn's text as the model wrote it, special tokens included (what the response parser reads)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)


def normalize(messages: list[dict]) -> list[dict]:
    """OpenAI's message shapes as chat templates read them."""
    names = {}
    out = []
    for i, message in enumerate(messages):
        m = {k: v for k, v in message.items() if v is not None or k == "content"}
        if m["role"] == "developer":
            m["role"] = "system"
        m["content"] = _text(m.get("content"), i)
        if m.get("tool_calls"):
            m["tool_calls"] = [_template_call(c, i) for c in m["tool_calls"]]
            names.update({c.get("id"): c["function"]["name"] for c in m["tool_calls"] if c.get("id")})
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
        out.append(m)
    return out


def same_message(sent: dict, returned: dict) -> bool:
    """Whether a message a client sent back is the assistant message the server returned (content and calls; the
    call ids and other fields aside)."""
    if sent.get("role") != "assistant":
        return False
    a, b = normalize([sent])[0], normalize([returned])[0]
    calls = [[(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []] for m in (a, b)]
    return (a.get("content") or "") == (b.get("content") or "") and calls[0] == calls[1]


def _text(content: Any, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{index}].content", "only text content parts are supported "
                                  "({\"type\": \"text\", \"text\": ...}): this server serves a text model")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"messages[{index}].content", "content must be a string, null or a list of text parts")


def _template_call(call: Any, index: int) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f"messages[{index}].tool_calls", "each tool call must be {\"type\": \"function\", "
                          "\"function\": {\"name\": ..., \"arguments\": ...}}")
    arguments = function.get("arguments")
    if isinstance(arguments, str):  # OpenAI sends a JSON string; templates render an object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as error:  # not JSON: the template renders the string as the client sent it
            LOG.debug("messages[%d]: a tool call's arguments are not JSON (%s): rendered as the string", index, error)
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        out["id"] = call["id"]
    return out


def _is_call(call: Any) -> bool:
    """Whether a parsed call has what OpenAI's shape needs: a function name, and arguments that are an object (or
    absent, or a string as some templates write them)."""
    function = call.get("function", call) if isinstance(call, dict) else None
    return isinstance(function, dict) and isinstance(function.get("name"), str) and \
        isinstance(function.get("arguments", {}), (dict, str))


def openai_call(call: dict) -> dict:
    """A parsed call ({"type": "function", "function": {"name", "arguments": object}}) as OpenAI returns it."""
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": function.get("name"),
                         "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}
