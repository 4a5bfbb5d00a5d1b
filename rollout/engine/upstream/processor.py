"""The batch processor with verify rows settled after upstream's update, and the page bookkeeping a verify row's
rollback needs (the cache allocators' block tables and ledger, which only this room reaches into).

The verification itself (which drafts a row keeps) is the engine's: rollout/engine/speculation/verifier.py, handed in
at construction as `verifier`.
"""

from __future__ import annotations

from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor


def complete_blocks(cache, past: int, kept: int) -> dict[str, int]:
    """The pages that `kept` tokens written from position `past` on complete, per allocator (upstream's count)."""
    if not cache.use_prefix_sharing:
        return {}
    counts = {}
    for name, allocator in cache.cache_allocators.items():
        count = (past % allocator.tokens_per_page + kept) // allocator.tokens_per_page
        if count:
            counts[name] = count
    return counts


def release_pages_past(cache, request_id: str, length: int) -> None:
    """Free the request's pages past its first `length` positions (allocated for drafts it did not keep). They were
    allocated fresh this step, never shared nor hashed."""
    for allocator in cache.cache_allocators.values():
        table = allocator.block_table.get(request_id)
        keep = -(-length // allocator.tokens_per_page)
        if table is None or len(table) <= keep:
            continue
        dropped = table[keep:]
        del table[keep:]
        allocator.pool.free_blocks(allocator.index, [b for b in dropped if allocator.ledger.release(b)])


class RolloutProcessor(ContinuousBatchProcessor):
    """upstream's batch processor, settling verify rows after its own update."""

    verifier: object | None  # the engine's Verifier (speculation/verifier.py), or None

    @classmethod
    def adopt(cls, processor: ContinuousBatchProcessor, verifier) -> None:
        processor.__class__ = cls
        processor.verifier = verifier

    def __del__(self) -> None:
        """upstream's drops the step buffers (their CUDA graphs) first, then runs a full garbage collection and empties
        the device cache: RolloutManager.stop does both where they are needed, once, after the processor is gone."""
        self.inputs_and_outputs = None

    def update_batch(self) -> None:
        verifier = self.verifier
        if verifier is None:
            return super().update_batch()
        if not verifier.drafted:
            super().update_batch()
        else:
            held = verifier.hold_blocks(self.inputs_and_outputs.requests_in_batch)
            super().update_batch()
            verifier.settle(self, held)
        verifier.ended()
