"""What a weight switch does to the engine's cached KV, inside a pause of its loop (no forward runs meanwhile).

- `forget_prefix_cache`: no request submitted after the switch may match KV computed by older weights. Unheld
  cached blocks go back to the pool; blocks still held by in-flight requests (mode "keep") get a random sentinel
  hash instead of none, because upstream re-hashes a held block whose hash is missing the next time its request
  completes a page, which would publish old-weight KV under a real content hash. Content hashes are 64-bit blake2b
  digests, so a random 64-bit sentinel equals one with probability 2^-64, and the hashes of later pages chain from
  it: nothing computed before the switch is ever matched.
- `recompute_in_flight` (mode "recompute"): every request the scheduler holds is soft reset the way upstream's own
  preemption does it (`RequestState.create_equivalent_initial_request`: the tokens generated so far are folded into
  the prompt, the request keeps its id and logprobs, its budget shrinks by what it generated) and requeued, so its
  KV is recomputed by the new weights before it samples again. CPU-offloaded KV would come back from the old weights,
  so the engine runs without a CPU swap pool (`cpu_offload_space` 0, the default; the contract test pins it).
"""

from __future__ import annotations

import secrets

from transformers.generation.continuous_batching.requests import RequestStatus

def forget_prefix_cache(manager) -> None:
    cache = manager.batch_processor.cache
    cache.evict_cached_blocks()
    for allocator in cache.cache_allocators.values():
        ledger = allocator.ledger
        ledger.hash_to_block.clear()
        ledger.block_to_hash.clear()
        for block in {b for table in allocator.block_table.values() for b in table}:
            sentinel = secrets.randbits(64)
            ledger.block_to_hash[block] = sentinel
            ledger.hash_to_block[sentinel] = block


def recompute_in_flight(manager) -> tuple[int, int]:
    """Soft reset every request the scheduler holds (started or waiting); returns how many were started and how many
    tokens of KV they held (computed again under the new weights)."""
    scheduler = manager.batch_processor.scheduler
    started = list(scheduler.active_requests.values())
    tokens = sum(state.position_offset for state in started)
    for state in started:
        fresh = state.create_equivalent_initial_request()
        state._status = RequestStatus.FINISHED
        scheduler.finish_request(state.request_id)
        scheduler.add_waiting_request(fresh)
    return len(started), tokens
