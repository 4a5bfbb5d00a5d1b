"""TRL's own `VLLMClient` (trl/generation/vllm_client.py, trl==1.16.0: what GRPOTrainer(use_vllm=True,
vllm_mode="server") builds on its main process) pointed at a served tiny model. At this version `trl vllm-serve` only
execs `vllm serve` (trl/scripts/vllm_serve.py), and the client speaks vLLM's own routes: GET /health and /v1/models
(its constructor), POST /v1/completions (`generate`: token-id or text prompts, n, repetition_penalty, temperature,
top_p, top_k 0, min_p, max_tokens, logprobs 0, return_token_ids, return_tokens_as_token_ids), POST
/reset_prefix_cache, and for weights GET /server_info then vLLM's NCCL weight-transfer rendezvous (answered with a
501 saying why). vLLM is not installed here, and the constructor refuses to run without it although `generate` and
`reset_prefix_cache` never import it: the test reports vLLM as available to that one check."""

from __future__ import annotations

import pytest
import requests
import torch
from conftest import reference_logprobs

import rollout
from rollout import RolloutWorker, WorkerConfig
from rollout.testing import build_chat_tokenizer, load_tiny_model

TOL = 1e-5
PROMPTS = [[5, 17, 42, 9, 3, 88, 120], [(7 * i + 3) % 500 + 1 for i in range(40)]]  # the second: two full pages


@pytest.fixture(scope="module")
def served(tiny_path):
    """(worker, base url, an independent copy of the served weights); admin routes on loopback without a key, as
    TRL's client sends none."""
    with RolloutWorker(tiny_path, WorkerConfig(page_size=16, max_batch_tokens=128),
                       tokenizer=build_chat_tokenizer()) as worker, \
            rollout.serve(worker, port=0, model_name="tiny", admin=True) as server:
        yield worker, server.url.removesuffix("/v1"), load_tiny_model(tiny_path)[0]


@pytest.fixture
def client(served, monkeypatch):
    from trl.generation import vllm_client

    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *args, **kwargs: True)
    return vllm_client.VLLMClient(base_url=served[1])


def test_trls_vllm_client_generates_with_exact_logprobs_in_its_shapes(served, client):
    _, _, model = served
    assert client.model == "tiny"  # from GET /v1/models
    n, max_tokens = 3, 6
    # GRPOTrainer's call (trl/generation/vllm_generation.py): token-id prompts, n = num_generations, logprobs 0
    out = client.generate(PROMPTS, n=n, temperature=0.8, top_p=1.0, top_k=0, min_p=0.0, max_tokens=max_tokens,
                          logprobs=0, generation_kwargs={"seed": 7, "ignore_eos": True})
    assert out["prompt_ids"] == PROMPTS
    assert len(out["completion_ids"]) == len(PROMPTS) * n
    for i, completion in enumerate(out["completion_ids"]):
        assert len(completion) == max_tokens
        assert out["logprob_token_ids"][i] == [[token] for token in completion]  # the sampled token alone (k = 0)
        logprobs = torch.tensor([position[0] for position in out["logprobs"][i]])
        full, _ = reference_logprobs(model, PROMPTS[i // n], completion, temperature=0.8)
        assert float((logprobs - full).abs().max()) <= TOL
    assert len({tuple(c) for c in out["completion_ids"][:n]}) > 1  # n samples, not n copies
    # a text prompt, tokenized by the server (prompt_ids: the ids it generated from)
    text = client.generate(["the cat sat"], max_tokens=4, temperature=0.0, logprobs=None)
    assert text["prompt_ids"] == [build_chat_tokenizer().encode("the cat sat")] and text["logprobs"] is None
    # logprobs=2: the two most likely at each position (greedy: the chosen token is the first of them)
    greedy = client.generate([PROMPTS[0]], max_tokens=4, temperature=0.0, logprobs=2)
    completion, ids, logprobs = greedy["completion_ids"][0], greedy["logprob_token_ids"][0], greedy["logprobs"][0]
    assert all(len(position) == 2 for position in ids) and [position[0] for position in ids] == completion
    full, _ = reference_logprobs(model, PROMPTS[0], completion)
    assert float((torch.tensor([position[0] for position in logprobs]) - full).abs().max()) <= TOL


def test_trls_reset_prefix_cache_forgets_every_cached_prefix(served, client):
    worker, _, _ = served
    prompt = [PROMPTS[1]]
    client.generate(prompt, max_tokens=2, temperature=0.0)
    reused = worker.metrics().prefix_cache_reused_tokens
    client.generate(prompt, max_tokens=2, temperature=0.0)
    assert worker.metrics().prefix_cache_reused_tokens == reused + 32  # its two full pages, from the cache
    client.reset_prefix_cache()
    reused = worker.metrics().prefix_cache_reused_tokens
    client.generate(prompt, max_tokens=2, temperature=0.0)
    assert worker.metrics().prefix_cache_reused_tokens == reused  # nothing left to match


def test_trls_weight_sync_is_refused_at_its_first_call_saying_why(served, client):
    """init_communicator reads GET /server_info first; its rendezvous (vLLM's StatelessProcessGroup +
    PyNcclCommunicator) cannot meet this server's torch.distributed rank, and the 501 says so."""
    with pytest.raises(Exception, match="Request failed: 501") as refused:
        client.get_server_info()
    assert "StatelessProcessGroup" in str(refused.value)
    response = requests.get(f"{served[1]}/server_info", params={"config_format": "json"}, timeout=30)
    assert response.status_code == 501 and response.json()["error"]["code"] == "not_implemented"
