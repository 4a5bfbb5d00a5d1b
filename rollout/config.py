"""WorkerConfig: how a RolloutWorker sizes and runs its engine. Frozen and validated at construction.

The defaults are sized for a small CPU machine and for a GPU shared with training: the KV cache takes a fixed
memory budget (not a fraction of free memory, as transformers does by default), and the batch token budget is
small enough that the per-step buffers stay in the tens of MiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import check_int, invalid

IN_FLIGHT_POLICIES = ("wait", "abort")


@dataclass(frozen=True)
class WorkerConfig:
    """Engine sizing and behaviour.

    page_size: tokens per KV page (transformers minimum: 4).
    num_blocks: KV blocks of `page_size` tokens; None derives it from `kv_cache_memory_mb`.
    max_batch_tokens: query tokens per forward step (prefill chunks + decodes).
    kv_cache_memory_mb: KV budget used when num_blocks is None.
    max_cache_tokens: cap on cached tokens when num_blocks is None and the engine's attention allocates a dense
        max_batch_tokens x cache-tokens mask ("sdpa", "paged|eager"; an uncapped cache on CPU costs GiBs of mask).
        Mask-free attention ("rollout_paged", flash) is sized by kv_cache_memory_mb alone.
    max_requests_per_batch: most sequences in one forward step.
    prefix_caching: reuse KV of identical prompt prefixes across calls (invalidated on every weight change).
    in_flight: what a weight update does with requests in flight: "wait" for them to finish (default) or "abort"
        them and re-run them on the new weights.
    seed: seed of the worker's own sampling generator (the global torch RNG is never touched).
    max_retries: times a request is re-run after the engine died under it before the call fails.
    attn_implementation: attention used by the engine: "auto" (default: "rollout_paged" on CPU, the model's own
        elsewhere), "rollout_paged" (rollout/attention.py: no dense mask, batched decode), "sdpa", "paged|eager", a
        flash implementation, or None to keep the model's. The owner's attention is restored between calls.
    merge_adapters: for a model carrying LoRA adapters (PEFT), fold them into the base weights while a generate call
        runs and restore the base bytes exactly after it (rollout.adapters.merged). On by default: measured 1.12-1.27x
        the unmerged generation speed (about that of the base model alone), the merge + restore included
        (benchmarks/RESULTS.md, "LoRA"). Costs a second copy of the targeted base weights while a call runs, and
        fp32 rounding of W + BA instead of Wx + B(Ax) (the trainer/rollout gap measured ~2x the unmerged one, still
        ~1e-5 on the test model): turn it off when that memory is not there. No effect without adapters.
    """

    page_size: int = 16
    num_blocks: int | None = None
    max_batch_tokens: int = 512
    kv_cache_memory_mb: int = 256
    max_cache_tokens: int = 32768
    max_requests_per_batch: int = 128
    prefix_caching: bool = True
    in_flight: str = "wait"
    seed: int = 0
    max_retries: int = 2
    attn_implementation: str | None = "auto"
    merge_adapters: bool = True

    def __post_init__(self) -> None:
        check_int("page_size", self.page_size, 4, "use a page size of at least 4 tokens (16 is a good CPU default)")
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks, 1, "use None to size from kv_cache_memory_mb, or >= 1")
        check_int("max_batch_tokens", self.max_batch_tokens, 1, "use e.g. 512 on CPU, 2048-8192 on GPU")
        check_int("kv_cache_memory_mb", self.kv_cache_memory_mb, 1, "give the KV cache at least 1 MiB")
        check_int("max_cache_tokens", self.max_cache_tokens, self.page_size,
                      "allow at least one page of cached tokens")
        check_int("max_requests_per_batch", self.max_requests_per_batch, 1, "allow at least 1 request per step")
        check_int("max_retries", self.max_retries, 0, "use 0 to never re-run, or a small number such as 2")
        check_int("seed", self.seed, 0, "use a non-negative integer")
        if self.in_flight not in IN_FLIGHT_POLICIES:
            raise invalid("in_flight", self.in_flight, f"must be one of {IN_FLIGHT_POLICIES}",
                          "use 'wait' (updates wait for in-flight requests) or 'abort' (re-run them)")
        if self.attn_implementation is not None and (not isinstance(self.attn_implementation, str)
                                                     or not self.attn_implementation):
            raise invalid("attn_implementation", self.attn_implementation, "must be None or a non-empty string",
                          "use 'auto', 'rollout_paged', 'sdpa', a flash implementation, or None")
        for name in ("prefix_caching", "merge_adapters"):
            if not isinstance(getattr(self, name), bool):
                raise invalid(name, getattr(self, name), "must be a bool", "use True or False")

