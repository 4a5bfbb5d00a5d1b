"""On a CUDA device (skipped elsewhere): exact rollouts with the engine's CUDA defaults, the same tokens with and
without CUDA graphs, sleep returning the KV cache to the device, and fingerprints that do not depend on the device.
benchmarks/gpu/gpu.sh runs this file on the GPU machine."""

from __future__ import annotations

import gc

import pytest
import torch
from conftest import reference_logprobs

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.model.weights import fingerprint
from rollout.testing import load_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOL = {torch.float32: 1e-4, torch.bfloat16: 0.15}  # fp32: reductions reorder across devices; bf16: see benchmarks/results/exactness.md
PARAMS = [SamplingParams(n=3, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=5),
          SamplingParams(n=2, temperature=0.0, max_new_tokens=10),
          SamplingParams(n=2, temperature=0.8, top_k=20, top_p=0.9, max_new_tokens=12, seed=6)]


def prompts_of(lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 500, (n,), generator=gen).tolist() for n in lengths]


@pytest.fixture()
def cuda_model(tiny_path):
    model, tok = load_tiny_model(tiny_path)
    return model.to("cuda"), tok


def max_gap(reference, batch, params) -> float:
    """Max |logprob - a plain forward's| over every row and both logprobs (the forward of `reference`, a trainer's
    model: the same weights in the same dtype)."""
    gap = 0.0
    for r, completion in enumerate(batch.completion_token_lists()):
        p = params[int(batch.prompt_index[r])]
        full, truncated = reference_logprobs(reference, batch.prompt_ids[r], completion, p.temperature, p.top_k,
                                             p.top_p)
        gap = max(gap, float((batch.logprobs[r, : len(completion)] - full).abs().max()),
                  float((batch.sampling_logprobs[r, : len(completion)] - truncated).abs().max()))
    return gap


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_defaults_give_exact_rollouts_with_and_without_cuda_graphs(cuda_model, dtype):
    model, tok = cuda_model
    model = model.to(dtype)  # fp32: rollout_paged on CUDA; bf16: flash when flash_attn imports, with CUDA graphs
    reference = model  # the trainer's forward: same weights, dtype and device
    prompts = prompts_of([9, 30, 3, 70])
    for graphs in ("auto", "off"):
        with RolloutWorker(model, WorkerConfig(kv_cache_memory_mb=64, cuda_graphs=graphs), tokenizer=tok) as worker:
            batch = worker.generate(prompts, PARAMS + PARAMS[:1])
            assert worker.engine.is_alive() and worker.engine.num_restarts == 0
            gap = max_gap(reference, batch, PARAMS + PARAMS[:1])
            print(f"{dtype} cuda_graphs={graphs} attention={worker._engine_attn}: max logprob gap {gap:.2e}")
            assert gap <= TOL[dtype], worker._engine_attn


def test_sleep_returns_the_kv_cache_to_the_device_and_wake_serves_exact_rollouts(cuda_model):
    model, tok = cuda_model
    kv_mb = 1024
    with RolloutWorker(model, WorkerConfig(kv_cache_memory_mb=kv_mb), tokenizer=tok) as worker:
        worker.generate(prompts_of([20]), PARAMS[:1])
        torch.cuda.synchronize()
        awake = torch.cuda.memory_reserved()
        worker.sleep()
        gc.collect()
        asleep = torch.cuda.memory_reserved()
        assert (awake - asleep) / 2**20 >= 0.9 * kv_mb, (awake, asleep)
        batch = worker.generate(prompts_of([7, 12], seed=1), PARAMS[:2])
        assert max_gap(model, batch, PARAMS) <= TOL[torch.float32]


def test_a_fraction_budget_is_a_fraction_of_free_device_memory_up_to_what_the_engine_can_hold(cuda_model):
    """0.05 of an H200's free memory is ~7 GB; the tiny model's engine holds at most 512 requests of its longest
    sequence (~256 MiB of KV), and the cache stops there."""
    model, _ = cuda_model
    free = torch.cuda.mem_get_info()[0]
    c = model.config
    token_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) \
        * model.dtype.itemsize
    holds = 512 * c.max_position_embeddings * token_bytes  # the GPU default max_requests_per_batch is 512
    expected = min(0.05 * free, holds)
    with RolloutWorker(model, WorkerConfig(kv_cache_memory_fraction=0.05)) as worker:
        cache = worker.engine.manager.batch_processor.cache
        assert 0.8 * expected <= cache.cache_tensor.numel() <= 1.05 * expected, (free, holds)


def test_fingerprints_of_the_same_weights_agree_across_devices(cuda_model, tiny_path):
    model, _ = cuda_model
    cpu_model, _ = load_tiny_model(tiny_path)
    assert fingerprint(model) == fingerprint(cpu_model)

