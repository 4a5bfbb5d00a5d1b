"""SGLang's dialect (rollout/server/sglang/, the SGLang routes of admin/sglang.py), driven the way AReaL's SGLangBackend
(areal/engine/sglang_remote.py) builds its requests and parses the answers. Logprobs are checked against a plain
teacher-forced forward, tokens against the worker's own rows for the same seed."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import assert_alternatives_exact, perturbed, post_json, reference_logprobs, wait_for_tokens
from safetensors.torch import save_file

import rollout
from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import build_chat_tokenizer, load_tiny_model

TOL = 1e-5
KEY = "root"
PROMPT = [5, 17, 42, 9, 3, 88, 120, 7]


@pytest.fixture(scope="module")
def served(tiny_path):
    """(worker, server): the tiny model shared in place by a worker with the chat tokenizer, served with the admin
    routes behind KEY."""
    model, _ = load_tiny_model(tiny_path)
    worker = RolloutWorker(model, WorkerConfig(page_size=16, max_batch_tokens=128), tokenizer=build_chat_tokenizer())
    server = rollout.serve(worker, port=0, model_name="tiny", admin=True, admin_key=KEY)
    yield worker, server
    server.close()
    worker.close()


def post(server, path: str, body: dict | None, key: str | None = KEY) -> tuple[int, object]:
    return post_json(server, path, body, key)


def areal_payload(input_ids: list[int], max_new_tokens: int, stop_token_ids: list[int], **extra) -> dict:
    """SGLangBackend.build_generation_request's payload (areal/engine/sglang_remote.py), with AReaL's
    GenerationHyperparameters defaults (areal/api/cli_args.py: top_k int(1e8), top_p 1.0, temperature 1.0)."""
    sample_params = {"top_p": 1.0, "top_k": int(1e8), "max_new_tokens": max_new_tokens, "temperature": 1.0,
                     "stop_token_ids": stop_token_ids, "ignore_eos": False, "skip_special_tokens": True,
                     "frequency_penalty": 0.0, **extra}
    return {"input_ids": list(input_ids), "image_data": None, "sampling_params": sample_params,
            "return_logprob": True, "stream": False}


def areal_parse(response: dict) -> tuple[list[int], list[float], str]:
    """SGLangBackend.parse_generation_response: (output tokens, their logprobs, stop reason)."""
    meta_info = response["meta_info"]
    stop_reason = meta_info["finish_reason"]["type"]
    output_tokens = [x[1] for x in meta_info["output_token_logprobs"]]
    output_logprobs = [x[0] for x in meta_info["output_token_logprobs"]]
    return output_tokens, output_logprobs, stop_reason


def test_areal_sglang_backend_generate_gets_the_engines_tokens_and_exact_logprobs(served):
    worker, server = served
    status, response = post(server, "/generate", areal_payload(PROMPT, 9, [], sampling_seed=11))
    assert status == 200, response
    tokens, logprobs, stop_reason = areal_parse(response)
    expected = worker.generate([PROMPT], SamplingParams(max_new_tokens=9, seed=11, stop_token_ids=()))
    assert tokens == response["output_ids"] == expected.completion_token_lists()[0]
    assert logprobs == expected.logprobs[0, :len(tokens)].tolist()  # the engine's own row, bit for bit
    full, _ = reference_logprobs(worker.model, PROMPT, tokens)
    assert float((torch.tensor(logprobs) - full).abs().max()) <= TOL
    meta = response["meta_info"]
    assert stop_reason == "length" and meta["finish_reason"] == {"type": "length", "length": 9}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(PROMPT), 9)
    assert meta["weight_version"] == str(worker.policy_version)
    assert meta["token_versions"] == [worker.policy_version] * 9
    assert response["text"] == worker.tokenizer.decode(tokens, skip_special_tokens=True)
    assert all(entry[2] is None for entry in meta["output_token_logprobs"])  # return_text_in_logprobs: false
    status, plain = post(server, "/generate", areal_payload(PROMPT, 9, [], sampling_seed=11) | {"return_logprob": None})
    assert status == 200 and plain["output_ids"] == tokens and "output_token_logprobs" not in plain["meta_info"]
    status, out = post(server, "/generate", areal_payload(PROMPT, 9, []) | {"return_logprob": "yes"})
    assert status == 400 and out["error"]["param"] == "return_logprob", out


def test_text_prompts_n_samples_stop_strings_and_top_logprobs_in_sglangs_shapes(served):
    worker, server = served
    tok = worker.tokenizer
    ids = tok.encode("the cat sat on")
    first = worker.generate([ids], SamplingParams(n=2, max_new_tokens=8, seed=4, ignore_eos=True))
    rows = first.completion_token_lists()
    stop = tok.decode(rows[0][3:5])  # text row 0 writes: it ends there with "matched" that string
    assert stop and stop not in tok.decode(rows[0][:3])
    body = {"text": "the cat sat on", "return_logprob": True, "top_logprobs_num": 3, "return_text_in_logprobs": True,
            "sampling_params": {"n": 2, "max_new_tokens": 8, "sampling_seed": 4, "ignore_eos": True, "stop": [stop],
                                "top_k": -1}}
    status, outputs = post(server, "/generate", body)
    assert status == 200 and isinstance(outputs, list) and len(outputs) == 2, outputs
    cut = outputs[0]["output_ids"]
    assert cut == rows[0][:len(cut)] and stop in tok.decode(cut) and stop not in tok.decode(cut[:-1])
    assert outputs[0]["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in outputs[0]["text"]  # SGLang trims the stop string (no_stop_trim: false)
    assert outputs[1]["output_ids"] == rows[1][:len(outputs[1]["output_ids"])]
    for out in outputs:
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and [e[2] for e in meta["output_token_logprobs"]] == \
            [tok.decode([t]) for t in out["output_ids"]]
        full, _ = reference_logprobs(worker.model, ids, out["output_ids"])
        assert float((torch.tensor([e[0] for e in meta["output_token_logprobs"]]) - full).abs().max()) <= TOL
        top = meta["output_top_logprobs"]
        assert len(top) == len(out["output_ids"]) and all(len(position) == 3 for position in top)
        assert_alternatives_exact(worker.model, ids, out["output_ids"],
                                  [[(f"token_id:{e[1]}", e[0]) for e in position] for position in top], 3, 1.0)
        for position, (logprob, token, _) in zip(top, meta["output_token_logprobs"]):
            for listed_logprob, listed, _ in position:
                if listed == token:  # the sampled token's own entry: the same log-softmax, bit for bit
                    assert listed_logprob == logprob
    untrimmed = body["sampling_params"] | {"no_stop_trim": True}
    status, kept = post(server, "/generate", body | {"sampling_params": untrimmed, "return_logprob": False,
                                                     "top_logprobs_num": 0})
    assert status == 200 and kept[0]["text"].endswith(stop) and "output_token_logprobs" not in kept[0]["meta_info"]


@pytest.mark.parametrize("body, param", [
    ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0}}, "sampling_params.max_new_tokens"),
    ({"input_ids": PROMPT, "sampling_params": {"top_k": -2}}, "sampling_params.top_k"),
    ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"input_ids": PROMPT, "sampling_params": {"frob": 1}}, "sampling_params.frob"),
    ({"input_ids": PROMPT, "sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
    ({"input_ids": PROMPT, "stream": True}, "stream"),
    ({"input_ids": PROMPT, "logprob_start_len": 0}, "logprob_start_len"),
    ({"input_ids": PROMPT, "text": "hi"}, "input_ids"),
    ({"input_ids": [1, 100000]}, "input_ids"),
    ({"text": ""}, "text"),
    ({"input_ids": PROMPT, "top_logprobs_num": 2}, "top_logprobs_num"),
    ({"input_ids": PROMPT, "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
])
def test_a_bad_generate_body_is_a_400_naming_the_field_as_sglang_spells_it(served, body, param):
    worker, server = served
    prompted = worker.metrics().prompt_tokens
    status, out = post(server, "/generate", body)
    assert status == 400 and out["error"]["param"] == param, out
    assert worker.metrics().prompt_tokens == prompted  # nothing reached the engine


def test_sglang_pause_continue_and_memory_routes_map_to_pause_resume_sleep_wake(served, slow_steps):
    worker, server = served
    assert post(server, "/pause_generation", {"mode": "abort"}, key=None)[0] == 401
    assert post(server, "/release_memory_occupation", {}, key="user")[0] == 403
    status, out = post(server, "/pause_generation", {"mode": "sideways"})
    assert status == 400 and out["error"]["param"] == "mode" and not worker.is_paused
    answers: list = []
    payload = areal_payload(PROMPT, 40, [], sampling_seed=2, ignore_eos=True)  # > 1.2 s with slow_steps
    caller = threading.Thread(target=lambda: answers.append(post(server, "/generate", payload)))
    caller.start()
    wait_for_tokens(worker, 2)  # the pause lands mid-generation
    assert post(server, "/pause_generation", {"mode": "abort"}) == (200, {"status": "paused", "mode": "abort"})
    assert worker.is_paused
    assert post(server, "/continue_generation", {})[0] == 200 and not worker.is_paused
    caller.join(60)
    (status, response), = answers
    tokens, logprobs, stop_reason = areal_parse(response)
    assert status == 200 and stop_reason == "length" and len(tokens) == 40  # re-run whole, not SGLang's abort
    assert tokens == worker.generate([PROMPT], SamplingParams(max_new_tokens=40, seed=2, ignore_eos=True,
                                                              stop_token_ids=())).completion_token_lists()[0]
    full, _ = reference_logprobs(worker.model, PROMPT, tokens)
    assert float((torch.tensor(logprobs) - full).abs().max()) <= TOL
    assert post(server, "/pause_generation", None)[0] == 200 and worker.is_paused  # no body: SGLang's default
    assert post(server, "/continue_generation", None)[0] == 200 and not worker.is_paused

    status, out = post(server, "/release_memory_occupation", {"tags": ["weights"]})
    assert status == 400 and out["error"]["param"] == "tags" and not worker.is_sleeping
    status, out = post(server, "/release_memory_occupation", {"tags": ["gpu"]})
    assert status == 400 and out["error"]["param"] == "tags" and not worker.is_sleeping
    assert post(server, "/release_memory_occupation", {})[0] == 200 and worker.is_sleeping  # AReaL's offload body
    assert post(server, "/resume_memory_occupation", {"tags": ["weights"]}) == \
        (200, {"success": True, "is_sleeping": True})  # the weights never left; the cache stays released
    assert post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]}) == \
        (200, {"success": True, "is_sleeping": False})
    assert post(server, "/release_memory_occupation", {"tags": ["kv_cache", "weights"]})[0] == 200
    assert worker.is_sleeping
    assert post(server, "/resume_memory_occupation", {})[0] == 200 and not worker.is_sleeping


def test_areal_disk_update_then_generate_reports_the_new_weight_version_with_its_exact_logprobs(served, tmp_path):
    worker, server = served
    new = perturbed(worker.model, 5)
    save_file({k: v.contiguous() for k, v in new.items()}, str(tmp_path / "model.safetensors"))
    before = int(worker.policy_version)
    # SGLangBackend.build_disk_weight_update_requests, full model update
    status, out = post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "abort_all_requests": True})
    assert status == 200 and out["success"] is True and out["policy_version"] == before + 1, out
    status, response = post(server, "/generate", areal_payload(PROMPT, 6, [], sampling_seed=3))
    tokens, logprobs, _ = areal_parse(response)
    assert response["meta_info"]["weight_version"] == str(before + 1)
    assert all(torch.equal(worker.model.state_dict()[k], v) for k, v in new.items())
    full, _ = reference_logprobs(worker.model, PROMPT, tokens)
    assert float((torch.tensor(logprobs) - full).abs().max()) <= TOL
