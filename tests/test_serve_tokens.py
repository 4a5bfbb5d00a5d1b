"""The server's prompt logprobs (echo, prompt_logprobs), token-in/token-out endpoints and per-request limits, over
loopback HTTP on the tiny model.

Every prompt logprob is checked against `rollout.score` (the scoring path) and an independent teacher-forced forward;
the request bodies are the ones lm-eval's `local-completions` and renderers' `generate` (verifiers) send.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
import torch
from conftest import reference_logprobs

import rollout
from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.server.transport.limits import RequestLimits
from rollout.testing import build_chat_tokenizer, load_tiny_model

TOL = 1e-5
TEXT = "the cat sat on the mat and looked at two dogs"


@pytest.fixture(scope="module")
def tok():
    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def served(tiny_path, tok):
    model, _ = load_tiny_model(tiny_path)
    worker = RolloutWorker(model, WorkerConfig(page_size=16, max_batch_tokens=128), tokenizer=tok)
    server = rollout.serve(worker, port=0, model_name="tiny")
    yield worker, server
    server.close()
    worker.close()


def post(server, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    root = server.url.removesuffix("/v1")
    data = raw if raw is not None else json.dumps(body).encode()
    request = urllib.request.Request(root + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(server, path: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(server.url.removesuffix("/v1") + path, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def reference(model, prompt: list[int]) -> torch.Tensor:
    """log_softmax of the logits predicting prompt[1:], one plain forward: [P - 1, V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def assert_prompt_logprobs(worker, prompt: list[int], values: list[float]) -> None:
    """`values` (for prompt[1:]) equal rollout.score's and an independent forward's, within TOL."""
    (scored,) = rollout.score(worker.model, [prompt[:1]], [prompt[1:]])
    forward, _ = reference_logprobs(worker.model, prompt[:1], prompt[1:])
    got = torch.tensor(values)
    assert float((got - scored).abs().max()) <= TOL and float((got - forward).abs().max()) <= TOL


# ---------------------------------------------------------------------------------------------- echo
def test_lm_eval_loglikelihood_request_gets_exact_prompt_logprobs_and_greedy_flags(served, tok):
    worker, server = served
    prompts = [tok.encode(TEXT), tok.encode("two dogs ran")]
    # lm-eval's local-completions loglikelihood body, token ids batched (tokenized_requests=True)
    body = {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    for choice, prompt in zip(sorted(out["choices"], key=lambda c: c["index"]), prompts):
        lp = choice["logprobs"]
        generated = choice["token_ids"]
        assert len(generated) == 1 and lp["tokens"] == [tok.decode([t]) for t in prompt + generated]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert_prompt_logprobs(worker, prompt, lp["token_logprobs"][1:len(prompt)])
        full, _ = reference_logprobs(worker.model, prompt, generated)  # the generated token: the engine's
        assert abs(lp["token_logprobs"][-1] - float(full[0])) <= TOL
        logp = reference(worker.model, prompt)
        for pos, top in enumerate(lp["top_logprobs"][1:len(prompt)]):
            name, value = next(iter(top.items()))  # the most likely first; the prompt token added when another
            assert name == tok.decode([int(logp[pos].argmax())]) and abs(value - float(logp[pos].max())) <= TOL
            greedy = int(logp[pos].argmax()) == prompt[pos + 1]
            assert len(top) == (1 if greedy else 2) and top[tok.decode([prompt[pos + 1]])] == lp["token_logprobs"][
                pos + 1]
            assert (lp["token_logprobs"][pos + 1] == value) == greedy  # lm-eval's is_greedy, bit-exact
        assert choice["text"] == tok.decode(prompt, skip_special_tokens=True) + tok.decode(generated)
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])


def test_max_tokens_zero_with_echo_scores_a_text_prompt_without_generating(served, tok):
    worker, server = served
    before = worker.engine.num_prompt_tokens
    status, out = post(server, "/v1/completions", {"model": "tiny", "prompt": TEXT, "max_tokens": 0, "echo": True,
                                                   "logprobs": 0, "n": 2})
    assert status == 200, out
    prompt = tok.encode(TEXT)
    for choice in out["choices"]:
        assert choice["text"] == TEXT and choice["token_ids"] == [] and choice["finish_reason"] == "length"
        assert choice["logprobs"]["top_logprobs"] is None and len(choice["logprobs"]["tokens"]) == len(prompt)
        assert_prompt_logprobs(worker, prompt, choice["logprobs"]["token_logprobs"][1:])
    assert worker.engine.num_prompt_tokens == before  # nothing reached the engine
    assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(prompt)
    status, out = post(server, "/v1/completions", {"model": "tiny", "prompt": TEXT, "max_tokens": 0})
    assert status == 400 and out["error"]["param"] == "max_tokens"  # 0 only when the prompt is what is asked


def test_prompt_logprobs_in_vllm_shape_with_ranks_for_completions_and_chat(served, tok):
    worker, server = served
    prompt = tok.encode(TEXT)
    status, out = post(server, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 3, "seed": 2,
                                                   "prompt_logprobs": 2})
    assert status == 200, out
    entries = out["choices"][0]["prompt_logprobs"]
    logp = reference(worker.model, prompt)
    assert entries[0] is None and len(entries) == len(prompt)
    for pos, entry in enumerate(entries[1:]):
        token = prompt[pos + 1]
        own = entry[str(token)]
        assert own["rank"] == 1 + int((logp[pos] > logp[pos, token]).sum())
        assert own["decoded_token"] == tok.decode([token])
        best = torch.topk(logp[pos], 2).indices.tolist()
        for rank, i in enumerate(best, 1):
            assert abs(entry[str(i)]["logprob"] - float(logp[pos, i])) <= TOL
            assert i == token or entry[str(i)]["rank"] == rank
        assert set(entry) == {str(token), *map(str, best)}
    assert_prompt_logprobs(worker, prompt, [e[str(t)]["logprob"] for e, t in zip(entries[1:], prompt[1:])])
    chat = openai.OpenAI(base_url=server.url, api_key="-", max_retries=0).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"prompt_logprobs": 0})
    ids = chat.model_extra["prompt_token_ids"]
    top = chat.model_extra["prompt_logprobs"]
    assert top[0] is None and all(set(e) == {str(t)} for e, t in zip(top[1:], ids[1:]))
    assert_prompt_logprobs(worker, ids, [e[str(t)]["logprob"] for e, t in zip(top[1:], ids[1:])])


# ---------------------------------------------------------------------------------------------- token in, token out
def test_generate_endpoint_takes_and_returns_token_ids_as_renderers_sends_them(served, tok):
    worker, server = served
    prompt = tok.encode(TEXT)
    stops = [tok.eos_token_id]
    # the body renderers' generate (verifiers' RendererClient) posts for a top-3 head: logprobs = k + 2
    sampling = {"max_tokens": 6, "temperature": 1.0, "top_p": 1.0, "seed": 9, "stop_token_ids": stops, "logprobs": 5,
                "flat_logprobs": True, "extra_args": {"prl_compact_logprobs": True}, "skip_special_tokens": False}
    status, out = post(server, "/inference/v1/generate", {"model": "tiny", "token_ids": prompt,
                                                          "sampling_params": sampling})
    assert status == 200, out
    choice = out["choices"][0]
    assert out["prompt_token_ids"] == prompt and out["prompt_logprobs"] is None and out["request_id"]
    same = worker.generate([prompt], SamplingParams(max_new_tokens=6, seed=9, stop_token_ids=tuple(stops)))
    assert choice["token_ids"] == same.completion_token_lists()[0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in choice["token_ids"]]
    full, _ = reference_logprobs(worker.model, prompt, choice["token_ids"])
    assert float((torch.tensor([c["logprob"] for c in content]) - full).abs().max()) <= TOL
    assert all(len(c["top_logprobs"]) == 5 and c["top_logprobs"][0]["token"].startswith("token_id:") for c in content)
    assert out["usage"]["prompt_tokens"] == len(prompt) and choice["finish_reason"] in ("stop", "length")
    status, bad = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {"temperature": -1}})
    assert status == 400 and bad["error"]["param"] == "sampling_params.temperature", bad
    status, bad = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": {"frob": 1}})
    assert status == 400 and bad["error"]["param"] == "sampling_params.frob"
    only_prompt = {"max_tokens": 0, "prompt_logprobs": 1}
    status, scored = post(server, "/inference/v1/generate", {"token_ids": prompt, "sampling_params": only_prompt})
    assert status == 200 and scored["choices"][0]["token_ids"] == []
    assert_prompt_logprobs(worker, prompt, [e[str(t)]["logprob"] for e, t in zip(scored["prompt_logprobs"][1:],
                                                                                    prompt[1:])])


def test_tokenize_detokenize_and_the_model_card(served, tok):
    worker, server = served
    status, out = post(server, "/tokenize", {"model": "tiny", "prompt": TEXT, "return_token_strs": True})
    assert status == 200 and out["tokens"] == tok(TEXT)["input_ids"] and out["count"] == len(out["tokens"])
    assert out["token_strs"] == tok.convert_ids_to_tokens(out["tokens"])
    messages = [{"role": "user", "content": "hi"}]
    status, chat = post(server, "/tokenize", {"messages": messages})
    assert chat["tokens"] == tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert chat["token_strs"] is None and chat["max_model_len"] == out["max_model_len"]
    assert post(server, "/detokenize", {"tokens": out["tokens"]}) == (200, {"prompt": tok.decode(out["tokens"])})
    assert post(server, "/detokenize", {"tokens": [10 ** 9]})[1]["error"]["param"] == "tokens"
    status, card = get(server, "/v1/models/tiny")
    assert status == 200 and card["id"] == "tiny" and card["max_model_len"] == out["max_model_len"] > 0
    status, missing = get(server, "/v1/models/other")
    assert status == 404 and missing["error"]["code"] == "model_not_found"


def test_tokenizer_info_is_what_lm_evals_remote_tokenizer_reads(served, tok):
    _, server = served
    status, info = get(server, "/tokenizer_info")
    assert status == 200
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == ("<eos>", "<bos>", "<pad>")
    assert info["chat_template"] == tok.chat_template and info["model_max_length"] > 0
    # lm-eval's RemoteTokenizer.eos_token_id: /tokenize of eos_token without special tokens, first id
    status, out = post(server, "/tokenize", {"prompt": info["eos_token"], "add_special_tokens": False})
    assert out["tokens"][0] == tok.eos_token_id


# ---------------------------------------------------------------------------------------------- text offsets
def test_text_offsets_index_into_the_text_special_tokens_skipped(served, tok):
    _, server = served
    prompt = tok.encode("<|user|>hi there<|end|><|assistant|>")  # special tokens the text leaves out
    body = {"model": "tiny", "prompt": prompt, "echo": True, "logprobs": 0, "max_tokens": 8, "seed": 3,
            "ignore_eos": True}
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    completion, text, offsets = choice["token_ids"], choice["text"], choice["logprobs"]["text_offset"]
    head = tok.decode(prompt, skip_special_tokens=True)
    def before(ids, i):  # the text of the tokens before i; a token after half a character begins where it does
        return len(tok.decode(ids[:i], skip_special_tokens=True).rstrip("\ufffd"))

    expected = [before(prompt, i) for i in range(len(prompt))] + \
        [len(head) + before(completion, i) for i in range(len(completion))]
    assert text == head + tok.decode(completion, skip_special_tokens=True) and offsets == expected
    assert offsets[:3] == [0, 0, 1] and offsets[6] == offsets[7] == len("hi there")  # <|user|>, <|end|>: no text
    streamed = post_stream(server, {**body, "echo": False, "stream": True})
    assert [o for chunk in streamed for o in (chunk["choices"][0]["logprobs"] or {}).get("text_offset", [])] == [
        o - len(head) for o in expected[len(prompt):]]


def post_stream(server, body) -> list[dict]:
    request = urllib.request.Request(server.url + "/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        lines = response.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


# ---------------------------------------------------------------------------------------------- top logprobs
def test_completions_top_logprobs_add_the_chosen_token_as_openai_does(served, tok):
    worker, server = served
    body = {"model": "tiny", "prompt": TEXT, "logprobs": 2, "max_tokens": 12, "seed": 7, "temperature": 1.0,
            "ignore_eos": True, "return_tokens_as_token_ids": True}
    status, out = post(server, "/v1/completions", body)
    assert status == 200, out
    choice = out["choices"][0]
    ids, lp = choice["token_ids"], choice["logprobs"]
    prompt = choice["prompt_token_ids"]
    with torch.no_grad():
        logits = worker.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1].float()
    reference = torch.log_softmax(logits, dim=-1)
    added = 0
    for pos, (token, value, top) in enumerate(zip(ids, lp["token_logprobs"], lp["top_logprobs"])):
        best = reference[pos].topk(2).indices.tolist()
        listed = [int(name.removeprefix("token_id:")) for name in top]
        assert listed == best + ([] if token in best else [token])  # the top 2, then the chosen one if not there
        assert top[f"token_id:{token}"] == value  # the chosen token's entry is its own logprob, bit for bit
        assert max(abs(v - float(reference[pos, i])) for i, v in zip(listed, top.values())) <= 3e-5
        added += token not in best
    assert added > 0  # the untaught model samples outside its top 2 at T = 1 (seeded)


def test_tokens_that_decode_alike_share_one_key_holding_the_most_likely():
    from rollout.server.completions.prompts import legacy_top
    from rollout.server.rollouts.choices import Detokenizer

    class Alike:  # ids 1 and 2 decode to the same text
        def decode(self, ids, skip_special_tokens=False):
            return "".join("x" if i in (1, 2) else f"<{i}>" for i in ids)

    detok = Detokenizer(Alike())
    assert legacy_top(detok, 2, -3.0, [5, 1], [-0.5, -1.0]) == {"<5>": -0.5, "x": -1.0}
    assert legacy_top(detok, 7, -4.0, [2, 1], [-0.2, -0.9]) == {"x": -0.2, "<7>": -4.0}
    assert legacy_top(Detokenizer(Alike(), as_ids=True), 2, -3.0, [5, 1], [-0.5, -1.0]) == {
        "token_id:5": -0.5, "token_id:1": -1.0, "token_id:2": -3.0}


# ---------------------------------------------------------------------------------------------- limits
@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000, b'{"a":' * 5000 + b"1" + b"}" * 5000,
                                 b'{"model": "tiny", "prompt": ' + b"[" * 65 + b"1" + b"]" * 65 + b"}"])
def test_a_deeply_nested_body_is_a_400_naming_the_rule_not_a_500(served, raw):
    _, server = served
    for path in ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/tokenize"):
        status, out = post(server, path, None, raw=raw)
        assert status == 400 and out["error"]["type"] == "invalid_request_error", (path, out)
        assert "64 levels" in out["error"]["message"] and "--max-json-depth" in out["error"]["message"]
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1})[0] == 200


def test_n_prompts_and_stop_strings_are_bounded_and_the_bounds_are_configurable(served):
    worker, server = served
    before = worker.engine.num_prompt_tokens
    status, out = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 10000})
    assert status == 400 and out["error"]["param"] == "n"
    assert all(s in out["error"]["message"] for s in ("n=10000", "at most 128", "--max-n", "max_n="))
    status, out = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                                        "stop": [f"s{i}" for i in range(65)]})
    assert status == 400 and out["error"]["param"] == "stop" and "max_stop" in out["error"]["message"]
    assert worker.engine.num_prompt_tokens == before
    with rollout.serve(worker, port=0, model_name="tiny", max_n=2, max_prompts=1) as small:
        assert post(small, "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 3})[1]["error"]["param"] == "n"
        assert post(small, "/v1/completions", {"model": "tiny", "prompt": ["a", "b"]})[1]["error"]["param"] == "prompt"
        assert len(post(small, "/v1/completions", {"model": "tiny", "prompt": "hi", "n": 2, "max_tokens": 1})[1]
                   ["choices"]) == 2
    with pytest.raises(ValueError, match="max_n"):
        RequestLimits(max_n=0)
