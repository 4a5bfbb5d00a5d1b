"""The rollout side as a trainer sees it: generate, push weights, score with a reference model.

`rollouts` is a `rollout.Rollouts`: a `RolloutWorker` (sharing the policy in place, or holding its own copy) or a
`RolloutFleet`. A worker whose `.model` *is* the policy shares its parameters: after `optimizer.step()`
it only needs `refresh()` (a fence, prefix-cache invalidation and a version bump; no copy). Anything else receives
the policy's state dict; for a PEFT policy, only its adapter (`get_peft_model_state_dict`: the rollout side holds
the same PeftModel). The policy may be wrapped (DDP's `.module`); a rollouts object with its own
`push_policy(model, version)` (trainers_integration.distributed) moves the weights itself.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

# PromptsExhausted: an iterable prompt source (or a collector's stream) ran out: `train` stops
from rollout import EpisodeSpec, PromptsExhausted, RolloutBatch, Rollouts, adapters
from rollout import pad_token_id as tokenizer_pad_id


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The model under DDP-style wrappers (`.module`, as accelerate's `unwrap_model` strips them)."""
    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return model


def shares_model(rollouts: Rollouts, model: torch.nn.Module) -> bool:
    """True when `rollouts` generates with `model`'s own parameters (an in-place RolloutWorker): the worker holds the
    policy itself, under any wrapper, or the base model a PEFT policy wraps (adapters injected in place)."""
    held = getattr(rollouts, "model", None)
    if held is None:
        return False
    model = unwrapped(model)
    return held is model or (adapters.is_peft_model(model) and held is model.get_base_model())


def policy_weights(model: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None = None
                   ) -> dict[str, torch.Tensor]:
    """What the rollout side needs after a step: the state dict, or only the adapter of a PEFT policy (its base is
    frozen). `state_dict`: the policy's full state dict when it was gathered elsewhere (FSDP)."""
    model = unwrapped(model)
    if adapters.is_peft_model(model):
        return adapters.adapter_state_dict(model, state_dict)
    state = state_dict if state_dict is not None else model.state_dict()
    return {name: tensor.detach() for name, tensor in state.items()}


def push_weights(rollouts: Rollouts, model: torch.nn.Module, version: int, in_flight: str | None = None) -> float:
    """Bring the rollout side to the policy's current weights, tagged `version`; returns the seconds it took.
    `in_flight`: what happens to calls in flight (None: the rollout side's default)."""
    start = time.perf_counter()
    extra = {} if in_flight is None else {"in_flight": in_flight}
    if hasattr(rollouts, "push_policy"):
        rollouts.push_policy(model, version, **extra)
    elif shares_model(rollouts, model):
        rollouts.refresh(version, **extra)
    else:
        rollouts.update_weights(policy_weights(model), version=version, **extra)
    return time.perf_counter() - start


def timed_generate(rollouts: Rollouts, prompts, sampling, chat_template: bool = False,
                   episodes: EpisodeSpec | None = None) -> tuple[RolloutBatch, float]:
    start = time.perf_counter()
    batch = rollouts.generate(prompts, sampling=sampling, chat_template=chat_template,
                              **(episodes.kwargs() if episodes else {}))
    return batch, time.perf_counter() - start


def reference_logprobs(ref_model: torch.nn.Module, batch: RolloutBatch, temperature: float,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """(R, T) logprobs of the batch's completions under `ref_model`, through the re-scoring path
    (`rollout.score`), padded like `batch.logprobs`."""
    from rollout import score

    with torch.no_grad():
        scored = score(ref_model, batch.prompt_ids, batch.completion_token_lists(), temperature=temperature)
    out = torch.zeros_like(batch.logprobs)
    for i, row in enumerate(scored):
        out[i, : len(row)] = row.detach().float().cpu()
    return out.to(device) if device is not None else out


def episode_starts(episode_index: torch.Tensor) -> torch.Tensor:
    """(R,) bool: True on each episode's first row (an episode's rows are consecutive)."""
    first = torch.ones(len(episode_index), dtype=torch.bool)
    first[1:] = episode_index[1:] != episode_index[:-1]
    return first


def episode_rewards(rewards: torch.Tensor, batch: RolloutBatch) -> torch.Tensor:
    """(E,) one reward per episode from one per row: an episode with several rows (segments) must have the same
    reward on each (`batch.rewards` does)."""
    index = batch.episode_index
    if len(index) == 0 or int(index.max()) + 1 == len(index):
        return rewards
    per_episode = rewards[episode_starts(index)]
    if not torch.equal(per_episode[index], rewards):
        row = int(torch.nonzero(per_episode[index] != rewards)[0])
        raise ValueError(f"reward_fn gave row {row} a reward that differs from the other rows of its episode "
                         f"(episode {int(index[row])}, segment {int(batch.segment_index[row])}). Fix: return the "
                         "episode's reward on each of its rows (batch.episode_index says which rows form one).")
    return per_episode


def behaviour_logprobs(batch: RolloutBatch) -> torch.Tensor:
    """The behaviour policy's per-token logprobs for GRPO's and PPO's clipped ratio (and PPO's KL-shaped rewards):
    `batch.logprobs`, the full-vocabulary log_softmax(logits / T) that the trainer's own forward recomputes. Both
    trainers sample untruncated (their configs have no top_k / top_p), so this is also the distribution actually
    sampled: `batch.sampling_logprobs` holds the same numbers, bit for bit (tests/test_trainers.py checks it). With
    top-k / top-p rows (the TRL adapter passes TRL's), the two differ and `sampling_logprobs` is the one sampled."""
    return batch.logprobs


def logprob_gap(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                mask: torch.Tensor) -> tuple[float, float]:
    """(max, mean) |trainer logprob - rollout logprob| over real tokens: ~0 when the rollout side holds exactly the
    weights being trained; it is the health metric that a silent weight-sync failure breaks."""
    gap = (trainer_logprobs.detach().float() - rollout_logprobs.to(trainer_logprobs.device).float()).abs()[mask]
    if gap.numel() == 0:
        return 0.0, 0.0
    return float(gap.max()), float(gap.mean())


def flat_prompts(prompts: Callable[[int], Any]) -> tuple[int, Iterator[Any]]:
    """(the size of a step's prompt list, every prompt of step 0, 1, 2, ... one after another), for a collector:
    step 0's list is read now, the rest lazily, until the source raises PromptsExhausted."""
    first = list(prompts(0))
    if not first:
        raise ValueError("the prompt list of step 0 is empty. Fix: give each step at least one prompt.")

    def stream() -> Iterator[Any]:
        yield from first
        for step in itertools.count(1):
            try:
                batch = prompts(step)
            except PromptsExhausted:
                return
            yield from batch

    return len(first), stream()


def prompt_stream(prompts: Callable[[int], Any] | Iterable[Any]) -> Callable[[int], Any]:
    """A prompt source as `step -> prompts`: a callable is used as is; an iterable yields one prompt list per step."""
    if callable(prompts):
        return prompts
    iterator = iter(prompts)

    def next_prompts(step: int) -> Any:
        try:
            return next(iterator)
        except StopIteration:
            raise PromptsExhausted(f"the prompt iterable ran out at step {step}") from None

    return next_prompts


def pad_token_id(rollouts: Rollouts) -> int:
    """The rollout side's pad id (0 when it has no tokenizer): fills padding of packed rows, never read."""
    return tokenizer_pad_id(rollouts.tokenizer)
