"""Weight refresh and update: never a stale token, atomic updates, versions, fingerprints, in-place sharing."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
from conftest import reference_logprobs

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import load_tiny_model

TOL = 1e-5
PAGE = 16


def prompt_of(length: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 500, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def max_error(model, batch, temperature: float = 1.0) -> float:
    worst = 0.0
    for r, completion in enumerate(batch.completion_token_lists()):
        full, _ = reference_logprobs(model, batch.prompt_ids[r], completion, temperature)
        worst = max(worst, float((batch.logprobs[r, : len(completion)] - full).abs().max()))
    return worst


def perturbed_state(model, scale: float = 0.5, seed: int = 1) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: p.detach() + scale * torch.randn(p.shape, generator=gen) * p.detach().std()
            for name, p in model.named_parameters()}


@pytest.fixture()
def worker(tiny):
    model, tok = tiny
    w = RolloutWorker(model, WorkerConfig(page_size=PAGE, num_blocks=256), tokenizer=tok)
    yield w
    w.close()


def test_a_resent_prompt_gets_new_weights_logprobs_after_refresh(worker):
    prompt = prompt_of(3 * PAGE + 1)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    worker.generate([prompt], greedy)
    with torch.no_grad():
        for name, value in perturbed_state(worker.model).items():
            worker.model.get_parameter(name).copy_(value)
    stale = worker.generate([prompt], greedy)  # the upstream trap: hashes survive, KV is from the old weights
    assert max_error(worker.model, stale) > 1e-3
    assert worker.refresh() == 1
    fresh = worker.generate([prompt], greedy)
    assert max_error(worker.model, fresh) <= TOL
    assert fresh.policy_version.tolist() == [1]


def test_update_weights_copies_in_place_and_bumps_the_version(worker):
    addresses = {n: p.data_ptr() for n, p in worker.model.named_parameters()}
    prompt = prompt_of(2 * PAGE + 1, seed=3)
    worker.generate([prompt], SamplingParams(max_new_tokens=4))
    state = perturbed_state(worker.model)
    assert worker.update_weights(((n, t.double()) for n, t in state.items())) == 1  # a stream, cast on copy
    assert {n: p.data_ptr() for n, p in worker.model.named_parameters()} == addresses
    assert all(torch.equal(worker.model.get_parameter(n), t.float()) for n, t in state.items())
    batch = worker.generate([prompt], SamplingParams(n=3, max_new_tokens=6))
    assert max_error(worker.model, batch) <= TOL and batch.policy_version.tolist() == [1, 1, 1]
    assert worker.update_weights({}, version=41) == 41 and worker.policy_version == 41


@pytest.mark.parametrize("bad, message", [
    ({"model.nope.weight": torch.zeros(1)}, "weights\\['model.nope.weight'\\] is invalid: the model has no tensor"),
    ({"lm_head.weight": torch.zeros(3, 3)}, "weights\\['lm_head.weight'\\] has shape \\(3, 3\\)"),
    ({"model.norm.weight": torch.full((64,), float("nan"))}, "weights\\['model.norm.weight'\\] contains NaN"),
])
def test_a_bad_update_changes_nothing_and_the_worker_keeps_serving(worker, bad, message):
    good = perturbed_state(worker.model)
    before = worker.weights_fingerprint()
    with pytest.raises(ValueError, match=message):
        worker.update_weights({**good, **bad})  # good tensors first: none of them may land
    assert worker.weights_fingerprint() == before and worker.policy_version == 0
    batch = worker.generate([prompt_of(5)], SamplingParams(max_new_tokens=3))
    assert batch.policy_version.tolist() == [0] and max_error(worker.model, batch) <= TOL


def test_a_full_update_with_missing_tensors_is_rejected(worker):
    state = dict(worker.model.state_dict())
    state.pop("model.norm.weight")
    with pytest.raises(ValueError, match="missing 1 tensors, first 'model.norm.weight'"):
        worker.update_weights(state, full=True)
    assert worker.update_weights(worker.model.state_dict(), full=True) == 1


def test_buffers_such_as_rotary_inv_freq_can_be_updated(worker):
    inv = worker.model.model.rotary_emb.inv_freq
    worker.update_weights({"model.rotary_emb.inv_freq": inv * 0.5})
    assert torch.equal(worker.model.model.rotary_emb.inv_freq, inv)  # same tensor, new values
    batch = worker.generate([prompt_of(7)], SamplingParams(max_new_tokens=4))
    assert max_error(worker.model, batch) <= TOL


def test_tied_embeddings_update_through_either_name(tiny_tied_qwen_path):
    model, tok = load_tiny_model(tiny_tied_qwen_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    with RolloutWorker(model, WorkerConfig(num_blocks=64), tokenizer=tok) as w:
        new = model.lm_head.weight.detach() * 1.5
        w.update_weights({"lm_head.weight": new})
        assert torch.equal(model.model.embed_tokens.weight, new)
        batch = w.generate([prompt_of(9)], SamplingParams(n=2, max_new_tokens=5))
        # 1.12e-5 measured on an AVX-512 EPYC core (under 1e-5 where this was written): the tied tiny Qwen2 (init std
        # 0.2, ten times the rule's 0.02) with its embeddings scaled 1.5x has the largest logits of these tests
        assert max_error(model, batch) <= 2 * TOL


def test_fingerprints_agree_exactly_when_weights_agree(tiny_path):
    a, _ = load_tiny_model(tiny_path)
    b, _ = load_tiny_model(tiny_path)
    with RolloutWorker(a, WorkerConfig(num_blocks=32)) as wa, RolloutWorker(b, WorkerConfig(num_blocks=32)) as wb:
        assert wa.weights_fingerprint() == wb.weights_fingerprint()
        state = perturbed_state(a)
        wa.update_weights(state)
        assert wa.weights_fingerprint() != wb.weights_fingerprint()
        wb.update_weights(state)
        assert wa.weights_fingerprint() == wb.weights_fingerprint()


def test_a_bucketed_update_applies_what_update_weights_would(tiny_path):
    a, _ = load_tiny_model(tiny_path)
    b, _ = load_tiny_model(tiny_path)
    state = perturbed_state(a)
    names = sorted(state)
    buckets = [{n: state[n] for n in names[i: i + 5]} for i in range(0, len(names), 5)]
    with RolloutWorker(a, WorkerConfig(num_blocks=32)) as wa, RolloutWorker(b, WorkerConfig(num_blocks=32)) as wb:
        assert wa.update_weights(state) == wb.update_weights_by_bucket(iter(buckets)) == 1
        assert wa.weights_fingerprint() == wb.weights_fingerprint()
        params = SamplingParams(temperature=0.0, max_new_tokens=6)
        assert max_error(b, wb.generate([prompt_of(9)], params)) <= TOL


def test_a_bucketed_update_that_stops_midway_blocks_generation_until_a_full_update(worker):
    state = perturbed_state(worker.model)
    names = sorted(state)
    bad = dict(state, **{names[-1]: torch.full_like(state[names[-1]], float("nan"))})
    buckets = [{n: bad[n] for n in names[:3]}, {n: bad[n] for n in names[3:]}]
    with pytest.raises(ValueError, match=f"weights\\[{names[-1]!r}\\] contains NaN"):
        worker.update_weights_by_bucket(buckets)
    assert torch.equal(worker.model.get_parameter(names[0]), state[names[0]])  # the first bucket went in
    assert worker.policy_version == 0
    with pytest.raises(RuntimeError, match="half-updated: a bucketed update stopped midway .*contains NaN.*full=True"):
        worker.generate([prompt_of(5)], SamplingParams(max_new_tokens=2))
    full = dict(worker.model.state_dict(), **state)
    assert worker.update_weights(full, full=True) == 1
    assert max_error(worker.model, worker.generate([prompt_of(5)], SamplingParams(max_new_tokens=4))) <= TOL


def checksum_reference(tensor: torch.Tensor) -> int:
    """Independent of the tensor code: each element's bits as an int, mixed with its index by splitmix64 on Python
    ints, summed mod 2^64 (signed, as torch's int64 holds it)."""
    from rollout.engine.sampling.streams import GOLDEN, MASK64, mix64

    words = tensor.reshape(-1).view({2: torch.int16, 4: torch.int32}[tensor.element_size()]).tolist()
    total = sum(mix64((w + (i + 1) * GOLDEN) & MASK64) for i, w in enumerate(words)) & MASK64
    return total - 2**64 if total >= 2**63 else total


def test_a_checksum_is_its_reference_and_sees_any_one_flipped_bit(monkeypatch):
    from rollout.model import weights

    x = torch.randn(3000, generator=torch.Generator().manual_seed(0))
    assert int(weights.checksum(x)) == checksum_reference(x)
    assert int(weights.checksum(x.bfloat16())) == checksum_reference(x.bfloat16())
    monkeypatch.setitem(weights.CHECKSUM_WORDS, "cpu", 7)  # passes of any size add up to the same sum
    assert int(weights.checksum(x)) == checksum_reference(x)
    bits = x.view(torch.int32)
    for index, bit in [(0, 0), (1234, 17), (2999, 31)]:
        flipped = bits.clone()
        flipped[index] ^= 1 << bit if bit < 31 else -(2**31)
        assert int(weights.checksum(flipped.view(torch.float32))) != int(weights.checksum(x))


def _generate_in_thread(worker, prompts, params):
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("batch", worker.generate(prompts, params)))
    thread.start()
    deadline = time.monotonic() + 30
    while not worker.engine.in_flight().requests and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(0.05)  # let some decode steps happen on the old weights
    return thread, out


def test_by_default_an_update_waits_for_in_flight_requests(worker):
    old = copy.deepcopy(worker.model)
    prompts = [prompt_of(2 * PAGE + 1, seed=s) for s in range(4)]
    params = SamplingParams(n=2, max_new_tokens=60, ignore_eos=True)
    thread, out = _generate_in_thread(worker, prompts, params)
    assert thread.is_alive()
    worker.update_weights(perturbed_state(worker.model))
    thread.join()
    batch = out["batch"]
    assert batch.policy_version.tolist() == [0] * 8 and max_error(old, batch) <= TOL
    again = worker.generate(prompts, params)  # same prompts: no stale prefix blocks
    assert again.policy_version.tolist() == [1] * 8 and max_error(worker.model, again) <= TOL


def test_abort_policy_reruns_in_flight_requests_on_the_new_weights(tiny):
    model, tok = tiny
    config = WorkerConfig(page_size=PAGE, num_blocks=256, in_flight="abort")
    with RolloutWorker(model, config, tokenizer=tok) as w:
        prompts = [prompt_of(2 * PAGE + 1, seed=s) for s in range(4)]
        w.generate(prompts[:2], SamplingParams(max_new_tokens=2))  # cache their prefixes under version 0
        thread, out = _generate_in_thread(w, prompts, SamplingParams(n=2, max_new_tokens=60, ignore_eos=True))
        assert thread.is_alive()
        w.update_weights(perturbed_state(model))
        thread.join()
        batch = out["batch"]
        assert w.engine.num_aborted > 0
        assert batch.policy_version.tolist() == [1] * 8 and len(batch) == 8
        assert max_error(model, batch) <= TOL


def test_generating_leaves_the_trainers_model_as_it_was(tiny):
    model, tok = tiny
    model.train()
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    with RolloutWorker(model, WorkerConfig(num_blocks=64), tokenizer=tok) as w:
        torch.manual_seed(123)
        rng = torch.get_rng_state()
        w.generate([prompt_of(8)], SamplingParams(n=2, max_new_tokens=5))
        assert torch.equal(torch.get_rng_state(), rng)
        assert model.training and model.config._attn_implementation == "sdpa"
        assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
        assert all(p.grad is None for p in model.parameters())


def test_a_shared_model_trains_between_generates_and_rollouts_match_the_trainer(tiny):
    model, tok = tiny
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    prompts = [prompt_of(PAGE + 1, seed=s) for s in range(3)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=8)
    with RolloutWorker(model, WorkerConfig(page_size=PAGE, num_blocks=128), tokenizer=tok) as w:
        for step in range(3):
            batch = w.generate(prompts, params)
            assert batch.policy_version.tolist() == [step] * 12
            ids = [p + c for p, c in zip(batch.prompt_ids, batch.completion_token_lists())]
            loss = 0.0
            for r, seq in enumerate(ids):
                n_prompt = len(batch.prompt_ids[r])
                logits = model(torch.tensor([seq])).logits[0, n_prompt - 1 : -1]
                lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(seq[n_prompt:])[:, None]).squeeze(1)
                gap = (lp.detach() - batch.logprobs[r, : len(lp)]).abs().max()
                assert gap <= TOL, (step, r, float(gap))
                loss = loss - lp.sum() * (1.0 if r % 2 else -1.0)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            w.refresh()
        assert w.policy_version == 3 and model.training


def test_a_bad_version_is_rejected_before_any_weight_changes(worker):
    before = worker.weights_fingerprint()
    with pytest.raises(ValueError, match="version=-1 is invalid: must be an integer >= 0"):
        worker.update_weights(perturbed_state(worker.model), version=-1)
    with pytest.raises(ValueError, match="version=True is invalid"):
        worker.refresh(version=True)
    assert worker.weights_fingerprint() == before and worker.policy_version == 0


def test_a_worker_fingerprint_rehashes_only_what_was_written_tied_weights_included(tiny_tied_qwen_path, monkeypatch):
    import rollout.model.weights as weights_mod
    from rollout.model.weights import fingerprint

    model, _ = load_tiny_model(tiny_tied_qwen_path)
    hashed = []
    checksum = weights_mod.checksum
    monkeypatch.setattr(weights_mod, "checksum", lambda t: hashed.append(t.data_ptr()) or checksum(t))
    tied = {n for n, t in model.state_dict().items() if t.data_ptr() == model.lm_head.weight.data_ptr()}
    assert len(tied) == 2  # lm_head.weight and model.embed_tokens.weight: one storage
    with RolloutWorker(model, WorkerConfig(num_blocks=32)) as worker:
        worker.weights_fingerprint()
        worker.update_weights({"lm_head.weight": torch.randn_like(model.lm_head.weight)})
        hashed.clear()
        value = worker.weights_fingerprint()
        assert hashed == [model.lm_head.weight.data_ptr()] * 2  # both names of the written storage, nothing else
        assert value == fingerprint(model)
        with torch.no_grad():
            model.model.norm.weight.mul_(2.0)  # the owner writes in place and says so with refresh()
        worker.refresh()
        assert worker.weights_fingerprint() == fingerprint(model)
