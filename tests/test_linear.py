"""Wide linear layers run in column blocks on the engine's loop thread: bit for bit the unblocked product, the model
handed back unchanged, and nothing different for a trainer's forward meanwhile."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from torch import nn

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine import linear
from rollout.engine.attention import ENGINE_THREAD


def on_engine_thread(fn):
    """fn() run on a thread marked as the engine's loop thread, as RolloutManager marks it."""
    out = {}

    def run():
        ENGINE_THREAD.active = True
        out["value"] = fn()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return out["value"]


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_a_blocked_wide_layer_is_bit_identical_to_the_unblocked_product(rows, bias):
    torch.manual_seed(rows)
    layer = nn.Linear(96, linear.MIN_COLUMNS + 300, bias=bias)  # a last block narrower than the others
    x = torch.randn(rows, 96)
    expected = layer(x)
    assert linear.blocked(nn.Sequential(layer)) == [layer] and type(layer) is linear.BlockedLinear
    got = on_engine_thread(lambda: layer(x))
    assert torch.equal(got, expected)
    assert torch.equal(layer(x), expected)  # off the engine thread: nn.Linear's own forward


def test_only_wide_plain_linear_layers_are_blocked_and_restore_gives_them_back():
    class Lora(nn.Linear):  # a subclass (PEFT, FSDP, quantized): never touched
        pass

    narrow, wide, sub = nn.Linear(8, 16), nn.Linear(8, linear.MIN_COLUMNS), Lora(8, linear.MIN_COLUMNS)
    model = nn.Sequential(narrow, wide, sub)
    state = copy.deepcopy(model.state_dict())
    changed = linear.blocked(model)
    assert changed == [wide] and type(narrow) is nn.Linear and type(sub) is Lora
    assert list(model.state_dict()) == list(state)  # same parameters, same names
    twin = copy.deepcopy(model)  # a copy (a reference model) computes with its own weights
    with torch.no_grad():
        twin[1].weight.mul_(2)
    x = torch.randn(3, 8)
    assert not torch.equal(on_engine_thread(lambda: twin[1](x)), on_engine_thread(lambda: model[1](x)))
    linear.restore(changed)
    assert type(wide) is nn.Linear


def test_a_worker_blocks_the_lm_head_while_it_lives_and_its_rows_are_bit_identical_and_exact(tmp_path, monkeypatch):
    from conftest import reference_logprobs
    from rollout.testing import build_tiny_model, load_tiny_model

    model, _ = load_tiny_model(build_tiny_model(tmp_path / "m", size="tiny"))
    model.resize_token_embeddings(linear.MIN_COLUMNS + 8, mean_resizing=False)  # a vocabulary worth blocking
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=3)
    prompt = [[5, 6, 7, 8, 9] * 3]
    with RolloutWorker(model, WorkerConfig()) as worker:
        assert type(model.lm_head) is linear.BlockedLinear
        blocked = worker.generate(prompt, params)
        ids = torch.tensor([[5, 6, 7]])
        # a forward off the engine thread meanwhile is nn.Linear's own
        assert torch.equal(model(ids).logits, nn.functional.linear(model.model(ids)[0], model.lm_head.weight))
    assert type(model.lm_head) is nn.Linear
    monkeypatch.setattr(linear, "MIN_COLUMNS", 10**9)  # nothing blocked
    with RolloutWorker(model, WorkerConfig()) as worker:
        assert type(model.lm_head) is nn.Linear
        plain = worker.generate(prompt, params)
    assert blocked.completion_token_lists() == plain.completion_token_lists()
    assert torch.equal(blocked.logprobs, plain.logprobs)
    for r, completion in enumerate(blocked.completion_token_lists()):
        full, _ = reference_logprobs(model, blocked.prompt_ids[r], completion, 1.0, 0, 1.0)
        assert torch.allclose(blocked.logprobs[r, : len(completion)], full, atol=1e-5, rtol=0)
