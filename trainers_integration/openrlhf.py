"""This engine in place of OpenRLHF's vLLM actor (`RolloutRayActor` in `openrlhf/trainer/ray/vllm_engine.py`, read
at OpenRLHF commit 3c3be623, version 0.11.0), so its PPO / REINFORCE trainers generate here and get exact per-token
logprobs.

    import ray
    from trainers_integration.openrlhf import OpenRLHFEngine
    engines = [ray.remote(num_gpus=1)(OpenRLHFEngine).remote("checkpoint/") for _ in range(num_engines)]
    # hand `engines` to OpenRLHF where it takes the list create_vllm_engines returns (docs/frameworks.md)

OpenRLHF has no plugin point for its rollout side: it calls these methods by name on the Ray actors it is given.
What it calls, and what each does here:

- `generate_responses(prompt, label, sampling_params, max_length, hf_tokenizer, num_samples, images)` (its
  SamplesGenerator): runs the agent executor (OpenRLHF's `SingleTurnAgentExecutor`, or the one given) `num_samples`
  times with `llm_engine=self`; the executor awaits `generate(prompt_token_ids, sampling_params)` and reads the
  `RequestOutput` it returns (`outputs[0].token_ids`, `.text`, `.finish_reason`, `.logprobs[i][token_id].logprob`).
- `get_num_unfinished_requests()`: its load balancing across engines.
- `init_process_group(...)`, then per parameter `update_weight(name, dtype, shape, empty_cache)` while the trainer's
  rank 0 broadcasts it; `empty_cache=True` marks the last parameter of a sync (OpenRLHF's `count == num_params`), and
  there the staged tensors land as one atomic `update_weights` (policy_version + 1).
- `reset_prefix_cache()`, `pause_generation()` / `resume_generation()` (its async trainer, around a sync),
  `sleep(level)` / `wake_up(tags)` (`--vllm.enable_sleep`).

Logprobs are the engine's `sampling_logprobs`: log p(token) under the distribution sampled from (temperature, top-k,
top-p applied), what OpenRLHF asks vLLM for with `logprobs_mode="processed_logprobs"` when its correction is on.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import threading
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from rollout import RolloutBatch, RolloutsFuture, RolloutWorker, SamplingParams, WorkerConfig
from rollout.base import check_in_flight, invalid

GROUP_TIMEOUT_S = 300.0
VLLM_MAX_TOKENS = 16  # vLLM's SamplingParams default when max_tokens is None
WAKE_TAGS = ("weights", "kv_cache")
UNSUPPORTED_SAMPLING = ("stop", "bad_words", "prompt_logprobs", "guided_decoding", "structured_outputs",
                        "allowed_token_ids", "logits_processors")


@dataclass(frozen=True)
class Logprob:
    """vLLM's `Logprob`: one token's logprob (rank and decoded_token are not computed here: None)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's `CompletionOutput`: one sample. `logprobs`: one {token_id: Logprob} per token, holding the sampled
    token only, or None when the request's `logprobs` was None."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str
    stop_reason: int | None = None
    policy_version: int = 0  # the oldest weights version among its tokens (not a vLLM field)


@dataclass(frozen=True)
class RequestOutput:
    """vLLM's `RequestOutput` as OpenRLHF reads it: always finished (there is no streaming here)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt: str | None = None
    prompt_logprobs: None = None
    finished: bool = True
    metrics: dict = field(default_factory=dict)


def rollout_sampling(params: Any) -> SamplingParams:
    """A vLLM `SamplingParams` (read by attribute: what OpenRLHF builds) as this engine's. Refuses, by name, what has
    no meaning here rather than dropping it."""
    for name in UNSUPPORTED_SAMPLING:
        if getattr(params, name, None):
            raise invalid(f"sampling_params.{name}", getattr(params, name), "is not supported by this engine",
                          "leave it unset (stop on token ids: stop_token_ids)")
    max_tokens = VLLM_MAX_TOKENS if params.max_tokens is None else int(params.max_tokens)
    stop = tuple(params.stop_token_ids) if params.stop_token_ids else None
    return SamplingParams(n=int(params.n), temperature=float(params.temperature), top_k=int(params.top_k),
                          top_p=float(params.top_p), min_p=float(params.min_p), max_new_tokens=max_tokens,
                          min_new_tokens=int(params.min_tokens or 0), stop_token_ids=stop,
                          ignore_eos=bool(params.ignore_eos), seed=params.seed,
                          repetition_penalty=float(params.repetition_penalty),
                          presence_penalty=float(params.presence_penalty),
                          frequency_penalty=float(params.frequency_penalty))


class TrainerGroup:
    """Rank 0 of the weight group, for the trainer's side: a torch.distributed gloo / NCCL group over a TCPStore it
    hosts, with `broadcast(tensor, src=0, stream=None)` as OpenRLHF calls its vLLM communicator. OpenRLHF builds rank
    0 with vLLM's `StatelessProcessGroup` + `PyNcclCommunicator`, which an engine here cannot join; replace
    `openrlhf.trainer.ray.ppo_actor.stateless_init_process_group` in the trainer's actor with
    `lambda address, port, rank, world_size, device: TrainerGroup(address, port, world_size, "nccl")`.
    Construction returns once every rank has joined."""

    def __init__(self, master_address: str, master_port: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = GROUP_TIMEOUT_S) -> None:
        self.group = join_group(master_address, master_port, 0, world_size, backend, timeout_s)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        if src != 0:
            raise invalid("src", src, "must be 0 (the trainer's rank broadcasts)", "broadcast from rank 0")
        self.group.broadcast(tensor, 0).wait()


def join_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str,
               timeout_s: float = GROUP_TIMEOUT_S) -> Any:
    """A torch.distributed process group of its own (never the default group) over the TCPStore rank 0 hosts."""
    import torch.distributed as dist

    if backend not in ("gloo", "nccl"):
        raise invalid("backend", backend, "must be 'gloo' (CPU tensors) or 'nccl' (GPU tensors)",
                      "pass --vllm.sync_backend gloo or nccl")
    if not 0 <= rank < world_size:
        raise invalid("rank_offset", rank, f"must be in [0, world_size={world_size})",
                      "pass OpenRLHF's i * tensor_parallel_size + 1")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, rank == 0, timeout=timeout)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


class OpenRLHFEngine:
    """OpenRLHF's `RolloutRayActor` surface over a `RolloutWorker` (what pause, sleep and the prefix cache need; a
    `RolloutFleet` is not accepted: it has no pause).

    rollouts: a RolloutWorker, or a checkpoint path to build one from (in the Ray actor's own process).
    config: the WorkerConfig to build it with (a path only).
    executor: OpenRLHF's agent executor (anything with its `execute(prompt, label, sampling_params, max_length,
        hf_tokenizer, llm_engine, images)` coroutine); None builds OpenRLHF's `SingleTurnAgentExecutor(remote_rm_url)`.
    in_flight: what a weight sync does to generations in flight ("recompute" by default: under pause_generation
        they continue, exact, on the new weights; docs/async.md).
    """

    def __init__(self, rollouts: RolloutWorker | str, config: WorkerConfig | None = None, executor: Any = None,
                 remote_rm_url: str | list[str] | None = None, in_flight: str = "recompute") -> None:
        check_in_flight(in_flight)
        if isinstance(rollouts, str):
            rollouts = RolloutWorker(rollouts, config or WorkerConfig())
        elif config is not None:
            raise invalid("config", config, "is only used to build a worker from a path",
                          "configure the RolloutWorker you pass")
        if not isinstance(rollouts, RolloutWorker):
            raise invalid("rollouts", type(rollouts).__name__, "must be a RolloutWorker or a checkpoint path",
                          "pass RolloutWorker(path, WorkerConfig()) or the path")
        if executor is None:
            executor = _single_turn_executor(remote_rm_url)
        self.rollouts, self.executor, self.in_flight = rollouts, executor, in_flight
        self._unfinished = 0
        self._count_lock = threading.Lock()
        self._group: Any = None
        self._device = torch.device("cpu")  # where received tensors land: the GPU under the nccl backend
        self._staged: dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------------ generation
    async def generate(self, prompt_token_ids: list[int], sampling_params: Any,
                       multi_modal_data: Any = None) -> RequestOutput:
        """One request (its `n` samples): vLLM's `RequestOutput` once every sample is finished."""
        if multi_modal_data:
            raise invalid("multi_modal_data", type(multi_modal_data).__name__, "is not supported (text models only)",
                          "train a text-only model with this engine")
        sampling = rollout_sampling(sampling_params)
        prompt = [int(t) for t in prompt_token_ids]
        with self._count_lock:
            self._unfinished += sampling.n
        try:
            batch = await _awaited(self.rollouts.submit([prompt], sampling=sampling))
        finally:
            with self._count_lock:
                self._unfinished -= sampling.n
        return self._request_output(prompt, batch, sampling_params)

    def get_num_unfinished_requests(self) -> int:
        """Samples asked of `generate` and not finished yet (OpenRLHF balances its engines on it)."""
        return self._unfinished

    async def generate_responses(self, prompt: str, label: str, sampling_params: Any, max_length: int,
                                 hf_tokenizer: Any, num_samples: int = 1, images: Any = None) -> list[dict]:
        """`num_samples` runs of the executor on one prompt, concurrently (OpenRLHF's own code path)."""
        tasks = [self.executor.execute(prompt=prompt, label=label, sampling_params=sampling_params,
                                       max_length=max_length, hf_tokenizer=hf_tokenizer, llm_engine=self,
                                       images=images) for _ in range(num_samples)]
        return list(await asyncio.gather(*tasks))

    def _request_output(self, prompt: list[int], batch: RolloutBatch, params: Any) -> RequestOutput:
        tokenizer = self.rollouts.tokenizer
        skip = bool(params.skip_special_tokens)
        stops = set(params.stop_token_ids or ())
        outputs = []
        for i, ids in enumerate(batch.completion_token_lists()):
            lps = batch.sampling_logprobs[i, :len(ids)].tolist()
            logprobs = None if params.logprobs is None else [{t: Logprob(lp)} for t, lp in zip(ids, lps)]
            reason = batch.finish_reason[i]
            outputs.append(CompletionOutput(
                index=i, text=tokenizer.decode(ids, skip_special_tokens=skip) if tokenizer is not None else "",
                token_ids=ids, cumulative_logprob=None if logprobs is None else float(sum(lps)), logprobs=logprobs,
                finish_reason=reason, stop_reason=ids[-1] if reason == "stop" and ids and ids[-1] in stops else None,
                policy_version=int(batch.policy_version[i])))
        return RequestOutput(request_id=uuid.uuid4().hex, prompt_token_ids=prompt, outputs=outputs)

    # ------------------------------------------------------------------ weights
    async def init_process_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                 group_name: str, backend: str = "nccl", use_ray: bool = False) -> None:
        """Join the trainer's weight group as rank `rank_offset` (a torch.distributed group: see TrainerGroup for
        the trainer's side). Returns once every rank has joined."""
        if use_ray:
            raise invalid("use_ray", use_ray, "is not supported (ray.util.collective groups are not joined here)",
                          "leave --vllm.sync_with_ray off")
        if backend == "nccl" and not torch.cuda.is_available():
            raise invalid("backend", backend, "needs a GPU on the engine's side", "pass --vllm.sync_backend gloo")
        self._group = await asyncio.to_thread(join_group, master_address, master_port, int(rank_offset),
                                              int(world_size), backend)
        self._device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else \
            torch.device("cpu")
        self._staged = {}

    async def update_weight(self, name: str, dtype: torch.dtype, shape: Any, empty_cache: bool = False) -> None:
        """Receive one parameter from rank 0's broadcast and stage it; at `empty_cache=True` (the sync's last
        parameter) every staged tensor lands in one validated, atomic update (policy_version + 1)."""
        if self._group is None:
            raise RuntimeError("update_weight before init_process_group. Fix: let the trainer build the weight "
                               "group first (OpenRLHF does at model init unless it uses CUDA IPC).")
        self._staged[name] = await asyncio.to_thread(self._receive, dtype, tuple(shape))
        if empty_cache:
            staged, self._staged = self._staged, {}
            await asyncio.to_thread(self.rollouts.update_weights, staged, None, False, self.in_flight)

    def _receive(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        tensor = torch.empty(shape, dtype=dtype, device=self._device)
        self._group.broadcast(tensor, 0).wait()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)  # the copy into the model runs on another thread's stream
        return tensor

    async def update_weight_cuda_ipc(self, name: str, dtype: torch.dtype, shape: Any, ipc_handles: Any,
                                     empty_cache: bool = False) -> None:
        raise RuntimeError("CUDA IPC weight updates are not supported here (OpenRLHF uses them with "
                           "--train.colocate_all and the nccl sync backend). Fix: pass --vllm.sync_backend gloo, "
                           "or do not colocate.")

    # ------------------------------------------------------------------ control
    async def reset_prefix_cache(self) -> None:
        await asyncio.to_thread(self.rollouts.reset_prefix_cache)

    async def pause_generation(self) -> None:
        """vLLM's `pause_generation(mode="keep")`: requests in flight freeze where they are until resume."""
        await asyncio.to_thread(self.rollouts.pause, "keep")

    async def resume_generation(self) -> None:
        await asyncio.to_thread(self.rollouts.resume)

    async def sleep(self, level: int = 1) -> None:
        """Free the KV cache and step buffers; the weights stay on the device at either level (vLLM's level 2 would
        discard them; a sync after it updates them in place here)."""
        if level not in (1, 2):
            raise invalid("level", level, "must be 1 or 2", "pass vLLM's sleep level")
        await asyncio.to_thread(self.rollouts.sleep)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """"kv_cache" (or no tags) re-allocates what sleep freed; "weights" alone changes nothing (they never left)."""
        for tag in tags or WAKE_TAGS:
            if tag not in WAKE_TAGS:
                raise invalid("tags", tags, f"holds {tag!r}; known tags are {', '.join(WAKE_TAGS)}",
                              "pass ['weights'], ['kv_cache'] or None")
        if tags is None or "kv_cache" in tags:
            await asyncio.to_thread(self.rollouts.wake)


async def _awaited(future: RolloutsFuture) -> RolloutBatch:
    """The future's batch, awaited without holding a thread; cancelling the await cancels the generation."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(_: Any) -> None:
        if not done.done():
            done.set_result(None)

    def wake(f: Any) -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody awaits this any more
            loop.call_soon_threadsafe(settle, f)

    future.add_done_callback(wake)
    try:
        await done
    except asyncio.CancelledError:
        future.cancel()
        raise
    return future.result()


def _single_turn_executor(remote_rm_url: Any) -> Any:
    try:
        from openrlhf.utils.agent import SingleTurnAgentExecutor
    except ImportError as error:
        raise ImportError(f"OpenRLHFEngine's default executor is OpenRLHF's SingleTurnAgentExecutor, which did not "
                          f"import ({error}). Fix: install openrlhf in the actor's environment, or pass executor=") \
            from None
    return SingleTurnAgentExecutor(remote_rm_url)
