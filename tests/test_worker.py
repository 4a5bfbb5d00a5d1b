"""RolloutWorker: exactness against a plain teacher-forced forward, robustness, and the call contract."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from conftest import reference_logprobs, settled

from rollout import RolloutBatch, RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine.upstream.runner import RolloutModelRunner

TOL = 1e-5


@pytest.fixture(scope="module")
def shared(tiny_path):
    from rollout.testing import load_tiny_model

    model, tok = load_tiny_model(tiny_path)
    worker = RolloutWorker(model, WorkerConfig(page_size=16, max_batch_tokens=256), tokenizer=tok)
    yield worker
    worker.close()


def prompts_of(lengths: list[int], seed: int = 0, vocab: int = 500) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]


def assert_exact(worker: RolloutWorker, batch: RolloutBatch, params: list[SamplingParams]) -> None:
    """Every row's logprobs and sampling logprobs equal a plain forward's to TOL."""
    assert len(batch) > 0
    for r, completion in enumerate(batch.completion_token_lists()):
        p = params[int(batch.prompt_index[r])]
        full, truncated = reference_logprobs(worker.model, batch.prompt_ids[r], completion, p.temperature,
                                             p.top_k, p.top_p)
        n = len(completion)
        assert torch.allclose(batch.logprobs[r, :n], full, atol=TOL, rtol=0), (r, p)
        assert torch.allclose(batch.sampling_logprobs[r, :n], truncated, atol=TOL, rtol=0), (r, p)


def test_logprobs_match_plain_forward_for_mixed_sampling_in_one_batch(shared):
    params = [SamplingParams(n=3, temperature=0.7, max_new_tokens=12),
              SamplingParams(n=2, temperature=0.0, max_new_tokens=10),
              SamplingParams(n=3, temperature=1.3, top_k=5, max_new_tokens=12),
              SamplingParams(n=2, temperature=1.0, top_p=0.5, max_new_tokens=12),
              SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.8, max_new_tokens=12, seed=3)]
    prompts = prompts_of([5, 17, 33, 1, 40])
    batch = shared.generate(prompts, sampling=params)
    assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 3, 3, 4, 4]
    assert batch.sample_index.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 0, 1, 0, 1]
    assert_exact(shared, batch, params)
    # truncation really happened somewhere, and sampling logprobs differ from the full ones there
    rows = (batch.prompt_index == 2) & batch.completion_mask.any(1)
    assert (batch.sampling_logprobs[rows] - batch.logprobs[rows]).abs().max() > 1e-3
    # without truncation, both logprobs are the same number
    plain = batch.prompt_index == 0
    assert torch.equal(batch.sampling_logprobs[plain], batch.logprobs[plain])


def assert_top_lists_exact(worker: RolloutWorker, batch: RolloutBatch, params: list[SamplingParams]) -> None:
    """Every row's top lists against a plain forward: its k listed logprobs are the k largest of log_softmax(logits
    / T) at each position (to TOL), each listed id's own logprob there is the listed value, and the rest is -1/-inf."""
    for r, completion in enumerate(batch.completion_token_lists()):
        p = params[int(batch.prompt_index[r])]
        ids = torch.tensor([batch.prompt_ids[r] + completion])
        with torch.no_grad():
            logits = worker.model(ids).logits[0, len(batch.prompt_ids[r]) - 1: -1].float()
        reference = torch.log_softmax(logits / (p.temperature or 1.0), dim=-1)
        k, n = p.top_logprobs, len(completion)
        listed_ids, listed = batch.top_ids[r, :n, :k], batch.top_logprobs[r, :n, :k]
        assert torch.allclose(listed, reference.topk(k, dim=-1).values, atol=TOL, rtol=0), (r, p)
        assert torch.allclose(reference.gather(1, listed_ids), listed, atol=TOL, rtol=0), (r, p)
        assert (batch.top_ids[r, :, k:] == -1).all() and (batch.top_ids[r, n:] == -1).all()
        assert torch.isneginf(batch.top_logprobs[r, :, k:]).all()


def test_top_logprobs_are_the_exact_k_most_likely_tokens_per_position_and_survive_rows_round_trip(shared):
    params = [SamplingParams(n=2, temperature=0.7, max_new_tokens=12, top_logprobs=5),
              SamplingParams(n=1, temperature=0.0, max_new_tokens=9, top_logprobs=20),
              SamplingParams(n=2, temperature=1.3, top_k=5, max_new_tokens=12),
              SamplingParams(n=1, temperature=1.0, max_new_tokens=1, top_logprobs=1)]
    batch = shared.generate(prompts_of([5, 17, 33, 1]), sampling=params)
    assert batch.top_ids.shape == (6, 12, 20) and batch.top_logprobs.shape == (6, 12, 20)
    assert_exact(shared, batch, params)
    assert_top_lists_exact(shared, batch, params)
    greedy = batch.prompt_index == 1
    assert torch.equal(batch.top_ids[greedy][:, :9, 0], batch.completion_ids[greedy][:, :9])  # greedy: its top-1
    listed = batch.top_ids == batch.completion_ids[:, :, None]  # the sampled token's entry, where listed, is its
    where = listed.nonzero(as_tuple=True)  # logprob, bit for bit (one log_softmax serves both)
    assert where[0].numel() > 0 and torch.equal(batch.top_logprobs[where], batch.logprobs[where[0], where[1]])
    again = RolloutBatch.from_rows(batch.rows(), pad_token_id=0)  # what a fleet does with an actor's rows
    assert torch.equal(again.top_ids, batch.top_ids) and torch.equal(again.top_logprobs, batch.top_logprobs)
    assert shared.generate(prompts_of([4]), sampling=SamplingParams(max_new_tokens=3)).top_ids is None


def test_greedy_rows_are_argmax_with_zero_sampling_logprob(shared):
    prompt = prompts_of([9])[0]
    batch = shared.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True))
    ids = prompt[:]
    for t in batch.completion_token_lists()[0]:
        with torch.no_grad():
            assert int(shared.model(torch.tensor([ids])).logits[0, -1].argmax()) == t
        ids.append(t)
    assert batch.sampling_logprobs.abs().max() == 0


def test_samples_of_one_prompt_share_its_prefill(shared):
    counted = []
    hook = shared.model.register_forward_pre_hook(
        lambda m, a, kw: counted.append(kw["input_ids"].shape[-1]) if "input_ids" in kw else None, with_kwargs=True)
    try:
        prompt = prompts_of([64], seed=5)[0]
        batch = shared.generate([prompt], SamplingParams(n=8, max_new_tokens=4, ignore_eos=True))
    finally:
        hook.remove()
    assert len(batch) == 8
    # 63 prompt tokens once, then the last prompt token and 3 decodes per sample: far below 8 x 64
    assert sum(counted) <= 63 + 8 * 4 + 8, counted


def test_prefix_cache_hits_on_a_resent_prompt_stay_exact(shared):
    prompt = prompts_of([16 * 3 + 1], seed=7)[0]  # k * page_size + 1: a hit leaves exactly one token to prefill
    params = [SamplingParams(n=4, temperature=1.0, max_new_tokens=6)]
    shared.generate([prompt], params)
    counted = []
    hook = shared.model.register_forward_pre_hook(
        lambda m, a, kw: counted.append(kw["input_ids"].shape[-1]), with_kwargs=True)
    try:
        batch = shared.generate([prompt], params)
    finally:
        hook.remove()
    assert sum(counted) < 49, "second call should reuse cached prompt blocks"
    assert_exact(shared, batch, params)


def test_one_token_prompts_with_many_samples_do_not_kill_the_engine(shared):
    params = [SamplingParams(n=5, max_new_tokens=5)] * 3
    batch = shared.generate([[7], [8], [9]], params)
    assert len(batch) == 15 and shared.engine.is_alive()
    assert_exact(shared, batch, params)


def test_nasty_sampling_values_run_next_to_each_other(shared):
    params = [SamplingParams(temperature=0.0, max_new_tokens=4), SamplingParams(top_k=10**6, max_new_tokens=4),
              SamplingParams(temperature=1e-4, max_new_tokens=4), SamplingParams(top_p=1e-6, max_new_tokens=4)]
    batch = shared.generate(prompts_of([3, 4, 5, 6]), params)
    assert len(batch) == 4 and shared.engine.is_alive() and shared.engine.num_restarts == 0
    assert_exact(shared, batch, params)


def test_stop_tokens_end_rows_and_are_kept_with_their_logprob(shared):
    prompt = prompts_of([6], seed=11)[0]
    free = shared.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True))
    stop = free.completion_token_lists()[0][2]
    batch = shared.generate([prompt], SamplingParams(temperature=0.0, max_new_tokens=6, stop_token_ids=[stop]))
    tokens = batch.completion_token_lists()[0]
    assert tokens[-1] == stop and stop not in tokens[:-1] and batch.finish_reason == ["stop"]
    assert batch.completion_mask[0, len(tokens) - 1] and batch.logprobs[0, len(tokens) - 1] < 0
    assert free.finish_reason == ["length"] and int(free.completion_lengths[0]) == 6


def test_batch_layout_is_prompt_major_and_right_padded(shared):
    params = [SamplingParams(n=2, max_new_tokens=3, ignore_eos=True), SamplingParams(n=1, max_new_tokens=7,
                                                                                   ignore_eos=True)]
    batch = shared.generate(prompts_of([4, 5]), params)
    assert batch.completion_ids.shape == (3, 7) and batch.completion_ids.dtype == torch.long
    assert batch.completion_lengths.tolist() == [3, 3, 7]
    assert not batch.completion_mask[0, 3:].any() and (batch.logprobs[0, 3:] == 0).all()
    assert batch.logprobs.dtype == torch.float32 and batch.policy_version.tolist() == [0, 0, 0]
    assert batch.prompt_ids[2] == prompts_of([4, 5])[1]


def test_seeded_samples_do_not_depend_on_batch_composition(shared):
    prompt = prompts_of([12], seed=2)[0]
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=1234, ignore_eos=True)
    alone = shared.generate([prompt], params)
    crowded = shared.generate(prompts_of([30, 9, 21], seed=4) + [prompt],
                              [SamplingParams(n=3, max_new_tokens=8)] * 3 + [params])
    assert alone.completion_token_lists() == crowded.completion_token_lists()[-2:]


def test_text_prompts_and_chat_template_use_the_tokenizer(shared):
    tok = shared.tokenizer
    batch = shared.generate(["the cat is"], SamplingParams(max_new_tokens=4))
    assert batch.prompt_ids[0] == tok("the cat is", add_special_tokens=False)["input_ids"]
    chat = shared.generate(["two plus two"], SamplingParams(max_new_tokens=4), chat_template=True)
    assert tok.decode(chat.prompt_ids[0]).endswith("<|assistant|>")
    assert isinstance(chat.completion_texts()[0], str)


@pytest.mark.parametrize("prompts, sampling, message", [
    ([[1, 2], []], None, "prompt 1: prompt=[] is invalid"),
    ([[1, 2], [3, 10**6]], None, "prompt 1: prompt='token id 1000000' is invalid"),
    ([[1] * 1000], SamplingParams(max_new_tokens=100), "prompt 0: max_new_tokens=100 is invalid"),
    ([[1], [2]], [SamplingParams()], "sampling="),
    ([[1], "text", 3], None, "prompt 2: prompt=3 is invalid: must be a list of int token ids"),
    ([[1]], SamplingParams(stop_token_ids=[10**6]), "stop_token_ids=1000000"),
])
def test_bad_input_is_rejected_before_anything_is_submitted(shared, prompts, sampling, message, monkeypatch):
    engine = shared.engine

    def refuse(*args, **kwargs):  # a submission at the engine or at upstream's input queue fails the call loudly
        raise AssertionError(f"submitted before validation failed: {args}")

    monkeypatch.setattr(engine, "_submit", refuse)
    monkeypatch.setattr(engine.manager.input_queue, "put", refuse)
    next_id = engine.in_flight().next_request  # the number the next engine request's id gets
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        shared.generate(prompts, sampling)
    state = engine.in_flight()
    assert state.next_request == next_id and not state.requests and engine.manager.input_queue.empty()
    monkeypatch.undo()
    assert len(shared.generate([[5, 6]], SamplingParams(max_new_tokens=2))) == 1
    assert engine.in_flight().next_request != next_id  # the witness works: a good call does take an id


def test_more_alternatives_than_the_vocabulary_has_are_refused_naming_the_field():
    from rollout.worker.validation import check_prompt

    check_prompt([1, 2], SamplingParams(top_logprobs=4), 0, vocab_size=4, max_context=None, max_request_tokens=99)
    with pytest.raises(ValueError, match=r"prompt 0: top_logprobs=5 is invalid: the vocabulary has only 4 tokens"):
        check_prompt([1, 2], SamplingParams(top_logprobs=5), 0, vocab_size=4, max_context=None, max_request_tokens=99)


@pytest.mark.parametrize("prompts, sampling, field, index", [
    ([[1, 2], [3], []], None, "prompt", 2),
    ([[1, 2], [3, 10**6]], None, "prompt", 1),
    ([[1], [2], "text"], None, "prompt", 2),  # no tokenizer
    ([[1], [2]], [SamplingParams(), "greedy"], "sampling", 1),
    ([[1], [1] * 1020], SamplingParams(max_new_tokens=8), "max_new_tokens", 1),
    ([[1], [2]], [SamplingParams(), SamplingParams(stop_token_ids=[600])], "stop_token_ids", 1),
    ([[1], [2]], [SamplingParams(), SamplingParams()], None, None),
    ([[1], [2]], [SamplingParams()], "sampling", None),  # the call's, not one prompt's
])
def test_a_refused_prompt_is_an_invalid_argument_carrying_its_index(prompts, sampling, field, index):
    from rollout import InvalidArgument
    from rollout.worker.validation import prepare_call

    def call():
        return prepare_call(prompts, sampling, None, False, vocab_size=512, max_context=1024, max_request_tokens=2048)

    if field is None:
        assert len(call()[0]) == len(prompts)
        return
    with pytest.raises(InvalidArgument) as refused:
        call()
    error = refused.value
    assert (error.field, error.index) == (field, index)
    assert error.where == ("" if index is None else f"prompt {index}") and str(error).startswith(error.where)


def test_an_episode_too_long_for_one_request_is_refused_with_its_prompts_index():
    from rollout import EpisodeSpec, InvalidArgument

    spec = EpisodeSpec(env=lambda prompt_index, sample_index: None, max_episode_tokens=50)
    assert spec.budget(10, 64, 0) == 50
    with pytest.raises(InvalidArgument, match=r"^prompt 3: max_episode_tokens=50 is invalid") as refused:
        spec.budget(20, 64, 3)
    assert (refused.value.field, refused.value.index) == ("max_episode_tokens", 3)


def test_empty_call_returns_an_empty_batch(shared):
    batch = shared.generate([])
    assert len(batch) == 0 and batch.completion_ids.shape == (0, 0)


def test_engine_is_started_once_and_calls_leave_no_state(shared):
    manager = shared.engine.manager
    for _ in range(2):
        shared.generate(prompts_of([3, 4]), SamplingParams(n=2, max_new_tokens=3))
    assert shared.engine.manager is manager
    assert settled(shared.engine), shared.engine.in_flight()


def test_worker_from_a_checkpoint_directory_loads_model_and_tokenizer(tiny_path):
    with RolloutWorker(tiny_path, WorkerConfig(num_blocks=64)) as worker:
        assert worker.tokenizer is not None and worker.owns_model
        batch = worker.generate(["one two"], SamplingParams(max_new_tokens=3))
        assert len(batch.completion_texts()) == 1


def test_a_cache_far_too_small_for_the_batch_still_returns_exact_rows(tiny, monkeypatch):
    from transformers.generation.continuous_batching.requests import RequestState

    model, tok = tiny
    soft_resets = []
    original = RequestState.create_equivalent_initial_request
    monkeypatch.setattr(RequestState, "create_equivalent_initial_request",
                        lambda self: soft_resets.append(self.generated_len()) or original(self))
    config = WorkerConfig(page_size=4, num_blocks=24, max_batch_tokens=32)  # 96 tokens for ~16 x 30 tokens
    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=20, ignore_eos=True)] * 8
    with RolloutWorker(model, config, tokenizer=tok) as worker:
        batch = worker.generate(prompts_of([9, 3, 10, 7, 8, 5, 9, 10], seed=9), params)
        assert len(batch) == 16 and batch.completion_lengths.tolist() == [20] * 16
        assert worker.engine.is_alive()
        assert any(n > 0 for n in soft_resets), "requests were preempted mid-decode and re-prefilled"
        assert_exact(worker, batch, params)


def test_a_dead_engine_is_rebuilt_and_every_row_comes_back_once(tiny, inject_engine_fault):
    model, tok = tiny
    inject_engine_fault(3)
    params = [SamplingParams(n=3, temperature=1.0, max_new_tokens=6, ignore_eos=True)] * 3
    with RolloutWorker(model, WorkerConfig(num_blocks=64), tokenizer=tok) as worker:
        batch = worker.generate(prompts_of([5, 9, 13]), params)
        assert worker.engine.num_restarts == 1
        assert batch.prompt_index.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
        assert batch.sample_index.tolist() == [0, 1, 2] * 3
        assert batch.completion_lengths.tolist() == [6] * 9
        assert_exact(worker, batch, params)


def test_a_request_that_keeps_killing_the_engine_fails_the_call_clearly(tiny, monkeypatch):
    model, tok = tiny
    monkeypatch.setattr(RolloutModelRunner, "_forward_process_and_sample",
                        lambda self, *a: (_ for _ in ()).throw(RuntimeError("always broken")))
    with RolloutWorker(model, WorkerConfig(num_blocks=64, max_retries=1), tokenizer=tok) as worker:
        with pytest.raises(RuntimeError, match="prompt 0 sample 0 failed 2 times; last error: .*always broken"):
            worker.generate([[1, 2, 3]], SamplingParams(max_new_tokens=2))


def test_concurrent_generate_calls_from_threads_each_get_their_own_rows(shared):
    import threading

    params = [SamplingParams(n=2, temperature=1.0, max_new_tokens=10)] * 3
    inputs = [prompts_of([5, 9, 14], seed=s) for s in range(3)]
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, shared.generate(inputs[i], params)))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(3):
        assert [results[i].prompt_ids[r] for r in (0, 2, 4)] == inputs[i]
        assert_exact(shared, results[i], params)
    assert shared._active_calls == 0


def test_a_timeout_raises_with_progress_and_leaves_nothing_running(shared):
    params = SamplingParams(n=4, max_new_tokens=400, ignore_eos=True)
    with pytest.raises(TimeoutError, match=r"generate timed out after 0.05s with \d+/16 rows done"):
        shared.generate(prompts_of([20, 30, 40, 50], seed=21), params, timeout=0.05)
    state = shared.engine.in_flight()
    assert not state.requests and not state.reruns
    assert len(shared.generate([[3, 4]], SamplingParams(max_new_tokens=2))) == 1


def test_a_process_that_never_closes_its_worker_still_exits(tiny_path):
    import subprocess
    import sys

    script = ("from rollout import RolloutWorker, WorkerConfig\n"
              f"w = RolloutWorker({str(tiny_path)!r}, WorkerConfig(num_blocks=16))\n"
              "print(len(w.generate([[1, 2, 3]])))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-2000:]


def test_worker_and_fleet_are_both_rollouts_by_signature(shared):
    """Trainers type against rollout.Rollouts: both classes offer every method, each taking at least the protocol's
    parameters, in its order, with its defaults (extra keyword parameters allowed). A live worker is an instance
    (a live fleet too: tests/test_fleet.py)."""
    import inspect

    from rollout import Rollouts
    from rollout.fleet.fleet import RolloutFleet

    assert isinstance(shared, Rollouts)
    methods = [name for name, value in vars(Rollouts).items() if callable(value) and not name.startswith("_")]
    assert {"generate", "update_weights", "weights_fingerprint", "score", "close"} <= set(methods)
    for cls in (RolloutWorker, RolloutFleet):
        assert isinstance(inspect.getattr_static(cls, "policy_version"), property), cls
        for name in methods:
            want = list(inspect.signature(getattr(Rollouts, name)).parameters.values())
            have = list(inspect.signature(getattr(cls, name)).parameters.values())
            named = [p for p in want if p.kind is not p.VAR_KEYWORD]
            assert [(p.name, p.default) for p in have[: len(named)]] == [(p.name, p.default) for p in named], \
                (cls.__name__, name)
            if any(p.kind is p.VAR_KEYWORD for p in want):
                assert any(p.kind is p.VAR_KEYWORD for p in have), (cls.__name__, name)


@pytest.mark.parametrize("how", ["close", "sleep", "restart"])
def test_a_dropped_engine_frees_its_kv_cache_at_once_with_no_full_collection(tiny, inject_engine_fault, how):
    """Nothing the engine builds holds the KV cache in a reference cycle, so closing or sleeping a worker, or
    rebuilding a dead engine, frees the old cache at once, with the cycle collector off; and none of them runs a full
    collection (upstream's stop() ran two, 0.2-0.5 s each in a process that has imported torch and transformers)."""
    model, tok = tiny
    full_collections = []

    def on_collect(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full_collections.append(info)

    params = SamplingParams(n=2, max_new_tokens=6, ignore_eos=True, seed=1, top_logprobs=2)
    gc.collect()
    gc.disable()
    gc.callbacks.append(on_collect)
    try:
        worker = RolloutWorker(model, WorkerConfig(page_size=4, num_blocks=64), tokenizer=tok)
        cache = weakref.ref(worker.engine.manager.batch_processor.cache.cache_tensor)
        plain = worker.generate([[5, 6, 7]], params)
        if how == "restart":
            inject_engine_fault(at_step=1)
            again = worker.generate([[5, 6, 7]], params)
            assert worker.engine.num_restarts == 1 and torch.equal(again.completion_ids, plain.completion_ids)
        elif how == "sleep":
            worker.sleep()
        else:
            worker.close()
        assert cache() is None
        assert full_collections == []
    finally:
        gc.callbacks.remove(on_collect)
        gc.enable()
        worker.close()
