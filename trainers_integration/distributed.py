"""Multi-process training with accelerate: one trainer per process, three ways to place the rollouts.

    accelerator = make_accelerator(fsdp=layout == "sharded")   # Accelerator(cpu=True) when there is no GPU
    group = check_process_group(accelerator)                    # the ranks really form one group, or raise
    policy, optimizer = accelerator.prepare(policy, optimizer)  # DDP or FSDP: placement, wrapping, gradient sync
    prompts = rank_prompts(step_prompts, accelerator)           # this rank's shard of every step's prompts
    rollouts = ...                                              # one of the three layouts below
    trainer = GRPOTrainer(policy, optimizer, reward_fn, prompts, rollouts, config)

Layouts (examples/grpo_accelerate.py runs each; docs/trainers.md gives their costs):
1. colocated (DDP): `RolloutWorker(accelerator.unwrap_model(policy), ...)` on every rank, sharing that rank's
   replica in place. Each rank generates its own prompts; after the optimizer step the trainer calls `refresh()`:
   no weights move (DDP already made every replica equal).
2. sharded (FSDP): `MainProcessRollouts(accelerator, worker)` with a RolloutWorker holding a full copy on rank 0.
   After each step every rank joins `accelerator.get_state_dict(policy)` (the full state dict, gathered on rank 0);
   rank 0's worker takes it with `update_weights`. Prompts of every rank are generated there in one call.
3. fleet: `MainProcessRollouts(accelerator, fleet)` with a RolloutFleet owned by rank 0; same flow, the fleet's
   `update_weights` sends the weights to its actors.

In 2 and 3 the rows of the one call go back to the rank that asked for them, in order (`prompt_index` local to that
rank). A PEFT policy sends only its adapter. Nothing here calls `init_process_group`: accelerate made the group;
the row and prompt exchange uses torch.distributed's object collectives on it.

The CPU trap (measured with accelerate 1.15): `accelerate launch --cpu --num_processes 2` starts one process, and
`--multi_gpu --num_processes 2` on a machine without a GPU starts two that each believe they are alone (rank 0 of
1) unless the script builds `Accelerator(cpu=True)`; `make_accelerator` does, and `check_process_group` fails loudly
when the launcher started more processes than the group holds.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from rollout import RolloutBatch, SamplingParams, fingerprint

from .rollouts import policy_weights, prompt_stream, unwrapped

LAYOUTS = ("colocated", "sharded", "fleet")


def make_accelerator(fsdp: bool = False, **kwargs: Any):
    """An `Accelerator` for this machine: `cpu=True` when there is no GPU (see the trap above); with `fsdp`, FSDP2
    unless the launcher already configured FSDP (`accelerate launch --use_fsdp ...`).

    accelerate turns FSDP on only for accelerator devices (a multi-process CPU run is always DDP), while torch's
    FSDP2 itself runs on CPU over gloo. So that CPU runs (tests, CI) exercise the real sharded path, a CPU FSDP
    request switches accelerate's state to FSDP after construction: the same `prepare` (fully_shard) and
    `get_state_dict` (full state dict gathered on rank 0) then run.
    """
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType

    cpu = not torch.cuda.is_available()
    plugin = None
    if fsdp and os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2)
    accelerator = Accelerator(cpu=cpu, fsdp_plugin=plugin, **kwargs)
    if fsdp and accelerator.distributed_type == DistributedType.MULTI_CPU:
        from accelerate.state import AcceleratorState, PartialState

        plugin = plugin or FullyShardedDataParallelPlugin(fsdp_version=2)
        PartialState().distributed_type = DistributedType.FSDP  # AcceleratorState re-reads it from here
        state = AcceleratorState()
        state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, plugin
        if not accelerator.is_fsdp2:
            raise RuntimeError("could not switch accelerate to FSDP2 on CPU (accelerate's state layout changed?). "
                               "Fix: run the sharded layout on GPUs, or pin the accelerate version tested here.")
    return accelerator


def check_process_group(accelerator, expected: int | None = None) -> dict[str, Any]:
    """Prove the ranks form one group: `num_processes` matches the launcher (and `expected`), and an all_reduce of
    ones over the group sums to it. Returns what was checked; raises with the fix otherwise."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    n = accelerator.num_processes
    if launched != n or (expected is not None and n != expected):
        raise RuntimeError(f"the launcher started {launched} process(es) but this one sees a group of {n}"
                           f"{f' (expected {expected})' if expected is not None else ''}: the processes are not one "
                           "group. Fix: build the Accelerator with cpu=True when there is no GPU "
                           "(trainers_integration.distributed.make_accelerator does), and launch with "
                           "`accelerate launch --multi_gpu --num_processes N`.")
    total, backend = n, "none"
    if n > 1:
        ones = torch.ones(1, device=accelerator.device)
        dist.all_reduce(ones)
        total, backend = int(ones.item()), dist.get_backend()
        if total != n:
            raise RuntimeError(f"all_reduce of ones over the group gave {total}, not {n}: the group is broken.")
    return dict(rank=accelerator.process_index, num_processes=n, all_reduce=total, backend=backend,
                distributed_type=str(accelerator.distributed_type).split(".")[-1])


def shard(items: Sequence[Any], rank: int, world: int) -> list[Any]:
    """Contiguous shard `rank` of `world` equal shards (len(items) must be a multiple of world)."""
    size = len(items) // world
    return list(items[rank * size: (rank + 1) * size])


def rank_prompts(prompts: Callable[[int], Any] | Any, accelerator) -> Callable[[int], list]:
    """A prompt source (as the trainers take it) -> `step -> this rank's shard of that step's prompts`. Every rank
    must see the same prompt source. Shards are equal, so every rank runs the same number of forward and backward
    passes (DDP and FSDP hang otherwise): each step's prompt count must be a multiple of the number of processes."""
    source = prompt_stream(prompts)
    rank, world = accelerator.process_index, accelerator.num_processes

    def this_rank(step: int) -> list:
        full = list(source(step))
        if not full or len(full) % world:
            raise ValueError(f"step {step} has {len(full)} prompts for {world} ranks. Fix: give every step a "
                             f"non-zero multiple of {world} prompts, so every rank gets the same number.")
        return shard(full, rank, world)

    return this_rank


class MainProcessRollouts:
    """The rollouts object of every rank when generation runs on rank 0 (layouts `sharded` and `fleet`).

    `backend` (rank 0 only; None elsewhere): a RolloutWorker holding its own copy, or a RolloutFleet. `generate`
    is collective: each rank passes its prompts, rank 0 generates them all in one call, and each rank gets its rows
    back in input order. `push_policy` is collective too (the trainers call it after each optimizer step): every
    rank joins `accelerator.get_state_dict`, rank 0's backend takes the weights (only the adapter of a PEFT policy).
    Errors on rank 0 are raised on every rank, so no rank waits forever.
    """

    def __init__(self, accelerator, backend: Any = None, tokenizer: Any = None) -> None:
        self.accelerator = accelerator
        self.rank, self.world = accelerator.process_index, accelerator.num_processes
        if (backend is None) == (self.rank == 0):
            raise ValueError(f"backend={'None' if backend is None else type(backend).__name__} on rank {self.rank} is "
                             "invalid: rank 0 holds the RolloutWorker or RolloutFleet, every other rank passes None.")
        self.backend = backend
        self.tokenizer = tokenizer if tokenizer is not None else getattr(backend, "tokenizer", None)
        self._version = int(self._from_rank0(lambda: backend.policy_version))

    @property
    def policy_version(self) -> int:
        return self._version

    def generate(self, prompts: Sequence[Any], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 chat_template: bool = False, timeout: float | None = None) -> RolloutBatch:
        prompts = list(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        requests = [None] * self.world if self.rank == 0 else None
        dist.gather_object((prompts, list(sampling), chat_template), requests, dst=0)
        parts: list[Any] = [None] * self.world
        if self.rank == 0:
            try:
                parts = self._generate_all(requests, timeout)
            except Exception as exc:
                parts = [("error", f"{type(exc).__name__}: {exc}")] * self.world
                mine = [None]
                dist.scatter_object_list(mine, parts, src=0)
                raise
        mine = [None]
        dist.scatter_object_list(mine, parts if self.rank == 0 else None, src=0)
        rows = mine[0]
        if isinstance(rows, tuple) and rows and rows[0] == "error":
            raise RuntimeError(f"generation failed on rank 0: {rows[1]}")
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return RolloutBatch.from_rows(rows, pad_token_id=pad if pad is not None else 0, tokenizer=self.tokenizer)

    def _generate_all(self, requests: list, timeout: float | None) -> list[list]:
        if len({chat for _, _, chat in requests}) > 1:
            raise ValueError("ranks disagree on chat_template. Fix: use one trainer config on every rank.")
        prompts = [p for rank_prompts_, _, _ in requests for p in rank_prompts_]
        sampling = [s for _, rank_sampling, _ in requests for s in rank_sampling]
        batch = self.backend.generate(prompts, sampling=sampling, chat_template=requests[0][2], timeout=timeout)
        rows, parts, start = batch.rows(), [], 0
        for rank_prompts_, _, _ in requests:  # rows are prompt-major: rank r's prompts are a contiguous range
            stop = start + len(rank_prompts_)
            parts.append([_local(row, start) for row in rows if start <= row.prompt_index < stop])
            start = stop
        return parts

    def push_policy(self, model: torch.nn.Module, version: int, in_flight: str | None = None) -> None:
        state = self.accelerator.get_state_dict(model)  # collective under FSDP: every rank joins, rank 0 gets all
        extra = {} if in_flight is None else {"in_flight": in_flight}

        def update() -> int:
            return self.backend.update_weights(policy_weights(unwrapped(model), state), version=version, **extra)

        self._version = int(self._from_rank0(update))

    def weights_fingerprint(self) -> str:
        return self._from_rank0(lambda: self.backend.weights_fingerprint())

    def metrics(self) -> Any:
        """Rank 0's backend's metrics, on every rank (collective, like generate)."""
        return self._from_rank0(lambda: self.backend.metrics())

    def close(self) -> None:
        if self.backend is not None:
            self.backend.close()

    def _from_rank0(self, fn: Callable[[], Any]) -> Any:
        """fn() on rank 0, its result (or its error) on every rank."""
        box: list[Any] = [None]
        error = None
        if self.rank == 0:
            try:
                box[0] = ("ok", fn())
            except Exception as exc:
                error = exc
                box[0] = ("error", f"{type(exc).__name__}: {exc}")
        dist.broadcast_object_list(box, src=0)
        if error is not None:
            raise error
        status, value = box[0]
        if status == "error":
            raise RuntimeError(f"rank 0 failed: {value}")
        return value


def _local(row, offset: int):
    import dataclasses

    return dataclasses.replace(row, prompt_index=row.prompt_index - offset)


def trainer_fingerprint(accelerator, model: torch.nn.Module) -> str:
    """This rank's fingerprint of the full policy weights: its own replica under DDP; under FSDP the full state dict
    all-gathered to every rank (torch's get_model_state_dict, cpu_offload off, so no rank is left out)."""
    if accelerator.is_fsdp2:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return fingerprint(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)))
    return fingerprint(unwrapped(model))


def rank_report(accelerator, model: torch.nn.Module, rollouts: Any, history: list[dict]) -> dict[str, Any]:
    """What this rank ends with: weights fingerprint (trainer side and rollout side), policy version, worst gap; and
    what it cost: the mean weight push per step, this process's peak RSS (not counting Ray actors)."""
    import resource

    rollout_fp = rollouts.weights_fingerprint()
    return dict(rank=accelerator.process_index, fingerprint=trainer_fingerprint(accelerator, model),
                rollout_fingerprint=rollout_fp, policy_version=int(rollouts.policy_version),
                worst_gap=max((m["logprob_gap_max"] for m in history), default=0.0), steps=len(history),
                push_s=sum(m["refresh_s"] for m in history) / max(len(history), 1),
                peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)


def check_agreement(reports: list[dict[str, Any]], max_gap: float = 1e-4) -> list[str]:
    """The ways the ranks' reports disagree (empty when every rank holds the same weights on both sides, the same
    policy_version, and a logprob gap under `max_gap`)."""
    problems = []
    fingerprints = {r["fingerprint"] for r in reports}
    if len(fingerprints) > 1:
        problems.append(f"trainer weights differ across ranks: {sorted(fingerprints)}")
    stale = [r["rank"] for r in reports if r["rollout_fingerprint"] != r["fingerprint"]]
    if stale:
        problems.append(f"rollout weights differ from the trainer's on ranks {stale}")
    versions = {r["policy_version"] for r in reports}
    if len(versions) > 1:
        problems.append(f"policy_version differs across ranks: {sorted(versions)}")
    over = [(r["rank"], r["worst_gap"]) for r in reports if not r["worst_gap"] < max_gap]
    if over:
        problems.append(f"logprob gap >= {max_gap:g} on (rank, gap) {over}")
    return problems


def format_report(report: dict[str, Any]) -> str:
    return (f"rank {report['rank']}: fingerprint {report['fingerprint']} rollout {report['rollout_fingerprint']} "
            f"policy_version {report['policy_version']} worst_gap {report['worst_gap']:.2e} "
            f"(weight push {report['push_s'] * 1e3:.1f} ms/step, peak RSS {report['peak_rss_mib']:.0f} MiB)")


__all__ = ["LAYOUTS", "MainProcessRollouts", "check_agreement", "check_process_group", "format_report",
           "make_accelerator", "rank_prompts", "rank_report", "shard", "trainer_fingerprint"]
