"""RolloutCollector: over-sampling, dynamic sampling and partial rollouts over any `Rollouts` (worker or fleet).

    with RolloutCollector(rollouts, prompts=dataset, sampling=SamplingParams(n=8), reward_fn=fn,
                          accept=nonzero_std, over_sample=1.5, partial=True, max_staleness=1) as collector:
        batch = collector.next_batch(num_groups=32)    # 32 accepted groups, rewards in batch.rewards
        ...train; rollouts.update_weights(state_dict, in_flight="recompute")...
        batch = collector.next_batch(32)               # groups carried from the last call come first

Contract:
- Prompts are drawn from `prompts` as groups are needed and submitted in waves (one `rollouts.submit` per wave),
  each group sampled with `sampling` (one SamplingParams, or a function of the prompt giving its group's);
  `over_sample` x `num_groups` are submitted first and every group refused (or failed, or stale) is replaced, so
  (over_sample - 1) x `num_groups` more than still wanted stay in flight. Each wave is read with
  `future.as_completed()` on a feeder thread, and every group is rewarded (`reward_fn(group) -> n rewards`; None:
  the rows' own rewards, an environment's) and judged (`accept(group) -> bool`; None: accept all) on a small thread
  pool as soon as it finishes, while the others still generate. A raising `reward_fn` or `accept` fails that group
  only: its error is kept (`errors`), it is counted (`stats["failed_groups"]`), and the collector goes on.
- `next_batch(num_groups)` returns once `num_groups` groups are accepted, oldest prompt first (carried groups
  first); `batch.prompt_index` is each prompt's position in the prompt stream (the k-th prompt drawn is k).
- `partial=True`: what is unfinished when a batch returns keeps running and is used by the next call (finished
  groups not needed yet wait for it). Push new weights with `in_flight="recompute"`: a carried row continues on the
  new weights with its KV recomputed, so every token is exact under the version in `token_versions`. A row may span
  versions, but none is older than `max_staleness` versions when returned: at the start of a call, waves submitted
  before that bound are cancelled and their unfinished prompts regenerated, and a finished group holding an older
  token is dropped and regenerated (both counted in `aborted_rows`). While calls run in the background, a worker
  sharing the trainer's model must not be trained meanwhile: give the rollout side its own weights.
- `partial=False`: leftover waves are cancelled when the batch is complete and unused groups dropped; nothing runs
  between calls.
- A list of prompts is used once, in order (`cycle=True` repeats it forever); any other iterable is read lazily (an
  endless dataset). A source that runs dry returns what it has (`stats["prompts_exhausted"] == 1`); the next call
  raises PromptsExhausted. Bad arguments are ValueErrors naming the field, before anything is submitted.
- `close()` (or `with`) cancels everything in flight: the rollout side is left with nothing of the collector's.

`batch.stats` adds, for the call: accepted_groups, rejected_groups (refused by `accept`), failed_groups (reward_fn
or accept raised, or the rollout side failed the group), aborted_rows (stale rows
cancelled or dropped, and with partial=False the unfinished rows cancelled at the end), carried_rows (rows returned
that were in flight when an earlier call returned), in_flight_groups (left running for the next call),
over_generated_tokens (model tokens generated and not returned: rejected, failed, stale or dropped groups and what
cancels threw away), staleness_hist ({versions behind the policy: model tokens} of the batch) and
prompts_exhausted.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ..base.batch import RolloutBatch, rewards_tensor
from ..base.env import EnvFactory, EpisodeSpec
from ..base.errors import InvalidArgument, check_int, invalid, preview
from ..base.params import SamplingParams
from ..base.rollouts import Rollouts
from ..model.loading import pad_token_id
from .source import PromptGroup, PromptSource


class PromptsExhausted(Exception):
    """The collector's prompt source has no prompts left and nothing is in flight."""


def nonzero_std(group: RolloutBatch) -> bool:
    """DAPO's dynamic-sampling filter: keep a group unless all its rewards are equal (zero advantage)."""
    return len(group) > 1 and bool((group.rewards != group.rewards[0]).any())


@dataclass(eq=False)
class _Wave:
    """One submit: several groups in one call, read by a feeder thread."""

    future: Any
    groups: list[PromptGroup]
    version: int  # the policy version when it was submitted: no token of it is older
    delivered: set[int] = field(default_factory=set)  # local indices the feeder has handed on
    thread: threading.Thread | None = None


class RolloutCollector:
    def __init__(self, rollouts: Rollouts, prompts: Iterable[Any],
                 sampling: SamplingParams | Callable[[Any], SamplingParams] | None = None,
                 reward_fn: Callable[[RolloutBatch], Any] | None = None,
                 accept: Callable[[RolloutBatch], bool] | None = None, over_sample: float = 1.0,
                 partial: bool = True, max_staleness: int = 1, cycle: bool = False, chat_template: bool = False,
                 env: EnvFactory | None = None, max_turns: int = 1, max_episode_tokens: int | None = None,
                 env_timeout: float | None = 300.0, reward_workers: int = 4) -> None:
        for name, fn in (("reward_fn", reward_fn), ("accept", accept)):
            if fn is not None and not callable(fn):
                raise invalid(name, preview(fn), "must be callable (or None)",
                              "pass a function of a group's RolloutBatch (accept: e.g. nonzero_std)")
        if isinstance(over_sample, bool) or not isinstance(over_sample, (int, float)) or \
                not math.isfinite(over_sample) or over_sample < 1:
            raise invalid("over_sample", over_sample, "must be a number >= 1 (groups in flight per group wanted)",
                          "use 1.0 for no over-sampling, or e.g. 1.5")
        check_int("max_staleness", max_staleness, 0, "use 0 (no token from an older version) or e.g. 1")
        check_int("reward_workers", reward_workers, 1, "use e.g. 4")
        for name, value in (("partial", partial), ("cycle", cycle)):
            if not isinstance(value, bool):
                raise invalid(name, value, "must be a bool", "use True or False")
        if sampling is None:
            sampling = SamplingParams()
        if not isinstance(sampling, SamplingParams) and not callable(sampling):
            raise invalid("sampling", preview(sampling), "must be one SamplingParams for every group, or a function "
                          "of a prompt giving its group's", "pass e.g. SamplingParams(n=8)")
        if not hasattr(rollouts, "submit"):
            raise invalid("rollouts", type(rollouts).__name__, "must be a rollout.Rollouts (with submit)",
                          "pass a RolloutWorker or a RolloutFleet")
        self.spec = EpisodeSpec.of(env, max_turns, max_episode_tokens, env_timeout)
        self.rollouts, self.sampling, self.reward_fn, self.accept = rollouts, sampling, reward_fn, accept
        self.over_sample, self.partial, self.max_staleness = float(over_sample), partial, max_staleness
        self.chat_template = chat_template
        self._source = PromptSource(prompts, cycle)
        self._cond = threading.Condition()
        self._waves: list[_Wave] = []
        self._ready: deque[PromptGroup] = deque()  # finished and judged, not used yet
        self._scoring = 0  # groups handed to the reward pool and not back yet
        self._rewards = ThreadPoolExecutor(reward_workers, thread_name_prefix="rollout-reward")
        self.errors: deque[str] = deque(maxlen=100)  # the latest failed groups' errors, oldest first
        self._stats = _fresh_stats()
        self._dry = False  # the last call ran out of prompts
        self._closed = False

    # ------------------------------------------------------------------ the batch
    def next_batch(self, num_groups: int, timeout: float | None = None) -> RolloutBatch:
        """`num_groups` accepted groups (fewer only if the prompt source ran dry), oldest prompt first."""
        check_int("num_groups", num_groups, 1, "ask for at least 1 group, e.g. 32")
        if self._closed:
            raise RuntimeError("this RolloutCollector is closed. Fix: make a new one.")
        if self._dry:
            raise PromptsExhausted("the prompt source ran dry in the previous call and nothing is left. Fix: give "
                                   "more prompts (or cycle=True) to a new RolloutCollector.")
        deadline = None if timeout is None else time.monotonic() + timeout
        self._stats = _fresh_stats()
        self._abort_stale_waves()
        taken: list[PromptGroup] = []
        try:
            while len(taken) < num_groups:
                self._top_up(num_groups, len(taken))
                group = self._wait_ready(deadline, len(taken), num_groups)
                if group is None:
                    if self._source.exhausted:
                        self._dry = True
                        break
                    continue  # nothing in flight: top up again
                if self._judge(group):
                    taken.append(group)
        except BaseException:
            with self._cond:  # nothing accepted is lost: back to the front, for the next call
                self._ready.extendleft(reversed(taken))
            raise
        if not taken:
            self._dry = True
            raise PromptsExhausted("the prompt source is empty: no prompt was left to generate from. Fix: give "
                                   "more prompts (or cycle=True).")
        return self._finish(sorted(taken, key=lambda g: g.draw))

    def _judge(self, group: PromptGroup) -> bool:
        """Count a finished group; True if it goes into the batch. A stale one is regenerated."""
        stats, tokens = self._stats, _model_tokens(group.batch)
        if group.error:
            stats["failed_groups"] += 1
        elif self._oldest_allowed() > _oldest_token(group.batch):
            stats["aborted_rows"] += len(group.batch)
            self._requeue([group])
        elif not group.accepted:
            stats["rejected_groups"] += 1
        else:
            return True
        stats["over_generated_tokens"] += tokens
        return False

    def _finish(self, taken: list[PromptGroup]) -> RolloutBatch:
        stats = self._stats
        stats["accepted_groups"] = len(taken)
        stats["carried_rows"] = sum(len(g.batch) for g in taken if g.carried)
        stats["prompts_exhausted"] = int(self._dry)
        if not self.partial:
            self._cancel_all()
        with self._cond:
            pending = [g for wave in self._waves for i, g in enumerate(wave.groups) if i not in wave.delivered]
            for group in pending + list(self._ready):
                group.carried = True
            stats["in_flight_groups"] = len(pending)
        rows = [dataclasses.replace(row, prompt_index=g.draw) for g in taken for row in g.batch.rows()]
        batch = RolloutBatch.from_rows(rows, pad_token_id=pad_token_id(self.rollouts.tokenizer),
                                       tokenizer=self.rollouts.tokenizer)
        stats["staleness_hist"] = _staleness_hist(batch, self.rollouts.policy_version)
        batch.stats.update(stats)
        return batch

    # ------------------------------------------------------------------ waves
    def _top_up(self, num_groups: int, accepted: int) -> None:
        """Submit new groups until over_sample x `num_groups`, less those accepted already, are in flight or finished
        and unused: the first wave over-samples, and every group refused (or failed, or stale) is replaced."""
        with self._cond:
            pending = sum(len(w.groups) - len(w.delivered) for w in self._waves) + self._scoring + len(self._ready)
        missing = math.ceil(self.over_sample * num_groups - 1e-9) - accepted - pending
        if missing <= 0:
            return
        groups = self._source.take(missing)
        for i, group in enumerate(groups):
            try:
                self._set_params(group)
            except Exception as error:  # noqa: BLE001 - that prompt is dropped, the others kept
                self._source.put_back(groups[:i] + groups[i + 1:])
                raise ValueError(f"RolloutCollector: prompt_index {group.draw} of the prompt stream (dropped): "
                                 f"{error}") from None
        if groups:
            self._submit(groups)

    def _set_params(self, group: PromptGroup) -> None:
        if group.params is None:
            params = self.sampling(group.prompt) if callable(self.sampling) else self.sampling
            if not isinstance(params, SamplingParams):
                raise invalid("sampling", preview(params), "the sampling function must return a SamplingParams",
                              "return e.g. SamplingParams(n=8)")
            group.params = params

    def _submit(self, groups: list[PromptGroup]) -> None:
        version = self.rollouts.policy_version
        extra = self.spec.kwargs() if self.spec is not None else {}
        try:
            future = self.rollouts.submit([g.prompt for g in groups], sampling=[g.params for g in groups],
                                          chat_template=self.chat_template, **extra)
        except ValueError as error:  # refused before anything ran: the bad prompt is dropped, the rest kept
            raise self._refused(groups, error) from None
        wave = _Wave(future, groups, version)
        wave.thread = threading.Thread(target=self._feed, args=(wave,), daemon=True, name="rollout-collector")
        with self._cond:
            self._waves.append(wave)
        wave.thread.start()

    def _refused(self, groups: list[PromptGroup], error: ValueError) -> ValueError:
        index = error.index if isinstance(error, InvalidArgument) else None  # the refused prompt's place in the wave
        bad = index if index is not None and 0 <= index < len(groups) else None
        self._source.put_back([g for i, g in enumerate(groups) if i != bad])
        where = f"prompt_index {groups[bad].draw} of the prompt stream (dropped)" if bad is not None else \
            f"one of prompt_index {groups[0].draw}..{groups[-1].draw} of the prompt stream"
        self.errors.append(f"{where}: {error}")
        return ValueError(f"RolloutCollector: {where} was refused: {error}")

    def _feed(self, wave: _Wave) -> None:
        """Feeder thread: hand each finished group of the wave to the reward pool as it completes."""
        try:
            for part in wave.future.as_completed():
                local = int(part.prompt_index[0])
                with self._cond:
                    if self._closed:
                        return
                    wave.delivered.add(local)
                    self._scoring += 1
                group = wave.groups[local]
                self._rewards.submit(self._score, group, part)
        except CancelledError:
            pass
        except BaseException as error:  # noqa: BLE001 - the rollout side failed this wave: its groups fail too
            with self._cond:
                failed = [g for i, g in enumerate(wave.groups) if i not in wave.delivered]
                wave.delivered.update(range(len(wave.groups)))
                for group in failed:
                    group.error = f"rollout failed: {type(error).__name__}: {error}"
                    group.batch = _empty_group()
                    self._ready.append(group)
                self.errors.extend(g.error for g in failed[:1])
        finally:
            with self._cond:
                if len(wave.delivered) == len(wave.groups) and wave in self._waves:
                    self._waves.remove(wave)
                self._cond.notify_all()

    def _score(self, group: PromptGroup, part: RolloutBatch) -> None:
        """Reward pool: reward and judge one finished group, then make it ready."""
        try:
            rewards = part.rewards if self.reward_fn is None else \
                rewards_tensor(self.reward_fn(part), len(part), f"a group of {len(part)} rows")
            group.batch = dataclasses.replace(part, rewards=rewards)
            group.accepted = True if self.accept is None else bool(self.accept(group.batch))
        except Exception as error:  # noqa: BLE001 - the group's failure, never the collector's
            group.batch = group.batch if group.batch is not None else part
            group.error = f"prompt_index {group.draw}: {type(error).__name__}: {error}"
            self.errors.append(group.error)
        with self._cond:
            self._scoring -= 1
            if not self._closed:
                self._ready.append(group)
            self._cond.notify_all()

    def _wait_ready(self, deadline: float | None, have: int, want: int) -> PromptGroup | None:
        """The next finished group; None when nothing is in flight (or being rewarded) any more."""
        with self._cond:
            while not self._ready:
                if not self._waves and not self._scoring:
                    return None
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"next_batch timed out with {have}/{want} groups accepted (the groups "
                                       "accepted so far are kept for the next call)")
                self._cond.wait(remaining)
            return self._ready.popleft()

    # ------------------------------------------------------------------ staleness, cancellation
    def _oldest_allowed(self) -> int:
        return self.rollouts.policy_version - self.max_staleness

    def _abort_stale_waves(self) -> None:
        """Cancel the waves submitted before the staleness bound; their unfinished prompts are regenerated."""
        with self._cond:
            stale = [w for w in self._waves if w.version < self._oldest_allowed()]
        if stale:
            self._requeue(self._cancel(stale))

    def _cancel(self, waves: list[_Wave]) -> list[PromptGroup]:
        """Cancel waves and wait for their feeders; returns their groups never handed on (their rows counted as
        aborted)."""
        for wave in waves:
            wave.future.cancel()
            self._stats["over_generated_tokens"] += int(wave.future.discarded_tokens)
        for wave in waves:
            if wave.thread is not None and wave.thread is not threading.current_thread():
                wave.thread.join()
        with self._cond:
            undelivered = [g for w in waves for i, g in enumerate(w.groups) if i not in w.delivered]
            for wave in waves:
                wave.delivered.update(range(len(wave.groups)))
                if wave in self._waves:
                    self._waves.remove(wave)
        self._stats["aborted_rows"] += sum(g.params.n for g in undelivered)
        return undelivered

    def _cancel_all(self) -> None:
        """partial=False at the end of a batch: cancel every wave, drop every unused group."""
        with self._cond:
            waves = list(self._waves)
        self._cancel(waves)
        with self._cond:
            self._cond.wait_for(lambda: self._scoring == 0)
            dropped, self._ready = list(self._ready), deque()
        self._stats["over_generated_tokens"] += sum(_model_tokens(g.batch) for g in dropped)

    def _requeue(self, groups: list[PromptGroup]) -> None:
        """Regenerate these prompts first (same stream positions), as fresh groups."""
        self._source.put_back([PromptGroup(g.draw, g.prompt, g.params) for g in groups])

    def close(self) -> None:
        """Cancel everything in flight and stop the collector's threads; nothing of it stays on the rollout side."""
        if self._closed:
            return
        with self._cond:
            waves = list(self._waves)
        self._cancel(waves)
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        self._rewards.shutdown(wait=True)

    def __enter__(self) -> "RolloutCollector":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fresh_stats() -> dict[str, Any]:
    return dict(accepted_groups=0, rejected_groups=0, failed_groups=0, carried_rows=0, aborted_rows=0,
                in_flight_groups=0, over_generated_tokens=0, staleness_hist={}, prompts_exhausted=0)


def _model_tokens(batch: RolloutBatch | None) -> int:
    return 0 if batch is None else int(batch.action_mask.sum())


def _oldest_token(batch: RolloutBatch) -> int:
    versions = batch.token_versions[batch.action_mask]
    return int(versions.min()) if versions.numel() else 2 ** 62


def _staleness_hist(batch: RolloutBatch, version: int) -> dict[int, int]:
    behind = version - batch.token_versions[batch.action_mask]
    counts = torch.bincount(behind.clamp(min=0)) if behind.numel() else torch.zeros(0, dtype=torch.long)
    return {k: int(c) for k, c in enumerate(counts.tolist()) if c}


def _empty_group() -> RolloutBatch:
    return RolloutBatch.from_rows([])
