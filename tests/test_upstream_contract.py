"""What this project relies on inside transformers' continuous-batching engine (and one private torch kernel). An
upgrade that changes any of it must fail here, loudly, before it silently breaks exactness or robustness.

Upstream offers no public extension points for what the engine layer needs (per-row sampling with exact logprobs,
a daemon loop thread, our own request ids and children, a mask-free attention, a loop that can die and be rebuilt),
so rollout/engine/upstream/ (and only it: tests/test_layout.py) reaches into it, installed by one explicit
`install()` (importing rollout changes nothing in transformers). Every such hook, where it is used and why:

Private attributes and methods: `rollout.engine.upstream.HOOKS` (symbol, owner, files, why), the one table;
`test_the_hook_list_is_complete` checks it against the engine's source, and the tests below pin each behaviour.

Public but internal (no underscore, same risk):
- `background_thread_status.fatal_error` (core.py `Engine.is_alive`): how a loop that died is told from one that
  runs; the engine then rebuilds the manager and re-runs what it lost.
- `manager.input_queue` (upstream/manager.py): where submitted RequestStates wait for the scheduler.
- `background_thread_status.request_stop` / `is_pause_requested`, `distributed_helper.global_rank` and
  `manager.join` (upstream/manager.py): the steps of upstream's `stop()` that ours replays without its collections.
- The `output_ids` row layout (runner.py writes it): row 0 the sampled tokens, row 1 their logprobs as the int32
  view of fp32 values; upstream reads both back when it updates the batch.
- `PagedAttentionMemoryHandler.num_attention_masks` / `.kv_heads_at_peak` (memory.py patches `__init__` to set
  them): the memory plan charges every attention but flash for a dense mask and repeated KV; `rollout_paged` has
  neither, and the plan would refuse a large KV budget for a mask that is never built.
- `utils.get_device_and_memory_breakdown` and `initialization.resolve_max_memory_percent` (sizing.py): the memory
  upstream's plan accepts (0.6 of the NUMA nodes' memory less RSS on the host, 0.9 of free device memory), which a
  fraction budget's KV must stay within or the footprint check raises a MemoryError.
- `PagedAttentionCache.__init__` allocating the whole cache as one `torch.zeros(bytes, dtype=torch.uint8, device=...)`
  looked up as `torch` in transformers' `continuous_batching.cache` module (memory.py gives that module a `torch`
  whose `zeros` maps lazily zeroed pages on the host, so a large CPU budget costs only what is cached).
- The decode fast path (blocktable.py, plan.py): `initialization.ensure_decode_fast_path_is_available`, called by
  name while a manager resolves its config, turns it off for anything but flash (blocktable.py replaces it so that
  `rollout_paged` keeps it); in a decode-only step `get_model_kwargs` then passes `block_table` [allocators,
  sequences, width] (each request's pages, -1 past its last) with empty read and write indices, and nobody writes the
  step's KV but the attention; `PagedAttentionCache.fill_block_table(request_id, past_length, query_length, row)` fills
  a request's row with `block * (block_physical_stride // tokens_per_page)`, the index of the page in the layer's
  `_kv_token_views` viewed as pages of `tokens_per_page` rows (blocktable.py fills it the same way, faster).
- The plan cache's key (plan.py): `cu_seq_lens_q` and `read_index` are created afresh for every forward (and shared
  by its layers), so their identity tells one forward from the next.
- The cache ledgers' `hash_to_block` / `block_to_hash`, the allocators' `block_table` and `evict_cached_blocks`
  (switch.py): forgetting every prefix hash on a weight change, and giving blocks still held a random sentinel hash
  (upstream re-hashes a held block whose hash is missing, from its tokens alone; hashes are 64-bit blake2b).
- `scheduler.active_requests`, `finish_request`, `add_waiting_request`, `RequestState.create_equivalent_initial_request`
  (switch.py): the soft reset a "recompute" switch applies to every request in flight.
- `OffloadingManager.offload_requests` (preemption.py wraps it), `FIFOScheduler.schedule_batch` (scheduler.py wraps
  it), the cache's `pool.free_sectors` / `count_free_blocks`, the ledgers' `cached_blocks`, `num_blocks`,
  `num_sectors`, `bytes_per_sector` / `bytes_per_block`, `scheduler.waiting_requests`, `RequestState.logprobs`
  (counters.py, core.py, scheduler.py): what the engine's metrics count. Preemptions are the requests
  `offload_requests` takes out of the active set (the batch processor's only way to preempt); the KV peak is read
  once a step's pages are allocated; a re-admitted request (soft reset) is told from a new one by its logprobs.
- `scheduler.block_new_requests` (scheduler.py clears it when nothing is running): upstream's preemption sets it and
  only a request finishing in `update_batch` clears it, so a preemption followed by the cancellation of every running
  request left the waiting ones unscheduled forever.
- `OutputRouter.deliver` / `deliver_batch` (router.py overrides them), `ContinuousBatchingManager.start`'s body
  (replayed by upstream/manager.py with a daemon thread), `switch_to_cb_friendly_attn` (manager.py lets
  `rollout_paged` through),
  the `PagedAttentionArgs` fields and `FullAttentionCacheAllocator.update`'s signature (attention.py), and
  `attn_mask_is_needed` being false for `rollout_paged` (no dense mask is allocated).
"""

from __future__ import annotations

import ast
import copy
import inspect
import queue
import re
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import transformers
from transformers.generation.continuous_batching.cache import PagedAttentionMemoryHandler
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import BlockLedger
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.continuous_api import (
    BackgroundThreadStatus, ContinuousBatchingManager, ContinuousBatchProcessor, OutputRouter)
from transformers.generation.continuous_batching.input_outputs import (ContinuousBatchingIOs, HostDeviceIOPair,
                                                                       PagedAttentionArgs)
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
from transformers.generation.continuous_batching.scheduler import FIFOScheduler
from transformers.generation.continuous_batching.utils import attn_mask_is_needed

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine.attention import plan as plan_mod
from rollout.engine import install
from rollout.engine.upstream import HOOKS, PATCHES
from rollout.engine.upstream import NAME
from rollout.engine.upstream.runner import OUTPUT_ROWS, RolloutModelRunner
from rollout.engine.upstream.scheduler import RolloutScheduler
from rollout.engine.upstream.state import history

ENGINE = Path(__file__).resolve().parents[1] / "rollout" / "engine"


@pytest.fixture()
def worker(tiny):
    model, tok = tiny
    with RolloutWorker(model, WorkerConfig(num_blocks=64), tokenizer=tok) as worker:
        yield worker


def test_transformers_is_the_pinned_version():
    assert transformers.__version__ == "5.23.0"


def test_the_hook_list_is_complete():
    """Every `_name` the engine layer uses that upstream also defines (an upstream private it calls, reads or
    overrides) is in HOOKS with every file that uses it, and every listed use still exists."""
    upstream = Path(transformers.__file__).parent
    text = "\n".join(p.read_text() for p in (upstream / "generation" / "continuous_batching").rglob("*.py"))
    text += (upstream / "configuration_utils.py").read_text()
    used = set()  # (name, file)
    for path in ENGINE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "name", None) \
                if isinstance(node, ast.FunctionDef) else None
            if name and name.startswith("_") and not name.startswith("__"):
                used.add((name, str(path.relative_to(ENGINE))))
    listed = {(hook.symbol, file) for hook in HOOKS for file in hook.files}
    upstream_privates = {(n, f) for n, f in used if re.search(rf"\b{re.escape(n)}\b", text)}
    assert upstream_privates - listed == set(), "list it in rollout/engine/upstream/hooks.py, with the reason"
    assert listed - used == set(), "a hook the engine no longer uses there: drop it from the table"
    assert all(file.startswith("upstream/") for _, file in upstream_privates), "hooks live in rollout/engine/upstream/"
    assert all(hook.why and hook.owner for hook in HOOKS)


def _leaf(target: str) -> str:
    """The name a PATCHES target replaces: `A.b.c` -> `c`, `A['key']` -> `A`."""
    return target.split("[")[0].rsplit(".", 1)[-1]


def test_every_process_wide_patch_is_listed_with_the_function_that_makes_it():
    """upstream/patches.py is the one place process-wide state changes (tests/test_layout.py), and each change its
    functions make (an attribute or registry entry replaced) is a row of PATCHES with that function: the private
    helpers `_patch_*` act for `install_fused`, which calls them (the module's other functions read code, and change
    nothing but the objects they build)."""
    tree = ast.parse((ENGINE / "upstream" / "patches.py").read_text())
    made = set()
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith(("install", "_patch"))):
        owner = "install_fused" if fn.name.startswith("_patch") else fn.name
        for node in ast.walk(fn):
            targets = node.targets if isinstance(node, ast.Assign) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and target.attr != "__wrapped__":  # our wrapper's own field
                    made.add((owner, target.attr))
                elif isinstance(target, ast.Subscript):
                    made.add((owner, ast.unparse(target.value).rsplit(".", 1)[-1]))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "register":
                made.add((owner, ast.unparse(node.func.value)))
    listed = {(patch.by, _leaf(patch.target)) for patch in PATCHES}
    assert made == listed
    assert all(patch.why for patch in PATCHES)


def test_importing_rollout_changes_nothing_in_transformers_until_install():
    """In a fresh process: importing every rollout module leaves transformers as it was; install() plugs every hook
    in, and a second call changes nothing more. A module whose optional extra is not installed (Ray, the server's
    fastapi, ...: a GPU machine's Python may lack them) is left out, and only such a module."""
    script = textwrap.dedent("""
        import importlib, pkgutil
        EXTRAS = {"ray", "fastapi", "uvicorn", "xgrammar", "trl", "peft", "accelerate", "matplotlib", "tensorboard",
                  "flash_attn"}
        def missing(exc):  # the top-level module an ImportError (or the one it was raised from) could not find
            while exc is not None and not getattr(exc, "name", None):
                exc = exc.__cause__
            return exc.name.split(".")[0] if exc is not None else None
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.generation.continuous_batching import cache, initialization, scheduler
        from transformers.models.llama import modeling_llama
        import torch
        def state():
            return (AttentionInterface._global_mapping.get("rollout_paged"),
                    AttentionMaskInterface._global_mapping.get("rollout_paged"),
                    scheduler.SCHEDULER_MAPPING.get("rollout_fifo"),
                    initialization.ensure_decode_fast_path_is_available,
                    cache.PagedAttentionMemoryHandler.__init__, cache.torch)
        def kernels():  # what install_linear and install_fused replace, only when an engine chooses those kernels
            return (torch.nn.Linear.forward, modeling_llama.LlamaRMSNorm.forward, modeling_llama.apply_rotary_pos_emb)
        before, kernels_before = state(), kernels()
        import rollout
        for info in pkgutil.walk_packages(rollout.__path__, "rollout."):
            try:
                importlib.import_module(info.name)
            except ImportError as exc:
                if missing(exc) not in EXTRAS:
                    raise
                print("left out (its extra is not installed):", info.name)
        assert state() == before and kernels() == kernels_before, "an import changed transformers or torch"
        from rollout.engine import install
        from rollout.engine.upstream import is_installed
        assert not is_installed()
        install()
        after = state()
        assert all(a is not b for a, b in zip(after, before)), after
        install()
        assert state() == after and kernels() == kernels_before  # install() leaves the kernels' targets alone
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- overridden methods
def test_the_hooked_methods_keep_their_signatures():
    assert list(inspect.signature(ModelRunner._forward_process_and_sample).parameters) == [
        "self", "model", "batch_data", "carry_over_ids", "prev_output_ids", "output_ids"]
    assert list(inspect.signature(FIFOScheduler._schedule_request).parameters) == [
        "self", "state", "request_tokens", "token_budget", "request_ids_to_remove_from_waiting"]
    assert {"deliver", "deliver_batch", "fail_and_deliver"} <= set(vars(OutputRouter))
    assert {"_create_batch_processor", "_run_generation_loop", "pause", "cancel_request", "is_running"} <= set(
        vars(ContinuousBatchingManager))
    # Engine._start replays start() with a daemon thread: start() must still be exactly this
    source = inspect.getsource(ContinuousBatchingManager.start)
    assert "self.background_thread_status.clear()" in source
    assert "threading.Thread(target=self._run_generation_loop)" in source
    ledger = BlockLedger()
    assert ledger.hash_to_block == {} and ledger.block_to_hash == {} and ledger.cached_blocks == {}


def test_stop_and_the_processors_finaliser_do_only_what_ours_replay_and_a_collection():
    # RolloutManager.stop replays stop() and RolloutProcessor.__del__ replays __del__, each without gc.collect() (and
    # empty_cache, done by stop on CUDA): a step upstream adds to either must be replayed too
    def calls(function) -> set[str]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        return {ast.unparse(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}

    collection = {"gc.collect", "torch.get_device_module", "hasattr", "device_module.empty_cache"}
    assert calls(ContinuousBatchingManager.stop) == collection | {
        "RuntimeError", "logger.info", "logger.warning", "perf_counter", "self.background_thread_status.request_stop",
        "self.background_thread_status.is_pause_requested", "self.join", "self.model.set_attn_implementation"}
    assert calls(ContinuousBatchProcessor.__del__) == collection
    assert "self.inputs_and_outputs = None" in inspect.getsource(ContinuousBatchProcessor.__del__)
    stop = inspect.getsource(ContinuousBatchingManager.stop)
    assert "self.batch_processor = None" in stop and "self._original_attn_impl = None" in stop


def test_the_loop_runs_the_batch_processor_built_before_it_started(worker):
    # core.py builds the processor with _create_batch_processor and swaps its runner for ours before start(); the
    # loop's own call must hand back that processor (reset), not build a fresh one with upstream's runner
    source = inspect.getsource(ContinuousBatchingManager._run_generation_loop)
    assert "batch_processor = self._create_batch_processor()" in source
    assert 'batch_processor = getattr(self, "batch_processor", None)' in inspect.getsource(
        ContinuousBatchingManager._create_batch_processor)
    worker.generate([[5, 6, 7]], SamplingParams(max_new_tokens=3))
    assert type(worker.engine.manager.batch_processor.model_runner) is RolloutModelRunner


def test_upstream_still_schedules_a_zero_token_fork_and_ours_does_not():
    def fresh(tokens: list[int], children: int) -> RequestState:
        return RequestState(request_id="p", initial_tokens=tokens, num_children=children, max_new_tokens=4)

    upstream = FIFOScheduler.__new__(FIFOScheduler)
    FIFOScheduler.reset(upstream)
    state = fresh([5], children=2)
    upstream._schedule_request(state, [5], 100, set())
    assert state.tokens_to_process == [] and upstream._requests_to_fork == [state]  # the crash: 0-token forward

    ours = RolloutScheduler.__new__(RolloutScheduler)
    RolloutScheduler.reset(ours)
    state = fresh([5], children=2)
    ours._schedule_request(state, [5], 100, set())
    assert state.tokens_to_process == [5] and ours._requests_to_fork == []
    assert list(ours.waiting_requests) == ["p__child#0", "p__child#1"]
    assert all(c.initial_tokens == [5] and c.num_children == 0 for c in ours.waiting_requests.values())
    assert state.status == RequestStatus.DECODING


# ---------------------------------------------------------------------------------------------- the loop thread
def test_requests_reach_the_loop_through_the_input_queue_and_the_wake_up_event(worker):
    # core.py's _submit does what add_request does, with our RequestState: queue it, then wake the idle loop
    add = inspect.getsource(ContinuousBatchingManager.add_request)
    assert "self.input_queue.put(state" in add and "self._wake_up_loop.set()" in add
    body = inspect.getsource(ContinuousBatchingManager._generation_loop_body)
    assert "self._wake_up_loop.wait(" in body and "self._wake_up_loop.clear()" in body
    manager = worker.engine.manager
    assert isinstance(manager._wake_up_loop, threading.Event) and isinstance(manager.input_queue, queue.Queue)
    assert manager._generation_thread.daemon and manager._generation_thread.is_alive()


def test_a_loop_that_dies_records_its_error_as_fatal_error(tiny, monkeypatch):
    # Engine.is_alive reads background_thread_status.fatal_error: without it a dead loop looks alive and every call
    # waits forever
    status = BackgroundThreadStatus()
    assert status.fatal_error is None
    status.record_fatal_error(ValueError("x"))
    assert isinstance(status.fatal_error, ValueError)
    status.clear()
    assert status.fatal_error is None

    model, tok = tiny
    monkeypatch.setattr(RolloutModelRunner, "_forward_process_and_sample",
                        lambda self, *a: (_ for _ in ()).throw(RuntimeError("injected")))
    with RolloutWorker(model, WorkerConfig(num_blocks=64, max_retries=0), tokenizer=tok) as worker:
        first = worker.engine.manager
        with pytest.raises(RuntimeError, match="injected"):
            worker.generate([[5, 6, 7]], SamplingParams(max_new_tokens=2))
        assert isinstance(first.background_thread_status.fatal_error, RuntimeError)
        assert "injected" in str(first.background_thread_status.fatal_error)
        assert worker.engine.manager is not first and worker.engine.num_restarts >= 1


# ---------------------------------------------------------------------------------------------- what the runner writes
def test_output_ids_hold_tokens_in_row_0_and_fp32_logprobs_as_int32_in_row_1(worker):
    # upstream's own sampler writes this layout, and the batch update reads it back: runner.py writes the same
    source = inspect.getsource(ModelRunner._sample)
    assert "output_ids[0, :tokens].copy_(next_tokens)" in source
    assert "output_ids[1, :tokens].copy_(logprobs.view(dtype=torch.int32))" in source
    manager = worker.engine.manager
    with manager.pause():  # the loop is parked: its buffers are ours for a moment
        io = manager.batch_processor.inputs_and_outputs
        assert isinstance(io, ContinuousBatchingIOs)
        # rows 0 and 1 are upstream's (return_logprobs=True); runner.RolloutIOs adds row 2, the sampling logprobs,
        # and the top-list rows after it, read back in the same copy
        assert io.output_ids.dtype == torch.int32 and io.output_ids.shape[0] == OUTPUT_ROWS
        count, io.num_request_in_batch = io.num_request_in_batch, 3
        tokens, logprobs = torch.tensor([7, 9, 11]), torch.tensor([-0.5, -1.25, -3.0e-8])
        try:
            io.output_ids[0, :3].copy_(tokens)  # as runner.py does
            io.output_ids[1, :3].copy_(logprobs.float().view(dtype=torch.int32))
            _, new_tokens, new_logprobs = io.prepare_batch_update()
        finally:
            io.output_ids.zero_()
            io.num_request_in_batch = count
    assert new_tokens == tokens.tolist() and new_logprobs == logprobs.tolist()


# ---------------------------------------------------------------------------------------------- rollout_paged
def test_full_attention_layers_keep_per_layer_token_views_of_the_cache():
    # rollout_paged reads cache rows straight from these [rows, kv_heads, head_dim] views, by the allocator's indices
    source = inspect.getsource(FullAttentionCacheAllocator.register_cache_tensor)
    assert "self._kv_token_views[layer_idx] = (k_view, v_view)" in source
    update = inspect.getsource(FullAttentionCacheAllocator.update)
    assert "k_cache, v_cache = self._kv_token_views[layer_idx]" in update
    assert "torch.index_select(k_cache, 0, read_index)" in update


def test_the_upstream_pieces_rollout_paged_relies_on_keep_their_shape():
    """An upgrade that moves any of these must fail here, not silently fall back to a dense mask or crash the loop."""
    assert list(inspect.signature(FullAttentionCacheAllocator.update).parameters) == [
        "self", "key_states", "value_states", "layer_idx", "read_index", "write_index"]
    assert {"switch_to_cb_friendly_attn", "_run_generation_loop"} <= set(vars(ContinuousBatchingManager))
    assert {"cu_seq_lens_q", "cu_seq_lens_k", "read_index", "write_index", "cache"} <= set(
        PagedAttentionArgs.__annotations__)

    class Config:
        _attn_implementation = NAME

    assert not attn_mask_is_needed(Config())


def test_every_forward_gets_fresh_cu_seq_lens_q_and_read_index(worker, monkeypatch):
    """plan.py builds one Plan per forward and reuses it for every layer, keyed on the identity of the step's
    `cu_seq_lens_q` tensor and `read_index` list: each forward must bring new ones (else a stale plan is reused),
    shared by all its layers (else the plan is rebuilt per layer)."""
    assert "self.inputs_and_outputs.get_model_kwargs(" in inspect.getsource(ContinuousBatchProcessor._generation_step)
    manager = worker.engine.manager
    with manager.pause():
        io = manager.batch_processor.inputs_and_outputs
        first, second = io.get_model_kwargs(), io.get_model_kwargs()
    assert first["cu_seq_lens_q"] is not second["cu_seq_lens_q"] and first["read_index"] is not second["read_index"]

    forwards, builds = [], []
    run, build = RolloutModelRunner._forward_process_and_sample, plan_mod._build_plan
    monkeypatch.setattr(RolloutModelRunner, "_forward_process_and_sample",
                        lambda self, *a: forwards.append(1) or run(self, *a))
    monkeypatch.setattr(plan_mod, "_build_plan", lambda allocator, kwargs: builds.append(1) or build(allocator,
                                                                                                      kwargs))
    worker.generate([[5, 6, 7, 8], [9, 10]], SamplingParams(n=2, max_new_tokens=6, ignore_eos=True))
    assert worker.model.config.num_hidden_layers > 1 and len(forwards) > 1
    assert len(builds) == len(forwards)  # one full-attention layer group: one plan per forward, whatever the layers


def test_the_memory_plan_attributes_are_set_at_init_and_read_by_the_footprint():
    install()  # what the engine does before it builds a manager
    from transformers import LlamaConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    consumers = inspect.getsource(PagedAttentionMemoryHandler)
    assert "self.kv_heads_at_peak *" in consumers and "self.num_attention_masks *" in consumers
    config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
    plans = {}
    for impl in ("sdpa", NAME):
        config._attn_implementation = impl
        plans[impl] = PagedAttentionMemoryHandler(config, ContinuousBatchingConfig(max_memory_percent=0.5),
                                                  torch.float32, 1024, 16, 4096, ["full_attention"])
    assert (plans["sdpa"].num_attention_masks, plans["sdpa"].kv_heads_at_peak) == (1, 2 * 4 + 2)  # upstream's
    assert (plans[NAME].num_attention_masks, plans[NAME].kv_heads_at_peak) == (0, 2 * 2)  # memory.py's


def test_the_paged_cache_is_one_uint8_zeros_allocation_through_its_modules_torch():
    install()  # what the engine does before it builds a manager
    from transformers.generation.continuous_batching import cache as cache_module
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    from rollout.engine.upstream import memory

    source = inspect.getsource(PagedAttentionCache.__init__)
    assert len(re.findall(r"torch\.zeros\(", source)) == 1
    assert "self.cache_tensor = torch.zeros(non_trash_bytes + trash_bytes, dtype=torch.uint8, device=self.device)" \
        in source
    assert isinstance(cache_module.torch, memory.CacheTorch)
    lazy = cache_module.torch.zeros(3 * 2**20, dtype=torch.uint8, device=torch.device("cpu"))
    assert lazy.dtype == torch.uint8 and lazy.shape == (3 * 2**20,) and int(lazy.count_nonzero()) == 0
    assert cache_module.torch.zeros(2, 3).shape == (2, 3)  # every other call is torch's own
    assert cache_module.torch.Tensor is torch.Tensor


def test_the_decode_fast_path_check_is_looked_up_by_name_and_kept_for_rollout_paged():
    install()  # what the engine does before it builds a manager
    from transformers import LlamaConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import initialization

    from rollout.engine.upstream import blocktable

    source = inspect.getsource(initialization.resolve_continuous_batching_config)
    assert "ensure_decode_fast_path_is_available(config, cb_config, user_requested_decode_path)" in source
    assert initialization.ensure_decode_fast_path_is_available is blocktable.keep_block_tables
    config = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128)
    for impl, kept in (("sdpa", 0), (NAME, 9)):
        config._attn_implementation = impl
        cb_config = ContinuousBatchingConfig(max_blocks_per_request=9)
        initialization.ensure_decode_fast_path_is_available(config, cb_config, True)
        assert cb_config.max_blocks_per_request == kept  # upstream's check on CPU turns it off for sdpa
    config.layer_types, config.sliding_window = ["sliding_attention", "full_attention"], 8
    cb_config = ContinuousBatchingConfig(max_blocks_per_request=9)
    initialization.ensure_decode_fast_path_is_available(config, cb_config, True)
    assert cb_config.max_blocks_per_request == 0  # sliding-window groups have no block tables


def test_block_table_rows_hold_each_requests_pages_of_the_layers_token_view(worker):
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    # a copy of the engine's cache whose allocators hold only the probe: the engine thread owns the live tables
    cache = copy.copy(worker.engine.manager.batch_processor.cache)
    cache.cache_allocators = {name: copy.copy(a) for name, a in cache.cache_allocators.items()}
    allocator = cache.cache_allocators["full_attention"]
    allocator.block_table = {"probe": [3, 7, 11]}
    assert list(inspect.signature(PagedAttentionCache.fill_block_table).parameters) == [
        "self", "request_id", "past_length", "query_length", "block_table"]
    ours, upstream = (torch.full((1, 6), -1, dtype=torch.int32) for _ in range(2))
    cache.fill_block_table("probe", 40, 1, ours)  # RolloutCache's
    PagedAttentionCache.fill_block_table(cache, "probe", 40, 1, upstream)
    assert torch.equal(ours, upstream) and ours[0, 3:].tolist() == [-1, -1, -1]
    # entry j is the page of the request's keys j * page ... (j + 1) * page - 1 in the token view
    reads = allocator.get_read_indices("probe", 40, 1)
    page = allocator.tokens_per_page
    assert [reads[j * page] // page for j in range(3)] == ours[0, :3].tolist()
    assert all(reads[j * page + t] == reads[j * page] + t for j in range(3) for t in range(page) if j * page + t < 41)


def test_a_decode_only_step_comes_with_a_block_table_and_no_per_token_indices(worker, monkeypatch):
    from rollout.engine.attention import plan as plan_mod

    seen = []
    build = plan_mod._build_plan

    def spy(allocator, kwargs):
        if kwargs.get("block_table") is not None:
            seen.append((kwargs["block_table"].shape, [i.numel() for i in kwargs["read_index"]],
                         [i.numel() for i in kwargs["write_index"]]))
        return build(allocator, kwargs)

    monkeypatch.setattr(plan_mod, "_build_plan", spy)
    worker.generate([list(range(10, 30))], SamplingParams(n=2, max_new_tokens=5, ignore_eos=True))
    assert seen, "no decode-only step used a block table"
    shape, reads, writes = seen[-1]
    assert shape[0] == 1 and shape[1] == 2 and reads == [0] and writes == [0]


def test_the_cpu_flash_kernel_returns_the_log_sum_exp():
    q, k, v = (torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=None,
                                                                          scale=None)[:2]
    scores = q @ k.transpose(-1, -2) / 8 ** 0.5
    assert torch.allclose(out, torch.softmax(scores, -1) @ v, atol=1e-5)
    assert torch.allclose(lse.float(), torch.logsumexp(scores, -1), atol=1e-5)


def test_a_prefix_match_is_taken_in_infer_request_tokens_from_a_pending_request():
    source = inspect.getsource(FIFOScheduler._infer_request_tokens)
    assert "search_prefix_match" in source and "RequestStatus.PENDING" in source
    assert "state.position_offset += prefill_length" in source
    assert list(inspect.signature(FIFOScheduler._infer_request_tokens).parameters) == [
        "self", "state", "request_ids_to_remove_from_waiting"]


def test_what_a_verify_step_relies_on_in_request_states_and_the_cache():
    """upstream/verify.py: a decoding request's next input is `tokens_to_process` (set by each appended token),
    its stop ids are `_eos_token_ids`, its max_new_tokens counts down through soft resets, and the pages a forward
    completes are counted and hashed from `initial_tokens + generated_tokens`."""
    state = RequestState(request_id="r0", initial_tokens=[5, 6, 7], max_new_tokens=3, eos_token_id=[2, 4])
    assert state._eos_token_ids == {2, 4}
    state.status = RequestStatus.DECODING
    assert not state.update_and_check_completion(9, -0.5) and state.tokens_to_process == [9]
    assert not state.update_and_check_completion(8, -0.25) and state.generated_tokens == [9, 8]
    assert state.update_and_check_completion(1, -1.0) and state.status == RequestStatus.FINISHED  # the budget
    source = inspect.getsource(FIFOScheduler._infer_request_tokens)
    assert "if state.status == RequestStatus.DECODING:\n            request_tokens = state.tokens_to_process" in source
    from transformers.generation.continuous_batching.cache import PagedAttentionCache
    count = inspect.getsource(PagedAttentionCache.count_new_complete_blocks)
    assert "(tokens_in_last_block + request_len) // allocator.tokens_per_page" in count
    assert "state.initial_tokens + state.generated_tokens" in inspect.getsource(
        PagedAttentionCache.mark_complete_blocks)
    assert "logits_to_keep" in inspect.getsource(ModelRunner)  # the runner passes it: a verify step widens it


def test_a_soft_reset_folds_the_generated_tokens_into_the_prompt_and_keeps_id_and_logprobs():
    state = RequestState(request_id="r0", initial_tokens=[5, 6, 7], max_new_tokens=10, eos_token_id=[2])
    state.generated_tokens, state.logprobs = [8, 9], [-0.5, -0.25]
    fresh = state.create_equivalent_initial_request()
    assert fresh.request_id == "r0" and fresh.initial_tokens == [5, 6, 7, 8, 9] and fresh.max_new_tokens == 8
    assert fresh.logprobs == [-0.5, -0.25] and fresh.status == RequestStatus.PENDING
    out = fresh.to_generation_output()
    assert out.prompt_ids == [5, 6, 7] and out.generated_tokens == [8, 9]
    # penalties.history reads a soft-reset request's prompt and completion back the same way
    assert fresh._true_initial_tokens == 3 and state._true_initial_tokens == 0
    fresh.generated_tokens = [4]
    assert history(fresh) == ([5, 6, 7], [8, 9, 4]) and history(fresh.create_equivalent_initial_request()) == (
        [5, 6, 7], [8, 9, 4])
    assert "_status" in vars(state)  # the field a soft reset sets directly, as upstream's preemption does
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    assert ContinuousBatchingConfig().cpu_offload_space == 0  # no CPU swap pool: nothing restores old-weight KV


def test_only_a_finishing_request_lets_new_requests_in_after_a_preemption():
    """scheduler.py clears `block_new_requests` when nothing is running: upstream must still set it in
    `offload_requests` and clear it only where a request finishes (else the hook is stale or unneeded)."""
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    assert "scheduler.block_new_requests = True" in inspect.getsource(OffloadingManager.offload_requests)
    update = inspect.getsource(ContinuousBatchProcessor.update_batch)
    assert update.count("self.scheduler.block_new_requests = False") == 1
    assert "if not self.block_new_requests:" in inspect.getsource(FIFOScheduler.schedule_batch)


def test_preemption_goes_through_offload_requests_which_takes_requests_out_of_the_active_set(worker):
    """preemption.py counts a preemption as a request that `offload_requests` took out of `active_requests`: the batch
    processor must still preempt only through it, and it must still finish (then requeue) each victim. The count
    itself is checked against every soft reset under real KV pressure in tests/test_metrics.py."""
    from transformers.generation.continuous_batching.offloading_manager import OffloadingManager

    from rollout.engine.observe.counters import kv_pages
    from rollout.engine.upstream.preemption import RolloutOffloading

    prepare = inspect.getsource(ContinuousBatchProcessor.prepare_next_batch)
    assert prepare.count("self.offloading_manager.offload_requests()") == 2
    offload = inspect.getsource(OffloadingManager.offload_requests)
    assert "scheduler.finish_request(request_id)" in offload and "scheduler.add_waiting_request(new_state)" in offload
    assert "new_state = state.create_equivalent_initial_request()" in offload
    assert list(inspect.signature(FIFOScheduler.schedule_batch).parameters) == ["self", "token_budget", "cache_budget"]
    assert RequestState(request_id="r", initial_tokens=[1, 2]).logprobs == []  # a new request has sampled nothing
    processor = worker.engine.manager.batch_processor
    assert type(processor.offloading_manager) is RolloutOffloading and type(processor.scheduler) is RolloutScheduler
    worker.generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=3))
    assert kv_pages(processor.cache) == (64, 0, 0)  # the page count reads upstream's pools and ledgers


def test_block_hashes_are_unsigned_64_bit_chained_from_the_parent():
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash
    first = compute_block_hash(None, [1, 2, 3, 4])
    assert 0 <= first < 2**64 and compute_block_hash(first, [5, 6]) != compute_block_hash(None, [5, 6])
    ledger = BlockLedger()
    assert {"hash_to_block", "block_to_hash"} <= set(vars(ledger))


def test_the_step_inputs_and_outputs_keep_the_layout_the_sampler_hooks_rely_on():
    # runner.RowSlotArgs: one line of the bulk input tensor per `tensors_required`, filled by prepare_tensor_args and
    # handed to the forward as logits_processor_args
    setup = inspect.getsource(ContinuousBatchingIOs._setup_static_tensors)
    assert "bulk_lines = self.static_inputs + logit_processor.tensors_required" in setup
    assert "logit_processor.fill_defaults(self.logits_processors_defaults)" in setup
    prepare = inspect.getsource(ContinuousBatchingIOs.prepare_batch_tensors)
    assert "arg_storage=self._bulk_input_tensor[self.static_inputs :]," in prepare
    assert "logits_processor_args=self._bulk_input_tensor[self.static_inputs :, :num_sequences]" in inspect.getsource(
        ContinuousBatchingIOs.get_model_kwargs)
    # runner.RolloutIOs: outputs are read back once per step through prepare_batch_update, which returns
    # (requests, tokens, logprobs); async batching copies the whole output tensor to the host and drops the tokens of
    # requests finished or preempted after scheduling
    assert list(inspect.signature(ContinuousBatchingIOs.prepare_batch_update).parameters) == ["self"]
    update = inspect.getsource(ContinuousBatchProcessor.update_batch)
    assert "requests_in_batch, new_tokens, logprobs = self.inputs_and_outputs.prepare_batch_update()" in update
    assert "if state.status in (RequestStatus.FINISHED, RequestStatus.PENDING):" in update
    assert "self.host_io.output_ids.copy_(self.device_io.output_ids, non_blocking=True)" in inspect.getsource(
        HostDeviceIOPair.transfer_outputs_d2h)
    assert "self.logit_processor = ContinuousBatchingLogitsProcessorList(" in inspect.getsource(
        ContinuousBatchingManager.__init__)


def test_the_memory_plan_accepts_the_share_sizing_assumes():
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import cache as upstream_cache
    from transformers.generation.continuous_batching.initialization import resolve_max_memory_percent

    from rollout.engine.upstream import memory

    for device, expected in (("cpu", memory.PLAN_SHARE["cpu"]), ("cuda", memory.PLAN_SHARE_DEFAULT)):
        config = ContinuousBatchingConfig()
        resolve_max_memory_percent(config, has_logit_processors=False, device=torch.device(device))
        assert config.max_memory_percent == expected, device
    assert upstream_cache.get_device_and_memory_breakdown is memory.get_device_and_memory_breakdown
    source = inspect.getsource(upstream_cache.PagedAttentionMemoryHandler.get_available_memory)
    assert "total - max(allocated, reserved)" in source and "max_memory_percent" in source
