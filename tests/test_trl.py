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

GAP = 1e-4


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
                                     train_dataset=dataset, processing_class=tok)
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
                                     processing_class=tok)
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
                                     processing_class=tok, episodes=EpisodeSpec(Echo, max_turns=2))
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
