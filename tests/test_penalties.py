"""Penalties, logit bias, min_p and min_new_tokens: what a row samples from, checked against an independent reference
(a plain teacher-forced forward, the adjustments applied by hand with Python loops in float64), the two logprobs,
rows that ask for nothing left bit-identical, and bad values refused by name."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine.sampling.sampler import RowSpec, sample_rows
from rollout.engine.sampling.slots import SlotTable
from rollout.engine.sampling.streams import stream_key

ROOMY = WorkerConfig(num_blocks=256)
CRAMPED = WorkerConfig(page_size=4, num_blocks=24, max_batch_tokens=32)  # rows preempted mid-decode (reproducibility)


def reference_logits(raw: torch.Tensor, prompt: list[int], completion: list[int], p: SamplingParams,
                     stop_ids: tuple[int, ...]) -> torch.Tensor:
    """The logits a row samples from after its bias, min_new_tokens and penalties (vLLM's order), before temperature:
    one position, written token by token. raw: (V,)."""
    x = [float(v) for v in raw]
    for token, bias in p.logit_bias or ():
        x[token] += bias
    if len(completion) < p.min_new_tokens:
        for token in stop_ids:
            x[token] = -math.inf
    counts = Counter(completion)
    for token in set(prompt) | set(counts):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else x[token] * p.repetition_penalty
    for token, count in counts.items():
        x[token] -= p.frequency_penalty * count + p.presence_penalty
    return torch.tensor(x, dtype=torch.float64)


def reference_distribution(x: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Probabilities sampled from, from adjusted logits: temperature, min_p, top-k, top-p (renormalised each time)."""
    probs = torch.softmax(x / p.temperature, dim=-1)
    probs[probs < p.min_p * probs.max()] = 0.0
    order = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    if p.top_k:
        probs[order[p.top_k:]] = 0.0
    probs /= probs.sum()
    if p.top_p < 1.0:
        mass = 0.0
        for t in order:
            if mass >= p.top_p:
                probs[t] = 0.0
            mass += float(probs[t])
        probs /= probs.sum()
    return probs


def teacher_forced(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """Raw fp32 logits predicting each completion token, (T, V)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    return logits[len(prompt) - 1: len(prompt) + len(completion) - 1]


def check_row(model, prompt: list[int], completion: list[int], logprobs, sampling, p: SamplingParams,
              stop_ids: tuple[int, ...]) -> None:
    """Every token of a row against the reference: its full logprob, and its logprob under the distribution the
    adjustments made (greedy: the argmax of the adjusted logits)."""
    raw = teacher_forced(model, prompt, completion)
    temperature = p.temperature or 1.0
    expected_full = torch.log_softmax(raw.double() / temperature, -1)
    for t, token in enumerate(completion):
        assert abs(float(logprobs[t]) - float(expected_full[t, token])) < 1e-5, (t, "logprob")
        x = reference_logits(raw[t], prompt, completion[:t], p, stop_ids)
        if p.is_greedy:
            assert token == int(x.argmax()) and float(sampling[t]) == 0.0, t
            continue
        expected = math.log(float(reference_distribution(x, p)[token]))
        assert abs(float(sampling[t]) - expected) < 1e-5, (t, float(sampling[t]), expected)


MIXED = [SamplingParams(n=2, temperature=0.9, max_new_tokens=10, ignore_eos=True, seed=5),  # asks for nothing
         SamplingParams(n=3, temperature=0.9, top_k=50, max_new_tokens=10, ignore_eos=True, frequency_penalty=1.5,
                        presence_penalty=0.7),
         SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True, repetition_penalty=1.8),
         SamplingParams(n=2, temperature=1.2, top_p=0.9, max_new_tokens=10, ignore_eos=True, repetition_penalty=0.6,
                        min_p=0.05),
         SamplingParams(n=2, max_new_tokens=10, ignore_eos=True, logit_bias={7: 6.0, 9: -100.0}, min_p=0.2,
                        frequency_penalty=-1.0)]


def test_mixed_rows_sample_what_the_reference_adjustments_give_with_exact_logprobs(tiny):
    model, _ = tiny
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(10, 500, (n,), generator=gen).tolist() for n in (6, 9, 4, 7, 5)]
    # prompt 2 repeats itself: the repetition penalty acts on the prompt's tokens from the first step
    prompts[2] = prompts[2] * 3
    with RolloutWorker(model, ROOMY) as worker:
        batch = worker.generate(prompts, MIXED)
        alone = worker.generate(prompts[:1], MIXED[:1])
    assert batch.completion_token_lists()[:2] == alone.completion_token_lists()  # seeded, plain: unchanged
    assert torch.equal(batch.sampling_logprobs[:2], batch.logprobs[:2])  # nothing adjusted: the very same number
    for r, ids in enumerate(batch.completion_token_lists()):
        p = MIXED[int(batch.prompt_index[r])]
        check_row(model, batch.prompt_ids[r], ids, batch.logprobs[r], batch.sampling_logprobs[r], p, ())
    # the penalties act: a frequency-penalised row repeats less than the unpenalised greedy row would
    assert 9 not in {t for ids in batch.completion_token_lists()[8:] for t in ids}  # biased to -100
    assert sum(t == 7 for ids in batch.completion_token_lists()[8:] for t in ids) > 0


def test_min_new_tokens_holds_back_the_stop_ids_until_that_many_tokens(tiny):
    model, _ = tiny
    eos = model.config.eos_token_id
    p = SamplingParams(n=3, max_new_tokens=12, logit_bias={eos: 100.0}, min_new_tokens=4, seed=2)
    with RolloutWorker(model, ROOMY) as worker:
        batch = worker.generate([[11, 12, 13, 14]], p)
        eager = worker.generate([[11, 12, 13, 14]], SamplingParams(max_new_tokens=12, logit_bias={eos: 100.0}))
    assert eager.completion_token_lists() == [[eos]]  # the bias alone stops at once
    for r, ids in enumerate(batch.completion_token_lists()):
        assert len(ids) == 5 and ids[-1] == eos and eos not in ids[:4] and batch.finish_reason[r] == "stop"
        check_row(model, batch.prompt_ids[r], ids, batch.logprobs[r], batch.sampling_logprobs[r], p, (eos,))


def test_penalised_rows_repeat_whatever_the_preemption(tiny, monkeypatch):
    from transformers.generation.continuous_batching.requests import RequestState
    resets: list[int] = []
    original = RequestState.create_equivalent_initial_request
    monkeypatch.setattr(RequestState, "create_equivalent_initial_request",
                        lambda self: resets.append(self.generated_len()) or original(self))
    model, _ = tiny
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 500, (n,), generator=gen).tolist() for n in (9, 14, 5, 11)]
    params = [SamplingParams(n=2, max_new_tokens=16, ignore_eos=True, seed=40 + i, frequency_penalty=1.0,
                             presence_penalty=0.5, repetition_penalty=1.3) for i in range(4)]
    with RolloutWorker(model, ROOMY) as worker:
        roomy = worker.generate(prompts, params).completion_token_lists()
    with RolloutWorker(model, CRAMPED) as worker:
        cramped = worker.generate(prompts, params)
    assert any(n > 0 for n in resets), "the cramped cache preempted requests mid-decode"
    assert cramped.completion_token_lists() == roomy  # counts rebuilt from the tokens a preempted row holds
    for r, ids in enumerate(roomy):
        check_row(model, cramped.prompt_ids[r], ids, cramped.logprobs[r], cramped.sampling_logprobs[r],
                  params[int(cramped.prompt_index[r])], ())


def test_draws_follow_the_adjusted_distribution():
    vocab, num = 8, 40000
    raw = torch.tensor([2.0, 1.5, 1.0, 0.5, -0.5, -1.0, 0.2, 0.0])
    p = SamplingParams(temperature=0.8, frequency_penalty=0.4, presence_penalty=0.3, repetition_penalty=1.5,
                       logit_bias={5: 2.0}, min_p=0.15)
    state = fake_state("r0", prompt=[3, 4], completion=[0, 0, 1])
    table = SlotTable(torch.device("cpu"), 4, lambda _: RowSpec(p), lambda _: True, vocab_size=vocab)
    rows = table.rows(torch.full((num,), table.slots([state])[0]))
    rows = replace(rows, key=torch.tensor([stream_key(9, i) for i in range(num)]))  # each row its own stream
    drawn = sample_rows(raw.expand(num, vocab).clone(), rows, torch.full((num,), 4))
    expected = reference_distribution(reference_logits(raw, [3, 4], [0, 0, 1], p, ()), p)
    freq = torch.bincount(drawn.tokens, minlength=vocab).double() / num
    assert (freq - expected).abs().max() < 0.01, (freq, expected)
    assert expected[4] == 0 and freq[expected == 0].sum() == 0  # min_p removed a token: never drawn
    assert torch.allclose(drawn.sampling_logprobs.double(), expected.log()[drawn.tokens], atol=1e-5)
    assert torch.allclose(drawn.logprobs, torch.log_softmax(raw / 0.8, -1)[drawn.tokens], atol=1e-6)
    table.count(replace(rows, adjust=replace(rows.adjust, rows=rows.adjust.rows[:1], active=rows.adjust.active[:1],
                                             frequency=rows.adjust.frequency[:1], presence=rows.adjust.presence[:1])),
                drawn.tokens[:1])  # counted on the device: the row's completion is now [0, 0, 1, token]
    token, row = int(drawn.tokens[0]), int(rows.adjust.rows[0])
    counts = torch.bincount(torch.tensor([0, 0, 1, token]), minlength=vocab).float()
    assert torch.allclose(table.adjust.penalty[row], -(0.4 * counts + 0.3 * (counts > 0)))
    assert torch.equal(table.adjust.generated[row], counts > 0)
    assert table.adjust.seen[row].tolist() == [c > 0 or t in (3, 4) for t, c in enumerate(counts.tolist())]


def fake_state(request_id: str, prompt: list[int], completion: list[int]):
    """What the slot table reads of an upstream RequestState that was never soft reset."""
    return SimpleNamespace(request_id=request_id, initial_tokens=prompt, generated_tokens=completion,
                           _true_initial_tokens=0)


def test_a_step_with_adjusting_rows_leaves_the_others_bit_identical():
    logits = torch.randn(32, 300, generator=torch.Generator().manual_seed(5)) * 3
    plain = [SamplingParams(temperature=[1.0, 0.7, 0.0, 1.3][i % 4], top_k=[0, 0, 0, 40][i % 4]) for i in range(32)]
    asks = [SamplingParams(temperature=0.7, repetition_penalty=1.4, frequency_penalty=0.5, min_p=0.1)] * 32
    mixed = [a if i % 3 == 0 else b for i, (a, b) in enumerate(zip(asks, plain))]
    states = [fake_state(f"r{i}", [1, 2, 3], [2, 4]) for i in range(32)]

    def step(params):
        specs = {f"r{i}": RowSpec(p, stream_key(4, i)) for i, p in enumerate(params)}
        table = SlotTable(torch.device("cpu"), 64, specs.__getitem__, lambda _: True, vocab_size=300)
        slots = table.slots(states)
        passes = table.passes(slots)
        return sample_rows(logits, table.rows(torch.tensor(slots), passes), torch.full((32,), 4), passes), passes

    alone, skipped = step(plain)
    together, ran = step(mixed)
    assert not skipped.adjust and not skipped.min_p and ran.adjust and ran.min_p
    keep = [i for i in range(32) if i % 3]
    for a, b in zip(alone[:3], together[:3]):
        assert torch.equal(a[keep], b[keep])
    changed = [i for i in range(32) if i % 3 == 0]
    assert not torch.equal(together.sampling_logprobs[changed], together.logprobs[changed])


@pytest.mark.parametrize("field, value, message", [
    ("min_p", 1.5, "min_p=1.5 is invalid: must be a finite number in [0, 1]"),
    ("min_p", -0.1, "min_p=-0.1 is invalid"),
    ("repetition_penalty", 0.0, "repetition_penalty=0.0 is invalid: must be a finite number > 0"),
    ("repetition_penalty", math.inf, "repetition_penalty=inf is invalid"),
    ("presence_penalty", 2.5, "presence_penalty=2.5 is invalid: must be a finite number in [-2, 2]"),
    ("frequency_penalty", math.nan, "frequency_penalty=nan is invalid"),
    ("frequency_penalty", True, "frequency_penalty=True is invalid"),
    ("min_new_tokens", 65, "min_new_tokens=65 is invalid: must be an integer in [0, 64]"),
    ("logit_bias", {3: 101}, "logit_bias[3]=101 is invalid: must be a finite number in [-100, 100]"),
    ("logit_bias", {-3: 1.0}, "logit_bias=-3 is invalid"),
    ("logit_bias", [1, 2], "logit_bias=[1, 2] is invalid: must be a mapping of token id to bias"),
])
def test_bad_values_are_refused_naming_the_field_and_the_fix(field, value, message):
    with pytest.raises(ValueError) as error:
        SamplingParams(**{field: value})
    assert message in str(error.value) and "Fix:" in str(error.value)
    assert error.value.field.split("[")[0] == field


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused_before_anything_runs(tiny):
    model, _ = tiny
    vocab = model.get_output_embeddings().weight.shape[0]
    with RolloutWorker(model, ROOMY) as worker:
        with pytest.raises(ValueError, match=f"prompt 0: logit_bias={vocab} is invalid"):
            worker.generate([[1, 2]], SamplingParams(logit_bias={vocab: 1.0}))


def test_logit_bias_is_kept_as_sorted_pairs_and_params_stay_hashable():
    p = SamplingParams(logit_bias={9: 1.0, 2: -3.0})
    assert p.logit_bias == ((2, -3.0), (9, 1.0)) and p == SamplingParams(logit_bias=[(2, -3.0), (9, 1.0)])
    assert hash(p) == hash(SamplingParams(logit_bias={2: -3.0, 9: 1.0}))
    assert not SamplingParams(logit_bias={}).adjusts_logits and SamplingParams(min_new_tokens=1).adjusts_logits


def test_adjust_rows_of_finished_requests_are_reused_before_the_table_grows():
    p = SamplingParams(frequency_penalty=0.5)
    live: set[str] = set()
    table = SlotTable(torch.device("cpu"), 64, lambda _: RowSpec(p), live.__contains__, vocab_size=16)

    def start(names):
        live.update(names)
        return table.slots(fake_state(name, [1, 2], []) for name in names)

    start([f"a{i}" for i in range(7)])  # row 0 is the neutral row: 7 requests fill the first 8 rows
    assert table.adjust.capacity == 8
    live.clear()  # they finished
    start([f"b{i}" for i in range(7)])
    assert table.adjust.capacity == 8  # their rows were taken back, not 8 more allocated
    start(["c0"])
    assert table.adjust.capacity == 16  # every row live: the tables double


class Echo:
    """Answers every model turn with the observation [21, 22] and records the turns it saw."""

    def __init__(self, turns: list) -> None:
        self.turns = turns

    def step(self, completion_ids):
        from rollout.base.env import Turn
        self.turns.append(list(completion_ids))
        return Turn(observation_ids=[21, 22])


def test_each_turn_of_an_episode_counts_its_own_tokens(tiny):
    model, _ = tiny
    eos = model.config.eos_token_id
    turns: list[list[int]] = []
    p = SamplingParams(n=2, max_new_tokens=40, logit_bias={eos: 100.0}, min_new_tokens=3, seed=6)
    with RolloutWorker(model, ROOMY) as worker:
        batch = worker.generate([[11, 12, 13]], p, env=lambda i, j: Echo(turns), max_turns=3)
    assert batch.finish_reason == ["max_turns"] * 2 and len(turns) == 6
    assert all(len(t) == 4 and t[-1] == eos and eos not in t[:3] for t in turns)  # min_new_tokens per turn
