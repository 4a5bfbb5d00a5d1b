"""POST /v1/responses, and the chat path's tool and usage fixes it shares, driven by the real `openai` client.

The tiny model is taught three tool turns, so the parsing and streaming paths run on tokens it really samples: a
call, a call whose JSON is broken, and text followed by a call. Logprobs are checked against a plain teacher-forced
forward, token ids against the chat path and the template's own rendering.
"""

from __future__ import annotations

import json
import time

import openai
import pytest
from conftest import ADD, CALL, USER, assert_alternatives_exact, chat, http, serving, settled, wait_until
from conftest import assert_served_exact as assert_exact

from rollout import SamplingParams
from rollout.testing import load_tiny_model, teach

LOGPROBS = ["message.output_text.logprobs"]
ADD_R = {"type": "function", "name": "add", "description": "Add two numbers.",  # the Responses shape of the same tool
         "parameters": ADD["function"]["parameters"], "strict": True}
BROKEN_ASK = [{"role": "user", "content": "break it"}]
BROKEN = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 4}</tool_call>'  # one closing brace short
TALK_ASK = [{"role": "user", "content": "hello there friend, say something and then add"}]
TALK = "Let me add them."
TALK_CALL = TALK + ' <tool_call>{"name": "add", "arguments": {"a": 2, "b": 5}}</tool_call><|end|>'
TWICE_ASK = [{"role": "user", "content": "add twice"}]
FIRST = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
TWICE = FIRST + '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call><|end|>'


@pytest.fixture(scope="module")
def served(tiny_path, tok):
    model, _ = load_tiny_model(tiny_path)
    pairs = [(tok.apply_chat_template(ask, tools=[ADD], add_generation_prompt=True, return_dict=False), tok.encode(out))
             for ask, out in ((USER, CALL), (BROKEN_ASK, BROKEN + "<|end|>"), (TALK_ASK, TALK_CALL),
                              (TWICE_ASK, TWICE))]
    teach(model, pairs, steps=80)
    with serving(model, tok) as handles:
        yield handles


def respond(client, **kwargs):
    return client.responses.create(**{"model": "tiny", "input": USER[0]["content"], **kwargs})


def rendered(tok, messages, tools=None):
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, return_dict=False)


# ---------------------------------------------------------------------------------------------- responses
def test_a_text_response_has_exact_logprobs_token_ids_and_usage(served, tok):
    worker, _, client = served
    r = respond(client, max_output_tokens=12, temperature=0.9, include=LOGPROBS,
                extra_body={"seed": 5, "ignore_eos": True})
    extra = r.model_extra
    assert r.object == "response" and r.model == "tiny" and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert extra["prompt_token_ids"] == rendered(tok, USER)
    ids = extra["token_ids"]
    assert len(ids) == 12 and [item.type for item in r.output] == ["message"]
    assert r.output_text == tok.decode(ids, skip_special_tokens=True)
    values = [t.logprob for t in r.output[0].content[0].logprobs]
    assert values == extra["token_logprobs"]
    assert_exact(worker.model, extra["prompt_token_ids"], ids, values, temperature=0.9)
    direct = worker.generate([extra["prompt_token_ids"]], SamplingParams(temperature=0.9, max_new_tokens=12, seed=5,
                                                                          stop_token_ids=()))
    assert direct.completion_token_lists() == [ids] and direct.logprobs[0].tolist() == values  # bit for bit
    assert extra["token_versions"] == [worker.policy_version] * 12 and extra["policy_version"] == worker.policy_version
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (len(rendered(tok, USER)), 12,
                                                                                   len(rendered(tok, USER)) + 12)
    same = chat(client, max_tokens=12, temperature=0.9, seed=5, extra_body={"ignore_eos": True})
    assert same.choices[0].model_extra["token_ids"] == ids  # the chat path's engine call, seeded alike
    briefed = respond(client, instructions="be brief", max_output_tokens=2, store=False)
    assert briefed.model_extra["prompt_token_ids"] == rendered(tok, [{"role": "system", "content": "be brief"}] + USER)
    assert briefed.store is False and "token_logprobs" not in briefed.model_extra


def test_a_function_call_round_trip_continues_the_sampled_tokens(served, tok):
    worker, server, client = served
    first = respond(client, tools=[ADD_R], temperature=0, max_output_tokens=64, extra_body={"episode_id": "r-1"})
    [call] = first.output
    assert call.type == "function_call" and call.name == "add" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"a": 2, "b": 3} and first.status == "completed"
    assert first.model_extra["prompt_token_ids"] == rendered(tok, USER, [ADD])
    assert tok.decode(first.model_extra["token_ids"]) == CALL
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    second = respond(client, previous_response_id=first.id, input=[result], tools=[ADD_R], max_output_tokens=8,
                     include=LOGPROBS, extra_body={"seed": 2, "ignore_eos": True, "episode_id": "r-1"})
    p1, t1 = first.model_extra["prompt_token_ids"], first.model_extra["token_ids"]
    p2, t2 = second.model_extra["prompt_token_ids"], second.model_extra["token_ids"]
    assert p2 == p1 + t1 + tok.encode("<|tool|>5<|end|><|assistant|>")  # the sampled call, not re-tokenized
    assert second.usage.input_tokens_details.cached_tokens >= 16  # the history's full pages: prefix cache
    assert_exact(worker.model, p2, t2, second.model_extra["token_logprobs"])
    episode = server.take_episode("r-1")  # one segment: the trainer gets the turns as sampled
    assert episode.completion_token_lists() == [t1 + p2[len(p1) + len(t1):] + t2] and episode.num_turns.tolist() == [2]
    # stateless: the whole conversation sent back as items renders to the same prompt and samples the same tokens
    items = [{"role": "user", "content": [{"type": "input_text", "text": USER[0]["content"]}]},
             call.model_dump(exclude_none=True), result]
    again = respond(client, input=items, tools=[ADD_R], max_output_tokens=8, extra_body={"seed": 2, "ignore_eos": True})
    assert again.model_extra["prompt_token_ids"] == p2 and again.model_extra["token_ids"] == t2
    assert client.responses.retrieve(second.id).model_extra["token_ids"] == t2
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)


def test_top_logprobs_are_the_exact_alternatives(served):
    worker, _, client = served
    r = respond(client, max_output_tokens=6, temperature=0.8, top_logprobs=3,
                extra_body={"seed": 4, "ignore_eos": True, "return_tokens_as_token_ids": True})
    entries = r.output[0].content[0].logprobs
    ids = r.model_extra["token_ids"]
    assert [e.token for e in entries] == [f"token_id:{i}" for i in ids]
    alternatives = [[(a.token, a.logprob) for a in e.top_logprobs] for e in entries]
    assert_alternatives_exact(worker.model, r.model_extra["prompt_token_ids"], ids, alternatives, 3, 0.8)


def test_a_client_that_leaves_a_stream_cancels_its_turn(served, slow_steps):
    worker, _, client = served
    engine = worker.engine
    start = time.monotonic()
    stream = respond(client, max_output_tokens=900, stream=True, extra_body={"ignore_eos": True})
    kinds = [next(stream).type for _ in range(5)]
    assert kinds[-1] == "response.output_text.delta" and engine.in_flight().requests
    stream.close()
    assert wait_until(lambda: settled(engine), 10)
    assert time.monotonic() - start < 15


def test_previous_response_id_must_be_one_this_server_stored(served):
    _, _, client = served
    unstored = respond(client, max_output_tokens=2, store=False)
    for missing in (unstored.id, "resp_nowhere"):
        with pytest.raises(openai.BadRequestError) as error:
            respond(client, previous_response_id=missing, input="and then?", max_output_tokens=2)
        assert error.value.body["param"] == "previous_response_id"
        assert error.value.body["code"] == "previous_response_not_found"


def events_of(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_a_streamed_response_sends_openais_events_and_its_deltas_add_up(served):
    _, _, client = served
    asked = dict(max_output_tokens=10, temperature=1.0, include=LOGPROBS, extra_body={"seed": 7, "ignore_eos": True})
    whole = respond(client, **asked)
    events = events_of(respond(client, stream=True, **asked))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[4: 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and len(deltas) > 1
    assert kinds[4 + len(deltas):] == ["response.output_text.done", "response.content_part.done",
                                       "response.output_item.done", "response.incomplete"]
    done = events[-1].response
    assert "".join(d.delta for d in deltas) == events[-4].text == done.output_text == whole.output_text
    assert [t.logprob for d in deltas for t in d.logprobs] == whole.model_extra["token_logprobs"]
    assert done.model_extra["token_ids"] == whole.model_extra["token_ids"] and done.usage == whole.usage
    assert events[2].item.id == done.output[0].id == events[-2].item.id
    calls = events_of(respond(client, stream=True, tools=[ADD_R], temperature=0, max_output_tokens=64))
    kinds = [e.type for e in calls]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    assert kinds[2:6] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done"]
    assert json.loads(calls[4].arguments) == {"a": 2, "b": 3} and calls[4].name == "add"
    assert calls[-1].response.output[0].call_id == calls[5].item.call_id
    # the client's own stream helper rebuilds the response from the events (their indexes and ids) alike
    with client.responses.stream(model="tiny", input=USER[0]["content"], tools=[ADD_R], temperature=0,
                                 max_output_tokens=64) as helper:
        rebuilt = helper.get_final_response()
    assert rebuilt.output[0].arguments == calls[-1].response.output[0].arguments


def test_fields_with_no_meaning_here_are_refused_by_name(served):
    worker, _, client = served
    before = worker.engine.num_prompt_tokens
    cases = [
        (dict(tools=[{"type": "web_search"}]), 400, "tools[0].type"),
        (dict(background=True), 400, "background"),
        (dict(reasoning={"summary": "auto"}), 400, "reasoning.summary"),
        (dict(include=["file_search_call.results"]), 400, "include"),
        (dict(truncation="auto"), 400, "truncation"),
        (dict(max_output_tokens=5000), 400, "max_output_tokens"),
        (dict(temperature=-1), 400, "temperature"),
        (dict(top_logprobs=21), 400, "top_logprobs"),
        (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400,
         "input[0].content[0]"),
        (dict(input=[{"type": "item_reference", "id": "x"}]), 400, "input[0].type"),
        (dict(tool_choice={"type": "web_search_preview"}), 400, "tool_choice"),
        (dict(text={"verbosity": "low"}), 400, "text.verbosity"),
        (dict(extra_body={"frobnicate": 1}), 400, "frobnicate"),
        (dict(model="gpt-9"), 404, "model"),
    ]
    for kwargs, status, param in cases:
        with pytest.raises(openai.APIStatusError) as error:
            respond(client, **kwargs)
        assert error.value.status_code == status and error.value.body["param"] == param, (kwargs, error.value.body)
    assert worker.engine.num_prompt_tokens == before  # nothing reached the engine
    status, body = http(f"{client.base_url}responses", b"[1]")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_text_format_and_reasoning_effort_reach_the_chat_path_in_its_shape_and_errors_in_the_responses_names():
    from rollout.server.transport.errors import bad_request
    from rollout.server.responses.turns import _chat_body, renamed

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    chat = _chat_body({"model": "m", "text": {"format": {"type": "json_schema", "name": "x", "schema": schema,
                                                         "strict": True}},
                       "reasoning": {"effort": "low"}, "max_output_tokens": 9, "top_logprobs": 2}, [])
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "x", "schema": schema,
                                                                             "strict": True}}
    assert chat["reasoning_effort"] == "low" and chat["max_completion_tokens"] == 9
    assert chat["logprobs"] is True and chat["top_logprobs"] == 2
    error = renamed(bad_request("response_format.json_schema", "response_format.json_schema is invalid"))
    assert (error.param, error.message) == ("text.format.json_schema", "text.format.json_schema is invalid")
    error = renamed(bad_request("max_completion_tokens", "max_completion_tokens=9 is too many"))
    assert (error.param, error.message) == ("max_output_tokens", "max_output_tokens=9 is too many")


def test_reasoning_comes_out_as_a_reasoning_item_and_goes_back_in_as_the_turns_reasoning():
    from rollout.server.completions.chat import normalize
    from rollout.server.responses.items import messages_of, output_items

    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1}"}}
    message = {"role": "assistant", "reasoning_content": "think", "content": "so", "tool_calls": [call]}
    items = output_items(message, None, "completed", "msg_1")
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "think"}] and items[0]["summary"] == []
    assert [i["type"] for i in output_items(message, None, "completed", "msg_1", message_first=True)] == [
        "message", "reasoning", "function_call"]
    back = messages_of([{"role": "user", "content": "hi"}] + items)
    assert normalize(back) == normalize([{"role": "user", "content": "hi"}, message])
    with pytest.raises(Exception) as error:
        messages_of([{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}])
    assert error.value.param == "input[0].encrypted_content"


def test_include_encrypted_reasoning_as_inspect_ai_sends_it_is_accepted(served, tok):
    _, _, client = served
    # inspect-ai's openai/ provider (its Responses default): store false, encrypted reasoning asked for
    r = respond(client, max_output_tokens=4, store=False, include=["reasoning.encrypted_content"] + LOGPROBS,
                extra_body={"seed": 1})
    assert r.status == "incomplete" and [item.type for item in r.output] == ["message"]  # no reasoning here
    assert r.model_extra["prompt_token_ids"] == rendered(tok, USER) and len(r.model_extra["token_logprobs"]) == 4
    # a reasoning item comes with its text and no encrypted_content, and goes back in that way
    back = respond(client, max_output_tokens=2, store=False, include=["reasoning.encrypted_content"],
                   input=[{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [],
                          "encrypted_content": None, "content": [{"type": "reasoning_text", "text": "hm"}]},
                          {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again"}])
    assert back.status == "incomplete"


def test_reasoning_effort_renders_into_the_template_and_is_refused_where_chat_refuses_it(served, tok):
    _, _, client = served
    with pytest.raises(openai.BadRequestError) as chat_error:
        chat(client, max_tokens=2, reasoning_effort="low")
    with pytest.raises(openai.BadRequestError) as error:  # this template never reads it: refused, not dropped
        respond(client, max_output_tokens=2, reasoning={"effort": "low"})
    assert chat_error.value.body["param"] == "reasoning_effort" and error.value.body["param"] == "reasoning.effort"
    assert error.value.body["message"] == chat_error.value.body["message"].replace("reasoning_effort",
                                                                                   "reasoning.effort")
    template = tok.chat_template
    tok.chat_template = "{% if reasoning_effort is defined %}<|system|>effort {{ reasoning_effort }}<|end|>" \
                        "{% endif %}" + template
    try:  # a template that reads it: rendered with it, as chat renders it
        r = respond(client, max_output_tokens=2, reasoning={"effort": "low"})
        c = chat(client, max_tokens=2, reasoning_effort="low")
        expected = tok.apply_chat_template(USER, add_generation_prompt=True, return_dict=False, reasoning_effort="low")
        assert r.model_extra["prompt_token_ids"] == c.model_extra["prompt_token_ids"] == expected
        assert expected != rendered(tok, USER)
    finally:
        tok.chat_template = template


def test_a_turn_cut_after_a_complete_call_keeps_that_call(served, tok):
    worker, _, client = served
    asked = dict(messages=TWICE_ASK, tools=[ADD], temperature=0)
    whole = chat(client, max_tokens=len(tok.encode(TWICE)) + 2, **asked).choices[0]
    assert tok.decode(whole.model_extra["token_ids"]) == TWICE and len(whole.message.tool_calls) == 2
    budget = len(tok.encode(FIRST)) + 5  # the second call cut mid-way
    cut = chat(client, max_tokens=budget, **asked).choices[0]
    assert cut.finish_reason == "length" and cut.model_extra["token_ids"] == whole.model_extra["token_ids"][:budget]
    [call] = cut.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}
    assert cut.message.content is None and "tool_call_error" not in cut.model_extra
    last = list(chat(client, max_tokens=budget, stream=True, **asked))[-1]
    assert last.choices[0].finish_reason == "length" and len(last.choices[0].delta.tool_calls) == 1
    r = respond(client, input=TWICE_ASK[0]["content"], tools=[ADD_R], temperature=0, max_output_tokens=budget,
                include=LOGPROBS)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "function_call" and json.loads(item.arguments) == {"a": 1, "b": 2}
    events = events_of(respond(client, input=TWICE_ASK[0]["content"], tools=[ADD_R], temperature=0,
                               max_output_tokens=budget, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output[0].arguments == item.arguments
    assert [e.item.type for e in events if e.type == "response.output_item.done"] == ["function_call"]
    assert_exact(worker.model, r.model_extra["prompt_token_ids"], r.model_extra["token_ids"],
                 r.model_extra["token_logprobs"])


# ---------------------------------------------------------------------------------------------- the misleading cases
def test_tool_choice_none_renders_no_tools(served, tok):
    _, _, client = served
    r = chat(client, tools=[ADD], tool_choice="none", max_tokens=3)
    assert r.model_extra["prompt_token_ids"] == rendered(tok, USER)  # was rendered with the tools' system block
    rr = respond(client, tools=[ADD_R], tool_choice="none", max_output_tokens=3)
    assert rr.model_extra["prompt_token_ids"] == rendered(tok, USER)
    assert rr.tool_choice == "none" and rr.tools[0].name == "add"


def test_a_call_the_parser_rejects_keeps_its_markup_and_says_why(served, tok):
    _, _, client = served
    c = chat(client, messages=BROKEN_ASK, tools=[ADD], temperature=0, max_tokens=64).choices[0]
    assert tok.decode(c.model_extra["token_ids"]) == BROKEN + "<|end|>"
    assert c.message.content == BROKEN and c.message.tool_calls is None and c.finish_reason == "stop"
    assert "did not parse" in c.model_extra["tool_call_error"]
    streamed = list(chat(client, messages=BROKEN_ASK, tools=[ADD], temperature=0, max_tokens=64, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in streamed) == BROKEN
    assert "did not parse" in streamed[-1].choices[0].model_extra["tool_call_error"]
    r = respond(client, input=BROKEN_ASK[0]["content"], tools=[ADD_R], temperature=0, max_output_tokens=64)
    assert [item.type for item in r.output] == ["message"] and r.output_text == BROKEN
    assert "did not parse" in r.model_extra["tool_call_error"]


def test_with_tools_text_streams_as_it_comes_until_a_call_begins(served, tok):
    _, _, client = served
    asked = dict(messages=TALK_ASK, tools=[ADD], temperature=0, max_tokens=64)
    whole = chat(client, **asked).choices[0]
    assert whole.message.content == TALK and json.loads(whole.message.tool_calls[0].function.arguments) == {
        "a": 2, "b": 5}
    call_token = tok.convert_tokens_to_ids("<tool_call>")
    sent, seen_call = "", False
    for chunk in chat(client, stream=True, **asked):
        for c in chunk.choices:
            if c.delta.content and c.finish_reason is None:
                assert not seen_call  # text arrives before the call's first token, not with the parsed message
                sent += c.delta.content
            seen_call = seen_call or call_token in (c.model_extra or {}).get("token_ids", [])
    assert sent == TALK and seen_call
    events = events_of(respond(client, input=TALK_ASK[0]["content"], tools=[ADD_R], temperature=0,
                               max_output_tokens=64, stream=True))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == TALK and events[-1].response.output_text == TALK
    assert [item.type for item in events[-1].response.output] == ["message", "function_call"]
    kinds = [e.type for e in events]
    assert kinds.index("response.output_text.delta") < kinds.index("response.function_call_arguments.delta")


def test_usage_counts_the_tokens_sampled_past_a_multi_token_stop_string(served, tok):
    _, _, client = served
    free = chat(client, max_tokens=24, seed=3, extra_body={"ignore_eos": True}).choices[0]
    ids = free.model_extra["token_ids"]
    text = [tok.decode(ids[:k], skip_special_tokens=True) for k in range(25)]
    # two characters across a token boundary, not one token: the engine cannot stop on it
    stop = next(s for k in range(4, 20) if len(text[k + 1]) > len(text[k]) > 0
                and len(tok.encode(s := text[k][-1] + text[k + 1][len(text[k])])) > 1)
    cut = chat(client, max_tokens=24, seed=3, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and len(cut.choices[0].model_extra["token_ids"]) < 24
    assert cut.usage.completion_tokens == 24  # everything sampled, the tokens after the stop string included
    r = respond(client, max_output_tokens=24, extra_body={"seed": 3, "ignore_eos": True, "stop": [stop]})
    assert r.usage.output_tokens == 24 and len(r.model_extra["token_ids"]) < 24
