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
`use_vllm` is on. `RolloutGRPOTrainer` goes further: the rollout's full-vocabulary logprobs serve as TRL's old
logprobs while they are the trainer's, so TRL skips its recompute forward; the forward and the correction (on for
the rollout's logprobs, without starting vLLM) run only where they can matter (trl_logprobs.py says when).

`make_rollout_func` regroups consecutive repeats into one request with n samples (they share the prompt's prefill),
samples with the trainer's temperature / top-k / top-p / max_completion_length and EOS ids, and pushes the policy's
weights to the rollout side once per optimizer step before generating (`refresh()` for a worker sharing the policy,
`update_weights(state_dict)` for a fleet or a worker with its own copy). It returns `sampling_logprobs`: logprobs
under the distribution actually sampled from, what TRL's correction expects ("processed logprobs").

Train in the rollout's precision: with `bf16=True` (TRL's default) on an fp32 policy, TRL's forward runs under bf16
autocast and its logprobs differ from the rollout's by ~1e-2; the metric `rollout/logprob_gap/max` shows the gap
(and keeps TRL's forward and correction on).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from rollout import EpisodeSpec, RolloutBatch, Rollouts, SamplingParams

from .rollouts import push_weights
from .trl_logprobs import OldLogprobs, OldLogprobsPolicy, RolloutRecord

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
    """The trainer's generation settings as SamplingParams (min_p and repetition_penalty included; a value
    SamplingParams refuses raises, naming it)."""
    eos = getattr(trainer, "eos_token_ids", None)
    return SamplingParams(n=n, temperature=float(trainer.temperature), top_k=int(trainer.top_k or 0),
                          top_p=float(trainer.top_p if trainer.top_p is not None else 1.0),
                          max_new_tokens=int(trainer.max_completion_length),
                          min_p=float(trainer.min_p or 0.0),
                          repetition_penalty=float(getattr(trainer, "repetition_penalty", 1.0) or 1.0),
                          stop_token_ids=tuple(int(t) for t in eos) if eos else None)


def make_rollout_func(rollouts: Rollouts, model: Any = None, episodes: EpisodeSpec | None = None,
                      on_batch: Callable[[RolloutBatch, int], None] | None = None):
    """A TRL `rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}` over `rollouts` (a
    RolloutWorker or RolloutFleet). `model`: the policy whose weights to push; None means the trainer's model.
    `on_batch(batch, version)`: called with each RolloutBatch and the version pushed before it (RolloutGRPOTrainer
    keeps the full-vocabulary logprobs from it).

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
        if on_batch is not None:
            on_batch(batch, step)
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
        """TRL's GRPOTrainer generating through `rollouts`. With `episodes=EpisodeSpec(make_env, max_turns=...)` it
        trains on multi-turn episodes (see make_rollout_func).

        Old logprobs (`old_logprobs=OldLogprobs(...)`, trainers_integration/trl_logprobs.py): while the rollout's
        logprobs are the trainer's (rows of the version the trainer holds, last measured gap <= tolerance), they
        serve as TRL's old logprobs and TRL runs neither its recompute forward nor its importance-sampling
        correction: on-policy and aligned, TRL's loss takes `per_token_logps.detach()` as it does without vLLM;
        misaligned (`gradient_accumulation_steps` not a multiple of `steps_per_generation * num_iterations`), TRL's
        recompute call returns the rollout's logprobs (the generating weights' own) instead of running. Otherwise
        (stale rows, a check step, a failed check, TRL's tool loop, `OldLogprobs(source="trainer")`) TRL runs its
        forward and, with `vllm_importance_sampling_*` on (the default), its correction against the rollout's
        sampling logprobs.
        Metrics: `rollout/old_logprobs_from_rollout` (1 per batch served, 0 per forward), `rollout/logprob_gap/
        {max,mean}` (trainer forward vs rollout logprobs, on current rows), and TRL's `sampling/*` when corrected.

        TRL gates that forward and correction on `self.use_vllm`: here it reads False inside `_generate` (so TRL
        never looks for a vLLM engine) and during `__init__` (so none is built), then what the batch needs while
        TRL scores it, and in `_compute_loss` whether the batch carries TRL's ratio. tests/test_trl.py checks that
        TRL 1.16 still gates them this way.
        """

        def __init__(self, *args: Any, rollouts: Rollouts, episodes: EpisodeSpec | None = None,
                     old_logprobs: OldLogprobs | None = None, **kwargs: Any) -> None:
            if kwargs.get("rollout_func") is not None:
                raise ValueError("rollout_func is invalid here: RolloutGRPOTrainer builds it from rollouts. Fix: pass "
                                 "only rollouts=..., or use trl.GRPOTrainer(rollout_func=make_rollout_func(...)).")
            if old_logprobs is not None and not isinstance(old_logprobs, OldLogprobs):
                raise TypeError(f"old_logprobs={old_logprobs!r} is invalid: must be an OldLogprobs. Fix: pass "
                                "trainers_integration.trl.OldLogprobs(source=..., check_every=..., tolerance=...).")
            self._vllm_phase = False  # what use_vllm reads now
            self._policy = OldLogprobsPolicy(old_logprobs or OldLogprobs())
            self._record: RolloutRecord | None = None  # the batch being scored
            self._supply: RolloutRecord | None = None  # armed: TRL's next recompute call returns its logprobs
            self._forward = False  # TRL's forward runs for the batch being scored
            super().__init__(*args, rollout_func=make_rollout_func(rollouts, episodes=episodes, on_batch=self._keep),
                             **kwargs)
            self.rollouts = rollouts

        @property
        def old_logprobs(self) -> OldLogprobs:
            return self._policy.config

        @property
        def use_vllm(self) -> bool:
            return self.__dict__.get("_vllm_phase", False)

        @use_vllm.setter
        def use_vllm(self, value: bool) -> None:
            if value:
                raise ValueError("use_vllm=True is invalid for RolloutGRPOTrainer: it generates through rollouts. "
                                 "Fix: leave use_vllm=False in the GRPOConfig.")

        def _keep(self, batch: RolloutBatch, version: int) -> None:
            self._record = RolloutRecord.of(batch, version)

        def _generate(self, prompts: list):
            self._vllm_phase, self._record, self._supply = False, None, None
            result = super()._generate(prompts)
            self._decide()
            return result

        def _decide(self) -> None:
            """After generation, before TRL scores the batch: does TRL's forward run (use_vllm reads True: TRL's
            recompute and correction), or do the rollout's logprobs serve (armed for TRL's recompute call when
            TRL makes one: misaligned generation and optimizer steps)?"""
            record = self._record
            reason = self._policy.reason(int(self.state.global_step), record is not None and record.current,
                                         tools=bool(getattr(self, "tools", None)))
            self._forward = self._gathered(torch.tensor([float(reason is not None)])).max().item() > 0
            self._vllm_phase = self._forward
            generate_every = self.args.steps_per_generation * self.num_iterations
            if not self._forward and self.args.gradient_accumulation_steps % generate_every != 0:
                self._supply = record

        def _gathered(self, values: torch.Tensor) -> torch.Tensor:
            return self.accelerator.gather(values.to(self.accelerator.device)).view(-1, values.numel())

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                               **kwargs):
            supply, self._supply = self._supply, None
            if supply is not None and model is self.model and not torch.is_grad_enabled() \
                    and not kwargs.get("compute_entropy", False):
                if supply.matches(input_ids[:, -logits_to_keep:]):
                    return supply.padded(logits_to_keep, input_ids.device), None, None
                warnings.warn("TRL's old-logprob forward got completions that are not the rollout's: it runs. "
                              "(This adapter is tested with trl==1.16.0.)", stacklevel=2)
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)

        def _generate_and_score_completions(self, inputs):
            try:
                output = super()._generate_and_score_completions(inputs)
            finally:
                self._supply = None
            self._measure(output)
            return output

        def _measure(self, output: dict) -> None:
            """Log where this batch's old logprobs came from and, when TRL's forward ran on current rows, the gap
            between it and the rollout's logprobs (which decides whether later batches may skip it)."""
            metrics = self._metrics["train" if self.model.training else "eval"]
            metrics["rollout/old_logprobs_from_rollout"].append(0.0 if self._forward else 1.0)
            record, trainer_lp = self._record, output.get("old_per_token_logps")
            if not self._forward or trainer_lp is None or record is None:
                return
            mask = output["completion_mask"].bool()
            if "tool_mask" in output:
                mask = mask & output["tool_mask"].bool()
            gap = (trainer_lp.float() - record.padded(trainer_lp.size(1), trainer_lp.device)).abs()[mask]
            local = torch.tensor([float(gap.max()) if gap.numel() else 0.0, float(gap.sum()), float(gap.numel()),
                                  float(not record.current)])
            stats = self._gathered(local)
            if stats[:, 3].max() > 0:  # stale rows somewhere: the gap is the update's, not the numerics'
                return
            gap_max, gap_mean = float(stats[:, 0].max()), float(stats[:, 1].sum() / stats[:, 2].sum().clamp(min=1))
            metrics["rollout/logprob_gap/max"].append(gap_max)
            metrics["rollout/logprob_gap/mean"].append(gap_mean)
            if self._policy.measured(int(self.state.global_step), gap_max):
                warnings.warn(
                    f"the rollout's logprobs differ from the trainer's forward by up to {gap_max:.1e} (tolerance "
                    f"{self.old_logprobs.tolerance:.0e}): TRL's recompute forward and importance-sampling correction "
                    "run on every batch until a check passes. Fix: train in the rollout's precision and device "
                    "(GRPOConfig(bf16=False), an fp32 policy shared with RolloutWorker(policy)), or pass "
                    "old_logprobs=OldLogprobs(source='trainer') to always correct.", stacklevel=2)

        def _compute_loss(self, model, inputs):
            phase, self._vllm_phase = self._vllm_phase, "importance_sampling_ratio" in inputs
            try:
                return super()._compute_loss(model, inputs)
            finally:
                self._vllm_phase = phase

    return RolloutGRPOTrainer


def __getattr__(name: str):
    if name == "RolloutGRPOTrainer":  # built on first use, so importing this module does not import TRL
        cls = _trainer_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
