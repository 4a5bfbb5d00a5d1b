"""Per-row sampling: truncation semantics, exact draw frequencies, and both logprobs of the drawn token."""

from __future__ import annotations

import math

import torch

from rollout.engine.sampler import RowSpec, sample_rows, truncation_mask
from rollout.params import SamplingParams

LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.1, 0.0]]).clamp_min(1e-30))  # token 4 has probability ~0


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
    rows = [RowSpec(SamplingParams(top_k=3))] * num
    tokens, full, sampling = sample_rows(logits, rows, torch.Generator().manual_seed(0))
    freq = torch.bincount(tokens, minlength=5).double() / num
    expected = torch.tensor([0.5, 0.25, 0.15, 0.0, 0.0]) / 0.9
    assert (freq - expected).abs().max() < 0.01, freq
    assert torch.allclose(full, torch.log_softmax(LOGITS[0], -1)[tokens], atol=1e-6)
    assert torch.allclose(sampling, torch.log(expected.float())[tokens], atol=1e-6)


def test_a_zero_probability_token_is_never_drawn():
    logits = torch.tensor([[0.0, -math.inf, 0.0, -math.inf]]).expand(5000, 4).clone()
    tokens, _, _ = sample_rows(logits, [RowSpec(SamplingParams())] * 5000, torch.Generator().manual_seed(1))
    assert set(tokens.tolist()) == {0, 2}


def test_greedy_rows_take_the_argmax_next_to_sampled_rows():
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(2))
    rows = [RowSpec(SamplingParams(temperature=0.0 if i % 2 else 1.5)) for i in range(6)]
    tokens, full, sampling = sample_rows(logits, rows, torch.Generator().manual_seed(3))
    assert tokens[1::2].tolist() == logits[1::2].argmax(-1).tolist()
    assert (sampling[1::2] == 0).all()
    assert torch.equal(sampling[0::2], full[0::2])  # nothing truncated: the very same number
    assert torch.allclose(full[0::2], torch.log_softmax(logits[0::2] / 1.5, -1).gather(1, tokens[0::2, None])[:, 0])


def test_seeded_rows_are_reproducible_whatever_else_is_drawn():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(4))

    def draw(shared_seed):
        seeded = RowSpec(SamplingParams(seed=7), torch.Generator().manual_seed(7))
        rows = [RowSpec(SamplingParams()), seeded, RowSpec(SamplingParams())]
        return sample_rows(logits, rows, torch.Generator().manual_seed(shared_seed))[0]

    a, b = draw(10), draw(11)
    assert a[1] == b[1]  # the seeded row ignores the shared generator


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
    tokens, full, sampling = sample_rows(logits, [RowSpec(SamplingParams())] * num, torch.Generator().manual_seed(6))
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
    tokens, full, _ = sample_rows(logits, [RowSpec(SamplingParams())] * 4, torch.Generator().manual_seed(0))
    assert ((tokens >= 0) & (tokens < 300)).all()
    assert torch.isnan(full[0])
