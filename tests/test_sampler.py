"""Per-row sampling: truncation semantics, exact draw frequencies, both logprobs of the drawn token, and the
counter-based random streams behind the draws."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from rollout.base.params import SamplingParams
from rollout.engine.sampling.sampler import ALL, NONE, RowSpec, SamplingRows, sample_rows, truncation_mask
from rollout.engine.sampling.streams import stream_key, uniform_reference, uniforms

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1, 0.0]]).clamp_min(1e-30))  # token 4 has probability ~0


def sample(logits, params, keys=None, positions=None, passes=ALL):
    """sample_rows on one SamplingParams per row (or one for all), each row its own stream unless keys are given."""
    num = logits.shape[0]
    params = params if isinstance(params, list) else [params] * num
    keys = keys if keys is not None else [stream_key(9, i) for i in range(num)]
    rows = SamplingRows.of([RowSpec(p, k) for p, k in zip(params, keys)])
    positions = torch.zeros(num, dtype=torch.long) if positions is None else torch.as_tensor(positions)
    return sample_rows(logits, rows, positions, passes)[:3]  # tokens, logprobs, sampling logprobs


def test_truncation_keeps_top_k_then_the_smallest_top_p_set():
    sorted_logits = LOGITS.sort(descending=True).values
    keep = lambda k, p: (~truncation_mask(sorted_logits, torch.tensor([k]), torch.tensor([p])))[0].tolist()  # noqa
    assert keep(0, 1.0) == [True] * 5
    assert keep(2, 1.0) == [True, True, False, False, False]
    assert keep(0, 0.5) == [True, False, False, False, False]  # 0.5 already reaches 0.5
    assert keep(0, 0.6) == [True, True, False, False, False]
    assert keep(3, 0.9) == [True, True, True, False, False]  # renormalised over top-3: 0.556, 0.833, 1.0
    assert keep(1, 1e-9) == [True, False, False, False, False]  # the most likely token is always kept


def test_draws_follow_the_truncated_distribution_and_report_its_logprob():
    num = 40000
    logits = LOGITS.expand(num, 5).clone()
    tokens, full, sampling = sample(logits, SamplingParams(top_k=3))
    freq = torch.bincount(tokens, minlength=5).double() / num
    expected = torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]) / 0.9
    assert (freq - expected).abs().max() < 0.01, freq
    assert torch.allclose(full, torch.log_softmax(LOGITS[0], -1)[tokens], atol=1e-6)
    assert torch.allclose(sampling, torch.log(expected.float())[tokens], atol=1e-6)


def test_a_zero_probability_token_is_never_drawn():
    logits = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]]).expand(5000, 4).clone()
    tokens, _, _ = sample(logits, SamplingParams())
    assert set(tokens.tolist()) == {0, 2}


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    tokens, full, sampling = sample(logits, [SamplingParams(temperature=0.0 if i % 2 else 1.5) for i in range(6)])
    assert tokens[1::2].tolist() == logits[1::2].argmax(-1).tolist()
    assert (sampling[1::2] == 0).all()
    assert torch.equal(sampling[0::2], full[0::2])  # nothing truncated: the very same number
    assert torch.allclose(full[0::2], torch.log_softmax(logits[0::2] / 1.5, -1).gather(1, tokens[0::2, None])[:, 0])


def test_a_rows_draw_depends_on_its_key_and_position_only():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(4))
    key = stream_key(1, 7, 0)

    def draw(others: list[int], position: int):
        keys = [others[0], key, others[1]]
        params = [SamplingParams(top_k=5), SamplingParams(), SamplingParams(temperature=0.0)]
        return sample(logits, params, keys, positions=[3, position, 8])[0][1]

    assert draw([11, 12], 40) == draw([13, 14], 40)  # whatever else is in the batch
    tokens = {int(draw([11, 12], p)) for p in range(40)}
    assert len(tokens) > 10  # successive positions are fresh draws


@pytest.mark.parametrize("temperatures", [[1.0], [1.0, 0.7], [1.0, 0.0], [1.0, 0.7, 0.0]])
def test_skipping_passes_no_row_needs_changes_the_cost_not_the_results(temperatures):
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(5)) * 3
    specs = [RowSpec(SamplingParams(temperature=temperatures[i % len(temperatures)])) for i in range(64)]
    needed = NONE
    for spec in specs:
        needed |= spec.passes
    assert needed.truncate is False and needed.scale == (0.7 in temperatures) and needed.argmax == (0.0 in temperatures)
    params = [spec.params for spec in specs]
    every, only_needed = sample(logits, params, passes=ALL), sample(logits, params, passes=needed)
    for a, b in zip(every, only_needed):
        assert torch.equal(a, b)


def test_draw_frequencies_are_exact_across_blocks_of_a_large_vocabulary():
    # 300 tokens: three blocks of the two-level CDF, the last one partial; a whole block and scattered tokens at zero
    gen = torch.Generator().manual_seed(5)
    probs = torch.rand(300, generator=gen)
    probs[128:256] = 0.0
    probs[[0, 127, 256, 299]] = 0.0
    probs[100] = 5.0  # one heavy token
    probs /= probs.sum()
    num = 200000
    logits = probs.log().expand(num, 300).clone()
    tokens, full, sampling = sample(logits, SamplingParams())
    freq = torch.bincount(tokens, minlength=300).double() / num
    assert freq[probs == 0].sum() == 0, "a zero-probability token was drawn"
    assert (freq - probs.double()).abs().max() < 4 * math.sqrt(float(probs.max()) / num)
    assert torch.equal(full, sampling)
    assert torch.allclose(full, torch.log_softmax(logits[0], -1)[tokens])


def test_non_finite_logits_still_give_a_token_in_the_vocabulary():
    # a model that overflows must not take the engine down with an index error; the NaN logprob tells the caller
    logits = torch.randn(4, 300)
    logits[0] = float("nan")
    logits[1, 5] = float("inf")
    tokens, full, _ = sample(logits, SamplingParams())
    assert ((tokens >= 0) & (tokens < 300)).all()
    assert torch.isnan(full[0])


def test_streams_on_tensors_equal_the_integer_reference_bit_for_bit():
    gen = torch.Generator().manual_seed(7)
    keys = [stream_key(*torch.randint(0, 2**31, (3,), generator=gen).tolist()) for _ in range(500)]
    counters = torch.randint(0, 2**31, (500,), generator=gen)
    got = uniforms(torch.tensor(keys), counters)
    expected = torch.tensor([uniform_reference(k, int(c)) for k, c in zip(keys, counters)], dtype=torch.float64)
    assert torch.equal(got, expected)
    assert stream_key(1, 2, 3) != stream_key(1, 3, 2) and stream_key(1, 2) != stream_key(2, 1)


def test_one_streams_successive_draws_are_uniform():
    num = 100_000
    u = uniforms(torch.full((num,), stream_key(1, 42, 0)), torch.arange(num))
    assert 0 <= float(u.min()) and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    chi2 = float(((counts - num / 20) ** 2 / (num / 20)).sum())
    assert chi2 < 43.8  # 19 degrees of freedom: p = 0.001
    pairs = torch.histc((u[:-1] * 10).floor() * 10 + (u[1:] * 10).floor(), bins=100, min=0, max=100)
    chi2_pairs = float(((pairs - (num - 1) / 100) ** 2 / ((num - 1) / 100)).sum())
    assert chi2_pairs < 148.2  # successive draws independent: 99 degrees of freedom, p = 0.001


def test_the_slot_table_gives_back_each_requests_parameters_and_reuses_slots_of_finished_ones():
    from rollout.engine.sampling.slots import SlotTable

    specs = {f"r{i}": RowSpec(SamplingParams(temperature=[0.0, 0.7, 1.3][i % 3], top_k=i, top_p=1 - i / 20,
                                             min_p=i / 10),
                              stream_key(3, i)) for i in range(5)}
    live, grown = set(specs), []
    table = SlotTable(torch.device("cpu"), 4, specs.__getitem__, live.__contains__)
    table.on_grow = lambda: grown.append(table.capacity)

    def slots(ids):  # the table reads a request's id off its upstream RequestState
        return table.slots(SimpleNamespace(request_id=i) for i in ids)

    def check(ids):
        got, expected = table.rows(torch.tensor(slots(ids), dtype=torch.int32)), SamplingRows.of(
            [specs[i] for i in ids])
        for field in ("temperature", "top_k", "top_p", "greedy", "key", "min_p"):
            assert torch.equal(getattr(got, field), getattr(expected, field)), field
        assert got.adjust is None  # no request asked for penalties: the adjust pass has nothing to gather

    first = slots(["r0", "r1", "r2"])  # 3 usable slots: slot 0 is the default row
    assert sorted(first) == [1, 2, 3] and slots(["r1"]) == [first[1]]  # written once, found again
    live.discard("r0")  # finished: its slot comes back when the free list runs out
    assert slots(["r3"]) == [first[0]] and grown == []
    assert slots(["r4"]) and grown == [8]  # every slot live: the table doubles
    check(["r1", "r2", "r3", "r4"])
    assert table.passes([first[0]]) == specs["r3"].passes


def test_top_lists_are_the_k_most_likely_tokens_of_the_same_log_softmax_as_the_sampled_logprob():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 4
    params = [SamplingParams(temperature=t, top_logprobs=k, top_k=tk)
              for t, k, tk in [(1.0, 5, 0), (0.7, 20, 0), (0.0, 3, 0), (1.3, 1, 40), (1.0, 0, 0), (2.0, 20, 0)]]
    specs = [RowSpec(p, stream_key(9, i)) for i, p in enumerate(params)]
    passes = NONE
    for spec in specs:
        passes |= spec.passes
    assert passes.top == 20  # the step's pass serves the row that asks most
    drawn = sample_rows(logits, SamplingRows.of(specs), torch.zeros(6, dtype=torch.long), passes)
    assert drawn.top_ids.shape == (6, 20) and drawn.top_logprobs.shape == (6, 20)
    for i, p in enumerate(params):
        # independent reference: the log-softmax a trainer's forward computes at the row's temperature
        reference = torch.log_softmax(logits[i].double() / (p.temperature or 1.0), dim=-1)
        expected = reference.topk(20)
        assert drawn.top_ids[i].tolist() == expected.indices.tolist()
        assert torch.allclose(drawn.top_logprobs[i].double(), expected.values, atol=1e-5)
        token = int(drawn.tokens[i])
        if token in drawn.top_ids[i].tolist():  # listed: bit-identical to the sampled token's logprob
            assert drawn.top_logprobs[i, drawn.top_ids[i].tolist().index(token)] == drawn.logprobs[i]
    assert int(drawn.tokens[2]) == drawn.top_ids[2, 0]  # a greedy row samples its top-1


def test_a_step_where_no_row_asks_for_top_lists_skips_the_pass():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4))
    rows = SamplingRows.of([RowSpec(SamplingParams(), stream_key(9, i)) for i in range(4)])
    drawn = sample_rows(logits, rows, torch.zeros(4, dtype=torch.long), NONE)
    assert drawn.top_ids.shape == (4, 0) and drawn.top_logprobs.shape == (4, 0)
    assert RowSpec(SamplingParams()).passes.top == 0 and RowSpec(SamplingParams(top_logprobs=7)).passes.top == 7


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True])
def test_top_logprobs_outside_0_to_20_is_refused_naming_the_field(bad):
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=bad)
