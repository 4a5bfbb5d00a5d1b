"""Structured output over HTTP: `response_format` (json_object, json_schema), `tool_choice` "required" and named,
`parallel_tool_calls=false`, driven by the real `openai` client and by langchain-openai's `with_structured_output`
(its three methods) against a random tiny model, which unconstrained never writes what is asked. What comes back
validates (jsonschema), its logprobs are a plain teacher-forced forward's, and a bad format is a 400 naming its field.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch
from conftest import reference_logprobs
from conftest import serving

from rollout.testing import load_tiny_model

pytest.importorskip("xgrammar")

USER = [{"role": "user", "content": "who is it"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                     "b": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a", "b"]}}}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"key": {"enum": ["x", "y"]}}, "required": ["key"]}}}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def served(tiny_path, tok):
    """(model, client, url) of a random tiny model with the tool-speaking chat tokenizer."""
    model, _ = load_tiny_model(tiny_path)
    with serving(model, tok) as (_, server, client):
        yield model, client, server.url


def chat(client, **kwargs):
    return client.chat.completions.create(**{"model": "tiny", "messages": USER, **kwargs})


def bias(tok) -> dict[str, float]:
    """`"` and `}` made likelier: a random model's strings and objects of unbounded length then end in budget."""
    return {str(tok.convert_tokens_to_ids(t)): 4.0 for t in ('"', "}")}


def test_json_schema_responses_validate_and_carry_exact_logprobs(served):
    model, client, _ = served
    r = chat(client, response_format=SCHEMA_FORMAT, n=8, temperature=1.0, seed=1, max_tokens=60, logprobs=True)
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.message.content), PERSON)
        ids = c.model_extra["token_ids"]
        full, _ = reference_logprobs(model, r.model_extra["prompt_token_ids"], ids)
        got = torch.tensor([entry.logprob for entry in c.logprobs.content])
        assert float((got - full).abs().max()) < 1e-5
    streamed = chat(client, response_format=SCHEMA_FORMAT, temperature=1.0, seed=1, max_tokens=60, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices) == r.choices[0].message.content
    plain = chat(client, n=8, temperature=1.0, seed=1, max_tokens=60)
    for c in plain.choices:  # unconstrained, the same model writes no such JSON
        with pytest.raises((ValueError, jsonschema.ValidationError)):
            jsonschema.validate(json.loads(c.message.content), PERSON)


def test_json_object_responses_parse(served, tok):
    _, client, _ = served
    r = chat(client, response_format={"type": "json_object"}, n=4, seed=2, max_tokens=160, logit_bias=bias(tok))
    assert all(c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict) for c in r.choices)


def test_tool_choice_required_and_named_produce_parsed_calls_of_those_tools(served):
    _, client, _ = served
    required = chat(client, tools=[ADD, LOOKUP], tool_choice="required", n=4, seed=3, max_tokens=120,
                    parallel_tool_calls=False)
    named = chat(client, tools=[ADD, LOOKUP], tool_choice={"type": "function", "function": {"name": "lookup"}}, n=4,
                 seed=3, max_tokens=120, parallel_tool_calls=False)
    tools = {t["function"]["name"]: t["function"]["parameters"] for t in (ADD, LOOKUP)}
    for r, names in ((required, set(tools)), (named, {"lookup"})):
        for c in r.choices:
            assert c.finish_reason == "tool_calls" and c.message.content is None
            calls = c.message.tool_calls
            assert len(calls) == 1  # parallel_tool_calls=false: exactly one (several: tests/test_structured.py)
            for call in calls:
                assert call.function.name in names
                jsonschema.validate(json.loads(call.function.arguments), tools[call.function.name])


def test_parallel_tool_calls_false_with_auto_is_taken(served):
    _, client, _ = served
    r = chat(client, tools=[ADD], parallel_tool_calls=False, seed=4, max_tokens=8)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tools_next_to_a_response_format_give_a_call_or_the_formats_json(served, tok):
    model, client, _ = served
    call = str(tok.convert_tokens_to_ids("<tool_call>"))
    asked = dict(tools=[ADD], response_format=SCHEMA_FORMAT, n=4, temperature=1.0, seed=5, max_tokens=120,
                 logprobs=True, parallel_tool_calls=False)  # one call (else a pushed <tool_call> opens call after call)
    calls = chat(client, logit_bias={call: 100}, **asked)  # the model's own choice, pushed to each branch
    brace = str(tok.convert_tokens_to_ids("{"))
    answers = chat(client, logit_bias={brace: 100}, **asked)  # (the markup can also be spelled in characters)
    for c in calls.choices:
        assert c.finish_reason == "tool_calls" and c.message.content is None and c.message.tool_calls
        for made in c.message.tool_calls:
            jsonschema.validate(json.loads(made.function.arguments), ADD["function"]["parameters"])
    for c in answers.choices:
        assert c.finish_reason == "stop" and c.message.tool_calls is None
        jsonschema.validate(json.loads(c.message.content), PERSON)
    for c in calls.choices[:1] + answers.choices[:1]:  # the mask changes what is sampled, never the logprobs
        full, _ = reference_logprobs(model, calls.model_extra["prompt_token_ids"], c.model_extra["token_ids"])
        got = torch.tensor([entry.logprob for entry in c.logprobs.content])
        assert float((got - full).abs().max()) < 1e-5
    # openai-agents' Agent(tools=[...], output_type=Person): Responses with tools and text.format json_schema
    r = client.responses.create(model="tiny", input="who is it", max_output_tokens=120, temperature=1.0,
                                tools=[{"type": "function", "name": "add", "parameters": ADD["function"]["parameters"],
                                        "strict": True}],
                                text={"format": {"type": "json_schema", "name": "final_output", "schema": PERSON,
                                                 "strict": True}}, extra_body={"logit_bias": {brace: 100}})
    assert r.status == "completed" and [item.type for item in r.output] == ["message"]
    jsonschema.validate(json.loads(r.output_text), PERSON)


@pytest.mark.parametrize("kwargs, param", [
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}),
     "response_format.json_schema.schema"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "response_format.json_schema"),
    (dict(response_format={"type": "xml"}), "response_format"),
    (dict(response_format={"type": "json_object"}, tools=[ADD], tool_choice="required"), "response_format"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
          tool_choice="required"), "tools[0].function.parameters"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[ADD], tool_choice={"type": "function", "function": {"name": "sub"}}), "tool_choice"),
    (dict(tools=[ADD], tool_choice="sometimes"), "tool_choice"),
    (dict(tools=[ADD], parallel_tool_calls="no"), "parallel_tool_calls"),
])
def test_a_bad_format_is_a_400_naming_its_field(served, kwargs, param):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, max_tokens=4, **kwargs)
    assert error.value.body["param"] == param, error.value.body


def test_a_server_without_the_grammar_library_names_the_field_and_the_install(served, monkeypatch):
    import sys

    from rollout.base.structured import grammar_of

    _, client, _ = served
    grammar_of.cache_clear()
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    for kwargs, param in ((dict(response_format={"type": "json_object"}), "response_format"),
                          (dict(tools=[ADD], tool_choice="required"), "tool_choice")):
        with pytest.raises(openai.BadRequestError) as error:
            chat(client, max_tokens=4, **kwargs)
        assert error.value.body["param"] == param and "rollout[structured]" in error.value.body["message"]


def test_completions_refuse_response_format_by_name(served):
    _, client, _ = served
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                  extra_body={"response_format": {"type": "json_object"}})
    assert error.value.body["param"] == "response_format"


def test_responses_text_format_json_schema_is_constrained(served):
    _, client, _ = served
    r = client.responses.create(model="tiny", input="who is it", max_output_tokens=60, temperature=1.0,
                                text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), PERSON)


# ---------------------------------------------------------------------------------------------- langchain-openai
def test_langchain_with_structured_output_runs_all_three_methods(served, tok):
    langchain = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person."""

        name: str = Field(max_length=6)
        age: int = Field(ge=0, le=120)

    _, _, url = served
    llm = langchain.ChatOpenAI(base_url=url, api_key="unused", model="tiny", max_retries=0, max_tokens=160,
                               temperature=1.0, seed=5)
    for method in ("json_schema", "function_calling"):
        person = llm.with_structured_output(Person, method=method).invoke("who is it")
        assert isinstance(person, Person), method
    biased = langchain.ChatOpenAI(base_url=url, api_key="unused", model="tiny", max_retries=0, max_tokens=160,
                                  seed=5, logit_bias={int(k): v for k, v in bias(tok).items()})
    answer = biased.with_structured_output(PERSON | {"title": "person"}, method="json_mode").invoke(
        "who is it, as JSON")
    assert isinstance(answer, dict)
