"""What trainers do with the model a worker holds still works: `copy.deepcopy(model)` (how a reference model is made)
and `torch.save(model)`, with any worker config (MoE routing recording included), the worker idle or mid-call, and
the copy computes exactly what the model does."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import load_tiny_model

CONFIGS = {"default": WorkerConfig(), "record_routing": WorkerConfig(record_routing=True),
           "small_cache": WorkerConfig(page_size=4, num_blocks=32, max_batch_tokens=32, record_routing=True)}
PROMPT = torch.tensor([[11, 12, 13, 14, 15, 16]])


def logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(PROMPT).logits


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_held_model_deep_copies_and_saves_and_the_copies_compute_as_it_does(moe_paths, name):
    model, tok = load_tiny_model(moe_paths["qwen3_moe"])
    expected = logits(model)
    with RolloutWorker(model, CONFIGS[name], tokenizer=tok) as worker:
        first = worker.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, seed=1))
        twin = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert torch.equal(logits(twin), expected) and torch.equal(logits(loaded), expected)
        again = worker.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, seed=1))  # the worker is unaffected
        assert torch.equal(again.completion_ids, first.completion_ids)
        if CONFIGS[name].record_routing:
            assert again.routing is not None and again.routing.rows[0].shape[0] == 3 + 4 - 1


def test_a_model_copied_while_a_call_is_in_flight_is_independent_of_the_worker(moe_paths):
    model, tok = load_tiny_model(moe_paths["qwen3_moe"])
    with RolloutWorker(model, WorkerConfig(record_routing=True), tokenizer=tok) as worker:
        future = worker.submit([[5, 6, 7]] * 4, SamplingParams(n=2, max_new_tokens=32, ignore_eos=True))
        twin = copy.deepcopy(model)
        batch = future.result(timeout=120)
    with torch.no_grad():
        twin.lm_head.weight.mul_(2)  # the copy owns its weights
    assert not torch.equal(logits(twin), logits(model))
    assert batch.routing is not None and len(batch.routing) == 8
