"""What a chat request's output must look like: `response_format`, `tool_choice` and `parallel_tool_calls`, checked
when the body is parsed (`Format.parse`) and turned into a `Structured` (constrained decoding) once the tokenizer's
tool-call markup is known (`Format.structured`).

- `response_format`: {"type": "text"} (no constraint), {"type": "json_object"} (any JSON object), {"type":
  "json_schema", "json_schema": {"name", "schema", "strict"}} (JSON matching the schema; `strict` false lets objects
  carry properties the schema does not list).
- `tool_choice`: "auto" and "none" (no constraint), "required" (one or more calls of the request's tools, in the
  template's markup, each `{"name": <a tool>, "arguments": <matching its parameters>}`) or {"type": "function",
  "function": {"name": ...}} (calls of that tool). `parallel_tool_calls: false`: exactly one call when one is forced;
  at most one with "auto" (the row stops right after the first call's closing markup, a stop id when it is one
  token).
A response format next to tools the model may call ("auto") constrains the turn to either: the calls (in the
template's markup, as a forced call writes them) or the format's JSON, nothing else (openai-agents' `Agent(tools=...,
output_type=...)`). Next to a forced call it is refused by name (the turn must be a call, never the format); so is
one whose template has no JSON tool-call markup (the calls could not be constrained).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...base.errors import InvalidArgument
from ...base.structured import Structured
from ..transport.errors import bad_request

FORMATS = ("text", "json_object", "json_schema")
SCHEMA_FIELDS = {"name", "description", "schema", "strict"}


@dataclass(frozen=True)
class Format:
    """The output constraints of one chat request (see the module docstring)."""

    response_format: dict | None = None  # json_object / json_schema; None: text
    tool_choice: str = "auto"  # "auto", "none", "required" or "function" (then `tool_name`)
    tool_name: str | None = None
    parallel_tool_calls: bool = True

    @property
    def forces_call(self) -> bool:
        return self.tool_choice in ("required", "function")

    @classmethod
    def parse(cls, body: dict, tools: list[dict] | None) -> "Format":
        choice, name = _tool_choice(body.get("tool_choice"), tools)
        parallel = body.get("parallel_tool_calls")
        if parallel is not None and not isinstance(parallel, bool):
            raise bad_request("parallel_tool_calls", f"parallel_tool_calls={parallel!r} is invalid: must be true or "
                              "false")
        response_format = _response_format(body.get("response_format"))
        if response_format is not None and tools and choice in ("required", "function"):
            raise bad_request("response_format", f"response_format with tool_choice={body.get('tool_choice')!r} "
                              "is not supported: the turn must be a call, never the format. Fix: send "
                              "tool_choice=\"auto\" (a call or the format), or leave response_format out")
        return cls(response_format, choice, name, True if parallel is None else parallel)

    def structured(self, tools: list[dict] | None, markup: tuple[str, str] | None) -> Structured | None:
        """The constraint of the request's completion, or None. `markup`: the template's (open, close) of a call."""
        try:
            alternative = _format_structured(self.response_format) if self.response_format is not None else None
            if alternative is not None and not tools:
                return alternative
            if not self.forces_call and alternative is None:
                return None
            if markup is None:
                field, fix = ("response_format", "send tool_choice=\"none\" (the format alone)") \
                    if alternative is not None else ("tool_choice", "send tool_choice=\"auto\"")
                raise bad_request(field, f"{field} with tools needs the template's tool-call markup (the calls are "
                                  "constrained in it): this tokenizer's response_template has no JSON tool_calls "
                                  f"field. Fix: {fix}")
            calls = [_call_schema(i, tool) for i, tool in enumerate(tools or [])
                     if self.tool_name is None or tool["function"]["name"] == self.tool_name]
            schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
            return Structured.tool_calls(schema, markup[0], markup[1], repeats=self.parallel_tool_calls,
                                         field="tools", alternative=alternative)
        except InvalidArgument as error:  # "structured" itself: the grammar library is missing
            field = error.field if error.field != "structured" else \
                "response_format" if self.response_format is not None else "tool_choice"
            raise bad_request(field, f"{field} is invalid: {error.rule}. Fix: {error.fix}.") from None


def _response_format(value: Any) -> dict | None:
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in FORMATS:
        raise bad_request("response_format", f"response_format={value!r} is not supported: its type must be one of "
                          f"{', '.join(FORMATS)}")
    if kind == "text":
        return None
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema"), dict) or set(inner) - SCHEMA_FIELDS:
            raise bad_request("response_format.json_schema", "response_format.json_schema must be {\"name\": ..., "
                              "\"schema\": {...}, \"strict\": true|false}")
        if not isinstance(inner.get("strict", False), (bool, type(None))):
            raise bad_request("response_format.json_schema.strict", "strict must be true or false")
    return value


def _format_structured(value: dict) -> Structured:
    if value["type"] == "json_object":
        return Structured.json_object(field="response_format")
    inner = value["json_schema"]
    return Structured.json_schema(inner["schema"], strict=bool(inner.get("strict")),
                                  field="response_format.json_schema.schema")


def _tool_choice(choice: Any, tools: list[dict] | None) -> tuple[str, str | None]:
    if choice is None or choice in ("auto", "none"):
        return choice or "auto", None
    names = [tool["function"]["name"] for tool in tools or []]
    if choice == "required" or (isinstance(choice, dict) and choice.get("type") == "function"):
        if not names:
            raise bad_request("tool_choice", f"tool_choice={choice!r} forces a tool call, and the request has no "
                              "tools. Fix: send tools, or tool_choice=\"auto\"")
        if choice == "required":
            return "required", None
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        if name not in names:
            raise bad_request("tool_choice", f"tool_choice names the function {name!r}, which is not among the "
                              f"request's tools ({', '.join(names)})")
        return "function", name
    raise bad_request("tool_choice", f"tool_choice={choice!r} is not supported: this server takes \"auto\", \"none\", "
                      "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}")


def _call_schema(index: int, tool: dict) -> dict:
    """The JSON of one call of the tool, as the template writes it: its name, and arguments matching its parameters
    (checked alone first, so an error names the tool). Strict (no properties beyond the schema's), whatever the
    tool's `strict` says: a call a forced row writes always matches its tool."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    Structured.json_schema(parameters, field=f"tools[{index}].function.parameters")
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}
