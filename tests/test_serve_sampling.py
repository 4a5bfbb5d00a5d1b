"""The server's sampling and rendering fields, through the real `openai` client: penalties, min_p, min_tokens and
logit_bias reach the sampler (the same tokens as the in-process worker with the same SamplingParams, whose own
exactness tests/test_penalties.py checks against a reference); skip_special_tokens, include_stop_str_in_output, a
negative seed, chat_template_kwargs, add_generation_prompt, continue_final_message and reasoning_effort each do what
they say, or are refused by name."""

from __future__ import annotations

import openai
import pytest
from conftest import reference_logprobs

import rollout
from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import load_tiny_model
from rollout.testing.chat import build_reasoning_chat_tokenizer

USER = [{"role": "user", "content": "tell me a story"}]


@pytest.fixture(scope="module")
def served(tiny_path):
    tok = build_reasoning_chat_tokenizer()
    model, _ = load_tiny_model(tiny_path)
    worker = RolloutWorker(model, WorkerConfig(page_size=16, max_batch_tokens=128), tokenizer=tok)
    server = rollout.serve(worker, port=0, model_name="tiny")
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=600)
    yield worker, client, tok
    server.close()
    worker.close()


def chat(client, **kwargs):
    return client.chat.completions.create(**{"model": "tiny", "messages": USER, **kwargs})


def test_penalties_min_p_and_logit_bias_sample_what_the_worker_samples(served):
    worker, client, tok = served
    fields = dict(frequency_penalty=1.2, presence_penalty=-0.5, logit_bias={"40": 5.0, "41": -100})
    extra = dict(repetition_penalty=1.3, min_p=0.05, ignore_eos=True)
    r = chat(client, n=2, max_tokens=10, seed=-7, logprobs=True, **fields, extra_body=extra)
    prompt = r.model_extra["prompt_token_ids"]
    batch = worker.generate([prompt], SamplingParams(n=2, max_new_tokens=10, seed=-7, stop_token_ids=(),
                                                     frequency_penalty=1.2, presence_penalty=-0.5,
                                                     logit_bias={40: 5.0, 41: -100}, repetition_penalty=1.3,
                                                     min_p=0.05))
    tokens = [c.model_extra["token_ids"] for c in r.choices]
    assert tokens == batch.completion_token_lists() and all(41 not in ids for ids in tokens)
    plain = chat(client, n=2, max_tokens=10, seed=-7, extra_body={"ignore_eos": True})
    assert [c.model_extra["token_ids"] for c in plain.choices] != tokens  # the adjustments changed the draws
    for c, ids in zip(r.choices, tokens):  # logprobs stay those of the raw logits
        full, _ = reference_logprobs(worker.model, prompt, ids)
        assert max(abs(t.logprob - float(f)) for t, f in zip(c.logprobs.content, full)) <= 1e-5
    other = chat(client, max_tokens=10, seed=7, **fields, extra_body=extra)
    assert other.choices[0].model_extra["token_ids"] != tokens[0]  # -7 and 7 are different streams


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(served):
    _, client, tok = served
    end = tok.convert_tokens_to_ids("<|end|>")
    eager = chat(client, max_tokens=12, logit_bias={str(end): 100})
    assert eager.choices[0].model_extra["token_ids"] == [end]
    held = chat(client, n=2, max_tokens=12, logit_bias={str(end): 100}, extra_body={"min_tokens": 4})
    for c in held.choices:
        ids = c.model_extra["token_ids"]
        assert len(ids) == 5 and ids[-1] == end and c.finish_reason == "stop"
    free = chat(client, max_tokens=8, seed=3, extra_body={"ignore_eos": True}).choices[0]
    ids, text = free.model_extra["token_ids"], free.message.content
    stop = tok.decode(ids[:2])  # a stop string the first two tokens complete
    early = chat(client, max_tokens=8, seed=3, stop=[stop], extra_body={"ignore_eos": True}).choices[0]
    assert early.message.content == "" and early.finish_reason == "stop"
    late = chat(client, max_tokens=8, seed=3, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 3}).choices[0]
    assert late.model_extra["token_ids"] == ids and late.message.content == text  # no later occurrence: runs on


def test_text_options_keep_special_tokens_and_the_stop_string(served):
    _, client, tok = served
    base = dict(max_tokens=8, seed=3, extra_body={"ignore_eos": True})
    free = chat(client, **base).choices[0]
    ids, text = free.model_extra["token_ids"], free.message.content
    stop = text[2:5]
    with_stop = chat(client, max_tokens=8, seed=3, stop=[stop],
                     extra_body={"ignore_eos": True, "include_stop_str_in_output": True}).choices[0]
    assert with_stop.message.content == text[: text.find(stop) + len(stop)]
    end = tok.convert_tokens_to_ids("<|end|>")
    think = tok.convert_tokens_to_ids("<think>")
    special = dict(max_tokens=6, logit_bias={str(think): 100}, extra_body={"skip_special_tokens": False})
    shown = chat(client, **special).choices[0]
    assert shown.message.content.startswith("<think>")  # kept in the text
    assert chat(client, max_tokens=6, logit_bias={str(think): 100}).choices[0].message.content.find("<think>") < 0
    ended = chat(client, max_tokens=6, logit_bias={str(end): 100}, extra_body={"skip_special_tokens": False})
    assert ended.choices[0].message.content == ""  # the stop token that ended the row is not text (as vLLM)
    kept = chat(client, max_tokens=6, logit_bias={str(end): 100},
                extra_body={"skip_special_tokens": False, "include_stop_str_in_output": True})
    assert kept.choices[0].message.content == "<|end|>"


def test_chat_template_fields_reach_the_template(served):
    _, client, tok = served

    def prompt(**kwargs):
        return chat(client, max_tokens=1, **kwargs).model_extra["prompt_token_ids"]

    render = lambda messages, **kw: tok.apply_chat_template(messages, return_dict=False, **kw)  # noqa: E731
    assert prompt() == render(USER, add_generation_prompt=True)
    assert prompt(extra_body={"chat_template_kwargs": {"enable_thinking": False}}) == render(
        USER, add_generation_prompt=True, enable_thinking=False)
    assert prompt(reasoning_effort="low") == render(USER, add_generation_prompt=True, reasoning_effort="low")
    assert prompt(extra_body={"add_generation_prompt": False}) == render(USER, add_generation_prompt=False)
    partial = USER + [{"role": "assistant", "content": "Once upon"}]
    continued = prompt(messages=partial, extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert continued == render(partial, continue_final_message=True)
    assert tok.decode(continued).endswith("Once upon")


@pytest.mark.parametrize("kwargs, param", [
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-3), "presence_penalty"),
    (dict(logit_bias={"5": 101}), "logit_bias[5]"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"99999": 1}), "logit_bias"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(extra_body={"min_p": 2}), "min_p"),
    (dict(max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
    (dict(seed=2**63), "seed"),
    (dict(reasoning_effort="extreme"), "reasoning_effort"),
    (dict(extra_body={"chat_template_kwargs": {"tools_in_user_message": True}}),
     "chat_template_kwargs.tools_in_user_message"),  # the template never reads it
    (dict(extra_body={"chat_template_kwargs": {"tokenize": False}}), "chat_template_kwargs.tokenize"),
    (dict(extra_body={"continue_final_message": True}), "continue_final_message"),  # with a generation prompt
    (dict(extra_body={"skip_special_tokens": "no"}), "skip_special_tokens"),
    (dict(stream=True, stream_options={"include_obfuscation": True}), "stream_options.include_obfuscation"),
    (dict(messages=None, extra_body={"prompt_token_ids": [5, 6], "chat_template_kwargs": {"enable_thinking": False}}),
     "chat_template_kwargs"),  # nothing is rendered
])
def test_bad_values_are_400s_naming_the_field(served, kwargs, param):
    worker, client, _ = served
    before = worker.engine.num_prompt_tokens
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, **kwargs)
    assert error.value.body["param"] == param, error.value.body
    assert worker.engine.num_prompt_tokens == before


def test_reasoning_effort_is_refused_by_a_template_that_never_reads_it(tiny_path):
    from rollout.testing import build_chat_tokenizer

    model, _ = load_tiny_model(tiny_path)
    with RolloutWorker(model, WorkerConfig(page_size=16, max_batch_tokens=128),
                       tokenizer=build_chat_tokenizer()) as worker:
        with rollout.serve(worker, port=0, model_name="tiny") as server:
            client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0)
            with pytest.raises(openai.BadRequestError) as error:
                chat(client, max_tokens=2, reasoning_effort="low")
            assert error.value.body["param"] == "reasoning_effort" and "never reads" in error.value.body["message"]
            obfuscation_off = chat(client, max_tokens=2, stream=True, stream_options={"include_obfuscation": False})
            assert [c for c in obfuscation_off]
