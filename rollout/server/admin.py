"""Admin: the RL control plane over HTTP, mounted only by `rollout serve --admin` (`Server(admin=True)`).

Under vLLM's endpoint names (its RLHF router, `vllm/entrypoints/serve/rlhf`, and sleep mode), where vLLM has one:

    POST /pause?mode=abort|wait|keep     stop generating (what is in flight: the worker's `pause(in_flight=...)`)
    POST /resume, GET /is_paused         {"is_paused": bool}
    POST /sleep?level=1, POST /wake_up   free / re-allocate the KV cache (weights stay); GET /is_sleeping
    POST /reset_prefix_cache             forget every cached prefix
    POST /init_weight_transfer_engine    {"init_info": {master_address, master_port, rank_offset, world_size, backend}}
    POST /update_weights                 {"update_info": {names, dtype_names, shapes}}: tensors broadcast by rank 0
                                         of that group, one per name (vLLM's NCCL engine, unpacked); or
                                         {"weight_dir": DIR} (prime-rl's body): a safetensors checkpoint directory
    POST /update_weights_from_disk       {"model_path": DIR} (SGLang's name, which slime and AReaL call)
    GET  /get_weight_version             {"weight_version": "N", "policy_version": N, "weights_fingerprint": "..."}

Every update takes `version` (default: + 1) and `in_flight` ("wait", "abort", "recompute", "keep"; default: the
worker's own, or "recompute" while paused, since waiting for frozen requests would never end), is validated whole
(names, shapes, finite values) before any weight changes, lands atomically through the rollout side's
`update_weights`, and answers the new `policy_version`. A bad one is a 400 naming the tensor, and nothing changed.
Operations run one at a time on one thread of their own, off the event loop: generation goes on meanwhile.
"""

from __future__ import annotations

import asyncio
import datetime
import hmac
import ipaddress
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from fastapi import Depends, FastAPI, Query, Request

from ..base.errors import invalid
from .errors import ApiError, bad_request, from_value_error
from .limits import RequestLimits, read_json

PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's; the worker also has "recompute", which only an update can mean
GROUP_TIMEOUT_S = 300


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_admin_key(host: str, admin_key: str | None) -> None:
    """The control plane changes the weights every client is served: beyond loopback it needs a key."""
    if admin_key is None and not is_loopback(host):
        raise invalid("admin_key", None, f"the admin routes need a key when the server listens beyond loopback "
                      f"(host {host!r})", "pass --admin-key KEY (or set ROLLOUT_ADMIN_KEY), or listen on 127.0.0.1")


class Control:
    """The rollout side's control operations, run one at a time on a thread of their own."""

    def __init__(self, rollouts: Any) -> None:
        self.rollouts = rollouts
        self.group: WeightReceiver | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-admin")

    async def run(self, fn: Callable, *args) -> Any:
        """fn(*args) on the admin thread; a ValueError (a bad tensor, version or mode) is a 400 naming it."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except ValueError as error:
            raise from_value_error(error) from None

    def method(self, name: str) -> Callable:
        fn = getattr(self.rollouts, name, None)
        if fn is None:
            raise ApiError(501, f"{type(self.rollouts).__name__} has no {name}(): this route needs a RolloutWorker "
                           "(rollout serve without --workers)", code="not_implemented")
        return fn

    def update(self, weights, body: dict) -> dict:
        version = body.get("version")
        mode = body.get("in_flight") or ("recompute" if getattr(self.rollouts, "is_paused", False) else None)
        new = self.rollouts.update_weights(weights, version=version, in_flight=mode)
        return {"success": True, "message": "Weights updated", "policy_version": int(new)}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.group is not None:
            self.group.close()


def mount(app: FastAPI, control: Control, key: str | None, limits: RequestLimits) -> None:
    """Add the admin routes to `app`; with a key, each needs `Authorization: Bearer KEY` (401 without one, 403 with
    another)."""
    def authorize(request: Request) -> None:
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not given:
            raise ApiError(401, "the admin routes need Authorization: Bearer <admin key>. Fix: send the key given to "
                           "rollout serve --admin-key", code="invalid_api_key")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise ApiError(403, "wrong admin key. Fix: send the key given to rollout serve --admin-key",
                           code="forbidden")

    guard = [Depends(authorize)]
    rollouts = control.rollouts

    async def body_of(request: Request) -> dict:
        body = read_json(await request.body() or b"{}", limits)
        if not isinstance(body, dict):
            raise bad_request(None, "the body must be a JSON object")
        return body

    @app.post("/pause", dependencies=guard)
    async def pause(mode: str = "abort") -> dict:
        if mode not in PAUSE_MODES:
            raise bad_request("mode", f"mode={mode!r} is invalid: must be one of {PAUSE_MODES}. Fix: 'keep' freezes "
                              "requests in flight, 'wait' finishes them, 'abort' re-runs them after /resume")
        await control.run(control.method("pause"), mode)
        return {"status": "paused"}

    @app.post("/resume", dependencies=guard)
    async def resume() -> dict:
        await control.run(control.method("resume"))
        return {"status": "resumed"}

    @app.get("/is_paused", dependencies=guard)
    async def is_paused() -> dict:
        return {"is_paused": bool(getattr(rollouts, "is_paused", False))}

    @app.post("/sleep", dependencies=guard)
    async def sleep(level: int = 1) -> dict:
        if level != 1:
            raise bad_request("level", f"level={level} is invalid: only level 1 (the KV cache is freed, the weights "
                              "stay). Fix: use level=1, and update the weights with /update_weights")
        await control.run(_conflict_on_runtime_error(control.method("sleep")))
        return {"status": "sleeping"}

    @app.post("/wake_up", dependencies=guard)
    async def wake_up(tags: list[str] | None = Query(None)) -> dict:
        if tags and not set(tags) <= {"weights", "kv_cache"}:
            raise bad_request("tags", f"tags={tags} is invalid: must be among 'weights', 'kv_cache' (the weights never "
                              "leave; either wakes the KV cache)")
        await control.run(control.method("wake"))
        return {"status": "awake"}

    @app.get("/is_sleeping", dependencies=guard)
    async def is_sleeping() -> dict:
        return {"is_sleeping": bool(getattr(rollouts, "is_sleeping", False))}

    @app.post("/reset_prefix_cache", dependencies=guard)
    async def reset_prefix_cache() -> dict:
        await control.run(control.method("reset_prefix_cache"))
        return {"status": "ok"}

    @app.get("/get_weight_version", dependencies=guard)
    async def weight_version() -> dict:
        fingerprint = await control.run(rollouts.weights_fingerprint)
        version = int(rollouts.policy_version)
        return {"weight_version": str(version), "policy_version": version, "weights_fingerprint": fingerprint}

    @app.post("/init_weight_transfer_engine", dependencies=guard)
    async def init_weight_transfer_engine(request: Request) -> dict:
        info = (await body_of(request)).get("init_info")
        if not isinstance(info, dict):
            raise bad_request("init_info", "init_info is missing: send {\"init_info\": {\"master_address\", "
                              "\"master_port\", \"rank_offset\", \"world_size\", \"backend\"}}")
        await control.run(_join, control, info, _device_of(rollouts))
        return {"message": "Weight transfer initialized"}

    @app.post("/update_weights", dependencies=guard)
    async def update_weights(request: Request) -> dict:
        body = await body_of(request)
        if "update_info" in body:
            return await control.run(_from_group, control, body)
        return await control.run(_from_dir, control, body, "weight_dir")

    @app.post("/update_weights_from_disk", dependencies=guard)
    async def update_weights_from_disk(request: Request) -> dict:
        return await control.run(_from_dir, control, await body_of(request), "model_path")


def _conflict_on_runtime_error(fn: Callable) -> Callable:
    def run() -> None:
        try:
            fn()
        except RuntimeError as error:  # a state conflict (paused with requests frozen), not a bad request
            raise ApiError(409, str(error), code="conflict") from None

    return run


def _device_of(rollouts: Any) -> torch.device:
    model = getattr(rollouts, "model", None)
    return next(model.parameters()).device if model is not None else torch.device("cpu")


# ---------------------------------------------------------------------------------------------- from a directory
def read_checkpoint(path: Any, field: str) -> dict[str, torch.Tensor]:
    """Every tensor of the *.safetensors files in directory `path` (one file or shards), on the CPU."""
    from safetensors.torch import load_file

    if not isinstance(path, str) or not os.path.isdir(path):
        raise bad_request(field, f"{field}={path!r} is invalid: not a directory on the server. Fix: pass the "
                          "directory the trainer saved (save_pretrained, safetensors)")
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise bad_request(field, f"{field}={path!r} is invalid: no *.safetensors file in it. Fix: save with "
                          "save_pretrained(..., safe_serialization=True)")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(os.path.join(path, name), device="cpu"))
    return weights


def _from_dir(control: Control, body: dict, field: str) -> dict:
    return control.update(read_checkpoint(body.get(field), field), body)


# ---------------------------------------------------------------------------------------------- from a group
class WeightReceiver:
    """This server's rank of a trainer's torch.distributed group (its own TCPStore and ProcessGroup, never the default
    group): rank 0, the trainer, hosts the store at master_address:master_port; the server is rank `rank_offset`."""

    def __init__(self, info: dict, device: torch.device) -> None:
        import torch.distributed as dist

        backend = info.get("backend") or ("nccl" if device.type == "cuda" else "gloo")
        if backend not in ("gloo", "nccl") or (backend == "nccl" and device.type != "cuda"):
            raise bad_request("init_info.backend", f"backend={backend!r} is invalid: 'gloo' (CPU tensors) or 'nccl' "
                              f"(GPU tensors; the model is on {device})")
        timeout = datetime.timedelta(seconds=float(info.get("timeout_s", GROUP_TIMEOUT_S)))
        try:
            host, port = str(info["master_address"]), int(info["master_port"])
            rank, world_size = int(info["rank_offset"]), int(info["world_size"])
        except (KeyError, TypeError, ValueError) as error:
            raise bad_request("init_info", f"init_info needs master_address, master_port, rank_offset and "
                              f"world_size ({type(error).__name__}: {error})") from None
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.store = dist.TCPStore(host, port, world_size, False, timeout=timeout)
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(self.store, rank, world_size, timeout)
        else:
            torch.cuda.set_device(device)
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(self.store, rank, world_size, options)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> dict[str, torch.Tensor]:
        """Every tensor, broadcast by rank 0 one per name in this order, staged before any is applied."""
        out: dict[str, torch.Tensor] = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            self.group.broadcast(tensor, 0).wait()
            out[name] = tensor
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def close(self) -> None:
        self.group, self.store = None, None


def _join(control: Control, info: dict, device: torch.device) -> None:
    if control.group is not None:
        control.group.close()
        control.group = None
    control.group = WeightReceiver(info, device)


def _from_group(control: Control, body: dict) -> dict:
    if control.group is None:
        raise ApiError(409, "no weight transfer group: POST /init_weight_transfer_engine first", code="conflict")
    names, dtypes, shapes = _update_info(body.get("update_info"))
    return control.update(control.group.receive(names, dtypes, shapes), body)


def _update_info(info: Any) -> tuple[list[str], list[torch.dtype], list[list[int]]]:
    """names, dtype_names, shapes, checked so that every broadcast can be received (the group stays in step with the
    trainer even when the weights then fail validation: that is a 400 after the transfer, nothing applied)."""
    if not isinstance(info, dict):
        raise bad_request("update_info", "update_info must be an object with names, dtype_names and shapes")
    names, dtype_names, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not (isinstance(names, list) and isinstance(dtype_names, list) and isinstance(shapes, list)
            and len(names) == len(dtype_names) == len(shapes)):
        raise bad_request("update_info", "update_info needs names, dtype_names and shapes: lists of one length")
    if info.get("packed"):
        raise bad_request("update_info.packed", "packed=True is not supported: send one broadcast per tensor")
    dtypes = []
    for dtype in dtype_names:
        value = getattr(torch, str(dtype).removeprefix("torch."), None)
        if not isinstance(value, torch.dtype):
            raise bad_request("update_info.dtype_names", f"dtype {dtype!r} is not a torch dtype (e.g. 'bfloat16')")
        dtypes.append(value)
    for name, shape in zip(names, shapes):
        if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
            raise bad_request("update_info.shapes", f"the shape of {name!r}, {shape!r}, is not a list of sizes >= 0")
    return [str(n) for n in names], dtypes, shapes
