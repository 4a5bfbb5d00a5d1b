"""RoutingRecorder: the experts the engine's own forward chose, per request and position (WorkerConfig.record_routing).

Hooks, only while recording is on (none otherwise: no cost when off):
- on each MoE router (`rollout.moe.find_routers`): keep the step's `(tokens, top_k)` indices;
- on the model: a pre-hook notes whether this forward is the engine's (its `cache` is this manager's paged cache)
  and on which thread, so a trainer's forward of the same shared model (another thread) is never recorded; the
  post-hook cuts the step's `(tokens, layers, top_k)` indices by request (`cu_seq_lens_q`, in the order of the step's
  `requests_in_batch`) and writes them at their positions (`position_ids`) in the request's buffer.

Positions a request did not compute itself are filled from where they were computed, never left as a hole:
- a forked sample (`{parent}__child#i`) from its parent's buffer (the parent computed the shared prompt);
- a prefix-cache hit from the buffer of the request that computed those pages (live or finished), found by a chain
  hash of the page's tokens, as the cache itself finds them (`PrefixIndex`, kept within a position budget, cleared
  with the prefix cache at every weight change);
- a preempted request re-prefilled keeps its own buffer (the positions are rewritten by the re-prefill, the ones a
  prefix hit serves were computed under the same weights).
- a verify row (speculation) writes its next token's position and its drafts' after it: only the first is the
  request's for certain. The drafts it kept are counted when the step settles (`verified`) and until then serve
  nothing: no page holding a draft the row may reject is ever registered in the prefix index (a settle that never
  came would leave a hole, and the request would re-run, never return a rejected draft's routing).

Weight changes (`forget`, at every switch) start a new epoch: the prefix index is cleared, and a buffer computed
under older weights serves no later request. A request soft reset after a switch (mode "recompute", which resets
every request in flight; or preempted, then re-prefilled after one) starts its buffer again at its re-prefill: every
position is recomputed by the new weights or served from pages cached since the switch, and takes that routing, the
routing of the KV its later tokens attend to. A request that keeps its old-weight KV (mode "keep") keeps the routing
that built it.
A hole that no source covers (its pages were dropped from the index but the KV was still cached) fails that request,
which the engine re-runs; it never comes back with a hole.

The hooks sit on the trainer's own modules, so a trainer's habits must survive them: a `copy.deepcopy` of the model
(a reference model) or a `torch.save(model)` made while the recorder is attached carries an inert hook in their place
(`ModelHook`), never the recorder with its lock and buffers; the copy computes exactly as the model does.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from ...moe import Router, routing_dtype
from ..upstream import CHILD_SEPARATOR


class RoutingHole(RuntimeError):
    pass


def inert_hook(*args) -> None:
    """What a copied or unpickled model has where the recorder's hooks were: returns None, so it changes nothing."""


class ModelHook:
    """A recorder hook on a module of the trainer's model. Copies and pickles of the model get `inert_hook` instead
    (the recorder holds a lock, tensors of other requests and references to the engine's cache)."""

    __slots__ = ("fn",)

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __deepcopy__(self, memo):
        return inert_hook

    def __reduce__(self):
        return _inert, ()


def _inert():
    return inert_hook


class Buffer:
    """One request's routing: `data[p]` = (layers, top_k) experts at position p; `tokens[p]` the token fed there;
    positions [0, length) are filled (a verify row's drafts past them, until `RoutingRecorder.verified`)."""

    def __init__(self, num_layers: int, top_k: int, dtype: torch.dtype, epoch: int) -> None:
        self.data = torch.zeros((64, num_layers, top_k), dtype=dtype)
        self.tokens: list[int] = []
        self.length = 0
        self.pages: list[int] = []  # chain hashes of the full pages registered so far
        self.epoch = epoch  # the weights its positions were computed under (the recorder's epoch then)
        self.soft_reset = False  # its KV was dropped: its next write is a re-prefill

    def restart(self, epoch: int) -> None:
        """Its positions are all computed again (or served from the cache) under the weights of `epoch`."""
        self.tokens, self.length, self.pages, self.epoch = [], 0, [], epoch

    def write(self, start: int, values: torch.Tensor, tokens: list[int]) -> None:
        end = start + values.shape[0]
        if end > self.data.shape[0]:
            grown = torch.zeros((max(end, 2 * self.data.shape[0]), *self.data.shape[1:]), dtype=self.data.dtype)
            grown[: self.length] = self.data[: self.length]
            self.data = grown
        self.data[start:end] = values
        self.tokens[start:end] = tokens
        self.length = max(self.length, end) if start <= self.length else self.length

    def copy_prefix(self, source: "Buffer", end: int) -> None:
        self.write(0, source.data[:end], source.tokens[:end])
        self.length = max(self.length, end)


class PrefixIndex:
    """Chain hash of a prefix's full pages -> the buffer that holds its routing; least recently used dropped past
    `budget` positions."""

    def __init__(self, page_size: int, budget: int) -> None:
        self.page_size, self.budget = page_size, budget
        self._pages: OrderedDict[int, Buffer] = OrderedDict()

    @staticmethod
    def chain(previous: int, page: list[int]) -> int:
        return hash((previous, tuple(page)))

    def register(self, buffer: Buffer) -> None:
        size = self.page_size
        while (len(buffer.pages) + 1) * size <= buffer.length:
            k = len(buffer.pages)
            previous = buffer.pages[-1] if buffer.pages else 0
            buffer.pages.append(self.chain(previous, buffer.tokens[k * size:(k + 1) * size]))
            self._pages[buffer.pages[-1]] = buffer
            self._pages.move_to_end(buffer.pages[-1])
        while len(self._pages) * size > self.budget:
            self._pages.popitem(last=False)

    def find(self, tokens: list[int]) -> Buffer | None:
        """The buffer holding the routing of `tokens` (a whole number of pages)."""
        digest = 0
        for k in range(len(tokens) // self.page_size):
            digest = self.chain(digest, tokens[k * self.page_size:(k + 1) * self.page_size])
        buffer = self._pages.get(digest)
        if buffer is not None:
            self._pages.move_to_end(digest)
        return buffer

    def clear(self) -> None:
        self._pages.clear()


class RoutingRecorder:
    def __init__(self, model: torch.nn.Module, routers: list[Router], page_size: int, budget: int) -> None:
        self.routers = routers
        self.top_k = routers[0].top_k
        self.dtype = routing_dtype(routers[0].num_experts)
        self.buffers: dict[str, Buffer] = {}
        self.failed: dict[str, str] = {}  # request id -> why its routing has a hole
        self.index = PrefixIndex(page_size, budget)
        self.epoch = 0  # weight changes so far
        self.cache = None  # this manager's paged cache: the engine's forwards pass it
        self.ios = None  # the step's inputs and outputs (requests_in_batch, in the forward's order)
        self.verifier = None  # speculation's Verifier, if the engine drafts
        self._thread: int | None = None  # the thread running the engine's forward, while it runs
        self._step: list[torch.Tensor | None] = [None] * len(routers)
        self._handles = [r.module.register_forward_hook(ModelHook(self._capture(i))) for i, r in enumerate(routers)]
        self._handles.append(model.register_forward_pre_hook(ModelHook(self._begin), with_kwargs=True))
        self._handles.append(model.register_forward_hook(ModelHook(self._end), with_kwargs=True))

    def attach(self, cache, ios, verifier=None) -> None:
        """This manager's cache, step inputs, and speculation's `Verifier` (None: no drafts), whose `drafted` names
        the step's verify rows while its forward runs."""
        self.cache, self.ios, self.verifier = cache, ios, verifier

    def verified(self, request_id: str, accepted: int) -> None:
        """A verify row settled with `accepted` drafts kept: their positions (written by its forward, right after its
        first) count, the rejected ones' never do."""
        buffer = self.buffers.get(request_id)
        if buffer is not None and accepted:
            buffer.length += accepted
            if buffer.epoch == self.epoch:
                self.index.register(buffer)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def forget(self, live: set[str] | None = None) -> None:
        """Weights changed: no routing computed before may serve a later request's cached positions. `live` (given
        while no forward runs): the engine requests still in flight; any other's buffer (one aborted while it ran)
        is dropped."""
        self.index.clear()
        self.epoch += 1
        for request_id in [r for r in self.buffers if live is not None and r not in live]:
            self.drop(request_id)

    def soft_reset(self, request_ids) -> None:
        """These requests' KV was dropped (preempted, or a "recompute" switch): they are prefilled again."""
        for request_id in request_ids:
            buffer = self.buffers.get(request_id)
            if buffer is not None:
                buffer.soft_reset = True

    def take(self, request_id: str, num_positions: int) -> torch.Tensor:
        """The request's routing for positions [0, num_positions), (positions, layers, top_k); its buffer is kept
        (its pages may serve later prefix hits) but no longer by request id. RoutingHole if any is missing."""
        buffer = self.buffers.pop(request_id, None)
        why = self.failed.pop(request_id, None)
        if why is not None or buffer is None or buffer.length < num_positions:
            have = 0 if buffer is None else buffer.length
            raise RoutingHole(why or f"routing of request {request_id!r}: {have} of {num_positions} positions "
                                     "recorded")
        return buffer.data[:num_positions].clone()

    def drop(self, request_id: str) -> None:
        self.buffers.pop(request_id, None)
        self.failed.pop(request_id, None)

    # ------------------------------------------------------------------ hooks (engine thread)
    def _capture(self, layer: int):
        def hook(module, args, output) -> None:
            if self._thread == threading.get_ident():
                self._step[layer] = output[2]
        return hook

    def _begin(self, module, args, kwargs) -> None:
        if self.cache is not None and kwargs.get("cache") is self.cache:
            self._thread = threading.get_ident()
            self._step = [None] * len(self.routers)

    def _end(self, module, args, kwargs, output) -> None:
        if self._thread != threading.get_ident() or kwargs.get("cache") is not self.cache:
            return
        self._thread = None
        if any(step is None for step in self._step):
            raise RuntimeError("rollout: a MoE router did not run in the engine's forward; routing cannot be recorded")
        experts = torch.stack(self._step, dim=1).to(self.dtype).cpu()  # (tokens, layers, top_k)
        positions = kwargs["position_ids"][0].tolist()
        tokens = kwargs["input_ids"][0].tolist()
        bounds = kwargs["cu_seq_lens_q"].tolist()
        for i, future in enumerate(self.ios.requests_in_batch):
            start, end = bounds[i], bounds[i + 1]
            if end > start:
                self._write(future.state, positions[start], experts[start:end], tokens[start:end])

    def _write(self, state, first: int, values: torch.Tensor, tokens: list[int]) -> None:
        request_id = state.request_id
        buffer = self.buffers.get(request_id)
        if buffer is None:
            buffer = self.buffers[request_id] = Buffer(len(self.routers), self.top_k, self.dtype, self.epoch)
        elif buffer.soft_reset:  # its re-prefill: under newer weights, nothing it recorded before still holds
            buffer.soft_reset = False
            if buffer.epoch != self.epoch:
                buffer.restart(self.epoch)
        if first > buffer.length:
            self._fill(request_id, buffer, first, state.initial_tokens)
        buffer.write(first, values, tokens)
        if self.verifier is not None and request_id in self.verifier.drafted and buffer.length > first:
            buffer.length = first + 1  # its drafts count once `verified` says how many were kept
        if buffer.epoch == self.epoch:  # old-weight routing (mode "keep") serves no request after the switch
            self.index.register(buffer)

    def _fill(self, request_id: str, buffer: Buffer, first: int, prompt: list[int]) -> None:
        """Positions [buffer.length, first) were not computed by this request: copy them from their source."""
        parent = self.buffers.get(request_id.split(CHILD_SEPARATOR)[0]) if CHILD_SEPARATOR in request_id else None
        if parent is not None and parent.epoch == self.epoch and parent.length >= first \
                and parent.tokens[:first] == list(prompt[:first]):
            buffer.copy_prefix(parent, first)
            return
        source = self.index.find(list(prompt[:first])) if first % self.index.page_size == 0 else None
        if source is not None and source.length >= first:
            buffer.copy_prefix(source, first)
            return
        self.failed.setdefault(request_id, f"routing of request {request_id!r}: positions {buffer.length}.."
                                            f"{first - 1} came from the prefix cache but their routing was dropped")
