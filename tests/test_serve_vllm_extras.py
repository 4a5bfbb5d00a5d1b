"""vLLM's spellings that RL frameworks send by default (issue 47): top_k = -1 for "disabled" (vLLM, verl, SkyRL,
OpenRLHF), `use_beam_search: false`, `include_stop_str_in_output` on the token route, and completions without
`model` (AReaL's VLLMBackend). Each is accepted meaning what it means in vLLM, or refused by name."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import torch
from conftest import reference_logprobs

import rollout
from rollout import InvalidArgument, RolloutWorker, SamplingParams, WorkerConfig
from rollout.cli import records
from rollout.cli.main import build_parser
from rollout.testing import build_chat_tokenizer, load_tiny_model

TOL = 1e-5
PROMPT = [5, 17, 42, 9, 3, 88, 120]


@pytest.fixture(scope="module")
def served(tiny_path):
    model, _ = load_tiny_model(tiny_path)
    worker = RolloutWorker(model, WorkerConfig(page_size=16, max_batch_tokens=128), tokenizer=build_chat_tokenizer())
    server = rollout.serve(worker, port=0, model_name="tiny")
    yield worker, server
    server.close()
    worker.close()


def post(server, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(server.url.removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_top_k_minus_one_is_disabled_in_sampling_params_and_the_cli_and_other_negatives_are_refused():
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(top_k=-1) == SamplingParams()
    with pytest.raises(InvalidArgument) as refused:
        SamplingParams(top_k=-2)
    assert refused.value.field == "top_k" and refused.value.value == -2 and "-1" in refused.value.fix
    with pytest.raises(InvalidArgument):
        SamplingParams(top_k=True)  # a bool is not an int here, -1 or not
    args = build_parser().parse_args(["generate", "--model", "m", "--input", "-", "--output", "o", "--top-k", "-1"])
    base = {k: getattr(args, k) for k in records.SAMPLING_FIELDS if getattr(args, k, None) is not None}
    assert base["top_k"] == -1 and records.sampling_for({}, base, None).top_k == 0
    with pytest.raises(records.FieldError):
        records.sampling_for({"top_k": -3}, {}, None)


def test_top_k_minus_one_samples_as_disabled_on_every_route_and_minus_two_is_a_400_naming_it(served):
    worker, server = served
    expected = worker.generate([PROMPT], SamplingParams(max_new_tokens=6, seed=3, ignore_eos=True))
    ids = expected.completion_token_lists()[0]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 6, "seed": 3, "ignore_eos": True}
    status, out = post(server, "/v1/completions", body | {"top_k": -1})
    assert status == 200 and out["choices"][0]["token_ids"] == ids, out
    status, out = post(server, "/v1/chat/completions", {"model": "tiny", "prompt_token_ids": PROMPT, "max_tokens": 6,
                                                        "seed": 3, "ignore_eos": True, "top_k": -1})
    assert status == 200 and out["choices"][0]["token_ids"] == ids, out
    status, out = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
        "max_tokens": 6, "seed": 3, "ignore_eos": True, "top_k": -1}})
    assert status == 200 and out["choices"][0]["token_ids"] == ids, out
    status, out = post(server, "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 2, "top_k": -1})
    assert status == 200, out
    for path, body, param in [("/v1/completions", body | {"top_k": -2}, "top_k"),
                              ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {"top_k": -2}},
                               "sampling_params.top_k"),
                              ("/v1/responses", {"model": "tiny", "input": "hi", "top_k": -5}, "top_k")]:
        status, out = post(server, path, body)
        assert status == 400 and out["error"]["param"] == param and "-1" in out["error"]["message"], (path, out)


def test_areal_vllm_backend_completions_without_model_with_use_beam_search_false_parse_as_areal_reads_them(served):
    worker, server = served
    # the payload of AReaL's VLLMBackend.build_generation_request (areal/engine/vllm_remote.py), token-ids branch:
    # no "model", top_k at its default int(1e8) (areal/api/cli_args.py), use_beam_search false
    payload = {"top_p": 1.0, "top_k": int(1e8), "max_tokens": 5, "temperature": 1.0, "stop_token_ids": [],
               "ignore_eos": True, "skip_special_tokens": True, "return_tokens_as_token_ids": True, "logprobs": 0,
               "use_beam_search": False, "stream": False, "prompt": PROMPT}
    status, response = post(server, "/v1/completions", payload)
    assert status == 200, response
    # parsed as VLLMBackend.parse_generation_response does
    meta_info = response["choices"][0]
    output_tokens = [int(t.split(":")[1]) for t in meta_info["logprobs"]["tokens"]]
    output_logprobs = meta_info["logprobs"]["token_logprobs"]
    assert len(output_tokens) == 5 and meta_info["finish_reason"] == "length" and response["model"] == "tiny"
    full, _ = reference_logprobs(worker.model, PROMPT, output_tokens)
    assert float((torch.tensor(output_logprobs) - full).abs().max()) <= TOL
    status, out = post(server, "/v1/completions", payload | {"use_beam_search": True})
    assert status == 400 and out["error"]["param"] == "use_beam_search", out
    status, out = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 2, "use_beam_search": False})
    assert status == 200 and out["model"] == "tiny", out
    status, out = post(server, "/v1/completions", payload | {"model": "gpt-9"})
    assert status == 404 and out["error"]["param"] == "model"
    status, out = post(server, "/v1/completions", payload | {"model": ""})
    assert status == 400 and out["error"]["param"] == "model"


def test_include_stop_str_in_output_on_the_token_route_returns_the_stop_strings_tokens_either_way(served):
    worker, server = served
    tok = worker.tokenizer
    sampled = worker.generate([PROMPT], SamplingParams(max_new_tokens=8, seed=5, ignore_eos=True))
    ids = sampled.completion_token_lists()[0]
    stop = tok.decode(ids[2:4])  # text the row writes: the route cuts the row at the token that completes it
    assert stop and stop not in tok.decode(ids[:2])
    answers = []
    for include in (False, True):
        status, out = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
            "max_tokens": 8, "seed": 5, "ignore_eos": True, "stop": [stop], "include_stop_str_in_output": include}})
        assert status == 200, out
        answers.append(out["choices"][0])
    assert answers[0]["token_ids"] == answers[1]["token_ids"]
    cut = answers[0]["token_ids"]
    assert cut == ids[:len(cut)] and stop in tok.decode(cut) and stop not in tok.decode(cut[:-1])
    assert answers[0]["finish_reason"] == "stop"
    status, out = post(server, "/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": {
        "include_stop_str_in_output": "yes"}})
    assert status == 400 and out["error"]["param"] == "sampling_params.include_stop_str_in_output", out


def test_skyrl_remote_client_generate_body_is_answered_as_it_parses_it(served):
    worker, server = served
    # RemoteInferenceClient's /inference/v1/generate payload (skyrl/backends/skyrl_train/inference_servers/
    # remote_inference_client.py) with get_vllm_sampling_params' dict (engine_utils.py) at SkyRL's SamplingParams
    # defaults (skyrl/train/config/config.py: top_k -1, logprobs 1, stop None)
    sampling_params = {"min_tokens": 1, "skip_special_tokens": True, "include_stop_str_in_output": True,
                       "max_tokens": 7, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "logprobs": 1,
                       "stop": None}
    status, response = post(server, "/inference/v1/generate", {"sampling_params": sampling_params, "model": "tiny",
                                                               "token_ids": PROMPT})
    assert status == 200, response
    choice = response["choices"][0]
    token_ids, stop_reason = choice["token_ids"], choice["finish_reason"]
    response_logprobs = [info["logprob"] for info in choice["logprobs"]["content"]]
    assert stop_reason in ("stop", "length") and 1 <= len(token_ids) <= 7 and len(response_logprobs) == len(token_ids)
    full, _ = reference_logprobs(worker.model, PROMPT, token_ids)
    assert float((torch.tensor(response_logprobs) - full).abs().max()) <= TOL
