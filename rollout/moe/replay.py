"""Routing replay (R3) for the trainer's forward: route every token to the experts the rollout engine chose.

    batch = worker.generate(prompts, sampling)            # WorkerConfig(record_routing=True)
    with rollout.replay_routing(model, batch):             # or replay_routing(model, batch, rows=micro_batch_rows)
        logprobs = trainer_forward(model, rows of batch)   # prompt + completion per row, right-padded

Inside the block, each MoE router of `model` (found as the recorder found them, `rollout.moe.find_routers`) still
runs, but its output is replaced: the experts are the recorded ones, and their gate weights come from the trainer's
own router logits at those experts (softmax, renormalised as the router does), so gradients flow through the router
as in R3. Outside the block the model is untouched (the hooks are removed on exit, errors included). Works on a plain
model, a PEFT model and DDP/FSDP wrappers (router names are compared without wrapper prefixes).

The forward must be over the batch's rows (or `rows`) in order, each row its prompt then its completion from position
0, right-padded (`trainers_integration.forward.pack`). The recorded positions are 0 .. len(row) - 2; the row's last
token and the padding keep the trainer's own routing: the last token was never fed to the engine, and no logprob of
the row depends on it (causal attention). Checked before anything runs: the routers (names, expert counts, top-k)
against the recording, each row's recorded length, and at every forward the input's shape and, when given as ids, its
tokens; a mismatch is a ValueError naming what differs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch

from ..base.errors import invalid
from ..base.routing import Routing
from .routers import Router, find_routers, gate_weights


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, batch, rows: Sequence[int] | slice | None = None) -> Iterator[None]:
    """Force the recorded experts of `batch` (a RolloutBatch with `routing`) in `model`'s forwards inside the block;
    `rows`: the batch rows the forwards run over (default: all), e.g. one micro-batch."""
    routing, tokens = _selected(batch, rows)
    routers = _matching_routers(model, routing)
    replay = _Replay(routing, tokens, routers)
    handles = [router.module.register_forward_hook(replay.router_hook(i)) for i, router in enumerate(routers)]
    handles.append(model.register_forward_pre_hook(replay.begin, with_kwargs=True))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _selected(batch, rows) -> tuple[Routing, list[list[int]]]:
    routing = getattr(batch, "routing", None)
    if routing is None:
        raise invalid("batch.routing", None, "the batch was generated without routing",
                      "generate it with WorkerConfig(record_routing=True) (or score(..., return_routing=True))")
    index = list(range(len(batch)))[rows] if isinstance(rows, slice) else list(range(len(batch))) \
        if rows is None else [int(i) for i in rows]
    bad = [i for i in index if not 0 <= i < len(batch)]
    if bad or not index:
        raise invalid("rows", rows, f"must pick at least one of the batch's {len(batch)} rows",
                      "pass indices in range (or a slice) of the micro-batch the forward runs over")
    lengths = batch.completion_mask.long().sum(dim=1)
    tokens = [list(batch.prompt_ids[i]) + batch.completion_ids[i, : int(lengths[i])].tolist() for i in index]
    routing = routing.select(index)
    for i, (row, ids) in zip(index, zip(routing.rows, tokens)):
        if row.shape[0] != len(ids) - 1:
            raise ValueError(f"batch row {i} has {len(ids)} tokens but routing for {row.shape[0]} positions: must be "
                             f"{len(ids) - 1} (every token but the last). Fix: replay the batch the routing was "
                             "recorded with, unmodified.")
    return routing, tokens


def _matching_routers(model: torch.nn.Module, routing: Routing) -> list[Router]:
    routers = find_routers(model)
    names = tuple(r.name for r in routers)
    if names != routing.layers:
        diff = sorted(set(names) ^ set(routing.layers))[:3]
        raise ValueError(f"the batch's routing was recorded on another model: {len(routing.layers)} MoE layers "
                         f"recorded, {len(names)} in {type(model).__name__} (first differences: {diff}). Fix: replay "
                         "on the model the rollout ran (same architecture and layer names).")
    for router in routers:
        if (router.num_experts, router.top_k) != (routing.num_experts, routing.top_k):
            raise ValueError(f"router {router.name!r} has {router.num_experts} experts (top-{router.top_k}) but the "
                             f"routing was recorded with {routing.num_experts} (top-{routing.top_k}). Fix: replay on "
                             "the model the rollout ran.")
    return routers


class _Replay:
    """The forced experts of the current forward, built by the model's pre-hook, read by each router's hook."""

    def __init__(self, routing: Routing, tokens: list[list[int]], routers: list[Router]) -> None:
        self.routing, self.tokens, self.routers = routing, tokens, routers
        self.forced: torch.Tensor | None = None  # (layers, rows * width, top_k) int64
        self.own: torch.Tensor | None = None  # (rows * width,) bool: positions left to the trainer's routing
        self._width: int | None = None

    def begin(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        shape = tuple(ids.shape) if ids is not None else tuple(embeds.shape[:2]) if embeds is not None else None
        longest = max(len(t) for t in self.tokens)
        if shape is None or len(shape) != 2 or shape[0] != len(self.tokens) or shape[1] < longest:
            raise ValueError(f"replay_routing: the forward's input has shape {shape} but the replayed rows need "
                             f"({len(self.tokens)}, >= {longest}): one row per replayed batch row, prompt + "
                             "completion, right-padded. Fix: pass rows= for a micro-batch, and pack rows as "
                             "trainers_integration.forward.pack does.")
        if ids is not None:
            self._check_tokens(ids)
        if self._width != shape[1]:
            self._build(shape[1])

    def _check_tokens(self, ids: torch.Tensor) -> None:
        host = ids.detach().cpu()
        for r, row in enumerate(self.tokens):
            got = host[r, : len(row)]
            expected = torch.tensor(row, dtype=got.dtype)
            if not torch.equal(got, expected):
                position = int((got != expected).nonzero()[0])
                raise ValueError(f"replay_routing: row {r} of the forward has token {int(got[position])} at position "
                                 f"{position}, the replayed batch row has {row[position]}. Fix: run the forward over "
                                 "the same rows, in the same order, prompt + completion from position 0.")

    def _build(self, width: int) -> None:
        num_rows, layers, top_k = len(self.tokens), len(self.routers), self.routing.top_k
        forced = torch.zeros((num_rows, width, layers, top_k), dtype=torch.long)
        own = torch.ones((num_rows, width), dtype=torch.bool)
        for r, row in enumerate(self.routing.rows):
            forced[r, : row.shape[0]] = row.long()
            own[r, : row.shape[0]] = False
        self.forced = forced.reshape(num_rows * width, layers, top_k).permute(1, 0, 2).contiguous()
        self.own = own.reshape(-1)
        self._width = width

    def router_hook(self, layer: int):
        def hook(module, args, output):
            logits, scores, indices = output
            if self.forced is None or logits.shape[0] != self.forced.shape[1]:
                raise ValueError(f"replay_routing: router {self.routers[layer].name!r} saw {logits.shape[0]} tokens, "
                                 f"the replayed rows have {None if self.forced is None else self.forced.shape[1]} "
                                 "(rows x width). Fix: call the model itself (its forward checks the input first).")
            forced = self.forced[layer].to(indices.device)
            own = self.own.to(indices.device)[:, None]
            chosen = torch.where(own, indices.long(), forced)
            weights = gate_weights(logits, chosen, self.routers[layer].normalize).to(scores.dtype)
            return logits, weights, chosen.to(indices.dtype)
        return hook
