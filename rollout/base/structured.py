"""Structured: what a constrained row's completion must be (`SamplingParams(structured=...)`), a small frozen value.

- `Structured.json_object()`: any JSON object (OpenAI's `response_format={"type": "json_object"}`);
- `Structured.json_schema(schema, strict=True)`: a JSON value matching the schema (a dict or its JSON text);
  `strict=False` lets objects carry properties the schema does not list (xgrammar's non-strict mode);
- `Structured.regex(pattern)`: text matching the regular expression;
- `Structured.tool_calls(call_schema, open, close, repeats, alternative=None)`: tool calls in a chat template's
  markup, each `open + JSON matching call_schema + close`; one call, or (repeats) one or more (what the server's
  `tool_choice` "required" or a named function builds); with `alternative` (a json_object or json_schema value),
  either those calls or that JSON (what the server builds for tools next to a `response_format`: the agent's pattern
  of tools plus a structured final answer).
JSON is written as `json.dumps` and chat templates' `tojson` write it (`", "` and `": "` between items, no other
whitespace): the style tool calls are rendered in, so what models saw; a model allowed any whitespace may write
nothing else until its budget runs out.

Checked at construction: the value's shape, then its grammar is built (xgrammar, tokenizer-free; an optional
dependency, `pip install 'rollout[structured]'`), so a bad schema or pattern raises `InvalidArgument` here, before
anything is submitted. The grammar of each distinct value is built once and cached (`grammar_of`); the engine compiles
it against a tokenizer once per distinct value too (engine/grammar.py). The value itself holds only text, so it
pickles (fleet actors) and hashes (the caches' key).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from typing import Any

from .errors import invalid, preview

KINDS = ("json_object", "json_schema", "regex", "tool_calls")
INSTALL = "pip install 'rollout[structured]' (xgrammar), or drop `structured`"
# a bounded JSON string's character as xgrammar 0.2.9 writes it, and as this module narrows it (EBNF)
BOUNDED_CHARACTER = r'([^\"\\\r\n])'
PLAIN_CHARACTER = r'([^\"\\\x00-\x1f\uD800-\uDFFF])'
SEPARATORS = (", ", ": ")  # what a constrained row writes between items and after keys (json.dumps's, tojson's)


@dataclass(frozen=True)
class Structured:
    """See the module docstring. `spec`: the canonical JSON text of the schema (json_schema, tool_calls' call
    schema), or the pattern (regex); `field`: the name errors about it carry (the server sets its own)."""

    kind: str
    spec: str = ""
    strict: bool = True
    open: str = ""
    close: str = ""
    repeats: bool = False
    field: str = "structured"
    alternative: "Structured | None" = None  # tool_calls: the JSON the row may write instead of the calls

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise invalid(f"{self.field}.kind", self.kind, f"must be one of {KINDS}",
                          "build it with Structured.json_object(), .json_schema(schema), .regex(pattern) or "
                          ".tool_calls(...)")
        if not isinstance(self.spec, str) or (self.kind in ("regex", "json_schema", "tool_calls") and not self.spec):
            raise invalid(self.field, preview(self.spec), "needs a schema or a pattern",
                          "pass the JSON schema (a dict) or the regular expression")
        if self.kind == "tool_calls" and not (isinstance(self.open, str) and self.open and isinstance(self.close, str)
                                              and self.close):
            raise invalid(f"{self.field}.open", self.open, "tool calls need the markup that opens and closes one",
                          "pass the template's markup, e.g. open='<tool_call>', close='</tool_call>'")
        if self.alternative is not None and (self.kind != "tool_calls" or not isinstance(self.alternative, Structured)
                                             or self.alternative.kind not in ("json_object", "json_schema")):
            raise invalid(f"{self.field}.alternative", preview(self.alternative), "only tool calls take an "
                          "alternative, and it must be a json_object or json_schema value",
                          "pass alternative=Structured.json_schema(schema) (or .json_object()) to .tool_calls(...)")
        grammar_of(self)  # the grammar is built (and cached) now: a bad schema fails here

    @classmethod
    def json_object(cls, field: str = "structured") -> "Structured":
        return cls("json_object", field=field)

    @classmethod
    def json_schema(cls, schema: Any, strict: bool = True, field: str = "structured") -> "Structured":
        return cls("json_schema", _schema_text(schema, field), strict=bool(strict), field=field)

    @classmethod
    def regex(cls, pattern: str, field: str = "structured") -> "Structured":
        return cls("regex", pattern, field=field)

    @classmethod
    def tool_calls(cls, call_schema: Any, open: str, close: str, repeats: bool = False,
                   field: str = "structured", alternative: "Structured | None" = None) -> "Structured":
        return cls("tool_calls", _schema_text(call_schema, field), open=open, close=close, repeats=repeats,
                   field=field, alternative=alternative)


def xgrammar() -> Any:
    """The xgrammar module, or the InvalidArgument that says how to install it."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise invalid("structured", "xgrammar", "constrained decoding needs the xgrammar package", INSTALL) from None
    return xgr


@functools.lru_cache(maxsize=256)
def grammar_of(structured: Structured) -> Any:
    """The tokenizer-free xgrammar Grammar of a value (built once per distinct value; InvalidArgument if bad)."""
    xgr = xgrammar()
    try:
        if structured.kind == "regex":
            return xgr.Grammar.from_regex(structured.spec)
        body = _plain_bounded_strings(xgr, xgr.Grammar.from_json_schema(
            structured.spec or '{"type": "object"}', any_whitespace=False, separators=SEPARATORS,
            strict_mode=structured.strict))
        if structured.kind != "tool_calls":
            return body
        call = xgr.Grammar.concat(_literal(xgr, structured.open), body, _literal(xgr, structured.close))
        calls = xgr.Grammar.from_ebnf(f"{call}\ncalls ::= root+", root_rule_name="calls") if structured.repeats \
            else call
        if structured.alternative is None:
            return calls
        return xgr.Grammar.union(calls, grammar_of(structured.alternative))
    except (RuntimeError, ValueError, TypeError) as error:
        what = "pattern" if structured.kind == "regex" else "schema"
        raise invalid(structured.field, preview(structured.spec), f"is not a {what} the grammar library takes: "
                      f"{_reason(error)}", f"fix the {what} (JSON Schema as OpenAI's structured outputs take it)"
                      ) from None


def _schema_text(schema: Any, field: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise invalid(field, preview(schema), "is not JSON", "pass the schema as a dict or JSON text") from None
    if not isinstance(schema, dict):
        raise invalid(field, preview(schema), "must be a JSON schema object", "pass e.g. {\"type\": \"object\"}")
    try:
        return json.dumps(schema, separators=(",", ":"))  # key order kept: it is the order properties are written
    except (TypeError, ValueError):
        raise invalid(field, preview(schema), "is not JSON-serialisable", "use JSON types only") from None


def _plain_bounded_strings(xgr: Any, grammar: Any) -> Any:
    """The grammar with its length-bounded strings' character class narrowed. xgrammar 0.2.9 writes `maxLength` as
    repetitions of `[^"\\\r\n]`, which takes raw control characters (invalid JSON) and UTF-8-encoded surrogates (each
    decodes to three U+FFFD, over the length); its own unbounded strings exclude both, and so does this class."""
    text = str(grammar)
    return xgr.Grammar.from_ebnf(text.replace(BOUNDED_CHARACTER, PLAIN_CHARACTER)) if BOUNDED_CHARACTER in text \
        else grammar


def _literal(xgr: Any, text: str) -> Any:
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _reason(error: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line: " prefix."""
    lines = str(error).strip().splitlines()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0]) if lines else type(error).__name__
