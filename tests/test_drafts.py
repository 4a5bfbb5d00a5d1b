"""Speculation's config and the draft sources (rollout/engine/speculation/drafts.py): what they propose, checked against a
brute-force reference; the history's memory bound and LRU eviction; a failing source costing only its drafts."""

from __future__ import annotations

import dataclasses
import random
import time
import tracemalloc

import pytest

from rollout.base import InvalidArgument
from rollout.base.speculation import Speculation
from rollout.engine.speculation import drafts as drafts_module
from rollout.engine.speculation.drafts import ContextSource, DraftIndex, HistorySource

CONTEXT = Speculation(drafts=("context",))
HISTORY = Speculation(drafts=("history",))


# ---- the config ----

def test_speculation_defaults_and_a_list_of_drafts_stored_as_a_tuple():
    spec = Speculation()
    assert (spec.drafts, spec.max_draft_tokens, spec.history_memory_mb, spec.mode) == (("context", "history"), 4, 64,
                                                                                       "auto")
    assert (spec.min_ngram, spec.max_ngram, spec.draft_model) == (2, 4, None)
    assert Speculation(drafts=["history", "context"]).drafts == ("history", "context")
    model = object()
    assert Speculation(drafts=["model"], draft_model=model).draft_model is model
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.mode = "off"


@pytest.mark.parametrize("kwargs, field, rule", [
    ({"drafts": ()}, "drafts", "non-empty"),
    ({"drafts": []}, "drafts", "non-empty"),
    ({"drafts": "context"}, "drafts", "non-empty tuple or list"),
    ({"drafts": ("context", "suffix")}, "drafts", "'suffix' is not a draft source"),
    ({"drafts": ("context", "context")}, "drafts", "twice"),
    ({"max_draft_tokens": 0}, "max_draft_tokens", r"in \[1, 32\]"),
    ({"max_draft_tokens": 33}, "max_draft_tokens", r"in \[1, 32\]"),
    ({"max_draft_tokens": True}, "max_draft_tokens", "integer"),
    ({"max_draft_tokens": 4.0}, "max_draft_tokens", "integer"),
    ({"history_memory_mb": 0}, "history_memory_mb", "> 0"),
    ({"history_memory_mb": -1.5}, "history_memory_mb", "> 0"),
    ({"history_memory_mb": float("inf")}, "history_memory_mb", "finite"),
    ({"history_memory_mb": float("nan")}, "history_memory_mb", "> 0"),
    ({"history_memory_mb": "64"}, "history_memory_mb", "number"),
    ({"history_memory_mb": True}, "history_memory_mb", "number"),
    ({"mode": "sometimes"}, "mode", "one of"),
    ({"drafts": ("context", "model")}, "draft_model", "required"),
    ({"draft_model": object()}, "draft_model", "no use unless 'model'"),
    ({"min_ngram": 0}, "min_ngram", r"in \[1, 8\]"),
    ({"min_ngram": 9, "max_ngram": 9}, "min_ngram", r"in \[1, 8\]"),
    ({"max_ngram": 9}, "max_ngram", r"in \[2, 8\]"),
    ({"min_ngram": 3, "max_ngram": 2}, "max_ngram", r"in \[3, 8\]"),
])
def test_bad_speculation_values_are_refused_naming_field_rule_and_fix(kwargs, field, rule):
    with pytest.raises(InvalidArgument, match=rule) as caught:
        Speculation(**kwargs)
    assert caught.value.field == field and caught.value.fix and caught.value.where == ""


# ---- "context": the row's own tokens ----

def reference_context_draft(tokens: list[int], k: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Brute force: the longest suffix (max_ngram down to min_ngram) that occurred earlier; what followed its most
    recent earlier occurrence, continued as a repeat past the row's end."""
    length = len(tokens)
    for n in range(min(max_ngram, length), min_ngram - 1, -1):
        suffix = tokens[length - n:]
        for end in range(length - 1, n - 1, -1):  # an occurrence ending at end - 1, followed by tokens[end]
            if tokens[end - n: end] == suffix:
                virtual = list(tokens)
                while len(virtual) < length + k:
                    virtual.append(virtual[len(virtual) - (length - end)])
                return virtual[length: length + k]
    return []


def context_row(tokens: list[int], spec: Speculation = CONTEXT):
    return DraftIndex(spec).row(tokens)


def test_a_repeated_pattern_proposes_its_continuation():
    assert context_row([5, 6, 7, 8, 9, 5, 6, 7]).propose(2) == [8, 9]
    # past the row's end the match goes on as the repeat it is
    assert context_row([1, 2, 3, 1, 2, 3]).propose(5) == [1, 2, 3, 1, 2]


def test_no_repeat_proposes_nothing_and_short_rows_propose_nothing():
    assert context_row(list(range(20))).propose(4) == []
    assert context_row([]).propose(4) == []
    assert context_row([7]).propose(4) == []
    assert context_row([7, 7]).propose(4) == []  # the 1-gram repeats, but min_ngram is 2


def test_k_caps_the_draft():
    row = context_row([1, 2, 3, 4, 5, 6, 1, 2])
    assert row.propose(3) == [3, 4, 5]
    assert row.propose(1) == [3]
    assert row.propose(0) == []


def test_the_most_recent_occurrence_wins():
    assert context_row([1, 2, 3, 1, 2, 4, 1, 2]).propose(1) == [4]


def test_the_longest_suffix_wins_over_a_more_recent_shorter_one():
    assert context_row([7, 1, 2, 3, 9, 1, 2, 5, 7, 1, 2]).propose(1) == [3]
    assert context_row([7, 1, 2, 3, 9, 1, 2, 5, 7, 1, 2], Speculation(drafts=("context",), max_ngram=2)
                       ).propose(1) == [5]


@pytest.mark.parametrize("min_ngram, max_ngram", [(1, 1), (2, 4), (3, 8)])
def test_extend_keeps_the_index_equal_to_a_brute_force_scan(min_ngram, max_ngram):
    rng = random.Random(min_ngram * 10 + max_ngram)
    spec = Speculation(drafts=("context",), min_ngram=min_ngram, max_ngram=max_ngram)
    tokens = [rng.randrange(4) for _ in range(5)]
    row = DraftIndex(spec).row(tokens)
    hits = 0
    for _ in range(150):
        step = [rng.randrange(4) for _ in range(rng.randrange(1, 4))]
        row.extend(step)
        tokens += step
        k = rng.randrange(1, 7)
        expected = reference_context_draft(tokens, k, min_ngram, max_ngram)
        assert row.propose(k) == expected
        hits += bool(expected)
    assert hits > 100  # a 4-token alphabet repeats: the comparison covered real proposals


def test_samples_of_one_prompt_share_its_index_but_not_each_others_tokens():
    index = DraftIndex(CONTEXT)
    prompt = [1, 2, 3, 4, 1, 2]
    first = index.row(prompt)
    first.extend([8, 9, 1, 2, 8])  # (1, 2) -> 8 in this row only
    second = index.row(prompt)  # the prompt's index, copied from the first row's start
    assert second.propose(2) == reference_context_draft(prompt, 2, 2, 4) == [3, 4]
    assert first.propose(2) == reference_context_draft(prompt + [8, 9, 1, 2, 8], 2, 2, 4) == [9, 1]
    second.extend([5, 1, 2])
    assert second.propose(1) == [5]


# ---- "history": completions recorded for the same prompt ----

PROMPT = [11, 12, 13, 14, 15]


def test_a_recorded_completion_of_the_same_prompt_is_proposed_from_the_matching_point():
    index = DraftIndex(HISTORY)
    index.record(PROMPT, [20, 21, 22, 23, 24])
    row = index.row(PROMPT)
    assert row.propose(3) == [20, 21, 22]  # from the first token: the prompt's tail matches
    row.extend([20, 21])
    assert row.propose(2) == [22, 23]
    assert row.propose(9) == [22, 23, 24]  # no further than the completion went
    row.extend([30])
    assert row.propose(2) == []


def test_another_prompts_completion_is_not_proposed():
    index = DraftIndex(HISTORY)
    index.record(PROMPT, [20, 21, 22, 23, 24])
    other = index.row([10] + PROMPT[1:])  # the same tail, another prompt
    assert other.propose(3) == []
    other.extend([20, 21])
    assert other.propose(2) == []


def test_the_most_recent_completion_wins_and_a_group_mate_finishing_later_is_seen():
    index = DraftIndex(HISTORY)
    row = index.row(PROMPT)  # started before anything was recorded, like a sample of the same group
    assert row.propose(2) == []
    index.record(PROMPT, [20, 21, 22, 23])
    index.record(PROMPT, [20, 21, 22, 29])
    row.extend([20, 21, 22])
    assert row.propose(1) == [29]


def test_context_and_history_the_longest_match_wins_and_ties_go_to_the_source_named_first():
    index = DraftIndex(Speculation(drafts=("context", "history")))
    index.record(PROMPT, [1, 2, 3, 4, 40, 41])
    row = index.row(PROMPT)
    row.extend([7, 3, 4, 8, 1, 2, 3, 4])  # context knows (3, 4) -> 8; history knows (1, 2, 3, 4) -> 40
    assert row.propose(1) == [40]
    for order, expected in ((("context", "history"), 50), (("history", "context"), 40)):
        index = DraftIndex(Speculation(drafts=order))
        index.record(PROMPT, [1, 2, 3, 4, 40, 41])
        row = index.row(PROMPT)
        row.extend([1, 2, 3, 4, 50, 1, 2, 3, 4])  # both know (1, 2, 3, 4): context -> 50, history -> 40
        assert row.propose(1) == [expected]


def test_eviction_keeps_memory_under_the_budget_and_drops_the_least_recently_used_prompts():
    spec = Speculation(drafts=("history",), history_memory_mb=0.05)
    index = DraftIndex(spec)
    rng = random.Random(0)
    completions = {}
    for p in range(40):
        prompt = [p, p + 1000]
        completions[p] = [rng.randrange(5000) for _ in range(30)]
        index.record(prompt, completions[p])
        index.row(prompt).propose(1)  # a lookup indexes the completion: its n-grams count from then on
        assert 0 < index.memory_bytes <= 0.05 * 2**20
        if p >= 1:
            index.row([0, 1000])  # prompt 0 is drafted for after every record: the most recently used
    alive = [p for p in range(40) if index.holds([p, p + 1000])]
    assert 0 in alive and 39 in alive and 1 not in alive
    assert alive[1:] == list(range(40 - len(alive) + 1, 40))  # the survivors: prompt 0 and the newest ones
    assert index.row([39, 1039]).propose(3) == completions[39][:3]
    assert index.row([1, 1001]).propose(3) == []


def test_memory_bytes_tracks_what_the_history_really_allocates():
    rng = random.Random(1)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = DraftIndex(Speculation(history_memory_mb=512))
        for p in range(30):
            for _ in range(8):
                index.record([p] * 40, [rng.randrange(300) for _ in range(rng.randrange(50, 250))])
            if p % 2:
                index.row([p] * 40).propose(1)  # half the prompts looked up, so indexed; the rest stored only
        traced = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0.75 < index.memory_bytes / traced < 1.33


def test_a_recorded_completion_is_indexed_by_the_first_lookup_that_needs_it_and_counted_then():
    index = DraftIndex(HISTORY)
    index.record(PROMPT, [1, 2, 3, 4, 5])
    stored = index.memory_bytes
    row = index.row(PROMPT)
    assert index.memory_bytes == stored  # recorded and drafted for, not yet looked up: tokens only
    assert row.propose(2) == [1, 2]  # the prompt's last tokens lead into the completion
    indexed = index.memory_bytes
    assert indexed - stored == drafts_module.INDEX_ENTRY_BYTES * 5 * 3  # 5 followers x n-grams of 2, 3 and 4
    index.record(PROMPT, [1, 2, 9, 9])  # a later sample of the group: seen by the row's next lookup
    assert index.memory_bytes == indexed + drafts_module.TOKEN_BYTES * 4 + drafts_module.COMPLETION_BYTES
    row.extend([1, 2])
    assert row.propose(2) == [9, 9]  # the most recent completion wins


def test_a_prompt_keeps_only_its_most_recent_completions():
    index = DraftIndex(HISTORY)
    index.record(PROMPT, [90, 91, 92])
    for i in range(2 * drafts_module.MAX_COMPLETIONS):
        index.record(PROMPT, [100 + i, 7, 8])
    row = index.row(PROMPT)
    assert row.propose(3) == [100 + 2 * drafts_module.MAX_COMPLETIONS - 1, 7, 8]
    held = index.memory_bytes
    assert DraftIndex(HISTORY).row(PROMPT).propose(1) == []
    row.extend([90])  # the oldest completion was dropped with the others past MAX_COMPLETIONS
    assert row.propose(2) == []
    index.clear()
    assert index.memory_bytes == 0 < held
    assert index.row(PROMPT).propose(3) == []


# ---- failure and cost ----

def test_a_raising_source_yields_no_drafts_and_the_row_goes_on_with_the_others(monkeypatch):
    def boom(self, *args):
        raise RuntimeError("draft source broke")

    index = DraftIndex(Speculation(drafts=("context", "history")))
    index.record(PROMPT, [1, 2, 3, 1, 2, 9])
    row = index.row(PROMPT)
    monkeypatch.setattr(ContextSource, "lookup", boom)
    row.extend([1, 2, 3, 1, 2])
    assert row.propose(2) == []  # the failing call drafts nothing
    assert row.propose(1) == [9]  # then history alone: context would say 3
    monkeypatch.setattr(HistorySource, "lookup", boom)
    assert row.propose(1) == []
    assert row.sources == []
    monkeypatch.setattr(ContextSource, "advance", boom)
    fresh = index.row(PROMPT)  # a source that fails to start is left out
    assert [s.name for s in fresh.sources] == ["history"]
    fresh.extend([1])
    assert fresh.propose(1) == []


def test_record_never_raises_into_the_engine():
    index = DraftIndex(HISTORY)
    index.record(None, [1, 2])  # not a sequence: logged and ignored
    index.record(PROMPT, [])
    assert index.memory_bytes == 0


def test_propose_is_cheap():
    """propose on a 300-token row, measured in process CPU time (the machine is shared); the module docstring
    gives the quiet figure (~1-3 us). The bound here only catches a rescan or a per-call copy of the row."""
    rng = random.Random(2)
    index = DraftIndex(Speculation())
    prompt = [rng.randrange(2048) for _ in range(100)]
    completion = [rng.randrange(2048) for _ in range(200)]
    index.record(prompt, completion)
    row = index.row(prompt)
    row.extend([rng.randrange(2048) for _ in range(200)])
    calls = 3000
    start = time.process_time()
    for _ in range(calls):
        row.propose(4)  # a miss: every suffix length tried in both sources
    per_call = (time.process_time() - start) / calls
    assert per_call < 30e-6


def test_auto_rests_a_request_its_sources_find_nothing_for_and_looks_again_after():
    from rollout.engine.speculation import speculator as spec_module

    class State:  # the fields of an upstream RequestState the speculator reads
        request_id, max_new_tokens, _true_initial_tokens = "r", None, 0

        def __init__(self):
            self.initial_tokens, self.generated_tokens = list(range(100, 140)), []  # no n-gram repeats

        def generated_len(self):
            return len(self.generated_tokens)

    speculator = spec_module.Speculator(Speculation(mode="auto", drafts=("context",)),
                                        DraftIndex(Speculation(drafts=("context",))), lambda _: True,
                                        lambda *a: None)
    speculator.k = 2
    state, lookups = State(), []
    original = drafts_module.RowDrafts.propose
    drafts_module.RowDrafts.propose = lambda self, k: lookups.append(len(self.tokens)) or original(self, k)
    try:
        steps = spec_module.MAX_MISSES + spec_module.REST_STEPS + 1
        for step in range(steps):
            assert speculator.propose(state) == []
            state.generated_tokens.append(500 + step)
        assert len(lookups) == spec_module.MAX_MISSES + 1  # two misses, a rest, then a look again
        assert lookups[-1] == 40 + steps - 1  # the drafter was fed every token of the rest at once
        state.generated_tokens += [100, 101]  # now the row repeats its prompt's start: "100 101" -> 102 ...
        assert speculator.propose(state) == [102, 103]
    finally:
        drafts_module.RowDrafts.propose = original
