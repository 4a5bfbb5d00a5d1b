"""This engine behind TRL's experimental `AsyncGRPOTrainer` (pinned: trl==1.16.0): its two protocols, in-process.

    worker = RolloutWorker("checkpoint/", WorkerConfig())        # its own copy: the trainer loads the checkpoint too
    source = AsyncRollouts(worker, args, train_dataset, reward_funcs, tokenizer)
    trainer = AsyncGRPOTrainer("checkpoint/", reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                               processing_class=tokenizer, rollout_worker=source,
                               weight_transfer=AsyncWeightSync(source))
    trainer.train()

What TRL 1.16 does with them (read in `async_grpo_trainer.py`): on train begin `init_weight_transfer()`, a first sync,
then `start()`; every `weight_sync_steps` optimizer steps `pause()`, `send_weights(iterator of (name, tensor))`,
`resume()`, its `model_version += 1`, then `update_model_version(model_version)`; at the end `stop()` and `destroy()`.
It drains `rollout_buffer` for `RolloutSample`s, drops a sample when `model_version - sample.model_version >
max_staleness`, calls `check_health(heartbeat_stale_after_s)` whenever the buffer stays empty for 5 s, and drains
`metrics_queue` in `log()`. Its loss is PPO-clip on `exp(log_softmax(logits / T)[token] - old_log_probs)`.

What `AsyncRollouts` pushes, one sample per generation, each group of `num_generations` from one dataset row (cycled,
as TRL's own worker does): the chat-templated prompt ids (`apply_chat_template(..., add_generation_prompt=True,
**chat_template_kwargs)`) and the completion ids, `old_log_probs` the engine's `sampling_logprobs` (the distribution
sampled from: what TRL's vLLM server returns under `--logprobs-mode processed_logprobs`; with top_k=0, top_p=1, no
min_p and no repetition penalty it is log_softmax(logits / T) of the generating weights, so an on-policy ratio is 1),
`model_version` the oldest weights version that produced any of its tokens, and TRL's rewards and advantages
(`score_group`). Weights go into the rollout side with `update_weights(..., version=TRL's next model_version,
in_flight=...)`, so the engine's versions are TRL's: `batch.token_versions` and `sample.model_version` speak the same
numbers as the trainer's staleness check.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from rollout import RolloutBatch, Rollouts, RolloutsFuture, SamplingParams
from rollout.base import check_in_flight, invalid

from .trl import _require_trl

METRICS_QUEUE_SIZE = 4096  # TRL's own worker's bound: a trainer that stops draining never blocks generation
POLL_S = 0.1  # how long the producer waits on a queue before it looks at its stop flag again
STOP_TIMEOUT_S = 30.0


def trl_sampling(args: Any, stop_ids: Sequence[int]) -> SamplingParams:
    """An AsyncGRPOConfig's generation settings (what TRL's worker sends vLLM) as one group's SamplingParams."""
    return SamplingParams(n=int(args.num_generations), temperature=float(args.temperature), top_k=int(args.top_k or 0),
                          top_p=float(args.top_p), min_p=float(args.min_p or 0.0),
                          repetition_penalty=float(args.repetition_penalty),
                          max_new_tokens=int(args.max_completion_length), stop_token_ids=tuple(stop_ids))


def parses_responses(tokenizer: Any) -> bool:
    """The tokenizer can parse a completion into an assistant message (a response template, or TRL's legacy schema)."""
    return getattr(tokenizer, "response_template", None) is not None or \
        getattr(tokenizer, "response_schema", None) is not None


def score_group(reward_funcs: Sequence[Callable], prompts: list, completions: list, completion_ids: list[list[int]],
                reward_kwargs: dict[str, list]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TRL 1.16's `_AsyncRolloutLoop._score_group` arithmetic: every reward function on the group (async ones
    awaited), None -> NaN, summed with weight 1 ignoring NaN; a sample every function left None stays NaN and gets
    advantage 0; the others get (reward - mean) / (std + 1e-8) over the scored ones. Returns (rewards, advantages,
    per-function rewards (F, G)). tests/test_trl_async.py checks it against TRL's own on the same group."""
    kwargs = dict(completions=completions, prompts=prompts, completion_ids=completion_ids, **reward_kwargs)
    columns = []
    for func in reward_funcs:
        out = func(**kwargs)
        columns.append(asyncio.run(out) if inspect.isawaitable(out) else out)
    per_func = np.array([[math.nan if r is None else r for r in col] for col in columns], dtype=float)
    rewards = np.nansum(per_func, axis=0)
    rewards[np.all(np.isnan(per_func), axis=0)] = np.nan
    scored = ~np.isnan(rewards)
    advantages = np.zeros_like(rewards)
    if scored.any():
        advantages[scored] = (rewards[scored] - rewards[scored].mean()) / (rewards[scored].std() + 1e-8)
    return rewards, advantages, per_func


class AsyncRollouts:
    """TRL's `RolloutWorkerProtocol` over any `rollout.Rollouts` (a RolloutWorker holding its own weights, or a
    RolloutFleet): one producer thread keeps `max_inflight_tasks` generations in flight (whole groups, each one
    `submit` of `num_generations` samples), scores each group as it finishes and pushes its samples.

    rollouts: the rollout side; it must hold its own weights (the trainer loads its own model from the checkpoint).
    args: the trainer's AsyncGRPOConfig, read at `start()` (after the trainer derived `max_inflight_tasks`); a
        `token_budget` left None is set here to the longest request the rollout side holds (TRL would ask vLLM).
    train_dataset: the trainer's dataset, conversational prompts (`prompt` = a list of messages; TRL's async worker
        takes no plain-text prompts); its other columns go to the reward functions, as in TRL.
    reward_funcs: the trainer's reward functions (called as TRL calls them: completions, prompts, completion_ids and
        the dataset's other columns, each repeated per generation).
    tokenizer: the trainer's processing class (templates prompts, parses completions into assistant messages).
    in_flight: what a weight update does to generations in flight ("recompute" by default: docs/trainers.md).

    Not supported: TRL's `tools` and `environment_factory` (multi-turn): they go to TRL's own worker only.
    """

    def __init__(self, rollouts: Rollouts, args: Any, train_dataset: Any, reward_funcs: Callable | Sequence[Callable],
                 tokenizer: Any, in_flight: str = "recompute") -> None:
        _require_trl()
        from trl.chat_template_utils import add_response_schema
        from trl.trainer.utils import get_callable_name

        check_in_flight(in_flight)
        funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        if not funcs or not all(callable(f) for f in funcs):
            raise invalid("reward_funcs", reward_funcs, "must be one callable or a non-empty list of callables",
                          "pass the reward functions given to AsyncGRPOTrainer")
        if len(train_dataset) == 0 or "prompt" not in train_dataset.column_names:
            raise invalid("train_dataset", train_dataset, "must hold rows with a 'prompt' column",
                          "pass the trainer's dataset of conversational prompts")
        if getattr(args, "token_budget", None) is None:
            args.token_budget = min(rollouts.max_request_tokens, rollouts.max_context or rollouts.max_request_tokens)
        if not parses_responses(tokenizer):
            with contextlib.suppress(ValueError):  # as TRL's worker does for known templates; TRL raises on others,
                tokenizer = add_response_schema(tokenizer)  # here their completions are decoded text (parse_response)
        self.rollouts, self.args, self.dataset, self.tokenizer = rollouts, args, train_dataset, tokenizer
        self.reward_funcs, self.reward_names = funcs, [get_callable_name(f) for f in funcs]
        self.in_flight = in_flight
        self.rollout_buffer: queue.Queue = queue.Queue(maxsize=max(int(args.queue_maxsize), 0))
        self.metrics_queue: queue.Queue = queue.Queue(maxsize=METRICS_QUEUE_SIZE)
        self.model_version = 0  # TRL's live version, as update_model_version last said
        self._stop = threading.Event()
        self._held = threading.Event()  # set between AsyncWeightSync.pause() and resume(): no new groups start
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._heartbeat = time.time()

    # ------------------------------------------------------------------ RolloutWorkerProtocol
    def start(self) -> None:
        """Start the producer thread (TRL calls this once, after the first weight sync)."""
        if self._thread is not None or self._stop.is_set():
            raise RuntimeError("AsyncRollouts.start() was called twice. Fix: one start() per stop(); make a new "
                               "AsyncRollouts for a new trainer.")
        if int(self.args.max_inflight_tasks) < 1:
            raise invalid("args.max_inflight_tasks", self.args.max_inflight_tasks, "must be >= 1 at start()",
                          "pass the same AsyncGRPOConfig to the trainer (it derives the value) or set it")
        self._heartbeat = time.time()
        self._thread = threading.Thread(target=self._run, name="rollout-trl-async", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the producer: it cancels the generations in flight and exits; joined here (no thread left)."""
        self._stop.set()
        self._held.clear()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(STOP_TIMEOUT_S)
            if thread.is_alive():
                raise RuntimeError(f"the rollout producer thread did not stop within {STOP_TIMEOUT_S:.0f} s")

    def update_model_version(self, model_version: int) -> None:
        self.model_version = int(model_version)

    def check_health(self, stale_after_s: float) -> None:
        """Raise if the producer failed (its error chained), died, or has made no progress (no group finished, no
        wait on the trainer) for `stale_after_s` seconds."""
        if self._error is not None:
            raise RuntimeError("the rollout producer failed; see the chained exception") from self._error
        if self._thread is not None and not self._thread.is_alive():
            raise RuntimeError("the rollout producer thread is gone without an error")
        age = time.time() - self._heartbeat
        if age > stale_after_s:
            raise RuntimeError(f"no rollout progress for {age:.0f} s (> {stale_after_s:.0f} s): the rollout side is "
                               "stuck. Check rollouts.metrics() (requests in flight, restarts).")

    def hold(self) -> None:
        """Start no new group until `release()` (a weight sync is under way); groups in flight go on."""
        self._held.set()

    def release(self) -> None:
        self._held.clear()

    # ------------------------------------------------------------------ the producer
    def _run(self) -> None:
        try:
            self._produce()
        except BaseException as exc:  # kept for check_health, which TRL calls while it waits for samples
            self._error = exc

    def _produce(self) -> None:
        done: queue.Queue = queue.Queue()
        pending: dict[int, tuple[RolloutsFuture, dict]] = {}
        rows = self._rows()
        max_groups = max(1, math.ceil(int(self.args.max_inflight_tasks) / int(self.args.num_generations)))
        sampling = trl_sampling(self.args, self._stop_ids())
        try:
            while not self._stop.is_set():
                while len(pending) < max_groups and not self._held.is_set() and not self._stop.is_set():
                    group_id, row = next(rows)
                    prompt_ids = self._template(row["prompt"])
                    future = self.rollouts.submit([prompt_ids], sampling=sampling)
                    pending[group_id] = (future, row)
                    future.add_done_callback(lambda _, g=group_id: done.put(g))
                try:
                    group_id = done.get(timeout=POLL_S)
                except queue.Empty:
                    if self._held.is_set():
                        self._heartbeat = time.time()  # waiting on the trainer's weight sync is not a stall
                    continue
                future, row = pending.pop(group_id)
                self._push(self._samples(group_id, row, future.result()))
        finally:
            for future, _ in pending.values():
                future.cancel()

    def _rows(self) -> Iterator[tuple[int, dict]]:
        group_id = 0
        while True:
            for row in self.dataset:
                yield group_id, row
                group_id += 1

    def _stop_ids(self) -> list[int]:
        """TRL's: the tokenizer's EOS, then every EOS id the model declares (the rollout side's default stops)."""
        ids = [self.tokenizer.eos_token_id] if self.tokenizer.eos_token_id is not None else []
        return ids + [i for i in self.rollouts.default_stop_ids if i not in ids]

    def _template(self, messages: list[dict]) -> list[int]:
        kwargs = self.args.chat_template_kwargs or {}
        return list(self.tokenizer.apply_chat_template(messages, return_dict=False, add_generation_prompt=True,
                                                       **kwargs))

    def _samples(self, group_id: int, row: dict, batch: RolloutBatch) -> list:
        from trl.experimental.async_grpo.async_rollout_worker import RolloutSample

        start = time.monotonic()
        g = len(batch)
        prompt = list(batch.prompt_ids[0])
        ids = batch.completion_token_lists()
        completions = [[self._message(c, prompt)] for c in ids]
        reward_kwargs = {k: [v] * g for k, v in row.items() if k not in ("prompt", "completion", "completion_ids")}
        rewards, advantages, per_func = score_group(self.reward_funcs, [row["prompt"]] * g, completions, ids,
                                                    reward_kwargs)
        scored = rewards[~np.isnan(rewards)]
        reward_std = float(scored.std()) if scored.size else math.nan
        samples = []
        for i in range(g):
            n = len(ids[i])
            lps = batch.sampling_logprobs[i, :n].numpy().astype(np.float32)
            metrics = {"reward": float(rewards[i]), "reward_std": reward_std,
                       **{f"rewards/{name}": float(per_func[f, i]) for f, name in enumerate(self.reward_names)}}
            samples.append(RolloutSample(
                prompt=row["prompt"], completion=completions[i],
                input_ids=np.asarray(prompt + ids[i], dtype=np.int64),
                completion_mask=np.asarray([0] * len(prompt) + [1] * n, dtype=np.int64),
                old_log_probs=np.concatenate([np.zeros(len(prompt), dtype=np.float32), lps]),
                advantage=float(advantages[i]), model_version=int(batch.policy_version[i]), group_id=group_id,
                metrics=metrics))
        self._metric(self._group_metrics(batch, time.monotonic() - start))
        return samples

    def _message(self, completion_ids: list[int], prompt_ids: list[int]) -> dict:
        """The completion as TRL's worker makes it: parsed by the tokenizer's response template, or (none known for
        this chat template) TRL's own fallback, the decoded text."""
        from trl.chat_template_utils import parse_response

        if not parses_responses(self.tokenizer):
            return {"role": "assistant", "content": self.tokenizer.decode(completion_ids, skip_special_tokens=True)}
        return parse_response(self.tokenizer, completion_ids, prefix=prompt_ids)

    def _group_metrics(self, batch: RolloutBatch, score_s: float) -> dict:
        lengths = batch.completion_lengths
        model = batch.token_versions.masked_fill(~batch.action_mask, -1)
        mixed = int(((model.max(dim=1).values != batch.policy_version) & (lengths > 0)).sum())
        stopped = sum(reason == "stop" for reason in batch.finish_reason)
        return {"rollout/score_s": score_s, "completions/mean_length": (float(lengths.sum()), float(len(batch))),
                "completions/max_length": float(lengths.max()), "completions/min_length": float(lengths.min()),
                "completions/clipped_ratio": (float(len(batch) - stopped), float(len(batch))),
                "rollout/mixed_version_frac": (float(mixed), float(len(batch)))}

    def _metric(self, values: dict) -> None:
        try:
            self.metrics_queue.put_nowait(values)
        except queue.Full:
            pass  # never block generation on a trainer that stopped logging (TRL's worker does the same)

    def _push(self, samples: list) -> None:
        self._heartbeat = time.time()
        for sample in samples:
            while not self._stop.is_set():
                sample.enqueued_at = time.time()
                try:
                    self.rollout_buffer.put(sample, timeout=POLL_S)
                    break
                except queue.Full:
                    self._heartbeat = time.time()  # the trainer is behind: backpressure, not a stall


class AsyncWeightSync:
    """TRL's `WeightTransferProtocol` into the rollout side of an `AsyncRollouts`: `send_weights` is one
    `update_weights(iterator, version=TRL's next model_version, in_flight=source.in_flight)` (validated, then
    applied atomically; a fleet checks every actor's fingerprint), so the engine's version is TRL's after each sync.

    `pause()` / `resume()` hold back the groups the producer would start during the sync (they would sample from
    weights about to be replaced); the generations already in flight are handled by the update itself
    (`in_flight`): the engine fences them, so no pause of the engine is needed."""

    def __init__(self, source: AsyncRollouts) -> None:
        if not isinstance(source, AsyncRollouts):
            raise invalid("source", source, "must be an AsyncRollouts", "pass the trainer's rollout_worker")
        self.source = source
        self._open = False

    def init_weight_transfer(self) -> None:
        """In-process there is no transport group to build: this opens the transfer (sends are refused before it
        and after `destroy`)."""
        self._open = True

    def pause(self) -> None:
        self.source.hold()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        if not self._open:
            raise RuntimeError("send_weights before init_weight_transfer (or after destroy). Fix: let the trainer "
                               "drive AsyncWeightSync (it calls init_weight_transfer on train begin).")
        self.source.rollouts.update_weights(iterator, version=self.source.model_version + 1,
                                            in_flight=self.source.in_flight)

    def resume(self) -> None:
        self.source.release()

    def destroy(self) -> None:
        self._open = False
