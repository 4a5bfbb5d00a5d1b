"""KV cache sizing: the device's defaults, a budget in MiB or as a fraction of free memory (measured again at wake),
and the start-up error that says what fits when one request of `max_request_tokens` does not."""

from __future__ import annotations

import re

import pytest
import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine.device import sizing

PAGE = 16


def kv_bytes_per_token(model) -> int:
    """Independent of rollout.engine.device.sizing: K and V of every layer, from the model's own attention module."""
    attn = model.model.layers[0].self_attn
    kv_out = attn.k_proj.out_features  # kv_heads * head_dim
    return 2 * len(model.model.layers) * kv_out * model.dtype.itemsize


def cache_blocks(worker: RolloutWorker) -> int:
    return worker.engine.manager.batch_processor.cache.num_blocks


def test_unset_sizes_take_the_devices_defaults():
    cpu, gpu = WorkerConfig().for_device(torch.device("cpu")), WorkerConfig().for_device(torch.device("cuda"))
    assert (cpu.max_batch_tokens, cpu.max_requests_per_batch, cpu.kv_cache_memory_fraction) == (2048, 512, 0.25)
    assert cpu.kv_cache_memory_mb is None
    assert (gpu.max_batch_tokens, gpu.max_requests_per_batch, gpu.kv_cache_memory_fraction) == (8192, 512, 0.5)
    assert gpu.kv_cache_memory_mb is None
    mine = WorkerConfig(max_batch_tokens=64, kv_cache_memory_fraction=0.25).for_device(torch.device("cuda"))
    assert (mine.max_batch_tokens, mine.kv_cache_memory_mb, mine.kv_cache_memory_fraction) == (64, None, 0.25)


def test_a_mib_budget_holds_that_many_bytes_of_kv(tiny):
    model, _ = tiny
    with RolloutWorker(model, WorkerConfig(kv_cache_memory_mb=8)) as worker:
        assert cache_blocks(worker) == 8 * 2**20 // (kv_bytes_per_token(model) * PAGE)


def test_a_fraction_budget_is_measured_on_free_memory_at_start_and_again_at_wake(tiny, monkeypatch):
    model, _ = tiny
    free = {"bytes": 64 * 2**20}
    monkeypatch.setattr(sizing, "free_memory", lambda device: free["bytes"])
    with RolloutWorker(model, WorkerConfig(kv_cache_memory_fraction=0.5)) as worker:
        assert cache_blocks(worker) == 32 * 2**20 // (kv_bytes_per_token(model) * PAGE)
        free["bytes"] = 16 * 2**20  # the trainer took memory while the worker slept
        worker.sleep()
        worker.wake()
        assert cache_blocks(worker) == 8 * 2**20 // (kv_bytes_per_token(model) * PAGE)


def test_a_fraction_budget_stops_at_what_the_engine_can_hold_at_once_and_a_mib_budget_does_not(tiny, monkeypatch):
    model, _ = tiny
    monkeypatch.setattr(sizing, "free_memory", lambda device: 2**40)  # a host with a TiB free
    limit = 8 * model.config.max_position_embeddings  # 8 requests of the model's longest sequence
    with RolloutWorker(model, WorkerConfig(max_requests_per_batch=8)) as worker:
        assert cache_blocks(worker) == limit // PAGE
    with RolloutWorker(model, WorkerConfig(max_requests_per_batch=8, kv_cache_memory_mb=4 * 2**10 // 8)) as worker:
        assert cache_blocks(worker) == 512 * 2**20 // (kv_bytes_per_token(model) * PAGE)  # taken as given


def test_a_fraction_budget_stays_within_what_upstreams_memory_plan_accepts(tiny, monkeypatch):
    """A host whose NUMA nodes report less memory than MemAvailable (seen: 9 GB of nodes on a 24 GB virtual machine):
    upstream's plan counts the nodes, so a budget of a quarter of MemAvailable failed its footprint check with a
    MemoryError and `RolloutWorker(model)` did not start."""
    model, _ = tiny
    from transformers.generation.continuous_batching import cache as upstream_cache

    nodes = 256 * 2**20  # the memory the process's NUMA nodes report
    breakdown = lambda: (torch.device("cpu"), nodes, 0, 0)  # noqa: E731  (device, total, reserved, allocated)
    from rollout.engine.upstream import memory

    monkeypatch.setattr(memory, "get_device_and_memory_breakdown", breakdown)
    monkeypatch.setattr(upstream_cache, "get_device_and_memory_breakdown", breakdown)
    monkeypatch.setattr(sizing, "free_memory", lambda device: 4 * nodes)  # MemAvailable: four times the nodes
    layers = model.config.num_hidden_layers
    with RolloutWorker(model, WorkerConfig(max_requests_per_batch=512)) as worker:
        kv = cache_blocks(worker) * PAGE * kv_bytes_per_token(model)
        assert kv <= sizing.PLAN_MARGIN * 0.6 * nodes * layers / (layers + 1)
        assert kv >= 0.8 * sizing.PLAN_MARGIN * 0.6 * nodes * layers / (layers + 1)  # and uses what it may
        batch = worker.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3))
        assert batch.completion_lengths.tolist() == [3]


def test_free_host_memory_is_what_the_kernel_reports_available():
    with open("/proc/meminfo") as f:
        available = int(next(line for line in f if line.startswith("MemAvailable")).split()[1]) * 1024
    assert 0.5 * available < sizing.free_memory(torch.device("cpu")) < 2 * available


def test_a_cache_too_small_for_one_configured_request_fails_at_start_and_its_fix_works(tiny):
    model, _ = tiny
    user_attn = model.config._attn_implementation
    small = WorkerConfig(num_blocks=8, max_request_tokens=1000)
    with pytest.raises(ValueError, match=r"max_request_tokens=1000 is invalid: the KV cache \(8 blocks of 16 tokens, "
                                         r"\d+ bytes per token\) holds one request of at most 128 tokens") as error:
        RolloutWorker(model, small)
    assert model.config._attn_implementation == user_attn  # the owner's attention came back
    fix_blocks = int(re.search(r"num_blocks >= (\d+)", str(error.value)).group(1))
    assert fix_blocks == 63  # 1000 tokens in pages of 16: the advice is the least that works, not a guess
    with RolloutWorker(model, WorkerConfig(num_blocks=fix_blocks, max_request_tokens=1000)) as worker:
        assert worker.engine.max_request_tokens >= 1000
        batch = worker.generate([[5] * 990], SamplingParams(max_new_tokens=10, ignore_eos=True))
        assert batch.completion_lengths.tolist() == [10]
