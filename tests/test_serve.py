"""The OpenAI-compatible server, driven by the real `openai` client over loopback HTTP.

The model is the tiny test model with the tool-speaking chat tokenizer, taught (rollout.testing.teach) to answer one
prompt with a tool call, so the parsing paths run on tokens the model really sampled. Every number is checked against
an independent reference: logprobs against a plain teacher-forced forward, token ids against the in-process worker.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import openai
import pytest
import torch
from conftest import ADD, CALL, USER, assert_alternatives_exact, chat, gaps_by_version, http, perturbed, \
    reference_logprobs, serving, settled, wait_until
from conftest import SERVED_TOL as TOL, assert_served_exact as assert_exact

import rollout
from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import load_tiny_model, teach


@pytest.fixture(scope="module")
def served(tiny_path, tok):
    """(worker, server, client): the taught tiny model shared in place by a worker, served on a free port."""
    model, _ = load_tiny_model(tiny_path)
    prompt = tok.apply_chat_template(USER, tools=[ADD], add_generation_prompt=True, return_dict=False)
    teach(model, [(prompt, tok.encode(CALL))], steps=60)
    with serving(model, tok) as handles:
        yield handles


# ---------------------------------------------------------------------------------------------- responses
def test_chat_n_samples_carry_prompt_ids_token_ids_versions_and_exact_logprobs(served, tok):
    worker, _, client = served
    r = chat(client, n=3, temperature=0.9, max_tokens=12, logprobs=True, seed=5, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == "tiny" and len(r.choices) == 3
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt == tok.apply_chat_template(USER, add_generation_prompt=True, return_dict=False)
    for i, c in enumerate(r.choices):
        ids = c.model_extra["token_ids"]
        assert c.index == i and len(ids) == 12 and c.finish_reason == "length"
        assert c.message.content == tok.decode(ids, skip_special_tokens=True)
        assert c.model_extra["token_versions"] == [worker.policy_version] * 12
        assert c.model_extra["policy_version"] == worker.policy_version
        values = [t.logprob for t in c.logprobs.content]
        assert [t.token for t in c.logprobs.content] == [tok.decode([t]) for t in ids]
        assert all(t.top_logprobs == [] for t in c.logprobs.content)
        assert_exact(worker.model, prompt, ids, values, temperature=0.9)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == 36
    # the same seed through the in-process worker gives the same tokens: seeded streams are keyed on the sample
    batch = worker.generate([prompt], SamplingParams(n=3, temperature=0.9, max_new_tokens=12, seed=5,
                                                     stop_token_ids=()))
    assert batch.completion_token_lists() == [c.model_extra["token_ids"] for c in r.choices]


def test_completions_several_prompts_and_token_ids_in_and_out(served, tok):
    worker, _, client = served
    r = client.completions.create(model="tiny", prompt=["the cat", "two dogs"], n=2, max_tokens=6, logprobs=0,
                                  seed=1, temperature=1.0, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    prompts = [tok.encode("the cat"), tok.encode("two dogs")]
    for c in r.choices:
        prompt = c.model_extra["prompt_token_ids"]
        assert prompt == prompts[c.index // 2]
        assert c.text == tok.decode(c.model_extra["token_ids"], skip_special_tokens=True)
        assert_exact(worker.model, prompt, c.model_extra["token_ids"], c.logprobs.token_logprobs)
    assert r.usage.prompt_tokens == sum(map(len, prompts)) and r.usage.completion_tokens == 24
    # token ids in, as `prompt` or as the prompt_token_ids extension: the same seeded tokens come out
    by_ids = client.completions.create(model="tiny", prompt=prompts[1], max_tokens=6, seed=1,
                                       extra_body={"ignore_eos": True}, n=2)
    assert [c.model_extra["token_ids"] for c in by_ids.choices] == [c.model_extra["token_ids"] for c in r.choices[2:]]
    chat_ids = chat(client, messages=None, max_tokens=5, temperature=0, extra_body={"prompt_token_ids": prompts[0]})
    greedy = worker.generate([prompts[0]], SamplingParams(temperature=0, max_new_tokens=5,
                                                          stop_token_ids=worker.default_stop_ids + (tok.convert_tokens_to_ids("<|end|>"),)))
    assert chat_ids.model_extra["prompt_token_ids"] == prompts[0]
    assert chat_ids.choices[0].model_extra["token_ids"] == greedy.completion_token_lists()[0]


def test_stop_strings_cut_text_and_tokens_where_the_string_completes(served, tok):
    _, _, client = served
    free = chat(client, max_tokens=24, seed=3, extra_body={"ignore_eos": True})
    ids = free.choices[0].model_extra["token_ids"]
    text = free.choices[0].message.content
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop) == 3 and stop.strip()
    cut = chat(client, max_tokens=24, seed=3, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    kept = cut.model_extra["token_ids"]
    assert cut.finish_reason == "stop" and cut.message.content == text[: text.find(stop)]
    assert kept == ids[: len(kept)] and stop in tok.decode(kept) and stop not in tok.decode(kept[:-1])


def test_a_long_streamed_row_decodes_in_linear_time_and_cuts_where_the_whole_row_does(tok):
    from rollout.base.batch import Row
    from rollout.server.rollouts.choices import Detokenizer, StreamedChoice, choice_of

    text = "".join(f"step {i}: caf\u00e9 \u2192 \U0001F600 na\u00efve {i * 7} " for i in range(150)) + "THE END and after"
    ids = tok.encode(text)
    assert len(ids) > 2000 and tok.decode(ids) == text

    class Counting(Detokenizer):
        decoded = 0

        def text(self, part):
            Counting.decoded += len(part)
            return super().text(part)

    for stops in ((), ("THE END",), ("\U0001F600 na",)):
        Counting.decoded = 0
        detok, state, sent, sent_ids = Counting(tok, stops), None, "", []
        state = StreamedChoice(0, detok)
        for n in range(1, len(ids) + 1):  # the engine reports the row so far after every step
            delta = state.advance(ids[:n], [0.0] * n, [0] * n)
            if delta is not None:
                sent, sent_ids = sent + delta.text, sent_ids + delta.token_ids
            if state.stopped:
                break
        streamed_cost = Counting.decoded
        final = state.advance(ids, [0.0] * len(ids), [0] * len(ids), final=True)
        if final is not None:
            sent, sent_ids = sent + final.text, sent_ids + final.token_ids
        whole = choice_of(0, Row(0, 0, [], ids, [0.0] * len(ids), [0.0] * len(ids), "length", 0), Detokenizer(tok, stops))
        assert sent == whole.text and sent_ids == whole.token_ids, stops
        # windows of a few tokens per step, plus one binary search for where a stop string completes (~log2(n)
        # decodes of the row): under 30 n; a whole-row decode per step would be ~n^2 / 2 (8.7M here)
        assert streamed_cost < 30 * len(ids), (stops, streamed_cost)


def test_a_stream_re_run_from_its_first_token_sends_only_what_is_new_and_a_different_one_is_refused(tok):
    """Found by benchmarks/fleet/chaos.py: an engine restart re-runs a streamed row from its first token (the same seeded
    tokens, reported again from one); that ended the stream with `aborted_by_weight_update` after any re-run."""
    from rollout.server.rollouts.choices import Detokenizer, Diverged, StreamedChoice

    ids = tok.encode("the cat is on the mat and the dog is not")
    state, sent = StreamedChoice(0, Detokenizer(tok)), []
    for n in [*range(1, 6), *range(1, len(ids) + 1)]:  # 5 tokens streamed, then the re-run reports 1, 2, ... again
        delta = state.advance(ids[:n], [-1.0] * n, [0] * n)
        sent += delta.token_ids if delta is not None else []
    assert sent == ids  # each token sent once, in order
    other = StreamedChoice(0, Detokenizer(tok))
    other.advance(ids[:5], [-1.0] * 5, [0] * 5)
    with pytest.raises(Diverged, match="after 5 tokens"):  # a re-run on new weights that sampled otherwise
        other.advance(ids[:2] + [ids[2] + 1], [-1.0] * 3, [1] * 3)


def test_streamed_chunks_add_up_to_the_same_completion(served):
    _, _, client = served
    whole = chat(client, n=2, max_tokens=10, seed=7, logprobs=True)
    stream = chat(client, n=2, max_tokens=10, seed=7, logprobs=True, stream=True,
                  stream_options={"include_usage": True})
    text, ids, lps, finish, roles, usage = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}, {}, set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles.add(c.delta.role) if c.delta.role else None
            text[c.index] += c.delta.content or ""
            ids[c.index] += (c.model_extra or {}).get("token_ids", [])
            lps[c.index] += [t.logprob for t in (c.logprobs.content if c.logprobs else [])]
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert roles == {"assistant"}
    for c in whole.choices:
        assert text[c.index] == c.message.content and ids[c.index] == c.model_extra["token_ids"]
        assert lps[c.index] == [t.logprob for t in c.logprobs.content] and finish[c.index] == c.finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_top_logprobs_are_the_exact_alternatives_whole_streamed_and_in_completions(served, tok):
    worker, _, client = served
    asked = dict(max_tokens=8, seed=4, temperature=0.8, logprobs=True, top_logprobs=5,
                 extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    whole = chat(client, n=2, **asked)
    prompt = whole.model_extra["prompt_token_ids"]
    for c in whole.choices:
        ids = c.model_extra["token_ids"]
        assert [t.token for t in c.logprobs.content] == [f"token_id:{i}" for i in ids]
        alternatives = [[(a.token, a.logprob) for a in t.top_logprobs] for t in c.logprobs.content]
        assert_alternatives_exact(worker.model, prompt, ids, alternatives, 5, 0.8)
        for t in c.logprobs.content:  # the sampled token, where listed, has the very same value
            assert all(a.logprob == t.logprob for a in t.top_logprobs if a.token == t.token)
    stream = chat(client, n=2, stream=True, **asked)
    streamed = {0: [], 1: []}
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += [[(a.token, a.logprob) for a in t.top_logprobs]
                                  for t in (c.logprobs.content if c.logprobs else [])]
    for c in whole.choices:
        assert streamed[c.index] == [[(a.token, a.logprob) for a in t.top_logprobs] for t in c.logprobs.content]
    done = client.completions.create(model="tiny", prompt="the cat", max_tokens=6, logprobs=3, seed=2,
                                     extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    c = done.choices[0]
    ids = c.model_extra["token_ids"]
    assert_alternatives_exact(worker.model, c.model_extra["prompt_token_ids"], ids,
                              [list(d.items())[:3] for d in c.logprobs.top_logprobs], 3, 1.0)
    for token, value, top in zip(ids, c.logprobs.token_logprobs, c.logprobs.top_logprobs):
        listed = f"token_id:{token}" in list(top)[:3]  # else added after the top 3 (OpenAI's k + 1)
        assert top[f"token_id:{token}"] == value and len(top) == (3 if listed else 4)
    assert c.logprobs.text_offset == [len(tok.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd"))
                                      for i in range(6)]
    plain = chat(client, max_tokens=3, logprobs=True)  # text names; no alternatives unless asked
    assert all(t.top_logprobs == [] and not t.token.startswith("token_id:") for t in plain.choices[0].logprobs.content)


# ---------------------------------------------------------------------------------------------- tools
def test_tool_calls_are_parsed_by_the_tokenizers_own_parser(served, tok):
    _, _, client = served
    r = chat(client, tools=[ADD], temperature=0, max_tokens=64)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"a": 2, "b": 3}
    assert tok.decode(c.model_extra["token_ids"]) == CALL
    streamed = list(chat(client, tools=[ADD], temperature=0, max_tokens=64, stream=True))
    calls = [t for ch in streamed for choice in ch.choices for t in (choice.delta.tool_calls or [])]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("add", {"a": 2, "b": 3})]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"
    assert not any(choice.delta.content for ch in streamed for choice in ch.choices)  # no raw markup streamed
    plain = chat(client, tools=[ADD], tool_choice="none", temperature=0, max_tokens=64)  # the tools are not rendered
    assert plain.model_extra["prompt_token_ids"] == tok.apply_chat_template(USER, add_generation_prompt=True,
                                                                            return_dict=False)
    assert plain.choices[0].message.tool_calls is None
    forced = chat(client, tools=[ADD], tool_choice="required", temperature=0, max_tokens=64)  # constrained: the same
    assert forced.choices[0].message.tool_calls[0].function.name == "add"  # call (tests/test_serve_structured.py)
    assert forced.choices[0].model_extra["token_ids"] == c.model_extra["token_ids"]


def test_a_call_of_valid_json_but_not_a_calls_shape_is_content_with_its_markup_and_why(tok):
    """A sampled call whose JSON parses but has no string name (or arguments that are not an object) is returned as
    content, not as a tool call the client could not send back (the server refuses such a message with a 400); the
    markup stays as the model wrote it and the reason comes with it."""
    from rollout.server.completions.chat import ChatFormat

    fmt = ChatFormat(tok)
    prompt = fmt.render(USER, [ADD])
    for markup in ('{"nam": "add", "arguments": {}}', '{"name": 5, "arguments": {}}',
                   '{"name": "add", "arguments": [1]}'):
        ids = tok.encode(f"<tool_call>{markup}</tool_call><|end|>")
        message, error = fmt.message(ids, tok.decode(ids, skip_special_tokens=True), prompt, [ADD])
        assert "tool_calls" not in message and message["content"] == f"<tool_call>{markup}</tool_call>"
        assert "name" in error
    ids = tok.encode(CALL)
    good, error = fmt.message(ids, tok.decode(ids, skip_special_tokens=True), prompt, [ADD])
    assert [c["function"]["name"] for c in good["tool_calls"]] == ["add"] and error is None


# ---------------------------------------------------------------------------------------------- episodes
def test_episode_turns_extend_the_sampled_tokens_and_come_back_as_segments(served, tok):
    worker, server, client = served
    first = chat(client, tools=[ADD], temperature=0, max_tokens=64, extra_body={"episode_id": "ep-1"})
    message = first.choices[0].message.model_dump(exclude_none=True)
    tool = {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "5"}
    second_messages = USER + [message, tool]
    second = chat(client, messages=second_messages, tools=[ADD], max_tokens=8, seed=2,
                  extra_headers={"X-Episode-Id": "ep-1"}, extra_body={"ignore_eos": True})
    p1, t1 = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    p2, t2 = second.model_extra["prompt_token_ids"], second.choices[0].model_extra["token_ids"]
    observation = tok.encode("<|tool|>5<|end|><|assistant|>")  # the template's rendering of the tool message
    assert p2 == p1 + t1 + observation
    assert second.usage.prompt_tokens_details.cached_tokens >= 16  # the history's full pages: prefix cache
    # the harness rewrites the history: not an extension, so a new segment with its whole prompt
    edited = [{"role": "user", "content": "what is two plus four"}]
    third = chat(client, messages=edited, max_tokens=5, seed=4, extra_body={"episode_id": "ep-1"})
    chat(client, max_tokens=3, extra_body={"episode_id": "ep-2"})
    assert server.episodes().ids() == ["ep-1", "ep-2"]
    batch = server.take_episode("ep-1")
    assert "ep-1" not in server.episodes() and len(server.episodes()) == 1
    assert batch.episode_index.tolist() == [0, 0] and batch.segment_index.tolist() == [0, 1]
    assert batch.prompt_ids == [p1, third.model_extra["prompt_token_ids"]]
    rows = batch.completion_token_lists()
    assert rows[0] == t1 + observation + t2 and rows[1] == third.choices[0].model_extra["token_ids"]
    mask = batch.action_mask[0, : len(rows[0])].tolist()
    assert mask == [True] * len(t1) + [False] * len(observation) + [True] * len(t2)
    assert batch.num_turns.tolist() == [2, 1] and batch.finish_reason == ["length", "length"]
    versions = batch.token_versions[0, : len(rows[0])]
    assert (versions[~torch.tensor(mask)] == -1).all() and (versions[torch.tensor(mask)] == 0).all()
    for r in range(2):  # the model's tokens are exact under a forward of the whole segment
        n = len(rows[r])
        full, _ = reference_logprobs(worker.model, batch.prompt_ids[r], rows[r])
        at = batch.action_mask[r, :n]
        assert float((batch.logprobs[r, :n][at] - full[at]).abs().max()) <= TOL
        assert (batch.logprobs[r, :n][~at] == 0).all()
    with pytest.raises(KeyError, match="ep-1"):
        server.take_episode("ep-1")


# ---------------------------------------------------------------------------------------------- failures
def test_bad_requests_are_openai_errors_and_submit_nothing(served):
    worker, server, client = served
    before = worker.engine.num_prompt_tokens
    cases = [
        (dict(temperature=-1), 400, "temperature"),
        (dict(presence_penalty=3), 400, "presence_penalty"),
        (dict(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
        (dict(top_logprobs=2), 400, "top_logprobs"),  # without logprobs=true
        (dict(n=0), 400, "n"),
        (dict(max_tokens=5000), 400, "max_tokens"),
        (dict(messages=[{"role": "user", "content": "word " * 2000}]), 400, "messages"),
        (dict(model="gpt-9"), 404, "model"),
        (dict(extra_body={"frobnicate": 1}), 400, "frobnicate"),
        (dict(extra_body={"prompt_token_ids": [1, 99999]}, messages=None), 400, "prompt_token_ids"),
        (dict(stop=["x"], extra_body={"stop_token_ids": [99999]}), 400, "stop_token_ids"),
    ]
    for kwargs, status, param in cases:
        with pytest.raises(openai.APIStatusError) as error:
            chat(client, **kwargs)
        assert error.value.status_code == status and error.value.body["param"] == param, (kwargs, error.value.body)
        assert error.value.body["type"] == "invalid_request_error" and "message" in error.value.body
    status, body = http(f"{server.url}/chat/completions", b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    assert http(f"{server.url}/nowhere") == (404, {"error": {"message": "Not Found", "type": "invalid_request_error",
                                                              "param": None, "code": None}})
    assert worker.engine.num_prompt_tokens == before  # nothing reached the engine
    assert chat(client, max_tokens=2).choices[0].finish_reason in ("stop", "length")  # and it still serves


def test_a_completions_prompt_refused_is_named_as_the_request_spelled_it(served):
    """Found by benchmarks/fleet/chaos.py: a completions request with prompt_token_ids got 400s naming `prompt`."""
    _, server, _ = served
    cases = [({"prompt_token_ids": [1, 99999]}, "prompt_token_ids"),
             ({"prompt_token_ids": [7] * 1100}, "prompt_token_ids"),  # past the 1024-token context
             ({"prompt": [1, 99999]}, "prompt"), ({"prompt": "word " * 2000}, "prompt")]
    for fields, param in cases:
        body = json.dumps({"model": "tiny", "max_tokens": 4, **fields}).encode()
        status, payload = http(f"{server.url}/completions", body)
        assert (status, payload["error"]["param"]) == (400, param), (fields, payload)


def test_a_400_names_the_parameter_from_the_errors_field_not_from_its_text():
    from rollout.base.errors import invalid
    from rollout.server.transport.errors import from_value_error
    from rollout.server.completions.service import API_NAMES

    located = from_value_error(invalid("max_new_tokens", 9, "too long", "shorten it", "prompt 0", 0), API_NAMES)
    assert (located.status, located.param) == (400, "max_tokens")  # rollout's name mapped to the request's
    assert located.message == "prompt 0: max_tokens=9 is invalid: too long. Fix: shorten it."
    nested = invalid("tokenizer.chat_template", None, "tool results are rendered with it", "set one")
    assert from_value_error(nested, API_NAMES).param == "tokenizer.chat_template"
    assert from_value_error(invalid("prompt+completion", "9 tokens", "too long", "cut it", "pair 0", 0)).param == \
        "prompt+completion"
    plain = ValueError("record_routing=True is invalid for LlamaForCausalLM: it has no mixture-of-experts router")
    unnamed = from_value_error(plain, API_NAMES)  # reads like a field, but names no request parameter
    assert (unnamed.status, unnamed.param, unnamed.message) == (400, None, str(plain))


def test_a_client_that_disconnects_cancels_its_request(served, slow_steps):
    worker, _, client = served
    engine = worker.engine
    impatient = client.with_options(timeout=1.0)
    start = time.monotonic()
    with pytest.raises(openai.APITimeoutError):
        chat(impatient, max_tokens=900, extra_body={"ignore_eos": True})
    assert wait_until(lambda: settled(engine), 10)
    streamed = chat(client, max_tokens=900, stream=True, extra_body={"ignore_eos": True})
    chunks = [next(streamed) for _ in range(4)]
    assert chunks[-1].choices[0].model_extra["token_ids"]
    assert engine.in_flight().requests
    streamed.close()
    assert wait_until(lambda: settled(engine), 10)
    assert time.monotonic() - start < 20  # both were cancelled, not run to their 900 tokens


def test_versions_after_an_update_that_lands_mid_stream(tiny_path, tok):
    v0, _ = load_tiny_model(tiny_path)
    v1, _ = load_tiny_model(tiny_path)
    v1.load_state_dict(perturbed(v0, 1))
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16, max_batch_tokens=64), tokenizer=tok) as worker, \
            rollout.serve(worker, port=0, model_name="tiny") as server:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0)
        stream = chat(client, max_tokens=80, stream=True, extra_body={"ignore_eos": True, "episode_id": "e"})
        ids, versions, final = [], [], None
        for chunk in stream:
            for c in chunk.choices:
                ids += c.model_extra.get("token_ids", [])
                versions += c.model_extra.get("token_versions", [])
                final = c.model_extra.get("policy_version", final)
            if len(ids) >= 10 and worker.policy_version == 0:
                worker.update_weights(v1.state_dict(), in_flight="recompute")
        assert len(ids) == 80 and versions[0] == 0 and versions[-1] == 1 and final == 0
        assert versions == sorted(versions)
        batch = server.take_episode("e")
        assert batch.completion_token_lists() == [ids] and batch.token_versions[0].tolist() == versions
        gaps = gaps_by_version({0: v0, 1: v1}, batch)
        assert gaps[0] <= TOL and gaps[1] <= TOL, gaps
        assert client.models.list().data[0].id == "tiny"
        assert http(server.url.removesuffix("/v1") + "/health") == (200, {"status": "ok", "policy_version": 1})


def test_an_api_key_is_required_when_given(served):
    worker, _, _ = served
    with rollout.serve(worker, port=0, api_key="sesame", model_name="tiny") as server:
        good = openai.OpenAI(base_url=server.url, api_key="sesame", max_retries=0)
        bad = openai.OpenAI(base_url=server.url, api_key="wrong", max_retries=0)
        assert good.models.list().data[0].id == "tiny"
        with pytest.raises(openai.AuthenticationError) as error:
            chat(bad, max_tokens=2)
        assert error.value.body["code"] == "invalid_api_key"
        assert http(server.url.removesuffix("/v1") + "/health")[0] == 200


# ---------------------------------------------------------------------------------------------- other rollouts
class CallsInTurn:
    """A Rollouts without streaming (`supports_streaming` False) that runs one call at a time, as a RolloutFleet
    does."""

    supports_streaming = False

    def __init__(self, worker):
        self.worker, self.calls, self.lock = worker, [], threading.Lock()

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def submit(self, prompts, sampling=None, chat_template=False, env=None, max_turns=1, max_episode_tokens=None,
               env_timeout=300.0):
        raise AssertionError("the server must batch calls for this rollouts object")

    def generate(self, prompts, sampling=None, **kwargs):
        with self.lock:
            self.calls.append(len(prompts))
            return self.worker.generate(prompts, sampling, **kwargs)


def test_rollouts_that_run_calls_in_turn_get_concurrent_requests_batched(served):
    worker, _, _ = served
    wrapped = CallsInTurn(worker)
    with rollout.serve(wrapped, port=0, model_name="tiny") as server:
        client = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0)
        results = {}

        def ask(seed):
            results[seed] = chat(client, max_tokens=6, seed=seed, extra_body={"ignore_eos": True})

        threads = [threading.Thread(target=ask, args=(s,)) for s in range(8)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        streamed = chat(client, max_tokens=6, seed=3, stream=True, extra_body={"ignore_eos": True})
        streamed_ids = [i for ch in streamed for c in ch.choices for i in c.model_extra.get("token_ids", [])]
    assert sum(wrapped.calls) == 9 and len(wrapped.calls) < 9  # some requests shared a call
    direct = {s: chat_direct(worker, seed=s) for s in range(8)}
    assert {s: r.choices[0].model_extra["token_ids"] for s, r in results.items()} == direct
    assert streamed_ids == direct[3]


def chat_direct(worker, seed):
    prompt = worker.tokenizer.apply_chat_template(USER, add_generation_prompt=True, return_dict=False)
    batch = worker.generate([prompt], SamplingParams(max_new_tokens=6, seed=seed, stop_token_ids=()))
    return batch.completion_token_lists()[0]


# ---------------------------------------------------------------------------------------------- the command
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_rollout_serve_command_serves_until_interrupted(tiny_path):
    port = free_port()
    cmd = [sys.executable, "-m", "rollout.cli.serve", str(tiny_path), "--port", str(port), "--served-model-name",
           "tiny", "--kv-cache-memory-mb", "16", "--in-flight", "recompute", "--api-key", "k"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert wait_until(lambda: _healthy(port) or proc.poll() is not None, 300), "never came up: " + (proc.stderr.read() if proc.poll() is not None else "still starting")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=4)
        assert len(r.choices[0].model_extra["token_ids"]) <= 4
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "serving 'tiny' on http://127.0.0.1" in err



def test_rollout_serve_command_refuses_bad_flags_before_loading_anything(tiny_path, capsys):
    from rollout.cli.serve import main

    assert main([str(tiny_path), "--page-size", "2"]) == 2
    assert "rollout: error: page_size=2 is invalid" in capsys.readouterr().err
    assert main([str(tiny_path) + "-missing"]) == 2
    assert "not a directory" in capsys.readouterr().err
    from rollout import Speculation
    from rollout.cli.serve import build_parser

    assert build_parser().parse_args([str(tiny_path), "--speculation", "always"]).speculation == Speculation(
        mode="always")
    assert build_parser().parse_args([str(tiny_path), "--speculation", "off"]).speculation is None
    with pytest.raises(SystemExit):
        main([str(tiny_path), "--speculation", "sometimes"])
    assert "is not one of auto, always, off" in capsys.readouterr().err


def _healthy(port: int) -> bool:
    try:
        return http(f"http://127.0.0.1:{port}/health")[0] == 200
    except OSError:
        return False


def test_the_agent_examples_warm_up_call_parses_and_fits_its_first_turn(tok):
    """examples/agent_openai.py: the call its warm-up teaches is what the chat template writes, parses as a call to
    `peek`, and fits the first turn's max_tokens (a call cut short never parses: no episode reaches the tool, and
    GRPO has nothing to learn from); its answers fit the second turn's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("agent_openai", os.path.join(
        os.path.dirname(__file__), "..", "examples", "agent_openai.py"))
    agent = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent)
    pairs = agent.warm_up_pairs(tok, 8, seed=0, calls=2)
    (first, call), answers = pairs[0], pairs[2:]
    assert pairs[1] == pairs[0] and len(answers) == 8
    said = [{"role": "assistant", "content": None,
             "tool_calls": [{"type": "function", "function": {"name": "peek", "arguments": {}}}]}]
    rendered = tok.apply_chat_template(agent.QUESTION + said, tools=[agent.PEEK], return_dict=False)
    assert rendered == first + call
    parsed = tok.parse_response(call, prefix=first, tools=[agent.PEEK])
    assert [c["function"]["name"] for c in parsed["tool_calls"]] == ["peek"]
    assert len(call) <= agent.FIRST_TURN_TOKENS
    assert all(len(a) <= agent.ANSWER_TOKENS and tok.decode(a[:1]).isdigit() for _, a in answers)
