"""Trainer integration: the pure loss pieces against hand-computed values, GRPO and PPO steps on the tiny model
(finite losses, train/rollout logprob gap ~0, a broken weight sync caught by the gap), and the demo, shortened."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import reference_logprobs

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import load_tiny_model
from trainers_integration import losses
from trainers_integration.forward import completion_logprobs, pack
from trainers_integration.grpo import GRPOConfig, GRPOTrainer
from trainers_integration.ppo import PPOConfig, PPOTrainer
from trainers_integration.rollouts import behaviour_logprobs
from trainers_integration.value import CriticModel, ValueHead

GAP = 1e-4
PROMPTS = ["the cat is", "one plus two", "how many apples", "red blue green"]


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# ------------------------------------------------------------------------------------------ pure functions
def test_group_advantages_center_and_scale_per_group():
    rewards = t([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    # group 1: mean 0.5, sample std sqrt(1/3); group 2: all equal -> 0
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    got = losses.group_advantages(rewards, group_size=4)
    torch.testing.assert_close(got, t([expected, -expected, -expected, expected, 0, 0, 0, 0]))
    torch.testing.assert_close(losses.group_advantages(rewards, 4, scale=False), t([.5, -.5, -.5, .5, 0, 0, 0, 0]))


def test_group_advantages_reject_a_ragged_batch():
    with pytest.raises(ValueError, match="num_prompts"):
        losses.group_advantages(t([1.0, 2.0, 3.0]), group_size=2)


def test_aggregate_token_vs_sequence_normalisation():
    per_token = t([[1.0, 2.0, 3.0], [4.0, 99.0, 99.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert losses.aggregate(per_token, mask, "token").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert losses.aggregate(per_token, mask, "sequence").item() == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="loss_norm"):
        losses.aggregate(per_token, mask, "batch")


def test_clipped_policy_loss_takes_the_pessimistic_branch():
    old = torch.zeros(4, 1)
    logp = torch.log(t([[1.5], [1.5], [0.5], [0.5]]))
    adv = t([1.0, -1.0, 1.0, -1.0])
    loss, clipped = losses.clipped_policy_loss(logp, old, adv, 0.2, 0.2)
    # r=1.5,A=+1 -> -min(1.5, 1.2); r=1.5,A=-1 -> -min(-1.5,-1.2); r=.5,A=+1 -> -min(.5,.8); r=.5,A=-1 -> -min(-.5,-.8)
    torch.testing.assert_close(loss.squeeze(1), t([-1.2, 1.5, -0.5, 0.8]))
    assert clipped.squeeze(1).tolist() == [True, False, False, True]


def test_clip_higher_widens_only_the_upper_bound():
    loss, _ = losses.clipped_policy_loss(torch.log(t([[1.5], [0.5]])), torch.zeros(2, 1), t([1.0, -1.0]), 0.2, 0.28)
    torch.testing.assert_close(loss.squeeze(1), t([-1.28, 0.8]))


def test_k3_kl_is_zero_when_equal_and_matches_hand_value():
    logp, ref = torch.log(t([0.5, 0.3])), torch.log(t([0.25, 0.3]))
    # delta = log(0.25/0.5): exp(delta) - delta - 1 = 0.5 + log 2 - 1
    torch.testing.assert_close(losses.k3_kl(logp, ref), t([0.5 + math.log(2) - 1, 0.0]))


def test_truncated_is_weights_cap_the_ratio_and_carry_no_grad():
    trainer = torch.log(t([0.6, 0.2])).requires_grad_()
    weights = losses.truncated_is_weights(trainer, torch.log(t([0.2, 0.4])), cap=2.0)
    torch.testing.assert_close(weights, t([2.0, 0.5]))
    assert not weights.requires_grad


def test_gae_hand_computed_with_padding_ignored():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 1.0, 99.0]])
    values = t([[0.5, 0.6, 0.7], [0.2, 0.4, 99.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv, ret = losses.gae(rewards, values, mask, gamma=1.0, lam=0.5)
    # row 0: deltas (0.1, 0.1, 0.3) -> A2 = .3, A1 = .1 + .5*.3 = .25, A0 = .1 + .5*.25 = .225
    torch.testing.assert_close(adv[0], t([0.225, 0.25, 0.3]))
    torch.testing.assert_close(ret[0], t([0.725, 0.85, 1.0]))
    adv, _ = losses.gae(rewards, values, mask, gamma=0.9, lam=1.0)
    # row 1: delta1 = 1 - .4 = .6, delta0 = .9*.4 - .2 = .16 -> A0 = .16 + .9*.6 = .7; padding stays 0
    torch.testing.assert_close(adv[1], t([0.7, 0.6, 0.0]))


def test_gae_with_gamma_lam_one_is_return_minus_value():
    rewards, values = t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]])
    adv, ret = losses.gae(rewards, values, torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, t([[0.5, 0.4, 0.3]]))
    torch.testing.assert_close(ret, t([[1.0, 1.0, 1.0]]))


def test_gae_skips_observation_holes_inside_a_row_as_if_they_were_absent():
    # a 2-turn episode: action, action, [observation, observation], action, then padding
    rewards = t([[0.0, 0.0, 5.0, 5.0, 1.0, 0.0]])
    values = t([[0.5, 0.6, 9.0, 9.0, 0.7, 0.0]])
    mask = torch.tensor([[True, True, False, False, True, False]])
    adv, ret = losses.gae(rewards, values, mask, gamma=0.9, lam=0.5)
    dense_adv, dense_ret = losses.gae(t([[0.0, 0.0, 1.0]]), t([[0.5, 0.6, 0.7]]), torch.ones(1, 3, dtype=torch.bool),
                                      gamma=0.9, lam=0.5)
    torch.testing.assert_close(adv[0, [0, 1, 4]], dense_adv[0])
    torch.testing.assert_close(ret[0, [0, 1, 4]], dense_ret[0])
    assert adv[0, [2, 3, 5]].tolist() == [0.0, 0.0, 0.0] and ret[0, [2, 3, 5]].tolist() == [0.0, 0.0, 0.0]
    # by hand: delta2 = 1 - .7 = .3; delta1 = .9*.7 - .6 = .03 -> A1 = .03 + .45*.3 = .165
    assert abs(float(adv[0, 1]) - 0.165) < 1e-6


def test_kl_shaped_rewards_put_the_score_on_the_last_action_token_of_an_episode():
    mask = torch.tensor([[True, False, True, False, False]])
    got = losses.kl_shaped_rewards(t([2.0]), t([[-1.0] * 5]), None, mask, kl_coef=0.0)
    torch.testing.assert_close(got, t([[0.0, 0.0, 2.0, 0.0, 0.0]]))


def test_kl_shaped_rewards_put_the_score_on_the_last_real_token():
    logp = t([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    ref = t([[-1.5, -2.0, -2.0], [-1.0, -2.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    got = losses.kl_shaped_rewards(t([1.0, 2.0]), logp, ref, mask, kl_coef=0.1)
    torch.testing.assert_close(got, t([[-0.05, 0.0, 1.1], [0.0, 1.9, 0.0]]))
    torch.testing.assert_close(losses.kl_shaped_rewards(t([1.0, 2.0]), logp, None, mask, 0.1),
                               t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]]))


def test_the_offpolicy_split_and_zero_variance_groups_by_hand():
    from trainers_integration.tracking import offpolicy_split, zero_variance_fraction

    trainer, behaviour = t([[-1.0, -2.0, -3.0], [-1.0, -1.5, 0.0]]), t([[-1.5, -2.0, -1.0], [-1.25, -1.0, 9.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    versions = torch.tensor([[2, 3, 3], [3, 3, -1]])
    split = offpolicy_split(trainer, behaviour, mask, versions, version=3)
    assert split == {"offpolicy/gap_current": pytest.approx((0.0 + 2.0 + 0.25 + 0.5) / 4),
                     "offpolicy/gap_stale": pytest.approx(0.5), "offpolicy/stale_token_fraction": 0.2}
    ahead = offpolicy_split(trainer, behaviour, mask, versions, version=4)  # the trainer moved on: all stale
    assert math.isnan(ahead["offpolicy/gap_current"]) and ahead["offpolicy/stale_token_fraction"] == 1.0
    rewards, groups = t([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0]), torch.tensor([0, 0, 1, 1, 2, 2, 3])
    assert zero_variance_fraction(rewards, groups) == 2 / 3  # prompt 3 has one sample: not a group
    assert math.isnan(zero_variance_fraction(t([1.0]), torch.tensor([0])))


def test_clipped_value_loss_hand_values():
    values, old, returns = t([0.5, -0.5, 0.1]), t([0.0, 0.0, 0.0]), t([1.0, -1.0, 1.0])
    loss, clipped = losses.clipped_value_loss(values, old, returns, clip=0.2)
    # clipped values 0.2, -0.2, 0.1: max((v-R)^2, (vc-R)^2) / 2 = .64/2, .64/2, .81/2
    torch.testing.assert_close(loss, t([0.32, 0.32, 0.405]))
    assert clipped.tolist() == [True, True, False]


def test_masked_whiten_ignores_padding():
    got = losses.masked_whiten(t([1.0, 2.0, 3.0, 50.0]), torch.tensor([True, True, True, False]))
    torch.testing.assert_close(got, t([-math.sqrt(1.5), 0.0, math.sqrt(1.5), 0.0]), atol=1e-6, rtol=1e-5)


# ------------------------------------------------------------------------------------------ the trainer's forward
def test_trainer_forward_matches_a_plain_per_row_forward(tiny):
    model, tok = tiny
    prompts = [tok.encode(p) for p in PROMPTS[:3]]
    completions = [[5, 9, 11, 40], [7], [30, 31]]
    width = max(map(len, completions))
    ids = torch.tensor([c + [0] * (width - len(c)) for c in completions])
    mask = torch.tensor([[True] * len(c) + [False] * (width - len(c)) for c in completions])
    with torch.no_grad():
        got, _ = completion_logprobs(model, pack(prompts, ids, mask, tok.pad_token_id), temperature=0.7)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        want, _ = reference_logprobs(model, p, c, temperature=0.7)
        torch.testing.assert_close(got[i, : len(c)], want, atol=1e-5, rtol=0)
        assert bool((got[i, len(c):] == 0).all())


# ------------------------------------------------------------------------------------------ GRPO on the tiny model
def digit_reward(tok):
    digits = torch.tensor([i for i in range(len(tok)) if tok.decode([i]).strip().isdigit()])

    def reward(batch):
        hits = torch.isin(batch.completion_ids, digits) & batch.completion_mask
        return hits.sum(1).float() / batch.completion_lengths.float()

    return reward


def ids(tok, prompts=PROMPTS):
    return [tok.encode(p) for p in prompts]


@pytest.mark.parametrize("loss_norm", ["token", "sequence"])
def test_grpo_steps_through_a_shared_worker_have_zero_logprob_gap(tiny, loss_norm):
    model, tok = tiny
    ref = copy.deepcopy(model).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = GRPOConfig(num_generations=4, max_new_tokens=8, num_epochs=2, beta=0.01, loss_norm=loss_norm)
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), digit_reward(tok),
                              lambda step: ids(tok), worker, config, ref_model=ref)
        history = trainer.train(3)
        assert worker.policy_version == 3
    for m in history:
        assert math.isfinite(m["loss"]) and math.isfinite(m["kl"])
        assert m["logprob_gap_max"] < GAP, m
        assert m["rollout_tokens_per_s"] > 0 and m["refresh_s"] >= 0 and m["staleness"] == 0
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # step 1 samples from the reference itself
    assert history[-1]["kl"] > 0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_trainers_sampling_is_untruncated_so_both_logprobs_are_the_behaviour_policy(tiny, temperature):
    """GRPO and PPO both take `behaviour_logprobs` (batch.logprobs): with their sampling (no top-k / top-p) it is the
    distribution actually sampled, bit for bit."""
    model, tok = tiny
    sampling = GRPOConfig(num_generations=4, max_new_tokens=12, temperature=temperature).sampling()
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        batch = worker.generate(ids(tok), sampling)
    assert torch.equal(batch.sampling_logprobs, batch.logprobs)
    assert bool(batch.logprobs[batch.completion_mask].lt(0).all())
    assert behaviour_logprobs(batch) is batch.logprobs
    truncated = dataclasses.replace(sampling, top_k=5)  # where they differ, sampling_logprobs is what was sampled
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        other = worker.generate(ids(tok), truncated)
    assert bool((other.sampling_logprobs >= other.logprobs)[other.completion_mask].all())
    assert not torch.equal(other.sampling_logprobs, other.logprobs)


def test_grpo_with_truncated_is_and_micro_batches_stays_exact(tiny):
    model, tok = tiny
    config = GRPOConfig(num_generations=4, max_new_tokens=6, num_epochs=2, tis_cap=2.0, micro_batch_size=5)
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        trainer = GRPOTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5), digit_reward(tok),
                              iter([ids(tok)] * 2), worker, config)
        history = trainer.train(5)  # the prompt iterable holds 2 steps: train stops there
    assert len(history) == 2
    assert all(math.isfinite(m["loss"]) and m["logprob_gap_max"] < GAP for m in history)
    assert math.isnan(history[0]["kl"])  # no reference model: no KL to report
    assert history[0]["clip_frac"] > 0  # the second epoch moved the policy past the clip with this learning rate


@pytest.mark.parametrize("loss_norm", ["token", "sequence"])
def test_micro_batches_give_the_full_batch_update(tiny, loss_norm):
    model, tok = tiny
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        sampling = [SamplingParams(n=3, max_new_tokens=2 + 3 * i) for i in range(len(PROMPTS))]  # ragged rows
        batch = worker.generate(ids(tok), sampling)
    advantages = losses.group_advantages(torch.randn(len(batch), generator=torch.Generator().manual_seed(0)), 3)
    updated = []
    for micro in (None, 5):
        policy = copy.deepcopy(model)
        config = GRPOConfig(num_generations=3, loss_norm=loss_norm, micro_batch_size=micro, max_grad_norm=None)
        trainer = GRPOTrainer(policy, torch.optim.SGD(policy.parameters(), lr=1.0), None, [],
                              SimpleNamespace(model=policy, tokenizer=tok, policy_version=0), config)
        stats = trainer._update(batch, advantages, None)
        updated.append((stats["loss"], torch.cat([p.detach().flatten() for p in policy.parameters()])))
    assert updated[0][0] == pytest.approx(updated[1][0], abs=1e-6)
    torch.testing.assert_close(updated[0][1], updated[1][1], atol=1e-6, rtol=1e-5)


def test_grpo_pushes_weights_to_a_worker_with_its_own_copy(tiny_path):
    model, tok = load_tiny_model(tiny_path)
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        assert worker.model is not model
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), digit_reward(tok),
                              lambda step: ids(tok), worker, GRPOConfig(num_generations=4, max_new_tokens=8))
        history = trainer.train(3)
        assert worker.policy_version == 3
        assert worker.weights_fingerprint() == _fingerprint(model)
    assert all(m["logprob_gap_max"] < GAP for m in history), history


def test_logprob_gap_catches_a_weight_sync_that_silently_does_nothing(tiny_path, monkeypatch):
    import trainers_integration.loop as loop

    model, tok = load_tiny_model(tiny_path)
    monkeypatch.setattr(loop, "push_weights", lambda rollouts, model, version, in_flight=None: 0.0)
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), digit_reward(tok),
                              lambda step: ids(tok), worker, GRPOConfig(num_generations=4, max_new_tokens=8))
        first, second = trainer.train(2)
    assert first["logprob_gap_max"] < GAP  # same initial weights on both sides
    assert second["logprob_gap_max"] > 1e-2  # the trainer moved on, the worker did not


def test_learn_on_a_batch_generated_elsewhere_is_the_step_that_generated_it(tiny_path, monkeypatch):
    """`learn(batch, rewards)` (batches an outside harness drove, e.g. through rollout.serve) makes the update and
    the weight push `step` makes on the same batch: same parameters, same loss, the rollout side one version on."""
    import trainers_integration.loop as loop

    config = GRPOConfig(num_generations=4, max_new_tokens=6)
    results = []
    for how in ("step", "learn"):
        model, tok = load_tiny_model(tiny_path)
        with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
            batch = worker.generate(ids(tok)[:2], SamplingParams(n=4, max_new_tokens=6, seed=3))
            rewards = digit_reward(tok)(batch) + torch.arange(len(batch)) / 10  # no group is all-equal
            trainer = GRPOTrainer(model, torch.optim.SGD(model.parameters(), lr=0.5), lambda b: rewards,
                                  lambda step: ids(tok)[:2], worker, config)
            if how == "step":
                monkeypatch.setattr(loop, "timed_generate", lambda *a, **k: (batch, 0.5))
                metrics = trainer.step()
                monkeypatch.undo()
            else:
                metrics = trainer.learn(batch, rewards.tolist(), rollout_s=0.5)
            assert worker.policy_version == 1 and trainer.num_steps == 1 and trainer.history == [metrics]
            results.append((metrics, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (stepped, after_step), (learned, after_learn) = results
    assert learned["loss"] == stepped["loss"] and learned["reward_mean"] == stepped["reward_mean"]
    assert learned["logprob_gap_max"] < GAP and learned["rollout_s"] == 0.5
    torch.testing.assert_close(after_learn, after_step, atol=0, rtol=0)


def test_learn_is_refused_by_a_loop_that_generates_its_own_batches_ahead(tiny_path):
    model, tok = load_tiny_model(tiny_path)
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        trainer = GRPOTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), digit_reward(tok),
                              lambda step: ids(tok), worker, GRPOConfig(num_generations=2, max_new_tokens=4,
                                                                         async_rollouts=True))
        try:
            with pytest.raises(ValueError, match="async_rollouts"):
                trainer.learn(worker.generate(ids(tok)[:1], SamplingParams(n=2, max_new_tokens=2)), [0.0, 1.0])
            assert trainer.num_steps == 0 and worker.policy_version == 0
        finally:
            trainer.close()


def test_grpo_rejects_a_reward_per_prompt_instead_of_per_row(tiny):
    model, tok = tiny
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        trainer = GRPOTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda b: [0.0] * 4,
                              lambda step: ids(tok), worker, GRPOConfig(num_generations=2, max_new_tokens=4))
        with pytest.raises(ValueError, match="one float per row"):
            trainer.step()


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=0.0), "temperature"), (dict(num_generations=0), "num_generations"),
    (dict(loss_norm="batch"), "loss_norm"), (dict(tis_cap=0.5), "tis_cap"), (dict(clip_low=1.0), "clip_low"),
])
def test_grpo_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs)


def test_grpo_with_beta_needs_a_reference(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="ref_model"):
        GRPOTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), lambda b: [], [], object(),
                    GRPOConfig(beta=0.1))


# ------------------------------------------------------------------------------------------ PPO on the tiny model
@pytest.mark.parametrize("critic", ["value_head", "critic_model"])
def test_ppo_steps_are_finite_and_exact(tiny, tiny_path, critic):
    model, tok = tiny
    ref = copy.deepcopy(model).eval()
    value = ValueHead.for_model(model) if critic == "value_head" else CriticModel(load_tiny_model(tiny_path)[0])
    optimizer = torch.optim.AdamW([*model.parameters(), *value.parameters()], lr=3e-3)
    config = PPOConfig(num_generations=2, max_new_tokens=8, num_epochs=2, kl_coef=0.05)
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        trainer = PPOTrainer(model, value, optimizer, digit_reward(tok), lambda step: ids(tok), worker, config,
                             ref_model=ref)
        history = trainer.train(3)
    for m in history:
        for key in ("loss", "pg_loss", "value_loss", "kl", "grad_norm"):
            assert math.isfinite(m[key]), (key, m)
        assert m["logprob_gap_max"] < GAP, m
    assert history[0]["value_mean"] == 0.0  # zero-initialised head
    assert history[-1]["value_mean"] != 0.0  # the value model learned something


def test_ppo_rejects_an_optimizer_without_the_value_parameters(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="value_model"):
        PPOTrainer(model, ValueHead.for_model(model), torch.optim.SGD(model.parameters(), lr=0.1), lambda b: [],
                   [], model)


# ------------------------------------------------------------------------------------------ multi-turn episodes
class TwoTurns:
    """A 5-token observation after turn 1; turn 2 earns the fraction of its tokens that are digits."""

    def __init__(self, prompt_index, sample_index):
        self.turns = 0

    def step(self, completion_ids):
        from rollout import Turn

        self.turns += 1
        if self.turns == 1:
            return Turn([40, 41, 42, 43, 44])
        return Turn(reward=sum(22 <= t <= 31 for t in completion_ids) / len(completion_ids))


def test_grpo_on_episodes_trains_on_model_tokens_only_with_the_environment_rewards(tiny, monkeypatch):
    from rollout import EpisodeSpec

    model, tok = tiny
    masks, batches = [], []
    real_weights = losses.row_weights
    monkeypatch.setattr(losses, "row_weights", lambda mask, norm, index: masks.append(mask.clone()) or
                        real_weights(mask, norm, index))
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        real_generate = worker.generate
        monkeypatch.setattr(worker, "generate", lambda *a, **k: batches.append(real_generate(*a, **k)) or batches[-1])
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), None, lambda step: ids(tok),
                              worker, GRPOConfig(num_generations=4, max_new_tokens=6),
                              episodes=EpisodeSpec(TwoTurns, max_turns=2))
        history = trainer.train(2)
    assert len(masks) == len(batches) == len(history) == 2
    for m, batch, mask in zip(history, batches, masks):
        assert m["num_turns"] == 2.0 and m["logprob_gap_max"] < GAP
        assert m["reward_mean"] == pytest.approx(float(batch.rewards.mean()))
        assert torch.equal(mask, batch.action_mask)  # the loss saw the model's tokens, never the observations
        assert int((batch.completion_mask & ~batch.action_mask).sum()) == 5 * len(batch)


def test_ppo_on_episodes_is_exact_across_the_observation_holes(tiny):
    from rollout import EpisodeSpec

    model, tok = tiny
    value = ValueHead.for_model(model)
    optimizer = torch.optim.AdamW([*model.parameters(), *value.parameters()], lr=3e-3)
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        trainer = PPOTrainer(model, value, optimizer, None, lambda step: ids(tok), worker,
                             PPOConfig(num_generations=2, max_new_tokens=6, num_epochs=2, kl_coef=0.0),
                             episodes=EpisodeSpec(TwoTurns, max_turns=2))
        history = trainer.train(2)
    assert all(math.isfinite(m["loss"]) and m["logprob_gap_max"] < GAP and m["num_turns"] == 2.0 for m in history)


def test_a_trainer_without_reward_fn_or_episodes_fails_before_generating(tiny):
    model, tok = tiny
    calls = []
    rollouts = SimpleNamespace(model=model, tokenizer=tok, refresh=lambda v: None, policy_version=0,
                               generate=lambda *a, **k: calls.append(1))
    trainer = GRPOTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), None, lambda step: ids(tok), rollouts)
    with pytest.raises(ValueError, match="reward_fn=None"):
        trainer.step()
    assert calls == []


# ------------------------------------------------------------------------------------------ asynchronous rollouts
def test_async_grpo_trains_on_batches_at_most_one_version_old_whose_tokens_span_the_switch(tiny_path, monkeypatch):
    model, tok = load_tiny_model(tiny_path)
    batches = []
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        real_submit = worker.submit

        def spy(*args, **kwargs):
            future = real_submit(*args, **kwargs)
            batches.append(future)
            return future

        monkeypatch.setattr(worker, "submit", spy)
        config = GRPOConfig(num_generations=4, max_new_tokens=24, async_rollouts=True, tis_cap=2.0)
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), digit_reward(tok),
                              lambda step: ids(tok), worker, config)
        history = trainer.train(4)
        trainer.close()
        assert worker.policy_version == 4 and worker.weights_fingerprint() == _fingerprint(model)
    assert [m["staleness"] for m in history] == [0.0, 1.0, 1.0, 1.0] and history[-1]["dropped_batches"] == 0.0
    # the off-policy split: tokens of the weights the trainer holds are exact (numerics only), older ones are not
    assert math.isnan(history[0]["offpolicy/gap_stale"]) and history[0]["offpolicy/stale_token_fraction"] == 0
    for m in history[1:]:  # a batch finished before the update landed is all stale
        assert m["offpolicy/stale_token_fraction"] > 0 and not m["offpolicy/gap_current"] >= GAP
        assert m["offpolicy/gap_stale"] > 100 * GAP
    assert len(batches) == 5  # steps 0..4 submitted: step t+1 was generating while step t trained
    trained = [f.result() for f in batches[1:4]]
    assert all(int(b.token_versions[b.action_mask].min()) == t for t, b in enumerate(trained))
    assert all(math.isfinite(m["loss"]) for m in history)


def test_a_batch_older_than_max_staleness_is_dropped_and_regenerated(tiny_path, tiny):
    from trainers_integration.pipeline import Pipeline, staleness

    model, tok = tiny
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        pipeline = Pipeline(worker, lambda step: ids(tok), SamplingParams(n=2, max_new_tokens=4), False, None, 1)
        assert staleness(pipeline.batch(0, 0), 0) == 0  # and step 1 is submitted at version 0
        state = {k: v.clone() for k, v in model.state_dict().items()}
        worker.update_weights(state, version=1, in_flight="wait")
        worker.update_weights(state, version=2, in_flight="wait")
        batch = pipeline.batch(1, 2)  # step 1's tokens are 2 versions old: dropped, regenerated at version 2
        assert pipeline.num_dropped == 1 and staleness(batch, 2) == 0
        pipeline.close()


def test_async_rollouts_refuse_a_worker_sharing_the_policy(tiny):
    model, tok = tiny
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        with pytest.raises(ValueError, match="async_rollouts=True is invalid with a RolloutWorker that shares"):
            GRPOTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), digit_reward(tok), lambda s: ids(tok),
                        worker, GRPOConfig(async_rollouts=True))
    with pytest.raises(ValueError, match="in_flight"):
        GRPOConfig(async_rollouts=True, in_flight="soon")
    with pytest.raises(ValueError, match="max_staleness"):
        GRPOConfig(async_rollouts=True, max_staleness=0)


# ------------------------------------------------------------------------------------------ dynamic sampling
def gated_reward(tok):
    """digit_reward, but 0 for every row of a prompt whose first token is even: those groups have zero variance."""
    digits = digit_reward(tok)

    def reward(batch):
        values = digits(batch)
        gate = torch.tensor([float(p[0] % 2) for p in batch.prompt_ids])
        return values * gate

    return reward


def step_prompts(tok):
    words = "the a one two three four five six seven eight nine ten cat dog red blue".split()
    return lambda step: [tok.encode(f"{words[(step * 4 + i) % 16]} {words[(step * 7 + 3 * i) % 16]} is")
                         for i in range(4)]


def alternating_prompts(tok):
    """step_prompts' prompts reordered so the gate's parity alternates (odd first token, even, odd, ...): any 6 in a
    row hold 3 that the gate lets through, so a call wanting 4 groups at over_sample 1.5 (6 first drawn, in stream
    order) must judge a refused one before its 4th accepted, whatever order the groups finish in."""
    pool = list(dict.fromkeys(tuple(p) for step in range(4) for p in step_prompts(tok)(step)))
    odd, even = [p for p in pool if p[0] % 2], [p for p in pool if p[0] % 2 == 0]
    stream = [list(p) for pair in zip(odd, even) for p in pair]  # an even length: alternates across the wrap too
    return lambda step: [stream[(step * 4 + i) % len(stream)] for i in range(4)]


def spy_updates(trainer, monkeypatch) -> list:
    """Record the (batch, rewards) every update trains on."""
    seen = []
    update = trainer._update

    def recording(batch, rewards, ref):
        seen.append((batch, rewards.clone()))
        return update(batch, rewards, ref)

    monkeypatch.setattr(trainer, "_update", recording)
    return seen


def test_dynamic_sampling_trains_only_on_groups_whose_rewards_differ(tiny, monkeypatch):
    model, tok = tiny
    config = GRPOConfig(num_generations=4, max_new_tokens=8, dynamic_sampling=True, over_sample=1.5)
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:  # shared in place: nothing runs meanwhile
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=3e-3), gated_reward(tok),
                              alternating_prompts(tok), worker, config)
        seen = spy_updates(trainer, monkeypatch)
        history = trainer.train(3)
        trainer.close()
        state = worker.engine.in_flight()
        assert not state.requests and state.calls == 0  # partial=False: nothing left running
    for (batch, rewards), m in zip(seen, history):
        assert len(batch) == 16 and torch.equal(rewards, batch.rewards)
        assert (rewards.view(4, 4).std(dim=1) > 0).all()  # every group trained on has a signal
        assert all(p[0] % 2 == 1 for p in batch.prompt_ids)  # the gated (zero-variance) prompts never get in
        assert m["accepted_groups"] == 4 and m["rejected_groups"] >= 1
        assert m["zero_variance_frac"] == m["rejected_groups"] / (m["rejected_groups"] + 4)
        assert m["logprob_gap_max"] < GAP and math.isfinite(m["loss"])


def test_partial_rollouts_train_on_rows_spanning_versions_with_their_own_behaviour_logprobs(tiny_path,
                                                                                         monkeypatch):
    model, tok = load_tiny_model(tiny_path)
    snapshots = {}
    with RolloutWorker(tiny_path, WorkerConfig()) as worker:
        config = GRPOConfig(num_generations=4, max_new_tokens=40, stop_token_ids=tuple(range(10, 16)),
                            dynamic_sampling=True, partial_rollouts=True, over_sample=3.0, tis_cap=2.0)
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), gated_reward(tok),
                              step_prompts(tok), worker, config)
        snapshots[0] = copy.deepcopy(model).eval()
        seen = spy_updates(trainer, monkeypatch)
        history = []
        for step in range(4):
            history.append(trainer.step())
            snapshots[step + 1] = copy.deepcopy(model).eval()
        trainer.close()
        state = worker.engine.in_flight()
        assert not state.requests and state.calls == 0
    spanning = 0
    for step, (batch, _) in enumerate(seen):
        produced = batch.token_versions[batch.action_mask]
        assert step - int(produced.min()) <= 1 and int(produced.max()) <= step  # max_staleness 1
        for r, completion in enumerate(batch.completion_token_lists()):
            versions = batch.token_versions[r, : len(completion)]
            spanning += len(versions.unique()) > 1
            for v in versions.unique().tolist():  # the behaviour logprob of every token: exact under its version
                _, sampled = reference_logprobs(snapshots[v], batch.prompt_ids[r], completion, 1.0)
                at = versions == v
                assert torch.allclose(batch.sampling_logprobs[r, : len(completion)][at], sampled[at], atol=GAP)
    assert spanning > 0 and sum(m["carried_rows"] for m in history) > 0  # rows carried across a weight push
    assert max(m["staleness"] for m in history) == 1.0 and all(math.isfinite(m["loss"]) for m in history)


def test_dynamic_sampling_config_and_sharing_are_checked_before_anything_runs(tiny):
    for kwargs, match in [(dict(over_sample=0.5, dynamic_sampling=True), "over_sample"),
                          (dict(over_sample=2.0), "over_sample=2.0 is invalid: only applies"),
                          (dict(dynamic_sampling=True, async_rollouts=True), "async_rollouts"),
                          (dict(partial_rollouts=1), "partial_rollouts")]:
        with pytest.raises(ValueError, match=match):
            GRPOConfig(**kwargs)
    model, tok = tiny
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        with pytest.raises(ValueError, match="partial_rollouts=True is invalid with a RolloutWorker that shares"):
            GRPOTrainer(model, torch.optim.SGD(model.parameters(), lr=0.1), digit_reward(tok), lambda s: ids(tok),
                        worker, GRPOConfig(partial_rollouts=True))
        assert worker.engine.in_flight().calls == 0


# ------------------------------------------------------------------------------------------ the demo, shortened
@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("demo")  # shared: the demo builds its tiny model there once


def test_reward_verdict_compares_the_first_steps_mean_with_the_last_tenths(capsys):
    from trainers_integration.demo import reward_verdict

    rewards = [0.0, 0.3, 0.3] + [0.4] * 24 + [0.5] * 3  # 30 steps: the last tenth is the last 3
    assert reward_verdict(rewards, 0.45) == 0  # from the first step: 0.0 -> 0.5
    assert reward_verdict(rewards, 0.45, head=3) == 1  # from the first three steps' mean: 0.2 -> 0.5
    out, err = capsys.readouterr()
    assert "reward: 0.000 -> 0.500" in out and "reward: 0.200 -> 0.500" in out and "rose by 0.300 < 0.45" in err


def test_demo_learns_in_a_few_steps(demo_dir, tmp_path, capsys):
    from trainers_integration.demo import main

    plot = tmp_path / "reward.png"
    rc = main(["--steps", "12", "--lr", "1e-2", "--seed", "0", "--out", str(demo_dir), "--plot", str(plot),
               "--min-gain", "0.2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, "\n".join(out)
    steps = [line for line in out if line.startswith("step ")]
    assert len(steps) == 12 and all(k in steps[0] for k in ("reward", "kl", "gap", "tok/s"))
    first, last = (float(x) for x in out[-1].removeprefix("reward: ").split(" -> "))
    assert last - first >= 0.2
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    records = [json.loads(line) for line in (demo_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 12 and max(r["logprob_gap_max"] for r in records) < GAP
    # every step's metrics, the rollout worker's included, also went to a TensorBoard run through accelerate
    run = next(line for line in out if line.startswith("tensorboard: ")).split()[1]
    assert run.startswith(str(demo_dir / "tensorboard"))
    scalars = tensorboard_scalars(run)
    for key in ("reward_mean", "rollout/generated_tokens", "rollout/kv_pages_peak", "offpolicy/gap_current",
                "zero_variance_groups", "rollout/rows_finished/length"):
        assert scalars[key] == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records], key
    assert all(r["rollout/generated_tokens"] == sum(x["rollout_tokens"] for x in records[: i + 1])
               for i, r in enumerate(records))  # the worker's counter: every token the trainer got, cumulated


def test_the_multi_turn_demo_runs_episodes_and_plots_the_blind_ceiling(demo_dir, tmp_path, capsys):
    from trainers_integration.demo import main

    plot = tmp_path / "recall.png"
    rc = main(["--env", "recall", "--steps", "3", "--out", str(demo_dir), "--plot", str(plot), "--min-gain", "-1"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and "recall episodes" in out[0] and plot.read_bytes()[:4] == b"\x89PNG"
    records = [json.loads(line) for line in (demo_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_turns"] for r in records] == [2.0] * 3 and max(r["logprob_gap_max"] for r in records) < GAP


def test_the_rewrite_demo_trains_on_two_segments_per_episode(demo_dir, tmp_path, capsys):
    from trainers_integration.demo import main

    rc = main(["--env", "recall", "--rewrite", "--steps", "2", "--out", str(demo_dir), "--plot", "",
               "--min-gain", "-1"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and "re-rendered context" in out[0], "\n".join(out)
    records = [json.loads(line) for line in (demo_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["num_turns"] for r in records] == [2.0] * 2 and max(r["logprob_gap_max"] for r in records) < GAP
    assert all(r["episode_errors"] == 0.0 and r["segments"] == 2.0 for r in records)


def test_the_async_demo_learns_like_the_synchronous_one(demo_dir, tmp_path, capsys):
    from trainers_integration.demo import main

    rc = main(["--async", "--steps", "12", "--lr", "1e-2", "--seed", "0", "--out", str(demo_dir), "--plot", "",
               "--min-gain", "0.2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and "asynchronous rollouts" in out[0], "\n".join(out)
    records = [json.loads(line) for line in (demo_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness"] for r in records][1:] == [1.0] * 11 and records[-1]["dropped_batches"] == 0.0


def test_the_dynamic_demo_learns_and_plots_the_zero_variance_fraction(demo_dir, tmp_path, capsys):
    from trainers_integration.demo import main

    plot = tmp_path / "dynamic.png"
    rc = main(["--dynamic", "--steps", "12", "--lr", "1e-2", "--seed", "0", "--out", str(demo_dir), "--plot", str(plot),
               "--min-gain", "0.2"])
    out = capsys.readouterr().out.strip().splitlines()
    assert rc == 0 and "dynamic sampling with partial rollouts" in out[0], "\n".join(out)
    assert all("zero-var" in line for line in out if line.startswith("step "))
    records = [json.loads(line) for line in (demo_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["zero_variance_frac"] > 0.3  # a random policy earns 0 on most groups
    assert all(r["accepted_groups"] == 8 for r in records) and max(r["staleness"] for r in records) <= 1
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_demo_exits_nonzero_when_the_reward_does_not_rise(demo_dir, capsys):
    from trainers_integration.demo import main

    assert main(["--steps", "1", "--out", str(demo_dir), "--plot", ""]) == 1
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("reward: ")


def tensorboard_scalars(run_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of a TensorBoard run, read back with TensorBoard's own event reader: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _fingerprint(model):
    from rollout.model.weights import fingerprint

    return fingerprint(model)

