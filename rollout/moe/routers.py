"""Mixture-of-experts routers: finding a model's routers and proving their form (the routing a rollout records is
`rollout.base.routing.Routing`).

transformers' MoE models (Qwen2/3-MoE, OLMoE, Mixtral, gpt-oss, MiniMax, FlexOlmo, ...) route with one module per MoE
layer whose forward takes the layer's hidden states `(tokens, hidden)` and returns `(router_logits, scores, indices)`:
logits `(tokens, num_experts)`, and for each token its `top_k` experts and their gate weights, which the layer's
experts module uses as they are. The gate weights are the softmax of the logits at the chosen experts, renormalised
over them or not (`normalize`). `find_routers` finds these modules and proves each router follows that form on
a probe input (the recorder and `replay_routing` rely on it); anything else is refused with an error naming the model
class and the module, never recorded or replayed approximately.

May import torch and rollout.base (the engine, the worker, scoring and the trainers use it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from ..base.routing import routing_dtype

# path components wrappers insert between a model and its modules (DDP, FSDP, activation checkpointing, compile)
WRAPPER_PARTS = frozenset({"module", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})
PEFT_PREFIX = "base_model.model."
PROBE_TOKENS = 16


@dataclass(frozen=True)
class Router:
    """One MoE layer's router: `name` without wrapper prefixes (the same on a plain, PEFT or DDP/FSDP model)."""

    name: str
    module: torch.nn.Module
    num_experts: int
    top_k: int
    normalize: bool  # gate weights renormalised over the chosen experts


def layer_name(name: str) -> str:
    """A module path without the components wrappers add (DDP `module.`, FSDP, PEFT's `base_model.model.`)."""
    name = ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)
    return name[len(PEFT_PREFIX):] if name.startswith(PEFT_PREFIX) else name


def gate_weights(router_logits: torch.Tensor, indices: torch.Tensor, normalize: bool) -> torch.Tensor:
    """(tokens, top_k) fp32 gate weights of the chosen experts, from the router's own logits (gradients flow)."""
    probs = torch.softmax(router_logits.float(), dim=-1).gather(1, indices.long())
    return probs / probs.sum(dim=-1, keepdim=True) if normalize else probs


def find_routers(model: torch.nn.Module) -> list[Router]:
    """Every MoE router of `model`, in module order. ValueError if there is none, or if a router-like module (a class
    named *Router*, or the `gate`/`router` beside an `experts` module) does not follow the form of the module
    docstring."""
    candidates = _candidates(model)
    if not candidates:
        raise ValueError(f"record_routing=True is invalid for {type(model).__name__}: it has no mixture-of-experts "
                         "router (no module named *Router*, no gate beside an `experts` module). Fix: record routing "
                         "only for MoE models.")
    routers = []
    for name, module in candidates:
        with _unsharded(model, name):  # FSDP2 keeps a sharded router's weight as a DTensor outside its forward
            normalize = _probe(module)  # every router (16 tokens each): an instance may differ from its class
        if normalize is None:
            raise ValueError(
                f"record_routing=True is invalid for {type(model).__name__}: its router {name!r} "
                f"({type(module).__name__}) does not follow the form the recorder understands (int `top_k` and "
                "`num_experts`; forward(hidden (tokens, hidden)) -> (logits, softmax gate weights of the top-k, "
                "indices)). Fix: run this model with record_routing=False.")
        routers.append(Router(layer_name(name), module, int(module.num_experts), int(module.top_k), normalize))
    return routers


def _candidates(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    found = []
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if "router" in type(module).__name__.lower():
            found.append((name, module))
        elif "experts" in children:
            found += [(f"{name}.{key}" if name else key, children[key]) for key in ("gate", "router")
                      if key in children and "router" not in type(children[key]).__name__.lower()]
    return found


@contextlib.contextmanager
def _unsharded(model: torch.nn.Module, name: str) -> Iterator[None]:
    """The parameters of the innermost FSDP2 module holding `name` gathered for the block (nothing to do without
    FSDP2): what its own forward does before the router runs."""
    from torch.distributed.fsdp import FSDPModule

    parts = name.split(".")
    for end in range(len(parts) - 1, -1, -1):
        owner = model.get_submodule(".".join(parts[:end]))
        if isinstance(owner, FSDPModule):
            owner.unshard()
            try:
                yield
            finally:
                owner.reshard()
            return
    yield


@torch.no_grad()
def _probe(module: torch.nn.Module) -> bool | None:
    """Run the router on random hidden states: True / False (renormalised gate weights or not) if it follows the
    form, None if not."""
    top_k, num_experts = getattr(module, "top_k", None), getattr(module, "num_experts", None)
    weight = getattr(module, "weight", None)
    if not isinstance(top_k, int) or not isinstance(num_experts, int) or not isinstance(weight, torch.Tensor) \
            or weight.dim() != 2 or weight.shape[0] != num_experts:
        return None
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(PROBE_TOKENS, weight.shape[1], generator=gen).to(weight.device, weight.dtype)
    try:
        out = module.forward(hidden)  # no hooks: a recorder or a replay already on the model stays out of it
    except Exception:  # noqa: BLE001  (any failure means: not this form)
        return None
    if not isinstance(out, tuple) or len(out) != 3:
        return None
    logits, scores, indices = out
    if logits.shape != (PROBE_TOKENS, num_experts) or scores.shape != (PROBE_TOKENS, top_k) \
            or indices.shape != (PROBE_TOKENS, top_k) or indices.dtype.is_floating_point:
        return None
    tol = 1e-5 if scores.dtype == torch.float32 else 1e-2
    for normalize in (True, False):
        if torch.allclose(gate_weights(logits, indices, normalize), scores.float(), atol=tol, rtol=tol):
            return normalize
    return None


@contextlib.contextmanager
def capture_routing(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect the experts `model`'s own forwards choose inside the block: one (tokens, layers, top_k) int64 tensor
    per forward (tokens: the forward's batch x sequence, flattened row-major). For measuring and testing."""
    routers = find_routers(model)
    captured: list[torch.Tensor] = []
    step: dict[int, torch.Tensor] = {}

    def keep(layer: int):
        def hook(module, args, output) -> None:
            step[layer] = output[2].detach().long().cpu()
            if len(step) == len(routers):
                captured.append(torch.stack([step[i] for i in range(len(routers))], dim=1))
                step.clear()
        return hook

    handles = [router.module.register_forward_hook(keep(i)) for i, router in enumerate(routers)]
    try:
        yield captured
    finally:
        for handle in handles:
            handle.remove()
