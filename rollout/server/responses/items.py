"""The Responses API's items and tools in the chat shapes the rest of the server speaks, and back.

- `messages_of(input)`: `input` (a string: one user message; or a list of items) as chat messages. Items: messages
  (`role` user / system / developer / assistant, `content` a string or `input_text` / `output_text` parts),
  `function_call` (joined to the assistant message before it, as the calls of one turn), `function_call_output` (a
  `tool` message answering its `call_id`) and `reasoning` (its `reasoning_text` as the `reasoning_content` of the
  assistant message that follows, as reasoning templates render it). Any other item is a 400 naming it.
- `chat_tools(tools)`: function tools (`{"type": "function", "name", "parameters", "description"?, "strict"?}`) as
  chat tools; a built-in tool (web_search, file_search, ...) is a 400 naming it: nothing here runs one.
- `chat_tool_choice(choice)`: "auto" / "none" / "required" / `{"type": "function", "name"}` in the chat shape.
- `output_items(message, ...)`: an assistant message as output items: a `reasoning` item (when the template's parser
  read one), a `message` with one `output_text` (when the turn has text, or has nothing else) and a `function_call`
  per call, in that order.
"""

from __future__ import annotations

import uuid
from typing import Any

from ..transport.errors import bad_request

ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
TOOL_CHOICES = ("auto", "none", "required")


def messages_of(given: Any) -> list[dict]:
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise bad_request("input", "input must be a string or a non-empty list of input items")
    messages: list[dict] = []
    for i, item in enumerate(given):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}]", "each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            _add_message(messages, _message(item, i))
        elif kind == "reasoning":
            messages.append({"role": "assistant", "content": None, "reasoning_content": _reasoning(item, i)})
        elif kind == "function_call":
            _add_call(messages, item, i)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise bad_request(f"input[{i}].type", f"input item type {kind!r} is not supported: this server takes "
                              "message, reasoning, function_call and function_call_output items (a text model, "
                              "function tools)")
    return messages


def _message(item: dict, i: int) -> dict:
    role = item.get("role")
    if role not in ROLES:
        raise bad_request(f"input[{i}].role", f"role={role!r} is invalid: must be one of {', '.join(ROLES)}")
    return {"role": role, "content": _text(item.get("content"), f"input[{i}].content")}


def _add_message(messages: list[dict], message: dict) -> None:
    """An assistant message after a reasoning item is that turn's text."""
    last = messages[-1] if messages else {}
    if message["role"] == "assistant" and "reasoning_content" in last and last["content"] is None \
            and not last.get("tool_calls"):
        last["content"] = message["content"]
    else:
        messages.append(message)


def _reasoning(item: dict, i: int) -> str:
    if item.get("encrypted_content") is not None:
        raise bad_request(f"input[{i}].encrypted_content", "encrypted reasoning is not supported: this server writes "
                          "none and cannot read another's. Fix: leave it out")
    parts = item.get("content") or []
    if not isinstance(parts, list) or not all(isinstance(p, dict) and p.get("type") == "reasoning_text" and
                                              isinstance(p.get("text"), str) for p in parts):
        raise bad_request(f"input[{i}].content", "a reasoning item's content must be reasoning_text parts")
    return "".join(p["text"] for p in parts)


def _add_call(messages: list[dict], item: dict, i: int) -> None:
    """A function_call joins the assistant message it follows (one turn's text and calls), else starts one."""
    arguments = item.get("arguments")
    if not isinstance(arguments, str):
        raise bad_request(f"input[{i}].arguments", "arguments must be a JSON string")
    call = {"id": _string(item, "call_id", i), "type": "function",
            "function": {"name": _string(item, "name", i), "arguments": arguments}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1].setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _string(item: dict, name: str, i: int) -> str:
    value = item.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"input[{i}].{name}", f"{name} must be a non-empty string")
    return value


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}[{j}]", f"content part {kind!r} is not supported: only input_text and "
                                  "output_text parts (this server serves a text model)")
        return "".join(part["text"] for part in content)
    raise bad_request(where, f"{where} must be a string or a list of input_text parts")


def chat_tools(tools: Any) -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise bad_request("tools", "tools must be a list of {\"type\": \"function\", \"name\": ..., \"parameters\": "
                          "{...}} objects")
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}].type", f"tool type {kind!r} is not supported: nothing here runs built-in "
                              "tools. Fix: send function tools ({\"type\": \"function\", \"name\": ..., "
                              "\"parameters\": {...}}) and run them in the client")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name", "a function tool needs a name")
        # `strict` is not the template's to render; arguments are constrained only when a call is forced (completions/formats.py)
        function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out or None


def chat_tool_choice(choice: Any) -> Any:
    if choice is None or choice in TOOL_CHOICES:
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request("tool_choice", f"tool_choice={choice!r} is not supported: this server takes \"auto\", "
                      "\"none\", \"required\" or {\"type\": \"function\", \"name\": ...} (function tools only)")


def responses_tools(tools: list[dict] | None) -> list[dict]:
    """The function tools a response echoes (as given, with OpenAI's defaults)."""
    return [{"type": "function", "description": None, "parameters": None, "strict": None} | tool
            for tool in tools or []]


def output_items(message: dict, logprobs: list[dict] | None, status: str, message_id: str,
                 message_first: bool = False) -> list[dict]:
    """`message` (the chat path's assistant message) as output items. `logprobs`: the output_text's entries (asked
    for, and the turn is text only) or None. `message_first`: the message item before a reasoning item (its text
    streamed before the reasoning was known)."""
    calls = message.get("tool_calls") or []
    text = [message_item(message_id, message.get("content") or "", logprobs, status)] \
        if message.get("content") or not calls else []
    reasoning = [{"type": "reasoning", "id": new_id("rs"), "summary": [], "status": status,
                  "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]}] \
        if isinstance(message.get("reasoning_content"), str) else []
    return (text + reasoning if message_first else reasoning + text) + [call_item(call, status) for call in calls]


def message_item(item_id: str, text: str | None, logprobs: list[dict] | None, status: str) -> dict:
    content = [] if text is None else [text_part(text, logprobs)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def text_part(text: str, logprobs: list[dict] | None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def call_item(call: dict, status: str) -> dict:
    function = call["function"]
    return {"type": "function_call", "id": "fc_" + call["id"].removeprefix("call_"), "call_id": call["id"],
            "name": function["name"], "arguments": function["arguments"], "status": status}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"

