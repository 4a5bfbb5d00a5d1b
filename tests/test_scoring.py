"""Offline re-scoring: packed, padding-free logprobs against an independent per-sequence teacher-forced forward."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import reference_logprobs
from rollout.scoring.packing import Pair, batches, block_causal_mask, build_pack
from rollout import InvalidArgument
from rollout.scoring import TokenScores, check_pairs, score, score_details, score_iter

ATOL = 1e-5  # fp32 on CPU; a plain forward disagrees with itself by ~4e-6 when its length changes (measured)


def ragged(vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """1-token prompts and completions, long ones, and a random ragged middle."""
    gen = torch.Generator().manual_seed(seed)
    lengths = [(1, 1), (1, 9), (7, 1), (150, 200), (2, 250), (40, 40)]
    lengths += [tuple(int(x) for x in torch.randint(1, 50, (2,), generator=gen)) for _ in range(8)]
    prompts = [torch.randint(0, vocab, (p,), generator=gen).tolist() for p, _ in lengths]
    completions = [torch.randint(0, vocab, (c,), generator=gen).tolist() for _, c in lengths]
    return prompts, completions


def max_error(model, prompts, completions, rows, temperature: float = 1.0) -> float:
    errors = []
    for p, c, row in zip(prompts, completions, rows):
        assert row.dtype == torch.float32 and row.shape == (len(c),)
        errors.append(float((row - reference_logprobs(model, p, c, temperature)[0]).abs().max()))
    return max(errors)


def forward_spy(model) -> list[tuple[bool, bool]]:
    """Records (model.training, grad enabled) at every forward of the model."""
    seen: list[tuple[bool, bool]] = []
    model.register_forward_pre_hook(lambda module, args: seen.append((module.training, torch.is_grad_enabled())))
    return seen


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.5])
def test_packed_rows_equal_a_per_sequence_forward_on_ragged_data(tiny, temperature):
    model, _ = tiny
    prompts, completions = ragged(model.config.vocab_size)
    rows = score(model, prompts, completions, temperature=temperature, max_batch_tokens=512)
    assert len(rows) == len(prompts)
    assert max_error(model, prompts, completions, rows, temperature) <= ATOL


def test_eager_attention_packs_with_an_additive_mask_and_stays_exact(tiny):
    model, _ = tiny
    model.set_attn_implementation("eager")
    prompts, completions = ragged(model.config.vocab_size, seed=1)
    rows = score(model, prompts, completions, max_batch_tokens=300)
    assert max_error(model, prompts, completions, rows) <= ATOL
    assert model.config._attn_implementation == "eager"


def test_greedy_temperature_zero_scores_the_raw_distribution(tiny):
    model, _ = tiny
    prompts, completions = ragged(model.config.vocab_size, seed=2)
    greedy = score(model, prompts, completions, temperature=0.0)
    assert all(torch.equal(g, raw) for g, raw in zip(greedy, score(model, prompts, completions, temperature=1.0)))
    assert max_error(model, prompts[:4], completions[:4], greedy[:4], temperature=0.0) <= ATOL


def test_per_pair_temperatures_match_scoring_each_temperature_alone(tiny):
    model, _ = tiny
    prompts, completions = ragged(model.config.vocab_size, seed=3)
    temps = [0.5 + 0.1 * i for i in range(len(prompts))]
    rows = score(model, prompts, completions, temperature=temps)
    for i, t in enumerate(temps):
        assert float((rows[i] - reference_logprobs(model, prompts[i], completions[i], t)[0]).abs().max()) <= ATOL * 2


def test_a_sequence_longer_than_the_budget_is_scored_alone(tiny):
    model, _ = tiny
    prompts, completions = [[5] * 3, list(range(40)), [7]], [[9] * 4, list(range(60)), [8, 9]]
    groups = list(batches([Pair(i, tuple(p), tuple(c), 1.0) for i, (p, c) in enumerate(zip(prompts, completions))],
                          max_batch_tokens=16))
    assert [[pair.index for pair in g] for g in groups] == [[0], [1], [2]]
    rows = score(model, prompts, completions, max_batch_tokens=16)
    assert max_error(model, prompts, completions, rows) <= ATOL


def test_results_do_not_depend_on_the_token_budget(tiny):
    model, _ = tiny
    prompts, completions = ragged(model.config.vocab_size, seed=4)
    one_per_batch = score(model, prompts, completions, max_batch_tokens=1)
    all_in_one = score(model, prompts, completions, max_batch_tokens=100_000)
    for a, b in zip(one_per_batch, all_in_one):
        assert torch.allclose(a, b, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- packing
def test_packs_stay_within_budget_keep_order_and_restart_positions():
    gen = torch.Generator().manual_seed(0)
    pairs = [Pair(i, tuple(range(1, 1 + int(n))), tuple(range(100, 100 + int(m))), 1.0)
             for i, (n, m) in enumerate(torch.randint(1, 30, (40, 2), generator=gen).tolist())]
    groups = list(batches(pairs, max_batch_tokens=64))
    assert [p.index for g in groups for p in g] == list(range(40))
    for group in groups:
        pack = build_pack(group)
        assert pack.num_tokens <= 64 and pack.num_tokens == sum(p.num_fed for p in group)
        assert pack.position_ids[pack.cu_seq_lens[:-1].long()].eq(0).all()
        # every kept position holds the token just before its target: the last prompt token or a completion token
        expected = [t for p in group for t in (p.prompt[-1],) + p.completion[:-1]]
        assert pack.input_ids[pack.keep].tolist() == expected
        assert pack.targets.tolist() == [t for p in group for t in p.completion]


def test_block_causal_mask_lets_tokens_see_only_their_own_sequence():
    mask = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32))[0, 0]
    expected = torch.zeros(5, 5, dtype=torch.bool)
    expected[:2, :2] = torch.ones(2, 2, dtype=torch.bool).tril()
    expected[2:, 2:] = torch.ones(3, 3, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
    additive = block_causal_mask(torch.tensor([0, 2, 5], dtype=torch.int32), dtype=torch.float32)[0, 0]
    assert torch.equal(additive == 0, expected) and additive.min() == torch.finfo(torch.float32).min


def test_upstream_contract_logits_to_keep_index_and_position_ids_alone_do_not_isolate(tiny):
    """transformers 5.23 behaviour the packed path relies on: if this fails after an upgrade, re-check scoring."""
    model, _ = tiny
    a, b = torch.arange(3, 10), torch.arange(20, 25)
    with torch.no_grad():
        alone_b = model(b[None]).logits[0]
        packed_ids, positions = torch.cat([a, b])[None], torch.cat([torch.arange(7), torch.arange(5)])[None]
        leaky = model(packed_ids, position_ids=positions).logits[0, 7:]  # default use_cache: no packing detection
        kept = model(packed_ids, position_ids=positions, use_cache=False, logits_to_keep=torch.tensor([8, 11]),
                     attention_mask=block_causal_mask(torch.tensor([0, 7, 12]))).logits[0]
    assert (leaky - alone_b).abs().max() > 0.1
    assert kept.shape == (2, model.config.vocab_size)
    assert torch.allclose(kept, alone_b[[1, 4]], atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- model state
def test_model_runs_in_eval_without_grad_and_every_training_flag_is_restored(tiny):
    model, _ = tiny
    model.train()
    model.model.layers[0].eval()  # a trainer may freeze parts: flags are restored module by module
    before = [m.training for m in model.modules()]
    seen = forward_spy(model)
    rows = score(model, [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]])
    assert seen and all(state == (False, False) for state in seen)
    assert [m.training for m in model.modules()] == before and torch.is_grad_enabled()
    assert not any(r.requires_grad for r in rows)


def test_an_engine_attention_is_swapped_for_packing_and_restored(tiny):
    model, _ = tiny
    model.set_attn_implementation("paged|eager")
    rows = score(model, [[1, 2, 3], [4, 5]], [[5, 6], [7, 8, 9]])
    assert model.config._attn_implementation == "paged|eager"
    model.set_attn_implementation("sdpa")
    assert max_error(model, [[1, 2, 3], [4, 5]], [[5, 6], [7, 8, 9]], rows) <= ATOL


def test_worker_score_packs_under_sdpa_while_the_engine_uses_its_own_attention(tiny):
    from rollout import RolloutWorker

    model, tokenizer = tiny
    prompts, completions = [[1, 2, 3], [4, 5]], [[5, 6], [7, 8, 9]]
    with RolloutWorker(model, tokenizer=tokenizer) as worker:
        rows = worker.score(prompts, completions, temperature=0.7)
        assert model.config._attn_implementation == "sdpa"
    assert max_error(model, prompts, completions, rows, temperature=0.7) <= ATOL


def test_flash_attention_on_cpu_is_refused_before_any_compute(tiny):
    model, _ = tiny
    seen = forward_spy(model)
    model.config._attn_implementation = "flash_attention_2"  # cannot be loaded on CPU: fake the setting only
    with pytest.raises(ValueError, match="attn_implementation=.*CUDA"):
        score(model, [[1, 2]], [[3]])
    assert seen == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the flash varlen path needs CUDA and flash-attn")
def test_flash_varlen_rows_match_per_sequence_flash_forward(tiny_path):
    pytest.importorskip("flash_attn")
    from rollout.testing import load_tiny_model

    model, _ = load_tiny_model(tiny_path, attn_implementation="flash_attention_2", dtype=torch.bfloat16)
    model.to("cuda")
    prompts, completions = ragged(model.config.vocab_size, seed=5)
    rows = score(model, prompts, completions, max_batch_tokens=512)
    for p, c, row in zip(prompts, completions, rows):
        with torch.no_grad():
            logits = model(torch.tensor([p + c], device="cuda")).logits[0, len(p) - 1:-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(c, device="cuda")[:, None]).squeeze(1).cpu()
        assert torch.allclose(row, ref, atol=0.05, rtol=0)  # bf16: kernels differ in accumulation order


# ---------------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("prompts, completions, message", [
    ([[1, 2], []], [[3], [4]], r"pair 1: prompt=\[\] is invalid: must contain at least one token. Fix: drop"),
    ([[1, 2], [3]], [[3], []], r"pair 1: completion=\[\] is invalid"),
    ([[1]], [[3, 4, 512]], r"pair 0: completion='token id 512 at position 2' is invalid: ids must be in \[0, 512\)"),
    ([[-1]], [[3]], r"pair 0: prompt='token id -1 at position 0' is invalid"),
    ([[1], [1] * 1000], [[2], [2] * 25], r"pair 1: prompt\+completion='1025 tokens' is invalid: must fit .* 1024"),
    ([[1], "text"], [[2], [3]], r"pair 1: prompt='text' is invalid: text needs a tokenizer"),
    ([[1], [1.5]], [[2], [3]], r"pair 1: prompt=\[1.5\] is invalid: must be a list of int token ids"),
    ([[1], [2]], [[3]], r"completions='1 completions' is invalid: must be one per prompt \(2\)"),
])
def test_invalid_pairs_raise_naming_the_pair_field_value_and_fix_before_any_compute(tiny, prompts, completions,
                                                                                     message):
    model, _ = tiny
    seen = forward_spy(model)
    with pytest.raises(ValueError, match=message):
        score(model, prompts, completions)
    assert seen == []


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1.0), r"temperature=-1.0 is invalid: must be a finite number >= 0"),
    (dict(temperature=math.nan), r"temperature=nan is invalid"),
    (dict(temperature=[1.0]), r"temperature=\[1.0\] is invalid: must be one number or one per pair \(2\)"),
    (dict(max_batch_tokens=0), r"max_batch_tokens=0 is invalid: must be an integer >= 1"),
    (dict(top_k=513), r"top_k=513 is invalid: must be an integer in \[0, 512\]"),
])
def test_invalid_options_raise_with_the_fix(tiny, kwargs, message):
    model, _ = tiny
    with pytest.raises(ValueError, match=message):
        score_details(model, [[1], [2]], [[3], [4]], **kwargs)


@pytest.mark.parametrize("prompts, completions, temperature, field, index", [
    ([[1, 2], [3], []], [[3], [4], [5]], 1.0, "prompt", 2),
    ([[1], [2]], [[3], [4, 512]], 1.0, "completion", 1),
    ([[1], [1] * 1000], [[2], [2] * 25], 1.0, "prompt+completion", 1),
    ([[1], [2], [3]], [[3], [4], [5]], [1.0, 1.0, -1.0], "temperature", 2),
    ([[1], [2]], [[3]], 1.0, "completions", None),
])
def test_a_refused_pair_carries_its_index_and_a_meta_device_copy_refuses_it_alike(tiny, prompts, completions,
                                                                                   temperature, field, index):
    from transformers import AutoModelForCausalLM

    model, _ = tiny
    with pytest.raises(InvalidArgument) as scored:
        score(model, prompts, completions, temperature)
    assert (scored.value.field, scored.value.index) == (field, index)
    assert scored.value.where == ("" if index is None else f"pair {index}")
    with torch.device("meta"):  # what a fleet holds on the caller's side: shapes, no weights
        meta = AutoModelForCausalLM.from_config(model.config)
    with pytest.raises(InvalidArgument) as checked:
        check_pairs(meta, prompts, completions, temperature)
    assert str(checked.value) == str(scored.value) and checked.value.index == index


def test_check_pairs_gives_the_token_ids_and_temperatures_score_would_use(tiny):
    model, tokenizer = tiny
    pairs = check_pairs(model, ["count the cats", [4, 5]], [[6], " one two"], [0.0, 0.7], tokenizer)
    assert [p.index for p in pairs] == [0, 1] and [p.temperature for p in pairs] == [0.0, 0.7]
    assert pairs[0].prompt == tuple(tokenizer("count the cats", add_special_tokens=False)["input_ids"])
    assert pairs[1] == Pair(1, (4, 5), tuple(tokenizer(" one two", add_special_tokens=False)["input_ids"]), 0.7)
    with pytest.raises(InvalidArgument, match=r"^pair 1: pair='not a pair' is invalid") as refused:
        list(score_iter(model, [([1], [2]), "not a pair"]))
    assert (refused.value.field, refused.value.index) == ("pair", 1)


# ---------------------------------------------------------------------------------------------- inputs and outputs
def test_strings_with_a_tokenizer_score_like_their_token_ids(tiny):
    model, tokenizer = tiny
    prompts, completions = ["what is two plus two", "count the cats"], [" four", " one two three"]
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in prompts + completions]
    by_text = score(model, prompts, completions, tokenizer=tokenizer)
    by_ids = score(model, ids[:2], ids[2:])
    assert all(torch.equal(a, b) for a, b in zip(by_text, by_ids))


def test_tensor_and_numpy_ids_score_like_lists(tiny):
    import numpy as np

    model, _ = tiny
    by_list = score(model, [[1, 2, 3], [4]], [[5, 6], [7]])
    by_arrays = score(model, [torch.tensor([1, 2, 3]), np.array([4])], [[np.int64(5), np.int32(6)], torch.tensor([7])])
    assert all(torch.equal(a, b) for a, b in zip(by_list, by_arrays))


def test_a_checkpoint_directory_is_loaded_with_its_tokenizer(tiny, tiny_path):
    model, _ = tiny
    from_path = score(str(tiny_path), ["the red apple"], [" is big"])
    from_model = score(model, ["the red apple"], [" is big"], tokenizer=tiny[1])
    assert torch.allclose(from_path[0], from_model[0], atol=ATOL, rtol=0)


def test_details_give_entropy_and_top_k_of_the_tempered_distribution(tiny):
    model, _ = tiny
    prompts, completions = ragged(model.config.vocab_size, seed=6)
    details = score_details(model, prompts, completions, temperature=0.8, top_k=4, max_batch_tokens=200)
    for p, c, d in zip(prompts, completions, details):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + c])).logits[0, len(p) - 1:-1] / 0.8, dim=-1)
        assert isinstance(d, TokenScores) and d.top_ids.shape == (len(c), 4)
        assert torch.allclose(d.logprobs, logp.gather(1, torch.tensor(c)[:, None]).squeeze(1), atol=ATOL, rtol=0)
        assert torch.allclose(d.entropy, -(logp.exp() * logp).sum(-1), atol=1e-4, rtol=0)
        values, _ = logp.topk(4, dim=-1)
        assert torch.allclose(d.top_logprobs, values, atol=ATOL, rtol=0)
        assert torch.allclose(logp.gather(1, d.top_ids), d.top_logprobs, atol=ATOL, rtol=0)


def test_score_with_top_k_returns_alternatives_and_ranks_from_the_same_log_softmax(tiny):
    model, _ = tiny
    prompts, completions = ragged(model.config.vocab_size, seed=7)
    logprobs, top = score(model, prompts, completions, temperature=1.3, top_k=3, max_batch_tokens=300)
    assert torch.equal(torch.cat(logprobs), torch.cat(score(model, prompts, completions, temperature=1.3,
                                                            max_batch_tokens=300)))
    for p, c, row, (ids, values, ranks) in zip(prompts, completions, logprobs, top):
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([p + c])).logits[0, len(p) - 1:-1] / 1.3, dim=-1)
        chosen = logp.gather(1, torch.tensor(c)[:, None])
        assert ids.shape == values.shape == (len(c), 3) and ranks.dtype == torch.int64
        assert torch.equal(ranks, (logp > chosen).sum(-1) + 1)  # the reference forward ranks them alike here
        assert torch.allclose(values, logp.topk(3, dim=-1).values, atol=ATOL, rtol=0)
        assert torch.equal(values.gather(1, (ids == torch.tensor(c)[:, None]).int().argmax(1, keepdim=True))
                           .squeeze(1)[ranks <= 3], row[ranks <= 3])  # a listed token: its own logprob, bit-exact
    with pytest.raises(ValueError, match="top_k"):
        score(model, prompts, completions, top_k=2, return_routing=True)


def test_score_iter_streams_in_input_order_reading_only_as_far_as_the_batch(tiny):
    model, _ = tiny
    prompts, completions = ragged(model.config.vocab_size, seed=7)
    pulled = []

    def pairs():
        for i, pair in enumerate(zip(prompts, completions)):
            pulled.append(i)
            yield pair

    stream = score_iter(model, pairs(), max_batch_tokens=128)
    first = next(stream)
    assert len(pulled) < len(prompts)  # lazily: the rest is not read yet
    rows = [first.logprobs] + [s.logprobs for s in stream]
    assert all(torch.equal(a, b) for a, b in zip(rows, score(model, prompts, completions, max_batch_tokens=128)))


def test_score_iter_yields_finished_rows_before_a_bad_pair_raises(tiny):
    model, _ = tiny
    pairs = [([1, 2], [3, 4])] * 5 + [([1, 2], [])] + [([5], [6])]
    stream = score_iter(model, iter(pairs), max_batch_tokens=100_000)
    done = []
    with pytest.raises(ValueError, match=r"pair 5: completion=\[\] is invalid"):
        for row in stream:
            done.append(row)
    assert len(done) == 5
