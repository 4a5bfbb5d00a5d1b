"""HOOKS: every private name of transformers' continuous-batching engine (and one private torch kernel) that rollout
uses, where (a file under rollout/engine/) and why. tests/test_upstream_contract.py checks that this table is
complete against the engine's source and pins each entry's behaviour; an upgrade that changes any of it must fail
there, loudly, before it silently breaks exactness or robustness.

Upstream offers no public extension points for what the engine needs (per-row sampling with exact logprobs, a
daemon loop thread, our own request ids and children, a mask-free attention, a loop that can die and be rebuilt), so
this subpackage reaches into it. The public-but-internal pieces it relies on (no underscore, same risk) are listed
in the contract test's docstring.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Hook:
    symbol: str  # the private name, as the source spells it
    owner: str  # upstream's class or module that defines it
    files: tuple[str, ...]  # where rollout uses it, relative to rollout/engine/
    why: str


HOOKS: tuple[Hook, ...] = (
    Hook("_forward_process_and_sample", "ModelRunner", ("upstream/runner.py",),
         "forward + logits processing + sampling in one method; ours samples every row with its own params and "
         "computes both logprobs from the same logits"),
    Hook("_schedule_request", "FIFOScheduler", ("upstream/scheduler.py",),
         "where a prompt's n samples are forked; a 1-token remainder forks with a 0-token forward that kills the "
         "loop, so ours splits those children first"),
    Hook("_infer_request_tokens", "FIFOScheduler", ("upstream/scheduler.py",),
         "where a pending request's prefix-cache match is taken (PENDING -> PREFILLING, position_offset advanced "
         "past the matched tokens); the wrapper counts the reused tokens an episode's turns did not prefill"),
    Hook("_create_batch_processor", "ContinuousBatchingManager", ("upstream/manager.py",),
         "builds the batch processor (and its model runner) before the loop starts, so the runner, cache, scheduler "
         "and step buffers take their hooks first; the loop reuses that processor"),
    Hook("_run_generation_loop", "ContinuousBatchingManager", ("upstream/manager.py",),
         "the loop body, run on a daemon thread of ours (upstream's start() makes a non-daemon one that hangs "
         "interpreter exit) and marked as the engine thread (no mask is built there)"),
    Hook("_generation_step", "ContinuousBatchingManager", ("upstream/manager.py",),
         "one step's forward, whose start and end a TurnTrace records"),
    Hook("_generation_thread", "ContinuousBatchingManager", ("upstream/manager.py",),
         "the loop thread is_running() and stop() look at, set by our daemon start()"),
    Hook("_original_attn_impl", "ContinuousBatchingManager", ("upstream/manager.py",),
         "the attention a manager switched the model from, which stop() puts back; ours replays upstream's stop() "
         "without its full garbage collections"),
    Hook("_wake_up_loop", "ContinuousBatchingManager", ("upstream/manager.py",),
         "add_request cannot submit a RequestState with our request id, children and eos list, so submit() puts it "
         "on input_queue itself and wakes the idle loop the same way; stop() wakes it to see the stop at once"),
    Hook("_attn_implementation", "PretrainedConfig", ("upstream/attention.py", "upstream/blocktable.py",
                                                      "upstream/manager.py", "upstream/memory.py"),
         "the attention a model runs; transformers has a setter (set_attn_implementation) but no public getter "
         "(scoring reads it too)"),
    Hook("_true_initial_tokens", "RequestState", ("upstream/state.py",),
         "a soft-reset request's prompt length (0 if never reset), so the penalties of a preempted request are "
         "counted again over its own completion, not its folded prompt (slots.py reads it through `history`)"),
    Hook("_status", "RequestState", ("upstream/switch.py",),
         "a request soft reset for a 'recompute' weight switch is marked FINISHED the way upstream's preemption "
         "marks it (bypassing the setter's lifespan bookkeeping) before create_equivalent_initial_request()'s copy "
         "is requeued"),
    Hook("_eos_token_ids", "RequestState", ("upstream/state.py",),
         "a request's stop ids as upstream checks them; a verify row stops emitting at the first one sampled, so "
         "nothing past it is recorded (the ledger) or appended"),
    Hook("_kv_token_views", "FullAttentionCacheAllocator", ("upstream/attention.py",),
         "per-layer [cache rows, kv heads, head dim] views of the paged cache that rollout_paged reads straight "
         "from, by the allocator's indices"),
    Hook("_scaled_dot_product_flash_attention_for_cpu", "torch.ops.aten", ("attention/paged.py",),
         "the CPU flash kernel, the only SDPA that also returns the log-sum-exp that merging shared-prefix "
         "attention needs"),
)


@dataclass(frozen=True)
class Patch:
    target: str  # what is replaced in process-wide state, as its owner spells it
    by: str  # the function of patches.py that replaces it (once, when the engine calls it)
    why: str


# Every change rollout makes to process-wide state (public names too), each made by one function of patches.py;
# tests/test_upstream_contract.py checks that this list is what patches.py assigns, and that importing rollout
# changes none of it.
PATCHES: tuple[Patch, ...] = (
    Patch("AttentionInterface['rollout_paged']", "install",
          "registers the mask-free paged attention (rollout/engine/attention/paged.py)"),
    Patch("AttentionMaskInterface['rollout_paged']", "install",
          "its mask entry: sdpa's off the engine thread, none on it"),
    Patch("continuous_batching.scheduler.SCHEDULER_MAPPING['rollout_fifo']", "install",
          "FIFO scheduling without the 1-token fork crash, with drafts joined to decoding rows"),
    Patch("continuous_batching.initialization.ensure_decode_fast_path_is_available", "install",
          "keeps the decode fast path's block tables under rollout_paged (upstream's check for every other attention)"),
    Patch("continuous_batching.cache.PagedAttentionMemoryHandler.__init__", "install",
          "upstream's memory plan fitted to rollout_paged (unchanged for other attentions)"),
    Patch("continuous_batching.cache.torch", "install",
          "the cache's one host allocation lazily zeroed; every other call is torch's own"),
    Patch("torch.nn.Linear.forward", "install_linear",
          "the engine thread's fp32 linears on oneDNN inside OneDNNLinears; everywhere else the forward before"),
    Patch("<Llama-exact RMSNorm class>.forward", "install_fused",
          "the engine thread's norms on the fused kernel inside Fused(), torch's bits; everywhere else the original"),
    Patch("<Llama-exact modeling module>.apply_rotary_pos_emb", "install_fused",
          "the engine thread's rotary on the fused kernel inside Fused(), torch's bits; everywhere else the original"),
)
