"""The TRL adapter: real GRPOTrainer steps on the tiny model through a RolloutWorker, and the TRL behaviour it
relies on (pinned trl==1.16.0), so a TRL upgrade that changes it fails here first."""

from __future__ import annotations

import inspect

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed: pip install 'rollout[trl]' (trl==1.16.0)")
datasets = pytest.importorskip("datasets", reason="TRL's datasets dependency is not installed")

from rollout import RolloutWorker, WorkerConfig  # noqa: E402
from rollout.testing import load_tiny_model  # noqa: E402
from trainers_integration.trl import TRL_VERSION, group_repeats, make_rollout_func, trainer_sampling  # noqa: E402
from trainers_integration.trl_logprobs import OldLogprobs, OldLogprobsPolicy  # noqa: E402

GAP = 1e-4
TRAINER = OldLogprobs(source="trainer")  # TRL's recompute and correction on every batch


def test_trl_is_the_pinned_version():
    assert trl.__version__ == TRL_VERSION


def test_trl_gates_its_importance_sampling_correction_on_use_vllm():
    """RolloutGRPOTrainer turns the correction on by making `use_vllm` read True outside `_generate`."""
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    loss = inspect.getsource(trl.GRPOTrainer._compute_loss)
    generate = inspect.getsource(trl.GRPOTrainer._generate)
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in score
    assert "sampling_per_token_logps" in score and "old_per_token_logps - sampling_per_token_logps" in score
    assert "self.use_vllm and self.vllm_importance_sampling_correction" in loss
    assert "self.rollout_func(prompts, self)" in generate
    assert {"prompt_ids", "completion_ids", "logprobs"} <= set(_required_keys(generate))


def _required_keys(source: str) -> list[str]:
    line = next(line for line in source.splitlines() if "required_keys =" in line)
    return [k.strip(" '\"") for k in line.split("{")[1].split("}")[0].split(",")]


def test_group_repeats_regroups_consecutive_copies():
    assert group_repeats(["a", "a", "b", "b", "a"]) == (["a", "b", "a"], [2, 2, 1])
    chat = [{"role": "user", "content": "hi"}]
    assert group_repeats([chat, chat]) == ([chat], [2])


def trl_args(tmp_path, **overrides):
    values = dict(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=8, num_generations=4,
                  max_completion_length=8, max_steps=2, learning_rate=1e-2, bf16=False, gradient_checkpointing=False,
                  report_to="none", logging_steps=1, use_cpu=True, save_strategy="no", seed=0, temperature=0.9)
    values.update(overrides)
    return trl.GRPOConfig(**values)


def digit_reward(completions, **kwargs):
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [sum(ch.isdigit() for ch in text) / 8 for text in texts]


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def test_rollout_func_returns_one_row_per_repeated_prompt(tiny):
    model, tok = tiny

    class Stub:  # what the rollout_func reads from a GRPOTrainer
        temperature, top_k, top_p, min_p, repetition_penalty = 0.9, 0, 1.0, None, 1.0
        max_completion_length, eos_token_ids = 5, [tok.eos_token_id]
        state = type("State", (), {"global_step": 0})()

    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        out = make_rollout_func(worker, model=model)(["one two", "one two", "red", "red"], Stub())
    assert len(out["prompt_ids"]) == len(out["completion_ids"]) == len(out["logprobs"]) == 4
    assert out["prompt_ids"][0] == out["prompt_ids"][1] == tok.encode("one two")
    assert all(1 <= len(c) <= 5 and len(c) == len(lp) for c, lp in zip(out["completion_ids"], out["logprobs"]))
    assert trainer_sampling(Stub(), 4).temperature == 0.9


def test_two_trl_steps_through_a_shared_worker(tiny, tmp_path, monkeypatch):
    from trainers_integration.trl import RolloutGRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tok = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dataset = datasets.Dataset.from_dict({"prompt": ["the cat is", "one plus two", "how many apples", "red blue"]})
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        trainer = RolloutGRPOTrainer(model=model, rollouts=worker, reward_funcs=digit_reward, args=trl_args(tmp_path),
                                     train_dataset=dataset, processing_class=tok, old_logprobs=TRAINER)
        trainer.train()
        assert worker.policy_version == 1  # pushed before each generation: versions 0 then 1 (TRL's global_step)
    assert trainer.state.global_step == 2
    losses = logged(trainer, "loss")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    gaps = logged(trainer, "sampling/sampling_logp_difference/max")  # only logged when the IS correction is on
    assert len(gaps) == 2 and max(gaps) < GAP, gaps
    assert all(abs(r - 1.0) < 1e-3 for r in logged(trainer, "sampling/importance_sampling_ratio/mean"))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_two_trl_steps_with_chat_prompts_and_a_worker_holding_its_own_copy(tiny_path, tmp_path, monkeypatch):
    """Step 2 samples from weights pushed by update_weights: a missing push would show as a large gap."""
    from trainers_integration.trl import RolloutGRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tok = load_tiny_model(tiny_path)
    prompts = [[{"role": "user", "content": text}] for text in ("count the dogs", "what is the sum")]
    dataset = datasets.Dataset.from_dict({"prompt": prompts})
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        assert worker.model is not model
        trainer = RolloutGRPOTrainer(model=model, rollouts=worker, reward_funcs=digit_reward,
                                     args=trl_args(tmp_path, learning_rate=5e-2), train_dataset=dataset,
                                     processing_class=tok, old_logprobs=TRAINER)
        trainer.train()
        assert worker.policy_version == 1
    gaps = logged(trainer, "sampling/sampling_logp_difference/max")
    assert len(gaps) == 2 and max(gaps) < GAP, gaps


class Echo:
    """Two-turn episodes: a 3-token observation after turn 1; reward 1 if turn 2 holds a digit token."""

    def __init__(self, prompt_index, sample_index):
        self.turns = 0

    def step(self, completion_ids):
        from rollout import Turn

        self.turns += 1
        return Turn([30, 31, 32], reward=float(any(22 <= t <= 31 for t in completion_ids)) if self.turns == 2 else 0.0)


def env_reward(completions, env_reward, **kwargs):
    return env_reward


def test_multi_turn_trl_steps_mask_observations_with_env_mask(tiny, tmp_path, monkeypatch):
    from rollout import EpisodeSpec
    from trainers_integration.trl import RolloutGRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tok = tiny
    seen = []
    dataset = datasets.Dataset.from_dict({"prompt": ["the cat is", "one plus two"]})
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        real_generate = worker.generate
        monkeypatch.setattr(worker, "generate", lambda *a, **k: seen.append(real_generate(*a, **k)) or seen[-1])
        trainer = RolloutGRPOTrainer(model=model, rollouts=worker, reward_funcs=env_reward,
                                     args=trl_args(tmp_path, max_completion_length=4), train_dataset=dataset,
                                     processing_class=tok, episodes=EpisodeSpec(Echo, max_turns=2),
                                     old_logprobs=TRAINER)
        trainer.train()
    assert len(seen) == 2 and all(b.num_turns.tolist() == [2] * len(b) for b in seen)
    assert all(int((~b.action_mask & b.completion_mask).sum()) == 3 * len(b) for b in seen)
    # TRL counts completion lengths over env_mask: the model's tokens only, observations excluded
    model_tokens = [float(b.action_mask.sum(1).float().mean()) for b in seen]
    assert logged(trainer, "completions/mean_length") == pytest.approx(model_tokens)
    gaps = logged(trainer, "sampling/sampling_logp_difference/max")
    assert len(gaps) == 2 and max(gaps) < GAP, gaps


def test_use_vllm_is_refused(tiny, tmp_path):
    from trainers_integration.trl import RolloutGRPOTrainer

    model, tok = tiny
    dataset = datasets.Dataset.from_dict({"prompt": ["a b"]})
    with pytest.raises(ValueError, match="use_vllm=True is invalid for RolloutGRPOTrainer"):
        RolloutGRPOTrainer(model=model, rollouts=object(), reward_funcs=digit_reward,
                           args=trl_args(tmp_path, use_vllm=True), train_dataset=dataset, processing_class=tok)


def test_episodes_restarted_from_new_context_ids_are_refused_naming_the_alternative(tiny):
    from rollout import EpisodeSpec, Turn

    model, tok = tiny

    class Rewrite:
        def __init__(self, prompt_index, sample_index):
            self.turns = 0

        def step(self, completion_ids):
            self.turns += 1
            return Turn(context_ids=[40, 41, 42]) if self.turns == 1 else Turn(done=True)

    class Stub:
        temperature, top_k, top_p, min_p, repetition_penalty = 0.9, 0, 1.0, None, 1.0
        max_completion_length, eos_token_ids = 4, [tok.eos_token_id]
        state = type("State", (), {"global_step": 0})()

    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        rollout_func = make_rollout_func(worker, model=model, episodes=EpisodeSpec(Rewrite, max_turns=2))
        with pytest.raises(ValueError, match="several rows.*one row per generation.*GRPOTrainer"):
            rollout_func(["one two", "one two"], Stub())


# --- old logprobs: the rollout's serve while they are the trainer's; TRL's forward runs where it can matter ---


def test_trl_computes_old_logprobs_where_the_adapter_expects():
    """The adapter serves TRL's old logprobs by arming TRL's first no-grad `_get_per_token_logps_and_entropies`
    call of a batch (made only when misaligned or corrected) and lets TRL's loss fall back to
    `per_token_logps.detach()` when none are given."""
    score = inspect.getsource(trl.GRPOTrainer._generate_and_score_completions)
    loss = inspect.getsource(trl.GRPOTrainer._compute_loss)
    condition = "self.args.gradient_accumulation_steps % generate_every != 0 or ("
    assert "generate_every = self.args.steps_per_generation * self.num_iterations" in score and condition in score
    after = score[score.index(condition):]
    assert after.index("old_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(") \
        < after.index("ref_per_token_logps, _, _ = self._get_per_token_logps_and_entropies(")
    assert 'output["old_per_token_logps"] = old_per_token_logps' in score
    assert "per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps" in loss
    assert 'per_token_loss * inputs["importance_sampling_ratio"]' in loss


def test_old_logprobs_policy_runs_the_forward_first_on_stale_rows_on_checks_and_after_a_failed_check():
    policy = OldLogprobsPolicy(OldLogprobs(check_every=3, tolerance=1e-4))
    assert policy.reason(0, current=True) == "first"
    assert policy.measured(0, 2e-6) is False
    assert [policy.reason(step, current=True) for step in (1, 2, 3)] == [None, None, "check"]
    assert policy.reason(1, current=False) == "stale" and policy.reason(1, True, tools=True) == "tools"
    assert policy.measured(3, 5e-3) is True and policy.reason(4, current=True) == "gap"
    assert policy.measured(4, 6e-3) is False  # still failing: warned once
    assert policy.measured(5, 1e-6) is False and policy.reason(6, current=True) is None
    assert OldLogprobsPolicy(TRAINER).reason(7, current=True) == "asked"


@pytest.mark.parametrize("field, value", [("source", "vllm"), ("check_every", 0), ("tolerance", 0.0),
                                          ("tolerance", float("nan"))])
def test_old_logprobs_config_refuses_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=f"{field}=.*is invalid.*Fix"):
        OldLogprobs(**{field: value})


@pytest.fixture()
def recomputes(monkeypatch):
    """Counts TRL's no-grad logprob forwards (the old-logprob recompute; beta=0: no reference forward)."""
    calls = []
    real = trl.GRPOTrainer._get_per_token_logps_and_entropies

    def counting(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            calls.append(args[0])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies", counting)
    return calls


def test_on_policy_steps_serve_the_rollouts_logprobs_and_run_no_recompute_forward(tiny, tmp_path, monkeypatch,
                                                                                  recomputes):
    """Three steps, check_every=2: TRL's forward (and correction) on step 0 (first) and step 2 (check) only."""
    from trainers_integration.trl import RolloutGRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tok = tiny
    dataset = datasets.Dataset.from_dict({"prompt": ["the cat is", "one plus two", "how many apples", "red blue"]})
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        trainer = RolloutGRPOTrainer(model=model, rollouts=worker, reward_funcs=digit_reward,
                                     args=trl_args(tmp_path, max_steps=3), train_dataset=dataset,
                                     processing_class=tok, old_logprobs=OldLogprobs(check_every=2))
        trainer.train()
    assert logged(trainer, "rollout/old_logprobs_from_rollout") == [0.0, 1.0, 0.0]
    assert len(recomputes) == 2 and all(m is trainer.model for m in recomputes)
    gaps = logged(trainer, "rollout/logprob_gap/max")
    assert len(gaps) == 2 and max(gaps) < GAP, gaps
    assert len(logged(trainer, "sampling/sampling_logp_difference/max")) == 2  # TRL's correction ran on those two
    assert all(torch.isfinite(torch.tensor(logged(trainer, "loss"))))


def scoring_setup(tiny, tmp_path, monkeypatch, **overrides):
    """A trainer over a shared worker whose batches can be replayed or altered, and one generation batch of inputs
    (2 prompts x 4 samples) for direct `_generate_and_score_completions` calls."""
    from trainers_integration.trl import RolloutGRPOTrainer

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    model, tok = tiny
    model.train()
    worker = RolloutWorker(model, WorkerConfig(), tokenizer=tok)
    old_logprobs = overrides.pop("old_logprobs", None)
    dataset = datasets.Dataset.from_dict({"prompt": ["the cat is", "one plus two"]})
    trainer = RolloutGRPOTrainer(model=model, rollouts=worker, reward_funcs=digit_reward,
                                 args=trl_args(tmp_path, **overrides), train_dataset=dataset, processing_class=tok,
                                 old_logprobs=old_logprobs)
    inputs = [{"prompt": p} for p in ("the cat is", "one plus two") for _ in range(4)]
    return trainer, worker, inputs


def test_stale_rows_run_trls_recompute_and_importance_sampling_correction(tiny, tmp_path, monkeypatch, recomputes):
    import dataclasses

    trainer, worker, inputs = scoring_setup(tiny, tmp_path, monkeypatch)
    with worker:
        first = trainer._generate_and_score_completions(inputs)  # no measurement yet: TRL's path
        served = trainer._generate_and_score_completions(inputs)
        real_generate = worker.generate

        def stale(*args, **kwargs):  # rows of the version before the trainer's
            batch = real_generate(*args, **kwargs)
            return dataclasses.replace(batch, policy_version=batch.policy_version - 1,
                                       token_versions=batch.token_versions - batch.action_mask.long())

        monkeypatch.setattr(worker, "generate", stale)
        corrected = trainer._generate_and_score_completions(inputs)
    assert len(recomputes) == 2  # first and stale; none for the served batch
    assert "importance_sampling_ratio" in first and "importance_sampling_ratio" in corrected
    assert "importance_sampling_ratio" not in served and "old_per_token_logps" not in served  # TRL's on-policy path
    assert trainer._metrics["train"]["rollout/old_logprobs_from_rollout"] == [0.0, 1.0, 0.0]
    assert len(trainer._metrics["train"]["rollout/logprob_gap/max"]) == 1  # a stale gap is not the numerics'
    assert len(trainer._metrics["train"]["sampling/sampling_logp_difference/max"]) == 2


def test_a_rollout_whose_logprobs_differ_keeps_the_correction_on_and_warns(tiny, tmp_path, monkeypatch, recomputes):
    """As a bf16 rollout would: logprobs off by 1e-2 fail the first check, so every later batch is corrected."""
    import dataclasses

    trainer, worker, inputs = scoring_setup(tiny, tmp_path, monkeypatch)
    with worker:
        real_generate = worker.generate

        def shifted(*args, **kwargs):
            batch = real_generate(*args, **kwargs)
            return dataclasses.replace(batch, logprobs=batch.logprobs - 1e-2 * batch.completion_mask)

        monkeypatch.setattr(worker, "generate", shifted)
        with pytest.warns(UserWarning, match="differ from the trainer's forward by up to 1.0e-02"):
            trainer._generate_and_score_completions(inputs)
        later = trainer._generate_and_score_completions(inputs)
    assert len(recomputes) == 2 and "importance_sampling_ratio" in later
    assert trainer._metrics["train"]["rollout/old_logprobs_from_rollout"] == [0.0, 0.0]
    assert all(abs(g - 1e-2) < 1e-4 for g in trainer._metrics["train"]["rollout/logprob_gap/max"])


def test_supplied_old_logprobs_give_trls_loss_and_gradient_with_num_iterations_2(tiny, tmp_path, monkeypatch,
                                                                                 recomputes):
    """num_iterations=2: TRL needs old logprobs from before the update. The rollout's (served, no forward) and TRL's
    recompute with its correction (on the same batch) give the same loss and gradient after the weights moved."""
    from trainers_integration.trl import RolloutGRPOTrainer

    trainer, worker, inputs = scoring_setup(tiny, tmp_path, monkeypatch, num_iterations=2)
    recompute = RolloutGRPOTrainer(model=trainer.model, rollouts=worker, reward_funcs=digit_reward,
                                   args=trl_args(tmp_path, num_iterations=2), processing_class=trainer.processing_class,
                                   train_dataset=trainer.train_dataset, old_logprobs=TRAINER)
    with worker:
        trainer._generate_and_score_completions(inputs)  # the first check
        seen = []
        real_generate = worker.generate
        monkeypatch.setattr(worker, "generate", lambda *a, **k: seen.append(real_generate(*a, **k)) or seen[-1])
        before = len(recomputes)
        served = trainer._generate_and_score_completions(inputs)
        assert len(recomputes) == before  # TRL's recompute call was answered by the rollout's logprobs
        monkeypatch.setattr(worker, "generate", lambda *a, **k: seen[0])  # the same batch again
        recomputed = recompute._generate_and_score_completions(inputs)
    assert len(recomputes) == before + 1
    assert "importance_sampling_ratio" not in served and "importance_sampling_ratio" in recomputed
    mask = served["completion_mask"].bool()
    assert torch.equal(served["completion_ids"], recomputed["completion_ids"])
    assert torch.equal(served["advantages"], recomputed["advantages"])
    assert (served["old_per_token_logps"] - recomputed["old_per_token_logps"]).abs()[mask].max() <= 1e-5

    model = trainer.model
    with torch.no_grad():  # the first iteration's update moved the weights: the ratio is no longer 1
        torch.manual_seed(0)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 2e-3)

    def loss_and_grad(owner, inputs):
        owner.current_gradient_accumulation_steps = 1
        model.zero_grad()
        loss = owner._compute_loss(model, inputs)
        loss.backward()
        return float(loss), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    ours, theirs = loss_and_grad(trainer, served), loss_and_grad(recompute, recomputed)
    on_policy = loss_and_grad(trainer, {k: v for k, v in served.items() if k != "old_per_token_logps"})
    assert abs(ours[0] - theirs[0]) <= 1e-5 and (ours[1] - theirs[1]).abs().max() <= 1e-5
    assert (ours[1] - on_policy[1]).abs().max() > 1e-3  # the old logprobs mattered: not a vacuous equality
