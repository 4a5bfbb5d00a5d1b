"""WorkerConfig: how a RolloutWorker sizes and runs its engine. Frozen and validated at construction.

The defaults are sized for a small CPU machine and for a GPU shared with training: the KV cache takes a fixed
memory budget (not a fraction of free memory, as transformers does by default), and the batch token budget is
small enough that the per-step buffers stay in the tens of MiB.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import check_int, invalid

IN_FLIGHT_POLICIES = ("wait", "abort", "recompute", "keep")


def check_in_flight(value: object, field: str = "in_flight") -> None:
    if value not in IN_FLIGHT_POLICIES:
        raise invalid(field, value, f"must be one of {IN_FLIGHT_POLICIES}",
                      "use 'wait' (finish on the old weights), 'abort' (re-run on the new), 'recompute' (keep the "
                      "tokens, recompute their KV under the new weights) or 'keep' (continue on old-weight KV)")


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
    in_flight: what a weight update does with calls in flight (each update may override it): "wait" for them to
        finish on the old weights (default), "abort" them and re-run them on the new weights, "recompute" their KV
        under the new weights and continue (every token exact under the version that produced it), or "keep" their
        old-weight KV and continue (fastest; tokens after the switch approximate). See docs/async.md.
    seed: seed of the worker's own sampling generator (the global torch RNG is never touched).
    max_retries: times a request is re-run after the engine died under it before the call fails.
    env_threads: threads that run environments' synchronous `step` calls (and `make_env`) of multi-turn episodes, so
        that many slow steps overlap; a step that outlives `env_timeout` keeps its thread until it returns.
    attn_implementation: attention used by the engine: "auto" (default: "rollout_paged" on CPU, the model's own
        elsewhere), "rollout_paged" (rollout/engine/attention.py: no dense mask, batched decode), "sdpa",
        "paged|eager", a flash implementation, or None to keep the model's. The owner's attention is restored
        between calls.
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
    env_threads: int = 64
    attn_implementation: str | None = "auto"

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
        check_int("env_threads", self.env_threads, 1, "allow at least 1 thread for environment steps (64 is the "
                  "default)")
        check_in_flight(self.in_flight)
        if self.attn_implementation is not None and (not isinstance(self.attn_implementation, str)
                                                     or not self.attn_implementation):
            raise invalid("attn_implementation", self.attn_implementation, "must be None or a non-empty string",
                          "use 'auto', 'rollout_paged', 'sdpa', a flash implementation, or None")
        if not isinstance(self.prefix_caching, bool):
            raise invalid("prefix_caching", self.prefix_caching, "must be a bool", "use True or False")

