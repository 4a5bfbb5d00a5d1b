"""What this project relies on in transformers' continuous-batching engine. An upgrade that changes any of it
must fail here, loudly, before it silently breaks exactness or robustness."""

from __future__ import annotations

import inspect

import transformers
from transformers.generation.continuous_batching.cache_allocators.cache_allocator import BlockLedger
from transformers.generation.continuous_batching.cache_allocators.full_attention import FullAttentionCacheAllocator
from transformers.generation.continuous_batching.continuous_api import (ContinuousBatchingManager,
                                                                         ContinuousBatchProcessor, OutputRouter)
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs, HostDeviceIOPair
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import RequestState, RequestStatus
from transformers.generation.continuous_batching.scheduler import FIFOScheduler

from rollout.engine.scheduler import RolloutScheduler


def test_transformers_is_the_pinned_version():
    assert transformers.__version__ == "5.23.0"


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


def test_full_attention_layers_keep_per_layer_token_views_of_the_cache():
    # rollout_paged reads cache rows straight from these [rows, kv_heads, head_dim] views, by the allocator's indices
    source = inspect.getsource(FullAttentionCacheAllocator.register_cache_tensor)
    assert "self._kv_token_views[layer_idx] = (k_view, v_view)" in source
    update = inspect.getsource(FullAttentionCacheAllocator.update)
    assert "k_cache, v_cache = self._kv_token_views[layer_idx]" in update
    assert "torch.index_select(k_cache, 0, read_index)" in update


def _fresh_state(tokens: list[int], children: int) -> RequestState:
    return RequestState(request_id="p", initial_tokens=tokens, num_children=children, max_new_tokens=4)


def test_upstream_still_schedules_a_zero_token_fork_and_ours_does_not():
    upstream = FIFOScheduler.__new__(FIFOScheduler)
    FIFOScheduler.reset(upstream)
    state = _fresh_state([5], children=2)
    upstream._schedule_request(state, [5], 100, set())
    assert state.tokens_to_process == [] and upstream._requests_to_fork == [state]  # the crash: 0-token forward

    ours = RolloutScheduler.__new__(RolloutScheduler)
    RolloutScheduler.reset(ours)
    state = _fresh_state([5], children=2)
    ours._schedule_request(state, [5], 100, set())
    assert state.tokens_to_process == [5] and ours._requests_to_fork == []
    assert list(ours.waiting_requests) == ["p__child#0", "p__child#1"]
    assert all(c.initial_tokens == [5] and c.num_children == 0 for c in ours.waiting_requests.values())
    assert state.status == RequestStatus.DECODING


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
