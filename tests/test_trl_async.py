"""TRL 1.16's experimental AsyncGRPOTrainer on this engine (trainers_integration/trl_async.py): real training steps
on the tiny model, the engine holding the trainer's exact weights after every sync, exact old logprobs (a weight
update in flight included), TRL's rewards and advantages, health checks and a clean stop, and the TRL protocols the
adapter implements, so a TRL upgrade that changes them fails here first.

TRL needs two CPU-only patches, applied here by `trl_on_cpu` (monkeypatch, the test only): its tree packing runs
FlashAttention-3 from the kernels hub (`packing._flash_attn`: replaced by `varlen_attention`, the same varlen causal
attention with torch SDPA), and its MFU reads `torch.cuda.get_device_name` (`get_peak_flops_per_device`: None, which
TRL reads as "peak unknown, no MFU")."""

from __future__ import annotations

import asyncio
import inspect
import threading
import types

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'rollout[trl]' (trl==1.16.0)")
datasets = pytest.importorskip("datasets", reason="TRL's datasets dependency is not installed")

from conftest import perturbed, reference_logprobs, wait_for_tokens  # noqa: E402
from rollout import RolloutWorker, WorkerConfig, fingerprint  # noqa: E402
from rollout.testing import load_tiny_model  # noqa: E402
from trainers_integration.trl_async import AsyncRollouts, AsyncWeightSync, score_group  # noqa: E402

TEMPERATURE = 0.9
TOL = 1e-5  # an engine logprob against a plain teacher-forced fp32 forward (tests/test_worker.py)
PROMPTS = ("the cat is", "one plus two", "how many apples", "red blue")


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=None,
                     causal=True, window_size=(-1, -1), **kwargs):
    """flash_attn_varlen_func on the CPU: segment s's queries q[cu_q[s]:cu_q[s+1]] (the last tokens of its path)
    attend causally, bottom-right aligned as FlashAttention does, to the keys k[cu_k[s]:cu_k[s+1]] (its whole path);
    grouped-query heads repeated. q: (Nq, H, D), k / v: (Nk, Hkv, D)."""
    assert causal and tuple(window_size) == (-1, -1), "the tiny models use full causal attention"
    out = torch.empty_like(q)
    repeat = q.shape[1] // k.shape[1]
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        qs, ks, vs = q[cq[s]:cq[s + 1]], k[ck[s]:ck[s + 1]], v[ck[s]:ck[s + 1]]
        mask = torch.ones(len(qs), len(ks), dtype=torch.bool).tril(len(ks) - len(qs))
        heads = [t.repeat_interleave(repeat, dim=1).transpose(0, 1) for t in (ks, vs)]
        attended = torch.nn.functional.scaled_dot_product_attention(qs.transpose(0, 1), *heads, attn_mask=mask,
                                                                    scale=softmax_scale)
        out[cq[s]:cq[s + 1]] = attended.transpose(0, 1)
    return out


@pytest.fixture(autouse=True)
def experimental_silenced(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")  # TRL warns on every import of trl.experimental otherwise


@pytest.fixture()
def trl_on_cpu(monkeypatch):
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    monkeypatch.setattr(packing, "_flash_attn", lambda: types.SimpleNamespace(flash_attn_varlen_func=varlen_attention))
    monkeypatch.setattr(async_grpo_trainer, "get_peak_flops_per_device", lambda *args, **kwargs: None)


def async_args(tmp_path, **overrides):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    values = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=8, max_steps=3, learning_rate=1e-2, bf16=False, report_to="none",
                  logging_steps=1, use_cpu=True, save_strategy="no", seed=0, temperature=TEMPERATURE,
                  token_budget=0)
    values.update(overrides)
    return AsyncGRPOConfig(**values)


def chat_dataset():
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": p}] for p in PROMPTS],
                                       "target": [len(p) for p in PROMPTS]})


def digit_reward(completions, **kwargs):
    return [sum(ch.isdigit() for ch in c[-1]["content"]) / 8 for c in completions]


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def recording(monkeypatch, worker, source):
    """(the samples TRL drained from the buffer, each generation call's future): both recorded as they happen."""
    drained, futures = [], []
    get, submit = source.rollout_buffer.get, worker.submit
    monkeypatch.setattr(source.rollout_buffer, "get", lambda *a, **k: drained.append(get(*a, **k)) or drained[-1])
    monkeypatch.setattr(worker, "submit", lambda *a, **k: futures.append(submit(*a, **k)) or futures[-1])
    return drained, futures


def assert_old_logprobs_exact(drained, futures, weights_by_version, tiny_path) -> set[tuple[int, ...]]:
    """Every drained sample's old logprobs are a teacher-forced fp32 forward, at T, of the weights of each token's
    own version (within TOL), its model_version is its oldest token's; returns the version sets seen per sample."""
    rows = {}
    for future in futures:
        if future.done() and not future.cancelled():
            batch = future.result()
            for i, ids in enumerate(batch.completion_token_lists()):
                rows[tuple(batch.prompt_ids[i]) + tuple(ids)] = batch.token_versions[i, :len(ids)]
    models = {}
    for version, state in weights_by_version.items():
        models[version] = load_tiny_model(tiny_path)[0]
        models[version].load_state_dict(state)
    seen = set()
    for sample in drained:
        mask = torch.from_numpy(sample.completion_mask).bool()
        ids = sample.input_ids.tolist()
        prompt, completion = ids[: int((~mask).sum())], ids[int((~mask).sum()):]
        old = torch.from_numpy(sample.old_log_probs)[mask]
        versions = rows[tuple(ids)]
        assert sample.model_version == int(versions.min())
        assert torch.equal(torch.from_numpy(sample.old_log_probs)[~mask], torch.zeros(len(prompt)))
        for version in versions.unique().tolist():
            full, _ = reference_logprobs(models[version], prompt, completion, temperature=TEMPERATURE)
            at = versions == version
            assert float((old[at] - full[at]).abs().max()) <= TOL, (version, old[at] - full[at])
        seen.add(tuple(versions.unique().tolist()))
    return seen


def test_async_grpo_trains_on_the_engine_holding_the_trainers_exact_weights(tiny_path, tmp_path, monkeypatch,
                                                                             trl_on_cpu):
    """Three AsyncGRPOTrainer steps: after every sync the engine holds the trainer's weights bit for bit at TRL's
    version, every old logprob TRL trained on is exact for the weights that sampled it, step 1's ratio is 1 and its
    KL 0, and nothing of the adapter is left running."""
    from transformers import TrainerCallback
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    _, tok = load_tiny_model(tiny_path)
    args, dataset = async_args(tmp_path), chat_dataset()
    synced = {}  # TRL's model_version -> the trainer's weights it synced

    class CheckSync(TrainerCallback):  # runs after TRL's own sync callbacks (added after them)
        def check(self):
            model = trainer.accelerator.unwrap_model(trainer.model)
            assert worker.policy_version == trainer.model_version
            assert worker.weights_fingerprint() == fingerprint(model)
            synced[trainer.model_version] = {k: v.detach().clone() for k, v in model.state_dict().items()}

        def on_train_begin(self, *args, **kwargs):
            self.check()

        def on_step_end(self, *args, **kwargs):
            self.check()

    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        source = AsyncRollouts(worker, args, dataset, digit_reward, tok)
        drained, futures = recording(monkeypatch, worker, source)
        trainer = AsyncGRPOTrainer(str(tiny_path), reward_funcs=digit_reward, args=args, train_dataset=dataset,
                                   processing_class=tok, rollout_worker=source, weight_transfer=AsyncWeightSync(source))
        trainer.add_callback(CheckSync())
        trainer.train()
        assert not any(t.name == "rollout-trl-async" for t in threading.enumerate())
        assert all(f.done() for f in futures)  # the groups in flight at the stop were cancelled, not left running
    assert trainer.state.global_step == 3 and sorted(synced) == [1, 2, 3, 4]  # the first sync, then one per step
    assert len({fingerprint(state) for state in synced.values()}) == 4  # the weights moved at every step
    assert len(drained) >= 24  # 8 samples a step
    seen = assert_old_logprobs_exact(drained, futures, synced, tiny_path)
    assert seen and all(set(versions) <= set(synced) for versions in seen)
    ratio, kl = logged(trainer, "ratio"), logged(trainer, "kl")
    assert len(ratio) == 3 and abs(ratio[0] - 1.0) <= 1e-5 and abs(kl[0]) <= 1e-8, (ratio, kl)
    assert all(torch.isfinite(torch.tensor(logged(trainer, "loss"))))
    assert logged(trainer, "rewards/digit_reward") and logged(trainer, "completions/mean_length")


def test_an_update_in_flight_keeps_every_old_logprob_exact_and_tags_the_oldest_version(tiny_path, tmp_path,
                                                                                       monkeypatch, slow_steps):
    """Driven as TRL drives it (pause, send_weights, resume, update_model_version), mid-generation: the groups in
    flight are recomputed under the new weights, their samples span versions 1 and 2, each token exact under its
    own version, and the sample says 1 (TRL's staleness counts from its oldest token)."""
    model, tok = load_tiny_model(tiny_path)
    args = async_args(tmp_path, num_generations=2, max_completion_length=24, max_inflight_tasks=4)
    new = perturbed(model, seed=1)
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        source = AsyncRollouts(worker, args, chat_dataset(), digit_reward, tok)
        sync = AsyncWeightSync(source)
        drained, futures = recording(monkeypatch, worker, source)
        sync.init_weight_transfer()
        sync.send_weights((name, p.detach()) for name, p in model.named_parameters())
        source.update_model_version(1)
        source.start()
        try:
            wait_for_tokens(worker, at_least=4)
            sync.pause()
            sync.send_weights(iter(new.items()))
            sync.resume()
            source.update_model_version(2)
            assert worker.policy_version == 2 and worker.weights_fingerprint() == fingerprint(new)
            while len(drained) < 4:  # the two groups that were in flight at the update
                source.rollout_buffer.get(timeout=60)
            source.check_health(stale_after_s=60)
        finally:
            source.stop()
            sync.destroy()
    seen = assert_old_logprobs_exact(drained, futures, {1: model.state_dict(), 2: new}, tiny_path)
    assert (1, 2) in seen
    with pytest.raises(RuntimeError, match="send_weights before init_weight_transfer"):
        sync.send_weights(iter(new.items()))


def test_a_failing_reward_function_surfaces_in_check_health_and_stop_leaves_no_thread(tiny_path, tmp_path):
    def broken(completions, **kwargs):
        raise ZeroDivisionError("reward bug")

    _, tok = load_tiny_model(tiny_path)
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        source = AsyncRollouts(worker, async_args(tmp_path, max_inflight_tasks=4), chat_dataset(), broken, tok)
        source.start()
        thread = source._thread
        thread.join(30)
        with pytest.raises(RuntimeError, match="producer failed") as failure:
            source.check_health(stale_after_s=60)
        assert isinstance(failure.value.__cause__, ZeroDivisionError)
        source.stop()
        assert not thread.is_alive()
        with pytest.raises(RuntimeError, match="start\\(\\) was called twice"):
            source.start()


def test_rewards_and_advantages_are_trls_own_on_the_same_group():
    """score_group against TRL's `_AsyncRolloutLoop._score_group` (run on a namespace holding what it reads): two
    functions, one async, None rewards, a sample no function scored."""
    from accelerate.state import PartialState
    from trl.experimental.async_grpo.async_rollout_worker import RolloutGroup, _AsyncRolloutLoop

    PartialState()  # TRL's worker logs through accelerate, which wants its state first (TRL's child process does this)

    def lengths(completions, **kwargs):
        return [float(len(c[-1]["content"])) if c[-1]["content"] != "x" else None for c in completions]

    async def bonus(completions, target, **kwargs):
        return [1.0 if i % 2 else None for i, _ in enumerate(target)]

    texts = ["ab", "x", "abcd", "abc", "x"]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    prompts = [[{"role": "user", "content": "q"}]] * len(texts)
    ids = [[7] * len(t) for t in texts]
    reward_kwargs = {"target": [3] * len(texts)}
    rewards, advantages, per_func = score_group([lengths, bonus], prompts, completions, ids, reward_kwargs)

    group = RolloutGroup(prompts=prompts, reward_kwargs=reward_kwargs, completions=completions, completions_ids=ids,
                         completions_sequences=[[types.SimpleNamespace(input_ids=[1], completion_mask=[1],
                                                                       old_log_probs=[0.0])] for _ in texts],
                         tool_call_counts=[0] * len(texts), tool_failure_counts=[0] * len(texts), model_version=1,
                         group_id=0, env_rewards=[None] * len(texts), rollout_rewards=[None] * len(texts))
    loop = types.SimpleNamespace(reward_funcs=[lengths, bonus], _env_reward_types=[], _provides_rollout_reward=False,
                                 reward_func_names=["lengths", "bonus"])
    theirs = asyncio.run(_AsyncRolloutLoop._score_group(loop, group))
    assert [s.advantage for s in theirs] == pytest.approx(advantages.tolist(), abs=1e-12)
    assert torch.allclose(torch.tensor([s.metrics["reward"] for s in theirs], dtype=torch.float64),
                          torch.tensor(rewards), equal_nan=True)
    assert advantages[4] == 0.0 and rewards[1] == 1.0 and advantages[0] < 0 < advantages[2]
    assert per_func.shape == (2, 5)


def test_the_adapter_implements_trls_protocols_method_for_method():
    from trl.experimental.async_grpo.async_grpo_trainer import RolloutWorkerProtocol, WeightTransferProtocol

    for ours, theirs in ((AsyncRollouts, RolloutWorkerProtocol), (AsyncWeightSync, WeightTransferProtocol)):
        methods = {n for n, f in vars(theirs).items() if inspect.isfunction(f) and not n.startswith("_")}
        assert methods and methods <= set(dir(ours)), (theirs.__name__, methods - set(dir(ours)))
        for name in methods:
            assert list(inspect.signature(getattr(ours, name)).parameters) == \
                list(inspect.signature(getattr(theirs, name)).parameters), name
    assert set(RolloutWorkerProtocol.__annotations__) == {"rollout_buffer", "metrics_queue"}


@pytest.mark.parametrize("field, value, match", [("in_flight", "sometimes", "in_flight='sometimes' is invalid"),
                                                 ("reward_funcs", [], "reward_funcs=.*is invalid")])
def test_bad_arguments_are_refused_naming_the_field(tmp_path, field, value, match):
    kwargs = dict(rollouts=object(), args=async_args(tmp_path), train_dataset=chat_dataset(),
                  reward_funcs=digit_reward, tokenizer=None)
    kwargs[field] = value
    with pytest.raises(ValueError, match=match):
        AsyncRollouts(**kwargs)
