"""TRL adapter: this engine as the generation backend of TRL's `GRPOTrainer` (pinned: trl==1.16.0).

    worker = RolloutWorker(policy, WorkerConfig(), tokenizer)        # shares the policy in place
    trainer = RolloutGRPOTrainer(model=policy, rollouts=worker, reward_funcs=..., args=GRPOConfig(...),
                                 train_dataset=..., processing_class=tokenizer)
    trainer.train()

How TRL 1.16 calls a `rollout_func` (read in `GRPOTrainer._generate`): `rollout_func(prompts, trainer)` gets this
process's slice of the generation batch, each prompt already repeated `num_generations` times consecutively (the
`RepeatSampler`), as raw text or chat messages (templating is the backend's job). It must return, one entry per
input prompt and in the same order, `prompt_ids`, `completion_ids` and `logprobs` (lists). Extra keys go to the
reward functions. The returned logprobs only feed TRL's importance-sampling correction, which TRL applies only when
`use_vllm` is on; `RolloutGRPOTrainer` turns it on for the rollout's logprobs without starting vLLM.

`make_rollout_func` regroups consecutive repeats into one request with n samples (they share the prompt's prefill),
samples with the trainer's temperature / top-k / top-p / max_completion_length and EOS ids, and pushes the policy's
weights to the rollout side once per optimizer step before generating (`refresh()` for a worker sharing the policy,
`update_weights(state_dict)` for a fleet or a worker with its own copy). It returns `sampling_logprobs`: logprobs
under the distribution actually sampled from, what TRL's correction expects ("processed logprobs").

Train in the rollout's precision: with `bf16=True` (TRL's default) on an fp32 policy, TRL's forward runs under bf16
autocast and its logprobs differ from the rollout's by ~1e-2; the metric `sampling/sampling_logp_difference/max`
shows the gap.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from rollout import EpisodeSpec, Rollouts, SamplingParams

from .rollouts import push_weights

TRL_VERSION = "1.16.0"


def _require_trl():
    try:
        import trl
    except ImportError as exc:
        raise ImportError(f"trainers_integration.trl needs TRL. Fix: pip install 'rollout[trl]' "
                          f"(trl=={TRL_VERSION}).") from exc
    if trl.__version__ != TRL_VERSION:
        warnings.warn(f"trl {trl.__version__} is installed; this adapter is pinned to and tested with trl=="
                      f"{TRL_VERSION} (its rollout_func API is experimental). Fix: pip install trl=={TRL_VERSION}.",
                      stacklevel=3)
    return trl


def group_repeats(prompts: list[Any]) -> tuple[list[Any], list[int]]:
    """Consecutive equal prompts -> (the distinct prompts, how many times each was repeated)."""
    unique, counts = [], []
    for prompt in prompts:
        if unique and prompt == unique[-1]:
            counts[-1] += 1
        else:
            unique.append(prompt)
            counts.append(1)
    return unique, counts


def trainer_sampling(trainer: Any, n: int) -> SamplingParams:
    """The trainer's generation settings as SamplingParams (unsupported ones, e.g. repetition_penalty, raise)."""
    eos = getattr(trainer, "eos_token_ids", None)
    return SamplingParams(n=n, temperature=float(trainer.temperature), top_k=int(trainer.top_k or 0),
                          top_p=float(trainer.top_p if trainer.top_p is not None else 1.0),
                          max_new_tokens=int(trainer.max_completion_length),
                          min_p=float(trainer.min_p or 0.0),
                          repetition_penalty=float(getattr(trainer, "repetition_penalty", 1.0) or 1.0),
                          stop_token_ids=tuple(int(t) for t in eos) if eos else None)


def make_rollout_func(rollouts: Rollouts, model: Any = None, episodes: EpisodeSpec | None = None):
    """A TRL `rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}` over `rollouts` (a
    RolloutWorker or RolloutFleet). `model`: the policy whose weights to push; None means the trainer's model.

    With `episodes` every sample is a multi-turn episode run inside the engine: the completion holds the model's
    turns and the environment's observations, and the function also returns `env_mask` (1 on the model's tokens,
    0 on observations: TRL 1.16 masks the loss with it), `env_reward` (each episode's summed turn rewards, for a
    reward function `lambda env_reward, **kw: env_reward`) and `num_turns`. An episode restarted from new
    `context_ids` (a history-rewriting chat template) has several rows, which TRL cannot take: a ValueError naming
    this project's GRPOTrainer (`refuse_segments`)."""
    _require_trl()
    last_pushed: dict[str, int | None] = {"step": None}

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, list]:
        policy = model if model is not None else trainer.accelerator.unwrap_model(trainer.model)
        step = int(trainer.state.global_step)
        if last_pushed["step"] != step:  # once per optimizer step: the policy changed since the last generation
            push_weights(rollouts, policy, version=step)
            last_pushed["step"] = step
        unique, counts = group_repeats(list(prompts))
        chat = bool(unique) and isinstance(unique[0], (list, tuple)) and bool(unique[0]) \
            and isinstance(unique[0][0], dict)
        batch = rollouts.generate(unique, sampling=[trainer_sampling(trainer, n) for n in counts], chat_template=chat,
                                  **(episodes.kwargs() if episodes else {}))
        refuse_segments(batch)
        lengths = batch.completion_lengths.tolist()
        out = {"prompt_ids": [list(p) for p in batch.prompt_ids],
               "completion_ids": batch.completion_token_lists(),
               "logprobs": [batch.sampling_logprobs[i, :n].tolist() for i, n in enumerate(lengths)]}
        if episodes is not None:
            out["env_mask"] = [batch.action_mask[i, :n].int().tolist() for i, n in enumerate(lengths)]
            out["env_reward"] = batch.rewards.tolist()
            out["num_turns"] = batch.num_turns.tolist()
        return out

    return rollout_func


def refuse_segments(batch: Any) -> None:
    """TRL 1.16 takes exactly one (prompt_ids, completion_ids) row per generation; an episode that its environment
    restarted from new context_ids (a chat template that rewrites history) has one row per segment, which TRL cannot
    take: say so, and what to use instead."""
    segments = batch.segment_index
    if len(segments) and int(segments.max()) > 0:
        row = int(torch.nonzero(segments > 0)[0])
        raise ValueError(
            f"episode {int(batch.episode_index[row])} (prompt {int(batch.prompt_index[row])}, sample "
            f"{int(batch.sample_index[row])}) was restarted from new context_ids by its environment (its chat "
            "template rewrote the history), so it has several rows (segments), and TRL's rollout_func takes exactly "
            "one row per generation. Fix: train with this project's trainers_integration.GRPOTrainer (or "
            "PPOTrainer), which train on every segment, or use a prefix-preserving chat template (e.g. TRL's "
            "get_training_chat_template) so that each episode stays one row.")


def _trainer_class():
    trl = _require_trl()

    class RolloutGRPOTrainer(trl.GRPOTrainer):
        """TRL's GRPOTrainer generating through `rollouts`, with TRL's importance-sampling correction
        (`vllm_importance_sampling_*` settings, on by default) computed against the rollout's logprobs. With
        `episodes=EpisodeSpec(make_env, max_turns=...)` it trains on multi-turn episodes (see make_rollout_func).

        TRL gates that correction, its metrics `sampling/sampling_logp_difference/{mean,max}` and
        `sampling/importance_sampling_ratio/*`, on `self.use_vllm`. Here `use_vllm` reads True everywhere except
        inside `_generate` (so TRL never looks for a vLLM engine) and during `__init__` (so none is built).
        tests/test_trl.py checks that TRL 1.16 still gates the correction this way.
        """

        def __init__(self, *args: Any, rollouts: Rollouts, episodes: EpisodeSpec | None = None,
                     **kwargs: Any) -> None:
            if kwargs.get("rollout_func") is not None:
                raise ValueError("rollout_func is invalid here: RolloutGRPOTrainer builds it from rollouts. Fix: pass "
                                 "only rollouts=..., or use trl.GRPOTrainer(rollout_func=make_rollout_func(...)).")
            self._rollout_logprob_phase = False
            super().__init__(*args, rollout_func=make_rollout_func(rollouts, episodes=episodes), **kwargs)
            self.rollouts = rollouts
            self._rollout_logprob_phase = bool(self.vllm_importance_sampling_correction)

        @property
        def use_vllm(self) -> bool:
            return self.__dict__.get("_rollout_logprob_phase", False)

        @use_vllm.setter
        def use_vllm(self, value: bool) -> None:
            if value:
                raise ValueError("use_vllm=True is invalid for RolloutGRPOTrainer: it generates through rollouts. "
                                 "Fix: leave use_vllm=False in the GRPOConfig.")

        def _generate(self, prompts: list):
            phase, self._rollout_logprob_phase = self._rollout_logprob_phase, False
            try:
                return super()._generate(prompts)
            finally:
                self._rollout_logprob_phase = phase

    return RolloutGRPOTrainer


def __getattr__(name: str):
    if name == "RolloutGRPOTrainer":  # built on first use, so importing this module does not import TRL
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
