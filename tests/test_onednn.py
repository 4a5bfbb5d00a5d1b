"""oneDNN linears (rollout/engine/kernels/onednn.py): the engine's fp32 linears on oneDNN, inside the logprob rule of the
trainer's own forward, on the engine thread only, and reading the live weights."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from conftest import reference_logprobs

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine.kernels import onednn
from rollout.engine.upstream import patches as upstream_install
from rollout.testing import build_tiny_model, load_tiny_model

pytestmark = pytest.mark.skipif(not onednn.available(), reason="this torch build has no oneDNN")


@pytest.fixture(autouse=True)
def linears_installed():
    """nn.Linear.forward patched as an engine that chose oneDNN patches it (once per process)."""
    upstream_install.install_linear(onednn.FLAG, onednn.linear)


@pytest.fixture(scope="module")
def normal_path(tmp_path_factory):
    """A normally initialised model (init std 0.02): the one the exactness rule is stated for."""
    return build_tiny_model(tmp_path_factory.mktemp("onednn") / "small", size="small", init_std=0.02)


class _Calls(dict):
    """oneDNN linear calls by thread name, and the row counts they ran at."""

    def __init__(self):
        super().__init__()
        self.rows: set[int] = set()


@pytest.fixture()
def spy(monkeypatch):
    """Counts the oneDNN linears the engine runs, by thread name."""
    calls = _Calls()
    original = onednn._linear

    def counted(x, weight, bias):
        name = threading.current_thread().name
        calls[name] = calls.get(name, 0) + 1
        calls.rows.add(x.shape[0])
        return original(x, weight, bias)

    monkeypatch.setattr(onednn, "_linear", counted)
    return calls


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (1, 15, 16, 17, 40)]


def _gaps(model, batch, temperature: float) -> torch.Tensor:
    gaps = []
    for r, completion in enumerate(batch.completion_token_lists()):
        ref, _ = reference_logprobs(model, batch.prompt_ids[r], completion, temperature)
        gaps.append((batch.logprobs[r, : len(completion)] - ref).abs())
    return torch.cat(gaps)


def test_the_private_op_is_f_linear_of_the_live_weight():
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=g) * 0.02, torch.randn(96, generator=g)
    x = torch.randn(3, 5, 64, generator=g)
    expected = (x.double() @ weight.double().T + bias.double())
    assert torch.allclose(onednn._linear(x, weight, bias).double(), expected, atol=1e-6, rtol=0)
    with torch.no_grad():
        weight.mul_(-2.0)  # in place: a packed copy would not see it
    expected = (x.double() @ weight.double().T + bias.double())
    assert torch.allclose(onednn._linear(x, weight, bias).double(), expected, atol=1e-6, rtol=0)


def test_only_fp32_linears_without_autograd_go_to_onednn(spy):
    layer = torch.nn.Linear(4, 8)
    x = torch.randn(2, 4)
    with onednn.OneDNNLinears():
        y = layer(x)  # autograd needs torch's own linear
        assert y.requires_grad and not spy
        with torch.no_grad():
            layer.double()(x.double())
            assert not spy
            layer.float()(x)
            F.linear(x, layer.weight)  # outside an nn.Linear: torch's
    with torch.no_grad():
        layer(x)  # outside the context: torch's
    assert sum(spy.values()) == 1


def test_rows_are_padded_to_few_buckets_so_onednn_builds_few_kernels():
    assert len(onednn.BUCKETS) == 24 and onednn.BUCKETS[-1] == onednn.CHUNK
    for rows in range(1, onednn.CHUNK + 1):
        size = onednn.bucket(rows)
        assert size in onednn.BUCKETS and rows <= size
        assert rows <= 8 or size < 1.25 * rows  # 4 buckets an octave: under 25% padding


@pytest.mark.parametrize("rows", [1, 3, 9, 17, 100, 255, 256, 257, 600])
def test_a_bucketed_linear_is_each_rows_own_product_at_a_bucketed_row_count(monkeypatch, rows):
    seen = []
    original = onednn._linear
    monkeypatch.setattr(onednn, "_linear", lambda x, w, b: seen.append(x.shape[0]) or original(x, w, b))
    g = torch.Generator().manual_seed(rows)
    layer = torch.nn.Linear(64, 48).requires_grad_(False)
    weight, bias = layer.weight.normal_(0, 0.02, generator=g), layer.bias.normal_(generator=g)
    x = torch.randn(1, rows, 64, generator=g)
    with onednn.OneDNNLinears():
        y = layer(x)
    assert y.shape == (1, rows, 48) and y.is_contiguous()
    expected = x.double() @ weight.double().T + bias.double()
    assert (y.double() - expected).abs().max().item() < 1e-6
    assert set(seen) <= set(onednn.BUCKETS) and sum(seen) >= rows
    assert sum(seen) - rows < onednn.CHUNK  # padding only in the last piece


def test_choice_follows_the_rule(tiny):
    model, _ = tiny
    assert onednn.choose("onednn", model) and not onednn.choose("blas", model)
    assert onednn.choose("auto", model) == onednn.slow_blas()
    assert not onednn.choose("onednn", model.to(torch.bfloat16))  # no fp32 linear: nothing to change


def test_onednn_rows_are_inside_the_logprob_rule_of_the_teacher_forced_forward(normal_path, spy):
    model, _ = load_tiny_model(normal_path)
    prompts = _prompts(model.config.vocab_size)
    with RolloutWorker(model, WorkerConfig(cpu_linear="onednn", page_size=16)) as worker:
        assert worker.engine.linears == "onednn"
        batch = worker.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=1))
        again = worker.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=20, seed=1))
    assert spy.get("rollout-engine", 0) > 0 and set(spy) == {"rollout-engine"}
    assert spy.rows <= set(onednn.BUCKETS)  # a step's token count never reaches oneDNN unbucketed
    gaps = _gaps(model, batch, 1.0)
    assert gaps.max().item() <= 1e-5 and gaps.mean().item() <= 1e-6, (gaps.max().item(), gaps.mean().item())
    assert again.completion_token_lists() == batch.completion_token_lists()  # seeded rows reproduce


def test_the_trainer_thread_keeps_torchs_own_linear_while_the_engine_runs(normal_path, spy):
    model, _ = load_tiny_model(normal_path)
    ids = torch.tensor([_prompts(model.config.vocab_size)[-1]])
    with torch.no_grad():
        before = model(ids).logits
    with RolloutWorker(model, WorkerConfig(cpu_linear="onednn")) as worker:
        future = worker.submit(_prompts(model.config.vocab_size), SamplingParams(n=4, max_new_tokens=48))
        during = []
        while not future.done() or not during:
            with torch.no_grad():
                during.append(model(ids).logits)
        future.result()
    assert set(spy) == {"rollout-engine"}
    assert all(torch.equal(d, before) for d in during)  # bit for bit: the trainer's kernels


def _noise_inside_in_place_update(model, worker, prompts) -> None:
    with worker.in_place_update() as bump:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.01)
        bump()


def _fused_adamw_step_then_refresh(model, worker, prompts) -> None:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)  # leaves version counters alone
    model(torch.tensor([prompts[-1]]), labels=torch.tensor([prompts[-1]])).loss.backward()
    optimizer.step()
    model.zero_grad(set_to_none=True)
    worker.refresh()


@pytest.mark.parametrize("change", [_noise_inside_in_place_update, _fused_adamw_step_then_refresh],
                         ids=["in-place-inside-weight-update", "fused-adamw-then-refresh"])
def test_weights_changed_in_place_are_what_the_next_call_computes(normal_path, change):
    """The packed oneDNN weights follow the change: the next call is inside the rule of the new weights."""
    model, _ = load_tiny_model(normal_path)
    prompts = _prompts(model.config.vocab_size)
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=5)
    with RolloutWorker(model, WorkerConfig(cpu_linear="onednn")) as worker:
        worker.generate(prompts, params)
        change(model, worker, prompts)
        batch = worker.generate(prompts, params)
    gaps = _gaps(model, batch, 1.0)
    assert gaps.max().item() <= 1e-5 and gaps.mean().item() <= 1e-6, (gaps.max().item(), gaps.mean().item())


def test_a_forward_patched_before_the_worker_is_kept_and_the_engine_still_gets_onednn(monkeypatch, spy):
    seen = []
    before = torch.nn.Linear.forward
    monkeypatch.setattr(torch.nn.Linear, "forward", lambda self, x: seen.append(1) or before(self, x))  # a profiler
    monkeypatch.setattr(upstream_install, "_linear_installed", False)  # as in a process where the worker comes after
    upstream_install.install_linear(onednn.FLAG, onednn.linear)  # the profiler
    layer, x = torch.nn.Linear(4, 8).requires_grad_(False), torch.randn(2, 4)
    layer(x)
    assert seen == [1] and not spy  # outside the engine: the forward that was there
    with onednn.OneDNNLinears():
        layer(x)
    assert seen == [1] and sum(spy.values()) == 1


def test_a_packed_weight_gives_the_live_weights_product_and_follows_every_kind_of_write():
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(96, 64, generator=g) * 0.02
    x = torch.randn(16, 64, generator=g)
    packs = onednn.PackedWeights()  # an engine's
    first = packs.packed(weight)
    assert first.is_mkldnn and packs.packed(weight) is first  # packed once, then reused
    for rows in (2, 4, 16):  # from 2 rows up, the same bits as oneDNN on the live weight
        assert torch.equal(onednn._linear(x[:rows], first, None), onednn._linear(x[:rows], weight, None))
    one = onednn._linear(x[:1], first, None).double()  # 1 row: another kernel, the same product to fp32 rounding
    assert (one - x[:1].double() @ weight.double().T).abs().max().item() < 1e-6

    def now(w):
        return x.double() @ w.double().T

    weight.add_(1.0)  # in place: the version counter moves
    assert (onednn._linear(x, packs.packed(weight), None).double() - now(weight)).abs().max().item() < 1e-5
    weight.data.mul_(-1.0)  # through .data (as PEFT's merge, fused optimizers): the counter stays
    stale = packs.packed(weight)
    assert not packs.check()  # a sampled element differs: everything is packed again
    assert packs.packed(weight) is not stale
    assert (onednn._linear(x, packs.packed(weight), None).double() - now(weight)).abs().max().item() < 1e-5
    assert packs.check()
    weight.data[0, 1] += 1.0  # an element no probe looks at: the worker's refresh says so instead
    packs.weights_changed()
    assert (onednn._linear(x, packs.packed(weight), None).double() - now(weight)).abs().max().item() < 1e-5
    packs.forget([weight])
    assert not packs.holds(weight) and packs.packed(weight) is not None and packs.holds(weight)
    other = onednn.PackedWeights()  # another engine's: its own copies, untouched by this one's changes
    theirs = other.packed(weight)
    packs.weights_changed()
    assert other.packed(weight) is theirs and packs.packed(weight) is not theirs
    del weight, stale, first, theirs
    assert packs.dead() == 0 and other.dead() == 0 and len(packs) == len(other) == 0  # a weight's copy dies with it
