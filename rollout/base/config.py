"""WorkerConfig: how a RolloutWorker sizes and runs its engine. Frozen and validated at construction.

Sizes left at None are the device's defaults (`for_device`): on CPU a quarter of the host's available memory for KV
(host pages cost memory only once tokens fill them, so the budget is a ceiling, not an allocation), steps of up to 2048
tokens and 512 sequences (a 512-row GRPO step decodes in one forward); on a GPU half of the device memory free when
the engine is built (again at every wake), and steps of up to 8192 tokens and 512 sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import check_int, invalid
from .speculation import Speculation

IN_FLIGHT_POLICIES = ("wait", "abort", "recompute", "keep")


def check_in_flight(value: object, field: str = "in_flight") -> None:
    if value not in IN_FLIGHT_POLICIES:
        raise invalid(field, value, f"must be one of {IN_FLIGHT_POLICIES}",
                      "use 'wait' (finish on the old weights), 'abort' (re-run on the new), 'recompute' (keep the "
                      "tokens, recompute their KV under the new weights) or 'keep' (continue on old-weight KV)")


CUDA_GRAPH_POLICIES = ("auto", "off")
CPU_LINEAR_KERNELS = ("auto", "blas", "onednn")


@dataclass(frozen=True)
class DeviceDefaults:
    """What a size left at None means on one kind of device."""

    max_batch_tokens: int
    max_requests_per_batch: int
    kv_cache_memory_mb: int | None  # a fixed budget, or None for kv_cache_memory_fraction
    kv_cache_memory_fraction: float | None


CPU_DEFAULTS = DeviceDefaults(max_batch_tokens=2048, max_requests_per_batch=512, kv_cache_memory_mb=None,
                              kv_cache_memory_fraction=0.25)
# A GRPO step of up to 512 rows decodes in one forward; 8192 tokens is transformers' own default step budget.
GPU_DEFAULTS = DeviceDefaults(max_batch_tokens=8192, max_requests_per_batch=512, kv_cache_memory_mb=None,
                              kv_cache_memory_fraction=0.5)


@dataclass(frozen=True)
class WorkerConfig:
    """Engine sizing and behaviour.

    page_size: tokens per KV page (transformers minimum: 4).
    num_blocks: KV blocks of `page_size` tokens; None derives it from the KV budget (the two fields below).
    max_batch_tokens: query tokens per forward step (prefill chunks + decodes); None: 2048 on CPU, 8192 on a GPU.
    kv_cache_memory_mb: KV budget in MiB, taken as given; None: the fraction below.
    kv_cache_memory_fraction: KV budget as a fraction in (0, 1] of the device memory free when the engine is built
        (CUDA: `torch.cuda.mem_get_info`; CPU: MemAvailable); exclusive with kv_cache_memory_mb. None: the device
        default (0.25 on CPU, 0.5 on a GPU). Capped at what the engine can use at once (max_requests_per_batch
        requests of the model's context). A sleeping worker measures again when it wakes.
    max_cache_tokens: cap on cached tokens when num_blocks is None and the engine's attention allocates a dense
        max_batch_tokens x cache-tokens mask ("sdpa", "paged|eager"; an uncapped cache on CPU costs GiBs of mask).
        Mask-free attention ("rollout_paged", flash) is sized by the KV budget alone.
    max_requests_per_batch: most sequences in one forward step; None: 512 on CPU and on a GPU.
    max_request_tokens: the longest request (prompt + completion) the worker must hold; when set, start-up fails
        unless the KV cache holds one such request, with an error that says how many tokens fit.
    prefix_caching: reuse KV of identical prompt prefixes across calls (invalidated on every weight change).
    in_flight: what a weight update does with calls in flight (each update may override it): "wait" for them to
        finish on the old weights (default), "abort" them and re-run them on the new weights, "recompute" their KV
        under the new weights and continue (every token exact under the version that produced it), or "keep" their
        old-weight KV and continue (fastest; tokens after the switch approximate). See docs/async.md.
    seed: keys the counter-based random streams of unseeded samples (the global torch RNG is never touched).
    max_retries: times a request is re-run after the engine died under it before the call fails.
    env_threads: threads that run environments' synchronous `step` calls (and `make_env`) of multi-turn episodes, so
        that many slow steps overlap; a step that outlives `env_timeout` keeps its thread until it returns.
    attn_implementation: attention used by the engine: "auto" (default: "rollout_paged" on CPU; on CUDA the model's
        own if it is flash, else flash_attention_2 when flash_attn imports, else "rollout_paged"), "rollout_paged"
        (rollout/engine/attention/paged.py: no dense mask, batched decode), "sdpa", "paged|eager", a flash
        implementation, or None to keep the model's. The owner's attention is restored between calls.
    cuda_graphs: "auto" (default) captures the engine's steps in CUDA graphs and overlaps host and device work (async
        batching) on CUDA when the attention allows it (a flash implementation); "off" never does. Off on CPU.
    cpu_linear: kernels of the engine's fp32 linear layers on CPU: "auto" (default) runs them on oneDNN where
        torch's BLAS (MKL) runs its slow kernels (an AVX-512 core that is not Intel's: MKL dispatches its AVX-512
        kernels on Intel CPUs only; measured 1.6-3.1x faster per linear and 1.2-1.3x on a GRPO step on an EPYC), else
        on torch's own; "blas" always torch's own (the trainer's, bit for bit); "onednn" always oneDNN. Only the engine
        thread's forward changes: the trainer's forward of the same shared model keeps torch's kernels. oneDNN's fp32
        product is summed in another order (~2x MKL's rounding against float64), inside the 1e-5 logprob rule; a
        seeded row is the same in every process on the same machine and choice. oneDNN keeps a compiled kernel per
        row count, so rows are padded to 24 buckets: its memory is bounded (~0.55 MiB a kernel, ~66 MiB for the tiny
        test model). docs/performance.md, "oneDNN linears".
    merge_adapters: for a model carrying LoRA adapters (PEFT), fold them into the base weights while a generate call
        runs and restore the base bytes exactly after it (rollout.model.adapters.merged). On by default: measured
        1.12-1.27x the unmerged generation speed (about that of the base model alone), the merge + restore included
        (benchmarks/results/lora.md, "LoRA"). Costs a second copy of the targeted base weights while a call runs, and
        fp32 rounding of W + BA instead of Wx + B(Ax) (the trainer/rollout gap measured ~2x the unmerged one, still
        ~1e-5 on the test model): turn it off when that memory is not there. No effect without adapters.
    record_routing: for a mixture-of-experts model, record the experts the engine's forward chose for every position
        of every row (`RolloutBatch.routing`, for `rollout.replay_routing`; docs/moe.md). Off by default (no hooks, no
        cost); on, the engine's steps are not captured in CUDA graphs (a replayed graph runs no hooks). A model whose
        routers the recorder does not understand is refused at start.
    speculation: speculative decoding (`Speculation`: draft sources, draft length, mode; docs/speculation.md): a
        decoding row is fed draft tokens in the same forward as its next token and keeps each draft only where it is
        the very token plain decoding samples there (the counter-based sampler decides every position), so the
        tokens, logprobs and versions are those of plain decoding, bit for bit; only the cost changes. None
        (default): off. Sync steps only (not with CUDA graphs / async batching).
    """

    page_size: int = 16
    num_blocks: int | None = None
    max_batch_tokens: int | None = None
    kv_cache_memory_mb: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_cache_tokens: int = 32768
    max_requests_per_batch: int | None = None
    max_request_tokens: int | None = None
    prefix_caching: bool = True
    in_flight: str = "wait"
    seed: int = 0
    max_retries: int = 2
    env_threads: int = 64
    attn_implementation: str | None = "auto"
    cuda_graphs: str = "auto"
    cpu_linear: str = "auto"
    merge_adapters: bool = True
    record_routing: bool = False
    speculation: Speculation | None = None

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, 4, "use a page size of at least 4 tokens (16 is a good CPU default)")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1, "use None to size from kv_cache_memory_mb, or >= 1")
        if self.max_batch_tokens is not None:
            check_int("max_batch_tokens", self.max_batch_tokens, 1, "use e.g. 2048 on CPU, 8192 on GPU")
        self._check_kv_budget()
        check_int("max_cache_tokens", self.max_cache_tokens, self.page_size,
                      "allow at least one page of cached tokens")
        if self.max_requests_per_batch is not None:
            check_int("max_requests_per_batch", self.max_requests_per_batch, 1, "allow at least 1 request per step")
        if self.max_request_tokens is not None:
            check_int("max_request_tokens", self.max_request_tokens, 2,
                      "use the longest prompt + max_new_tokens a call will send, or None to skip the start-up check")
        check_int("max_retries", self.max_retries, 0, "use 0 to never re-run, or a small number such as 2")
        check_int("seed", self.seed, 0, "use a non-negative integer")
        check_int("env_threads", self.env_threads, 1, "allow at least 1 thread for environment steps (64 is the "
                  "default)")
        check_in_flight(self.in_flight)
        if self.attn_implementation is not None and (not isinstance(self.attn_implementation, str)
                                                     or not self.attn_implementation):
            raise invalid("attn_implementation", self.attn_implementation, "must be None or a non-empty string",
                          "use 'auto', 'rollout_paged', 'sdpa', a flash implementation, or None")
        for name in ("prefix_caching", "merge_adapters", "record_routing"):
            if not isinstance(getattr(self, name), bool):
                raise invalid(name, getattr(self, name), "must be a bool", "use True or False")
        if self.speculation is not None and not isinstance(self.speculation, Speculation):
            raise invalid("speculation", self.speculation, "must be a rollout.Speculation or None",
                          "use e.g. Speculation(drafts=('context', 'history')), or None for no speculation")
        if self.cpu_linear not in CPU_LINEAR_KERNELS:
            raise invalid("cpu_linear", self.cpu_linear, f"must be one of {CPU_LINEAR_KERNELS}",
                          "use 'blas' (torch's own kernels), 'auto' (oneDNN where MKL is slow) or 'onednn'")
        if self.cuda_graphs not in CUDA_GRAPH_POLICIES:
            raise invalid("cuda_graphs", self.cuda_graphs, f"must be one of {CUDA_GRAPH_POLICIES}",
                          "use 'auto' (on CUDA when the attention allows it) or 'off'")

    def _check_kv_budget(self) -> None:
        if self.kv_cache_memory_mb is not None:
            check_int("kv_cache_memory_mb", self.kv_cache_memory_mb, 1, "give the KV cache at least 1 MiB")
        fraction = self.kv_cache_memory_fraction
        if fraction is None:
            return
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
            raise invalid("kv_cache_memory_fraction", fraction, "must be a number in (0, 1]",
                          "use e.g. 0.5 for half of the free device memory, or None")
        if self.kv_cache_memory_mb is not None:
            raise invalid("kv_cache_memory_fraction", fraction,
                          f"is exclusive with kv_cache_memory_mb (set to {self.kv_cache_memory_mb})",
                          "set one of the two KV budgets and leave the other at None")

    def for_device(self, device) -> "WorkerConfig":
        """This config with every size left at None replaced by the defaults of `device` (a torch.device or its
        type); the KV budget stays one of kv_cache_memory_mb or kv_cache_memory_fraction."""
        defaults = CPU_DEFAULTS if getattr(device, "type", device) == "cpu" else GPU_DEFAULTS
        sizes = {name: getattr(defaults, name) for name in ("max_batch_tokens", "max_requests_per_batch")
                 if getattr(self, name) is None}
        if self.kv_cache_memory_mb is None and self.kv_cache_memory_fraction is None:
            sizes.update(kv_cache_memory_mb=defaults.kv_cache_memory_mb,
                         kv_cache_memory_fraction=defaults.kv_cache_memory_fraction)
        return dataclasses.replace(self, **sizes)

