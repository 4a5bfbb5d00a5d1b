"""Constrained decoding (`SamplingParams(structured=...)`): what constrained rows write (always valid, checked with
jsonschema / json / re), their two logprobs against an independent reference (a plain teacher-forced forward; the
mask applied by hand, in float64, from a fresh matcher walked over the row), unconstrained rows left bit for bit as
they are, and bad values refused by name before anything runs."""

from __future__ import annotations

import json
import re
import sys

import jsonschema
import pytest
import torch

from rollout import InvalidArgument, RolloutWorker, SamplingParams, Structured, WorkerConfig
from rollout.base.structured import grammar_of
from rollout.engine.sampling.grammar import Constraint, constrain

xgr = pytest.importorskip("xgrammar")

ROOMY = WorkerConfig(num_blocks=256)
CRAMPED = WorkerConfig(page_size=4, num_blocks=24, max_batch_tokens=32)  # rows preempted mid-decode
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44]]


def texts(batch, tokenizer) -> list[str]:
    """Each row's completion without its stop token, decoded."""
    return [tokenizer.decode(ids[:-1] if reason == "stop" else ids)
            for ids, reason in zip(batch.completion_token_lists(), batch.finish_reason)]


def allowed_sets(tokenizer, vocab: int, structured: Structured, completion: list[int], stop_ids) -> list[set[int]]:
    """The tokens a fresh matcher allows before each completion token, unpacked bit by bit in Python."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_grammar(grammar_of(structured)),
                                 override_stop_tokens=list(stop_ids))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    sets = []
    for token in completion:
        matcher.fill_next_token_bitmask(bitmask, 0)
        words = bitmask[0].tolist()
        sets.append({t for t in range(vocab) if (words[t // 32] >> (t % 32)) & 1})
        assert matcher.accept_token(token), token
    return sets


def check_row(model, tokenizer, prompt, completion, logprobs, sampling, p: SamplingParams, stop_ids) -> None:
    with torch.no_grad():
        raw = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].double()
    temperature = p.temperature or 1.0
    full = torch.log_softmax(raw / temperature, -1)
    vocab = raw.shape[-1]
    for t, (token, allowed) in enumerate(zip(completion, allowed_sets(tokenizer, vocab, p.structured, completion,
                                                                      stop_ids))):
        assert token in allowed
        assert abs(float(logprobs[t]) - float(full[t, token])) < 1e-5, (t, "logprob")
        masked = torch.full((vocab,), float("-inf"), dtype=torch.float64)
        keep = torch.tensor(sorted(allowed))
        masked[keep] = raw[t, keep] / temperature
        if p.is_greedy:
            assert token == int(masked.argmax()) and float(sampling[t]) == 0.0, t
        else:
            expected = float(torch.log_softmax(masked, -1)[token])
            assert abs(float(sampling[t]) - expected) < 1e-5, (t, float(sampling[t]), expected)


def test_json_schema_rows_sampled_at_temperature_one_always_validate(tiny):
    model, tokenizer = tiny
    p = SamplingParams(n=16, temperature=1.0, max_new_tokens=80, seed=3, structured=Structured.json_schema(PERSON))
    with RolloutWorker(model, ROOMY, tokenizer=tokenizer) as worker:
        batch = worker.generate(PROMPTS, p)
        plain = worker.generate(PROMPTS, SamplingParams(n=16, temperature=1.0, max_new_tokens=80, seed=3))
    assert len(batch.finish_reason) == 32 and set(batch.finish_reason) == {"stop"}
    for text in texts(batch, tokenizer):
        jsonschema.validate(json.loads(text), PERSON)
    unconstrained = 0  # the same model unconstrained: (almost) never JSON
    for text in texts(plain, tokenizer):
        try:
            jsonschema.validate(json.loads(text), PERSON)
            unconstrained += 1
        except (ValueError, jsonschema.ValidationError):
            pass
    assert unconstrained == 0


def test_constrained_logprobs_are_the_full_vocabulary_ones_and_sampling_logprobs_the_masked_distribution(tiny):
    model, tokenizer = tiny
    eos = (model.config.eos_token_id,)
    rows = [SamplingParams(n=2, temperature=0.8, max_new_tokens=60, seed=1, structured=Structured.json_schema(PERSON)),
            SamplingParams(temperature=0.0, max_new_tokens=60, structured=Structured.json_schema(PERSON)),
            SamplingParams(n=2, temperature=1.3, top_k=20, top_p=0.9, max_new_tokens=30, seed=2,
                           structured=Structured.regex(r"(yes|no) [0-9]{1,3}"))]
    prompts = [[5, 6, 7], [8, 9], [30, 31, 32, 33]]
    with RolloutWorker(model, ROOMY, tokenizer=tokenizer) as worker:
        batch = worker.generate(prompts, rows)
    for r, ids in enumerate(batch.completion_token_lists()):
        p = rows[int(batch.prompt_index[r])]
        if p.top_k:  # truncation after the mask: checked below on what it writes, its logprob on the full softmax
            full = torch.log_softmax(_raw(model, batch.prompt_ids[r], ids) / p.temperature, -1)
            assert (batch.logprobs[r, :len(ids)] - full.gather(1, torch.tensor(ids)[:, None])[:, 0]).abs().max() < 1e-5
            continue
        check_row(model, tokenizer, batch.prompt_ids[r], ids, batch.logprobs[r], batch.sampling_logprobs[r], p, eos)
    written = texts(batch, tokenizer)
    jsonschema.validate(json.loads(written[2]), PERSON)  # greedy
    assert all(re.fullmatch(r"(yes|no) [0-9]{1,3}", text) for text in written[3:])


def _raw(model, prompt, completion) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].double()


def test_json_object_rows_write_objects_that_parse(tiny):
    model, tokenizer = tiny
    # strings and objects of any length: the bias on `"` and `}` makes them end on a random model
    bias = {tokenizer.convert_tokens_to_ids(t): 4.0 for t in ('"', "}")}
    p = SamplingParams(n=8, max_new_tokens=160, seed=6, logit_bias=bias, structured=Structured.json_object())
    with RolloutWorker(model, ROOMY, tokenizer=tokenizer) as worker:
        batch = worker.generate(PROMPTS[:1], p)
    assert set(batch.finish_reason) == {"stop"}
    assert all(isinstance(json.loads(text), dict) for text in texts(batch, tokenizer))


def test_unconstrained_rows_next_to_constrained_ones_sample_bit_for_bit_as_alone(tiny):
    model, tokenizer = tiny
    plain = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=9)
    constrained = SamplingParams(n=3, temperature=1.0, max_new_tokens=40, seed=9,
                                 structured=Structured.json_schema(PERSON))
    with RolloutWorker(model, ROOMY, tokenizer=tokenizer) as worker:
        alone = worker.generate(PROMPTS[:1], plain)
        mixed = worker.generate(PROMPTS, [plain, constrained])
    assert mixed.completion_token_lists()[:3] == alone.completion_token_lists()
    # (the forward of a larger batch may differ in the last bits; the sampler leaves the row's numbers as they are)
    assert (mixed.logprobs[:3, :12] - alone.logprobs).abs().max() < 1e-5
    assert torch.equal(mixed.sampling_logprobs[:3, :12], mixed.logprobs[:3, :12])


def test_constrained_rows_stay_valid_when_preempted_mid_decode(tiny):
    model, tokenizer = tiny
    p = SamplingParams(n=4, temperature=1.0, max_new_tokens=60, seed=4, structured=Structured.json_schema(PERSON))
    prompts = [list(range(10, 10 + n)) for n in (9, 14, 5)]
    with RolloutWorker(model, ROOMY, tokenizer=tokenizer) as worker:
        roomy = worker.generate(prompts, p)
    with RolloutWorker(model, CRAMPED, tokenizer=tokenizer) as worker:
        cramped = worker.generate(prompts, p)
        preempted = worker.metrics().preemptions
    assert preempted > 0
    assert cramped.completion_token_lists() == roomy.completion_token_lists()  # seeded: the same rows
    for text in texts(cramped, tokenizer):
        jsonschema.validate(json.loads(text), PERSON)


def test_tool_calls_are_written_in_their_markup_with_arguments_matching_the_schema(tiny):
    model, tokenizer = tiny
    call = {"type": "object", "properties": {"name": {"const": "add"}, "arguments": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"enum": [1, 2]}},
        "required": ["a", "b"], "additionalProperties": False}}, "required": ["name", "arguments"]}
    one = Structured.tool_calls(call, "<c>", "</c>")
    many = Structured.tool_calls(call, "<c>", "</c>", repeats=True)
    with RolloutWorker(model, ROOMY, tokenizer=tokenizer) as worker:
        batch = worker.generate(PROMPTS, [SamplingParams(n=4, max_new_tokens=80, seed=5, structured=one),
                                          SamplingParams(n=4, max_new_tokens=160, seed=5, structured=many)])
    assert batch.finish_reason[:4] == ["stop"] * 4 and "stop" in batch.finish_reason[4:]
    for r, text in enumerate(texts(batch, tokenizer)):
        calls = re.findall(r"<c>(.*?)</c>", text)
        written = "".join(f"<c>{c}</c>" for c in calls)
        if batch.finish_reason[r] == "stop":  # one call, or (repeats) one or more, and nothing else
            assert written == text and (len(calls) == 1 if r < 4 else len(calls) >= 1)
        else:  # cut by max_new_tokens in a later call
            assert text.startswith(written + "<c>") and r >= 4
        for c in calls:
            jsonschema.validate(json.loads(c), call)


def test_the_sampler_masks_only_constrained_rows_and_draws_from_the_masked_distribution():
    from rollout.engine.sampling.sampler import Passes, SamplingRows, RowSpec, sample_rows

    torch.manual_seed(0)
    logits = torch.randn(3, 70)
    masks = torch.tensor([[0b1010, 0, 1 << 5]], dtype=torch.int32)  # row 1 allows tokens 1, 3 and 69
    constraint = Constraint(torch.tensor([False, True, False]), torch.tensor([1]), masks,
                            (1 << torch.arange(8)).to(torch.uint8))
    specs = [RowSpec(SamplingParams(temperature=1.0), key=k) for k in (1, 2, 3)]
    rows = SamplingRows.of(specs)
    rows = SamplingRows(**{**rows.__dict__, "constraint": constraint})
    drawn = sample_rows(logits, rows, torch.tensor([4, 4, 4]), Passes(scale=False, truncate=False, argmax=False,
                                                                      top=0, adjust=0, min_p=False))
    plain = sample_rows(logits, SamplingRows.of(specs), torch.tensor([4, 4, 4]), Passes(
        scale=False, truncate=False, argmax=False, top=0, adjust=0, min_p=False, constrain=False))
    assert int(drawn.tokens[1]) in (1, 3, 69)
    keep = torch.tensor([1, 3, 69])
    expected = torch.log_softmax(logits[1, keep].double(), -1)[keep.tolist().index(int(drawn.tokens[1]))]
    assert abs(float(drawn.sampling_logprobs[1]) - float(expected)) < 1e-6
    assert torch.equal(drawn.logprobs, torch.log_softmax(logits, -1).gather(1, drawn.tokens[:, None])[:, 0])
    for r in (0, 2):  # unconstrained rows: what they draw without the pass, bit for bit
        assert int(drawn.tokens[r]) == int(plain.tokens[r])
        assert float(drawn.sampling_logprobs[r]) == float(plain.sampling_logprobs[r])
    target = logits.clone()
    constrain(target, constraint)
    assert torch.isinf(target[1]).sum() == 67 and torch.equal(target[0], logits[0])


@pytest.mark.parametrize("build, field", [
    (lambda: Structured.json_schema({"type": "objekt"}), "structured"),
    (lambda: Structured.json_schema([1, 2]), "structured"),
    (lambda: Structured.json_schema("{not json"), "structured"),
    (lambda: Structured.regex("a("), "structured"),
    (lambda: Structured("yaml"), "structured.kind"),
    (lambda: Structured.tool_calls({"type": "object"}, "", "</c>"), "structured.open"),
    (lambda: Structured.tool_calls({"type": "object"}, "<c>", "</c>", alternative=Structured.regex("a")),
     "structured.alternative"),
    (lambda: Structured("json_schema", '{"type": "object"}', alternative=Structured.json_object()),
     "structured.alternative"),
    (lambda: Structured.json_schema({"type": "objekt"}, field="response_format.json_schema.schema"),
     "response_format.json_schema.schema"),
    (lambda: SamplingParams(structured={"type": "object"}), "structured"),
    (lambda: SamplingParams(ignore_eos=True, structured=Structured.json_object()), "ignore_eos"),
    (lambda: SamplingParams(min_new_tokens=2, structured=Structured.json_object()), "min_new_tokens"),
])
def test_bad_structured_values_are_refused_by_name_at_construction(build, field):
    with pytest.raises(InvalidArgument) as error:
        build()
    assert error.value.field == field


def test_a_missing_grammar_library_is_an_invalid_argument_naming_the_install(monkeypatch):
    grammar_of.cache_clear()
    monkeypatch.setitem(sys.modules, "xgrammar", None)
    with pytest.raises(InvalidArgument) as error:
        Structured.json_schema({"type": "object", "properties": {"x": {"type": "null"}}})
    assert error.value.field == "structured" and "pip install 'rollout[structured]'" in error.value.fix


def test_constrained_rows_are_refused_under_async_batching_and_without_a_tokenizer_or_stop_id(tiny):
    model, tokenizer = tiny
    p = SamplingParams(structured=Structured.json_object())
    with RolloutWorker(model, ROOMY) as worker:
        with pytest.raises(InvalidArgument, match="tokenizer"):
            worker.generate([[1, 2]], p)
    with RolloutWorker(model, ROOMY, tokenizer=tokenizer) as worker:
        with pytest.raises(InvalidArgument) as error:
            worker.generate([[1, 2]], SamplingParams(stop_token_ids=(), structured=Structured.json_object()))
        assert error.value.field == "stop_token_ids"
        worker.engine.captures = True  # what a CUDA-graph engine reports
        with pytest.raises(InvalidArgument, match="cuda_graphs"):
            worker.generate([[1, 2]], p)
        assert SamplingParams(structured=Structured.json_object()).is_constrained
        assert not SamplingParams().is_constrained
