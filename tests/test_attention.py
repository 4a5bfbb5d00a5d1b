"""rollout_paged attention: exact against a plain forward on every engine path, and no dense mask anywhere."""

from __future__ import annotations

import pytest
import torch

from conftest import reference_logprobs
from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine.kernels import decode_kernel
from rollout.engine import attention
from rollout.engine.attention import paged, plan as plan_mod
from rollout.engine.upstream import NAME

TOL = 1e-5


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_exact(model, batch, params: list[SamplingParams]) -> None:
    assert len(batch) > 0
    for r, completion in enumerate(batch.completion_token_lists()):
        p = params[int(batch.prompt_index[r])]
        full, _ = reference_logprobs(model, batch.prompt_ids[r], completion, p.temperature)
        n = len(completion)
        assert (batch.logprobs[r, :n] - full).abs().max() <= TOL, (r, p)


@pytest.fixture()
def plans(monkeypatch):
    """Every step layout the attention builds, to check which paths a test really exercised."""
    built = []
    original = plan_mod._build_plan

    def spy(allocator, kwargs):
        plan = original(allocator, kwargs)
        built.append(plan)
        return plan

    monkeypatch.setattr(plan_mod, "_build_plan", spy)
    return built


@pytest.fixture(params=["kernel", "workspace"])
def decode_path(request, monkeypatch):
    """Decode attention on the paged decode kernel (where it builds) or on the workspace path (bucketed SDPAs over
    pages read into a workspace, shared prefixes merged by log-sum-exp): both must match the plain forward."""
    if request.param == "kernel" and decode_kernel.load() is None:
        pytest.skip("the paged decode kernel cannot be built here (no C compiler)")
    if request.param == "workspace":
        monkeypatch.setattr(decode_kernel, "usable", lambda *args: False)
    return request.param


def random_model(arch: str = "llama", kv_heads: int = 2, **extra):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    cls = LlamaConfig if arch == "llama" else Qwen2Config
    config = cls(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=kv_heads, intermediate_size=128, max_position_embeddings=512,
                 initializer_range=0.2, eos_token_id=2, bos_token_id=1, pad_token_id=0, **extra)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.mark.parametrize("call_tokens", [0, plan_mod.CALL_TOKENS])
def test_chunked_prefill_decode_and_forks_match_a_plain_forward(tiny, plans, monkeypatch, call_tokens, decode_path):
    monkeypatch.setattr(plan_mod, "CALL_TOKENS", call_tokens)
    model, _ = tiny
    params = [SamplingParams(n=3, temperature=1.0, max_new_tokens=14, ignore_eos=True),
              SamplingParams(n=1, temperature=0.0, max_new_tokens=9, ignore_eos=True),
              SamplingParams(n=2, temperature=0.8, max_new_tokens=20, ignore_eos=True),
              SamplingParams(n=4, temperature=1.2, max_new_tokens=6, ignore_eos=True)]
    # max_batch_tokens=16: prompts of 23-70 tokens are prefilled in chunks over several steps, next to decodes
    with RolloutWorker(model, WorkerConfig(max_batch_tokens=16, attn_implementation=NAME)) as worker:
        batch = worker.generate(prompts_of([23, 5, 70, 41]), params)
    assert_exact(model, batch, params)
    decodes = [p.decode for p in plans if p.decode is not None]
    if decode_path == "kernel":  # every row of <= 33 query tokens in one kernel call, wherever it sits in the step
        assert all(d.kernel is not None and not d.buckets for d in decodes)
        # a chunk continuing a cached prefix: consecutive query tokens over the same pages, one more key each
        assert any(bool(((k.positions[1:] == k.positions[:-1] + 1) & (k.lens[1:] == k.lens[:-1] + 1)
                         & (k.lens[:-1] > 16)).any()) for k in (d.kernel for d in decodes))
        return
    assert any(r.mask is not None for p in plans for r in p.prefill), "no chunk continued a cached prefix"
    assert any(p.decode and p.prefill for p in plans), "decodes never ran next to a prefill chunk"
    assert any(d.query_index is not None for d in decodes), "decode rows always came in order"
    assert any(len(d.buckets) > 1 for d in decodes)
    prefixes = [d.prefix for d in decodes if d.prefix is not None]
    assert prefixes, "forked samples never shared their prompt's keys"
    # groups of 4, 3 and 2 samples next to rows in no group: spare query slots, a slot map, padded prefix keys
    assert any(p.slots is not None and p.row_slot is not None for p in prefixes)
    assert any(p.num_groups > 1 and p.mask is not None for p in prefixes)
    buckets = [b for d in decodes for b in d.buckets]
    if call_tokens == 0:  # no row reads a page more than its own keys fill: padding only to the end of a page
        for b in buckets:
            keys = torch.full((b.end - b.start,), b.max_len) if b.mask is None else (b.mask[:, 0, 0] == 0).sum(-1)
            assert bool(((keys + 15) // 16 * 16 == b.max_len).all())
    else:  # rows of close lengths share a bucket, padded and masked
        assert any(b.mask is not None for b in buckets), "decode rows never needed padding"


def test_lock_step_samples_share_prefixes_without_reordering(tiny, plans, monkeypatch):
    monkeypatch.setattr(decode_kernel, "usable", lambda *args: False)  # the workspace path's layout
    # every prompt spans whole pages and has the same n: the slot grid is the decode order itself
    model, _ = tiny
    params = [SamplingParams(n=4, temperature=1.0, max_new_tokens=12, ignore_eos=True)] * 3
    with RolloutWorker(model, WorkerConfig(attn_implementation=NAME)) as worker:
        batch = worker.generate(prompts_of([40, 37, 52], seed=2), params)
    assert_exact(model, batch, params)
    prefixes = [p.decode.prefix for p in plans if p.decode is not None and p.decode.prefix is not None]
    assert any(p.num_groups == 3 and p.group_size == 4 and p.slots is None and p.row_slot is None for p in prefixes)


def test_prefix_cache_hits_match_a_plain_forward(tiny, plans, decode_path):
    model, _ = tiny
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=8, ignore_eos=True)] * 2
    prompts = prompts_of([37, 50], seed=1)
    with RolloutWorker(model, WorkerConfig(page_size=16, attn_implementation=NAME)) as worker:
        worker.generate(prompts, params)
        plans.clear()
        batch = worker.generate(prompts, params)  # whole pages of both prompts come from the prefix cache
    assert_exact(model, batch, params)
    first = plans[0]  # the first step resumes each prompt after its cached pages: queries shorter than keys
    if decode_path == "kernel":  # a few query tokens per prompt: kernel rows, each over the cached pages and more
        assert not first.prefill and bool((first.decode.kernel.lens > 16).all())
        return
    assert first.prefill and all(r.mask is not None for r in first.prefill)
    assert all(r.read_index.numel() - (r.query_end - r.query_start) >= 16 for r in first.prefill)


def test_rows_of_a_few_query_tokens_run_as_decode_rows_on_the_kernel_and_on_a_gpu_but_not_on_cpu_sdpa():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # a device object only: nothing runs on it
    assert plan_mod.decode_query_tokens(cpu, kernel=True) == plan_mod.KERNEL_QUERY_TOKENS == 33
    assert plan_mod.decode_query_tokens(cuda, kernel=False) == plan_mod.SDPA_QUERY_TOKENS == 9
    assert plan_mod.decode_query_tokens(cpu, kernel=False) == 1


@pytest.mark.parametrize("kv_heads", [1, 4], ids=["gqa-4-to-1", "mha"])
def test_grouped_and_plain_multi_head_attention_match_a_plain_forward(kv_heads, plans, decode_path):
    model = random_model(kv_heads=kv_heads)
    params = [SamplingParams(n=3, temperature=1.0, max_new_tokens=10, ignore_eos=True)] * 3
    with RolloutWorker(model, WorkerConfig(max_batch_tokens=32, attn_implementation=NAME)) as worker:
        batch = worker.generate(prompts_of([9, 40, 70], vocab=512), params)
    assert_exact(model, batch, params)
    decodes = [p.decode for p in plans if p.decode is not None]
    assert all(d.kernel is not None for d in decodes) if decode_path == "kernel" else any(d.prefix for d in decodes)


def test_sliding_window_layers_match_a_plain_forward(plans):
    # the sliding layer comes first, so every position's output (not only the last) reaches the logits
    model = random_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0,
                         layer_types=["sliding_attention", "full_attention"])
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True),
              SamplingParams(n=1, temperature=1.0, max_new_tokens=12, ignore_eos=True)]
    with RolloutWorker(model, WorkerConfig(max_batch_tokens=16, attn_implementation=NAME)) as worker:
        batch = worker.generate(prompts_of([21, 6], vocab=512), params)
    assert_exact(model, batch, params)
    assert any(p.sliding_window == 8 for p in plans)


def test_a_plain_forward_under_rollout_paged_is_sdpa_padding_and_gradients_included(tiny):
    model, _ = tiny
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    attention.set_attn_implementation(model, NAME)  # registers rollout_paged first (install())
    try:
        got = model(input_ids=ids, attention_mask=mask).logits
        got[:, -1].sum().backward()
    finally:
        model.set_attn_implementation("sdpa")
    assert torch.equal(got.detach(), expected)
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_the_engine_allocates_no_dense_mask_and_builds_none_per_step(tiny, monkeypatch):
    model, _ = tiny
    calls = []
    real_mask = paged.sdpa_mask
    monkeypatch.setattr(paged, "sdpa_mask", lambda *a, **k: calls.append(1) or real_mask(*a, **k))
    with RolloutWorker(model, WorkerConfig(attn_implementation="sdpa")) as worker:  # the control: upstream's path
        io = worker.engine.manager.batch_processor.inputs_and_outputs
        assert io.attention_mask is not None and io.attention_mask["full_attention"].shape[-1] > 1000
    with RolloutWorker(model, WorkerConfig()) as worker:  # the default on CPU
        assert worker._engine_attn == NAME
        assert worker.engine.manager.batch_processor.inputs_and_outputs.attention_mask is None
        worker.generate(prompts_of([30, 12]), SamplingParams(n=2, max_new_tokens=5))
        assert calls == []  # no per-step [tokens, tokens] mask on the engine thread
        assert model.config._attn_implementation == "sdpa"  # the owner's attention is back
    # off the engine thread the same name builds sdpa's mask (a packed or padded trainer forward needs it)
    attention.set_attn_implementation(model, NAME)  # registers rollout_paged first (install())
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([[5, 6, 7, 8]]), attention_mask=torch.tensor([[0, 1, 1, 1]]))
    finally:
        model.set_attn_implementation("sdpa")
    assert calls


def test_without_a_mask_the_cache_is_sized_by_memory_not_by_the_mask_cap(tiny):
    model, _ = tiny
    config = dict(kv_cache_memory_mb=16, max_cache_tokens=1024)
    with RolloutWorker(model, WorkerConfig(attn_implementation="sdpa", **config)) as capped:
        assert capped.engine.max_request_tokens <= 1024
    with RolloutWorker(model, WorkerConfig(**config)) as uncapped:
        # tiny model: 2 layers x 2 KV heads x 16 dims x K and V x 4 bytes = 512 bytes per token
        assert uncapped.engine.max_request_tokens >= 16 * 2**20 // 512 // 2


def test_a_large_kv_budget_is_not_charged_for_a_mask_that_is_never_built(tiny):
    # upstream's plan charged rollout_paged a dense [4096, 2M-token] mask (34 GB) and refused to start
    model, _ = tiny
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, ignore_eos=True)
    config = WorkerConfig(kv_cache_memory_mb=1024, max_batch_tokens=4096, attn_implementation=NAME)
    with RolloutWorker(model, config) as worker:
        batch = worker.generate(prompts_of([20, 3]), [params, params])
    assert_exact(model, batch, [params, params])
