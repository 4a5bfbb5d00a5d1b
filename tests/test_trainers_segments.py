"""Trainers over episodes with several rows (segments: an environment restarted the episode from new context_ids):
the episode is the unit of reward, advantage and loss weight; PPO's rewards land where they were earned and GAE runs
across an episode's segments; TRL, which takes one row per generation, refuses such episodes."""

from __future__ import annotations

import math

import pytest
import torch

from rollout import EpisodeSpec, RolloutBatch, RolloutWorker, Turn, WorkerConfig
from rollout.base.batch import Row
from trainers_integration import losses
from trainers_integration.grpo import GRPOConfig, GRPOTrainer
from trainers_integration.ppo import PPOConfig, PPOTrainer
from trainers_integration.rollouts import episode_rewards
from trainers_integration.value import ValueHead

GAP = 1e-4


def t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


# ------------------------------------------------------------------------------------------ pure functions
def test_sequence_norm_weighs_an_episode_of_three_segments_as_one_row():
    gen = torch.Generator().manual_seed(0)
    per_token = torch.randn(4, 3, generator=gen)
    # episode 0 split in three rows (2 + 1 + 3 model tokens), episode 1 one row of 2 tokens
    split_mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True], [True, True, False]])
    split = losses.masked_sum(per_token * losses.row_weights(split_mask, "sequence", t([0, 0, 0, 1], torch.long))
                              [:, None], split_mask)
    episode0 = per_token[:3][split_mask[:3]]
    episode1 = per_token[3, :2]
    assert float(split) == pytest.approx(float((episode0.mean() + episode1.mean()) / 2), abs=1e-6)
    # as one row per episode, the old aggregate gives the same
    joined = torch.zeros(2, 6)
    joined[0], joined[1, :2] = episode0, episode1
    joined_mask = torch.tensor([[True] * 6, [True, True] + [False] * 4])
    assert float(split) == pytest.approx(float(losses.aggregate(joined, joined_mask, "sequence")), abs=1e-6)
    # without episodes each row is one; "token" is the plain token mean either way
    weights = losses.row_weights(split_mask, "sequence")
    assert float(losses.masked_sum(per_token * weights[:, None], split_mask)) == pytest.approx(
        float(losses.aggregate(per_token, split_mask, "sequence")), abs=1e-6)
    token = losses.row_weights(split_mask, "token", t([0, 0, 0, 1], torch.long))
    assert token.tolist() == [1 / 8] * 4


def test_gae_over_an_episodes_segments_is_gae_over_the_joined_episode():
    # episode 0: segment rows [a a - pad] and [a - a pad] (- an observation); episode 1: one row
    rewards = t([[0.0, 0.5, 7.0, 0.0], [0.0, 9.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    values = t([[0.1, 0.2, 9.0, 9.0], [0.3, 9.0, 0.4, 9.0], [0.5, 0.6, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False, False], [True, False, True, False], [True, True, False, False]])
    index = t([0, 0, 1], torch.long)
    adv, ret = losses.gae_over_episodes(rewards, values, mask, index, gamma=0.9, lam=0.8)
    dense_adv, dense_ret = losses.gae(t([[0.0, 0.5, 0.0, 1.0]]), t([[0.1, 0.2, 0.3, 0.4]]),
                                      torch.ones(1, 4, dtype=torch.bool), gamma=0.9, lam=0.8)
    torch.testing.assert_close(torch.cat([adv[0, :2], adv[1, [0, 2]]]), dense_adv[0])
    torch.testing.assert_close(torch.cat([ret[0, :2], ret[1, [0, 2]]]), dense_ret[0])
    # by hand: the first segment's last token bootstraps from the second segment's first value (0.3)
    delta1 = 0.5 + 0.9 * 0.3 - 0.2
    assert float(adv[0, 1]) == pytest.approx(delta1 + 0.9 * 0.8 * float(adv[1, 0]), abs=1e-6)
    alone, _ = losses.gae(rewards[2:], values[2:], mask[2:], 0.9, 0.8)
    torch.testing.assert_close(adv[2], alone[0])
    assert adv[~mask].abs().sum() == 0 and ret[~mask].abs().sum() == 0


def test_episode_rewards_are_one_per_episode_and_rows_must_agree():
    rows = [Row(0, 0, [1], [2], [0.0], [0.0], "done", 0, reward=1.5),
            Row(0, 0, [3], [4], [0.0], [0.0], "done", 0, reward=1.5, segment_index=1),
            Row(0, 1, [1], [5], [0.0], [0.0], "done", 0, reward=-1.0)]
    batch = RolloutBatch.from_rows(rows)
    assert episode_rewards(batch.rewards, batch).tolist() == [1.5, -1.0]
    with pytest.raises(ValueError, match="row 1.*episode 0, segment 1"):
        episode_rewards(t([1.5, 2.0, -1.0]), batch)


# ------------------------------------------------------------------------------------------ trainer steps
class Rewrite:
    """Two turns; after turn 1 the next turn restarts from a context that keeps only the prompt's last tokens and
    the turn's last token (a rewritten history); turn 1 earns 0.25, turn 2 the fraction of its digit tokens."""

    def __init__(self, prompt_index, sample_index):
        self.turns = 0

    def step(self, completion_ids):
        self.turns += 1
        if self.turns == 1:
            return Turn(context_ids=[40, 41, 42, completion_ids[-1], 43], reward=0.25)
        return Turn(reward=sum(22 <= t <= 31 for t in completion_ids) / len(completion_ids), done=True)


def ids(tok):
    return [tok.encode(p) for p in ["the cat is", "one plus two"]]


def test_grpo_over_segments_gives_every_row_its_episodes_advantage(tiny, monkeypatch):
    model, tok = tiny
    seen, batches = [], []
    real_loss = losses.clipped_policy_loss
    monkeypatch.setattr(losses, "clipped_policy_loss", lambda lp, old, adv, lo, hi: seen.append(adv.clone()) or
                        real_loss(lp, old, adv, lo, hi))
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        real_generate = worker.generate
        monkeypatch.setattr(worker, "generate", lambda *a, **k: batches.append(real_generate(*a, **k)) or batches[-1])
        trainer = GRPOTrainer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), None, lambda step: ids(tok),
                              worker, GRPOConfig(num_generations=4, max_new_tokens=5, loss_norm="sequence"),
                              episodes=EpisodeSpec(Rewrite, max_turns=2))
        history = trainer.train(1)
    batch, m = batches[0], history[0]
    assert len(batch) == 16 and batch.segment_index.tolist() == [0, 1] * 8
    assert m["logprob_gap_max"] < GAP and m["reward_mean"] == pytest.approx(float(batch.rewards[::2].mean()))
    episode = batch.rewards[::2].view(2, 4)
    want = ((episode - episode.mean(1, keepdim=True)) / (episode.std(1, keepdim=True) + 1e-4)).flatten()
    torch.testing.assert_close(seen[0].flatten(), want.repeat_interleave(2))  # both segments, one advantage


def test_ppo_over_segments_rewards_each_turn_where_it_was_earned(tiny, monkeypatch):
    model, tok = tiny
    seen, batches = [], []
    real_gae = losses.gae_over_episodes
    monkeypatch.setattr(losses, "gae_over_episodes", lambda r, v, m, i, g, lam: seen.append((r.clone(), i.clone()))
                        or real_gae(r, v, m, i, g, lam))
    value = ValueHead.for_model(model)
    optimizer = torch.optim.AdamW([*model.parameters(), *value.parameters()], lr=3e-3)
    with RolloutWorker(model, WorkerConfig(), tokenizer=tok) as worker:
        real_generate = worker.generate
        monkeypatch.setattr(worker, "generate", lambda *a, **k: batches.append(real_generate(*a, **k)) or batches[-1])
        trainer = PPOTrainer(model, value, optimizer, None, lambda step: ids(tok), worker,
                             PPOConfig(num_generations=2, max_new_tokens=5, num_epochs=2, kl_coef=0.0),
                             episodes=EpisodeSpec(Rewrite, max_turns=2))
        history = trainer.train(1)
    batch, (rewards, index) = batches[0], seen[0]
    assert math.isfinite(history[0]["loss"]) and history[0]["logprob_gap_max"] < GAP
    assert torch.equal(index, batch.episode_index) and batch.segment_index.tolist() == [0, 1] * 4
    assert torch.equal(rewards, batch.turn_rewards)  # kl_coef 0: exactly the turns' rewards, where earned
    last = batch.completion_lengths - 1
    assert rewards[0::2, :].sum(1).tolist() == [0.25] * 4
    torch.testing.assert_close(rewards[torch.arange(len(batch)), last][1::2], batch.rewards[1::2] - 0.25)
