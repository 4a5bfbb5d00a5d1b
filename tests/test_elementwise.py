"""Fused RMSNorm and rotary embedding (rollout/engine/kernels/elementwise.py): the same bits as torch's eager ops, on the
engine thread only, for models whose code is exactly Llama's; the engine's rows are the same with and without them."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers.models.gemma import modeling_gemma
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine import Engine
from rollout.engine.kernels import elementwise, onednn
from rollout.engine.upstream import install_fused, install_linear
from rollout.engine.upstream.patches import LLAMA_NORM, LLAMA_ROTARY, same_code
from rollout.testing import load_tiny_model

needs_kernel = pytest.mark.skipif(elementwise.load() is None, reason="no C compiler, or not torch's bits here")


def _norm(width: int, seed: int) -> modeling_llama.LlamaRMSNorm:
    layer = modeling_llama.LlamaRMSNorm(width, eps=1e-5)
    with torch.no_grad():
        layer.weight.normal_(1.0, 0.2, generator=torch.Generator().manual_seed(seed))
    return layer


@needs_kernel
@pytest.mark.parametrize("rows", [0, 1, 7, 1100], ids=["empty", "one", "few", "split-over-threads"])
@pytest.mark.parametrize("width", [1, 9, 64, 512, 1000, 2304, 8192])
def test_rms_norm_is_torchs_rms_norm_bit_for_bit(rows, width):
    g = torch.Generator().manual_seed(rows * width)
    x = torch.randn(2, rows, width, generator=g) * torch.rand(2, rows, 1, generator=g) * 3  # rows of every scale
    layer = _norm(width, rows)
    with torch.no_grad():
        fused = elementwise.rms_norm(x, layer.weight, layer.variance_epsilon)
        assert fused is not None and torch.equal(fused, layer(x))  # outside Fused(): torch's ops


@needs_kernel
@pytest.mark.parametrize("heads,kv_heads,tokens,dim", [(4, 4, 1, 64), (8, 2, 5, 32), (6, 1, 3000, 128)],
                         ids=["decode-row", "gqa", "prefill-split-over-threads"])
def test_rotary_is_torchs_apply_rotary_pos_emb_bit_for_bit(heads, kv_heads, tokens, dim):
    g = torch.Generator().manual_seed(tokens)
    q = torch.randn(1, tokens, heads, dim, generator=g).transpose(1, 2)  # the projection's layout, as the model's
    k = torch.randn(1, tokens, kv_heads, dim, generator=g).transpose(1, 2)
    angles = torch.arange(tokens)[None, :, None] * torch.rand(1, 1, dim, generator=g) * 3
    cos, sin = angles.cos(), angles.sin()
    want = elementwise._ORIGINAL_ROTARY(q, k, cos, sin)
    got = elementwise.rotary(q, k, cos, sin)
    assert got is not None
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert got[0].stride() == q.stride()


def test_what_the_kernel_does_not_take_is_left_to_torch():
    x, w = torch.randn(3, 8), torch.ones(8)
    assert elementwise.rms_norm(x.double(), w.double(), 1e-6) is None
    assert elementwise.rms_norm(x.t(), torch.ones(3), 1e-6) is None  # not contiguous
    assert elementwise.rms_norm(x, torch.ones(4), 1e-6) is None
    assert elementwise.rms_norm(x.requires_grad_(), w, 1e-6) is None  # autograd needs torch's graph
    q = torch.randn(1, 2, 3, 8)
    cos = torch.randn(1, 3, 8)
    assert elementwise.rotary(q, q, cos, cos[:, :2]) is None
    assert elementwise.rotary(q.expand(2, 2, 3, 8), q, cos, cos) is None  # batch of 2
    assert elementwise.rotary(q[..., :7], q[..., :7], cos[..., :7], cos[..., :7]) is None  # odd head dim


def fuse(model) -> bool:
    """What an engine on a CPU with the kernels does to its model's norms and rotary."""
    return install_fused(model, elementwise.FLAG, lambda *a: elementwise.rms_norm(*a),
                         lambda *a: elementwise.rotary(*a))


@needs_kernel
def test_only_llama_exact_code_is_patched_and_only_the_engine_thread_inside_fused_takes_it(tiny, monkeypatch):
    model, _ = tiny
    assert fuse(model)
    assert hasattr(modeling_llama.LlamaRMSNorm.forward, "__wrapped__")
    assert hasattr(modeling_llama.apply_rotary_pos_emb, "__wrapped__")
    assert same_code(modeling_qwen2.Qwen2RMSNorm.forward, LLAMA_NORM)  # a copy of Llama's: patchable
    assert same_code(modeling_qwen2.apply_rotary_pos_emb, LLAMA_ROTARY)
    assert not same_code(modeling_gemma.GemmaRMSNorm.forward, LLAMA_NORM)  # (1 + weight): its own
    calls = []
    original = elementwise.rms_norm
    monkeypatch.setattr(elementwise, "rms_norm", lambda *a: calls.append(threading.current_thread().name) or
                        original(*a))
    norm = model.model.norm
    x = torch.randn(4, norm.weight.shape[0])
    with torch.no_grad():
        plain = norm(x)
        with elementwise.Fused():
            fused = norm(x)
        assert calls == [threading.current_thread().name]  # not outside Fused()
        done = []
        with elementwise.Fused():  # the flag is this thread's: another thread's forward keeps torch's ops
            worker = threading.Thread(target=lambda: done.append(norm(x)))
            worker.start()
            worker.join()
    assert len(calls) == 1 and torch.equal(plain, fused) and torch.equal(done[0], plain)


@needs_kernel
def test_the_engines_rows_are_the_same_bits_with_and_without_fusion(tiny_path, monkeypatch):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 500, (n,), generator=g).tolist() for n in (1, 16, 33)]
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=12, seed=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_new_tokens=9), SamplingParams(top_p=0.9, max_new_tokens=20, seed=1)]
    calls = []
    for name in ("rms_norm", "rotary"):
        original = getattr(elementwise, name)
        monkeypatch.setattr(elementwise, name, lambda *a, original=original, name=name:
                            calls.append(name) or original(*a))
    runs = []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(Engine, "_fused", lambda self: None)
        model, _ = load_tiny_model(tiny_path)
        with RolloutWorker(model, WorkerConfig()) as worker:
            runs.append(worker.generate(prompts, params))
        runs.append(len(calls))
    fused, fused_calls, plain, all_calls = runs
    assert {"rms_norm", "rotary"} <= set(calls) and fused_calls == all_calls > 0  # fused, then not
    assert fused.completion_token_lists() == plain.completion_token_lists()
    assert torch.equal(fused.logprobs, plain.logprobs)


@needs_kernel
def test_a_trainer_compiling_the_shared_model_traces_through_the_patches_in_one_graph(tiny):
    model, _ = tiny
    install_linear(onednn.FLAG, onednn.linear)  # patches nn.Linear.forward
    assert fuse(model) and hasattr(torch.nn.Linear.forward, "__wrapped__")
    ids = torch.tensor([[5, 9, 300, 41, 7]])
    with torch.no_grad():
        want = model(ids).logits
        got = torch.compile(model, backend="eager", fullgraph=True)(ids).logits  # fullgraph: a break raises
    assert torch.equal(want, got)
