"""The hooks into transformers' model runner and its step inputs and outputs, so every row gets its own temperature /
top-k / top-p (greedy rows next to sampled ones, temperature 0 and top_k above the vocabulary included, none of which
the engine survives on its own) and both logprobs come from the one pass. What samples is the engine's (a
`StepSampling`, rollout/engine/sampling/step.py), handed in at construction; this module only plugs it in:

- `RowSlotArgs` stands where upstream's per-request logits processors are, to own one int32 line of the step's bulk
  input tensor: while the step's inputs are prepared, the sampling hands back the step's `choice` (what the step's
  forward and read-back need: its sampler passes, a verify step's logits rows) after writing each sampling row's slot
  into that line, which travels to the device with the other inputs.
- `RolloutModelRunner._forward_process_and_sample`: the forward (inside the sampling's kernel contexts), then the
  sampling of the step's logits rows; it writes the token, its full-vocabulary logprob and its sampling logprob into
  three rows of the step's output tensor, and, on a step where some row asks for top logprobs, the top ids and
  logprobs into the rows after them (`TOP_IDS`, `TOP_VALUES`). Device work only, nothing read back: the step can run
  ahead of the host (async batching) and be captured (CUDA graphs).
- `RolloutIOs`: the output tensor gets those rows; where the engine reads tokens and logprobs back after the step
  (`prepare_batch_update`), the sampling logprobs come back with them, in the same read, to `record`, with a reader
  of each recorded row's top lists (`TopReader`: only rows that asked are read).

Pinned by tests/test_upstream_contract.py (the hooked signatures, the output and bulk-input layouts).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Protocol

import torch
from transformers.generation.continuous_batching.cb_logits_processors import ContinuousBatchingLogitsProcessorList
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs
from transformers.generation.continuous_batching.model_runner import ModelRunner
from transformers.generation.continuous_batching.requests import RequestStatus
from transformers.generation.continuous_batching.utils import CudaGraphBuffer
from transformers.generation.logits_process import LogitsProcessorList

from ...base.params import MAX_TOP_LOGPROBS
from .state import stop_ids

# output_ids: tokens, logprobs (fp32 bits), sampling logprobs (fp32 bits), then MAX_TOP_LOGPROBS rows of top ids and
# as many of their logprobs (fp32 bits), most likely first (written only on steps where some row asks for them)
TOP_IDS = 3
TOP_VALUES = TOP_IDS + MAX_TOP_LOGPROBS
OUTPUT_ROWS = TOP_VALUES + MAX_TOP_LOGPROBS
# states whose token the engine drops at update (async batching: finished or preempted after the step was scheduled)
DROPPED = (RequestStatus.FINISHED, RequestStatus.PENDING)


class StepChoice(Protocol):
    """What one step's inputs chose (the engine's `StepChoice`): read by that step's forward and read-back."""

    verify: object | None  # a verify step's logits rows (`indices`, `slots`, `num_columns`); None: one per row

    @property
    def num_columns(self) -> int | None: ...


class StepSampling(Protocol):
    """The engine's per-row sampling (rollout/engine/sampling/step.py `StepSampler`)."""

    def bind(self, stream, on_grow: Callable[[], None]) -> None: ...
    def forget(self, request_ids: list[str]) -> None: ...
    def prepare(self, requests_in_batch, arg_storage: torch.Tensor) -> StepChoice: ...
    def forward_context(self): ...
    def sample(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, step: StepChoice): ...
    def accept(self, step: StepChoice, request_id: str, stops, row: int, tokens: list[int],
               values: list[float]) -> list[int]: ...


class RowSlotArgs(ContinuousBatchingLogitsProcessorList):
    """No logits processing (the runner samples); one argument line: the slot of each row that samples."""

    def __init__(self, sampling: StepSampling, verifier=None) -> None:
        super().__init__(LogitsProcessorList())
        self.tensors_required = 1
        self.sampling = sampling
        self.verifier = verifier  # speculative decoding (the engine's Verifier), for the scheduler and processor
        self.choice: StepChoice | None = None  # the choice of the step whose inputs were prepared last

    def fill_defaults(self, int32_tensor: torch.Tensor) -> None:
        int32_tensor.fill_(0)  # the table's default row

    def prepare_tensor_args(self, requests_in_batch, arg_storage: torch.Tensor) -> torch.Tensor:
        self.choice = self.sampling.prepare(requests_in_batch, arg_storage)
        return arg_storage


class RolloutModelRunner(ModelRunner):
    """Forward, then our own per-row sampling, written where the engine reads outputs."""

    logit_processor: RowSlotArgs

    @classmethod
    def adopt(cls, runner: ModelRunner) -> "RolloutModelRunner":
        runner.__class__ = cls
        # the sampling reaches the runner weakly: a bound method would close a cycle (runner -> its row args -> the
        # sampling's table -> runner) that keeps the KV cache alive past the manager until the cycle collector runs
        runner_ref = weakref.ref(runner)
        runner.logit_processor.sampling.bind(runner.inputs_and_outputs.compute_stream,
                                             lambda: (r := runner_ref()) is not None and r.drop_graphs())
        return runner  # type: ignore[return-value]

    def _forward_process_and_sample(self, model, batch_data, carry_over_ids, prev_output_ids, output_ids) -> None:
        self.inputs_and_outputs.carry_over_tokens(batch_data["input_ids"], carry_over_ids, prev_output_ids)
        args = self.logit_processor
        step = args.choice
        if step.verify is None:
            indices = batch_data["logits_indices"]  # [num_sequences]: the rows that sample a token come first
            slots = batch_data["logits_processor_args"][0]
        else:  # a verify step: every sampling row's first position, then the draft positions
            indices, slots = step.verify.indices, step.verify.slots
            if "logits_to_keep" in batch_data:
                batch_data["logits_to_keep"] = indices
        with args.sampling.forward_context():  # the linears on oneDNN, norms and rotary fused, where chosen
            logits = model(**batch_data).logits  # [1, num_tokens or num_logits, V]
        if "logits_to_keep" not in batch_data:
            logits = logits[:, indices, :]
        logits = logits[0].float()  # [num_sequences (+ draft positions), V]
        positions = batch_data["position_ids"][0].index_select(0, indices.long()).long()  # of each row's last token
        drawn = args.sampling.sample(logits, slots, positions, step)
        count, top = drawn.tokens.size(0), drawn.top_ids.size(1)
        output_ids[0, :count].copy_(drawn.tokens)
        output_ids[1, :count].copy_(drawn.logprobs.view(dtype=torch.int32))
        output_ids[2, :count].copy_(drawn.sampling_logprobs.view(dtype=torch.int32))
        if top:
            output_ids[TOP_IDS:TOP_IDS + top, :count].copy_(drawn.top_ids.T)
            output_ids[TOP_VALUES:TOP_VALUES + top, :count].copy_(drawn.top_logprobs.T.contiguous().view(torch.int32))

    def drop_graphs(self) -> None:
        """Forget captured CUDA graphs (they read tensors that were just replaced); they are captured again."""
        for io in _all_ios(self.inputs_and_outputs):
            io.graphs = CudaGraphBuffer()


class TopReader:
    """The top lists of a step's recorded rows, read from its outputs on demand (the step's read-back, host side):
    on the first ask, every row's lists in one conversion (per-row reads cost ~25 us each)."""

    def __init__(self, outputs: torch.Tensor, columns: list[int]) -> None:
        self.outputs, self.columns = outputs, columns
        self._lists: tuple[list[list[int]], list[list[float]]] | None = None

    def __call__(self, row: int, k: int) -> tuple[list[int], list[float]]:
        """The k most likely (ids, logprobs) at the `row`-th recorded request's sampled position."""
        if self._lists is None:
            tops = self.outputs[TOP_IDS:OUTPUT_ROWS].T.contiguous()  # (columns, 2 x MAX_TOP_LOGPROBS)
            self._lists = (tops[:, :MAX_TOP_LOGPROBS].tolist(),
                           tops[:, MAX_TOP_LOGPROBS:].contiguous().view(dtype=torch.float32).tolist())
        column = self.columns[row]
        return self._lists[0][column][:k], self._lists[1][column][:k]


Record = Callable[[list[str], list[float], TopReader], None]


class RolloutIOs(ContinuousBatchingIOs):
    """Step inputs and outputs with the sampling-logprob and top-list rows, read back with upstream's two."""

    record: Record
    row_args: RowSlotArgs

    @classmethod
    def adopt(cls, ios, record: Record, row_args: RowSlotArgs) -> None:
        """Every ContinuousBatchingIOs of a batch processor: its one, or the host and device halves of both async
        pairs. Before any step: no captured graph holds the old output tensor."""
        for io in _all_ios(ios, hosts=True):
            io.__class__ = cls
            io.record = record
            io.row_args = row_args
            old = io.output_ids
            io.output_ids = torch.zeros((OUTPUT_ROWS, old.shape[1]), dtype=old.dtype, device=old.device,
                                        pin_memory=old.is_pinned())

    def prepare_batch_update(self):
        # the choice of the step read back: under async batching the next step's inputs may be prepared already, but
        # those steps never verify (sync steps only), so their choice reads back one column per row all the same
        step, sampler = self.row_args.choice, self.row_args.sampling
        columns_of_step = None if step is None else step.num_columns
        count = self.num_request_in_batch if columns_of_step is None else columns_of_step
        outputs = self.output_ids[:, :count].cpu()  # the step's one read-back (a no-op copy on CPU)
        sampling = outputs[2].view(dtype=torch.float32).tolist()
        tokens, logprobs = outputs[0].tolist(), outputs[1].view(dtype=torch.float32).tolist()
        ids, values, columns, row = [], [], [], 0
        for future in self.requests_in_batch:  # sampling rows are the new-token requests, in order
            if future.has_new_token:
                if future.state.status not in DROPPED:
                    # a verify row emits one token or more (speculation/verifier.py): each recorded in order
                    emitted = [row] if columns_of_step is None else \
                        sampler.accept(step, future.state.request_id, stop_ids(future.state), row, tokens, logprobs)
                    for column in emitted:
                        ids.append(future.state.request_id)
                        values.append(sampling[column])
                        columns.append(column)
                row += 1
        self.record(ids, values, TopReader(outputs, columns))
        return self.requests_in_batch, tokens, logprobs


def _all_ios(ios, hosts: bool = False) -> list[ContinuousBatchingIOs]:
    """The ContinuousBatchingIOs inside a sync IOs (itself) or an async one (device halves; host halves too)."""
    if isinstance(ios, ContinuousBatchingIOs):
        return [ios]
    return [io for pair in ios.io_pairs for io in ((pair.host_io, pair.device_io) if hosts else (pair.device_io,))]
