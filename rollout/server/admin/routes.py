"""Admin: the RL control plane over HTTP, mounted only by `rollout serve --admin` (`Server(admin=True)`).

Under vLLM's endpoint names (its RLHF router, `vllm/entrypoints/serve/rlhf`, and sleep mode), where vLLM has one:

    POST /pause?mode=abort|wait|keep     stop generating (what is in flight: the worker's `pause(in_flight=...)`)
    POST /resume, GET /is_paused         {"is_paused": bool}
    POST /sleep?level=1|2, POST /wake_up free / re-allocate the KV cache (the weights stay, at either level);
                                         GET /is_sleeping
    POST /reset_prefix_cache             forget every cached prefix
    POST /init_weight_transfer_engine    {"init_info": {master_address, master_port, rank_offset, world_size, backend}}
    POST /update_weights                 {"update_info": {names, dtype_names, shapes}}: tensors broadcast by rank 0
                                         of that group, one per name or packed into buffers
                                         (vLLM's NCCL engine, `packed`: transfer.py); or
                                         {"weight_dir": DIR} (prime-rl's body): a safetensors checkpoint directory

and the version, the world size (SGLang's, vLLM's) and vLLM's RLHF fence:

    GET  /get_weight_version             {"weight_version": "N", "policy_version": N, "weights_fingerprint": "..."}
    GET  /get_world_size                 {"world_size": 1}: the ranks this server joins a trainer's group with
    GET  /server_info                    501, saying why: TRL's VLLMClient.init_communicator reads it, then builds a
                                         rendezvous (vLLM's StatelessProcessGroup) this server cannot join
    POST /start_weight_update            {"is_checkpoint_format"?: true}: open the fence (staging.py); until
    POST /finish_weight_update           {"weight_version"?: "N"} every update (/update_weights, SGLang's and AReaL's
                                         update routes) is staged, then applied here as one update (SkyRL, TRL's
                                         async GRPO)

SGLang's names (/pause_generation, /update_weights_from_distributed, ...) and AReaL's (/areal_*): sglang.py.
Where the tensors come from: transfer.py.
Every update takes `version` (default: + 1) and `in_flight` ("wait", "abort", "recompute", "keep"; default: the
worker's own, or "recompute" while paused, since waiting for frozen requests would never end), is validated whole
(names, shapes, finite values) before any weight changes, lands atomically through the rollout side's
`update_weights`, and answers the new `policy_version`. A bad one is a 400 naming the tensor, and nothing changed.
Operations run one at a time on one thread of their own, off the event loop: generation goes on meanwhile.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
from fastapi import Depends, FastAPI, Query, Request

from ...base.errors import invalid
from ..transport.errors import ApiError, bad_request, from_value_error
from ..transport.limits import RequestLimits, read_json
from . import sglang
from .staging import Staging
from .transfer import Transfer, WeightReceiver, known_fields, parse_update_info, read_checkpoint

LOG = logging.getLogger("rollout")
SLEEP_LEVELS = (1, 2)  # vLLM's; level 2 (SkyRL's default) also discards vLLM's weights, which stay here (see /sleep)
PAUSE_MODES = ("abort", "wait", "keep")  # vLLM's; the worker also has "recompute", which only an update can mean
UPDATE = sglang.UPDATE  # what every update body may add to its source


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError as error:  # a host name, not an address: not known to be loopback
        LOG.debug("admin host %r is not an IP address (%s): taken as beyond loopback", host, error)
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
        self.areal_meta: tuple[Transfer, str] | None = None  # /areal_set_update_weight_meta's, for the next update
        self.staging = Staging()
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

    def sleep(self) -> None:
        try:
            self.method("sleep")()
        except RuntimeError as error:  # a state conflict (paused with requests frozen), not a failure
            raise ApiError(409, str(error), code="conflict") from None

    def update(self, weights: dict[str, torch.Tensor], version: Any = None, in_flight: Any = None) -> dict:
        """Apply `weights` now, or stage them when a /start_weight_update fence is open."""
        if self.staging.is_open:
            for name, value in (("version", version), ("in_flight", in_flight)):
                if value is not None:
                    raise bad_request(name, f"{name} belongs to /finish_weight_update while an update is staged. "
                                      f"Fix: send {name} (or weight_version) with /finish_weight_update")
            staged = self.staging.add(weights)
            return {"success": True, "message": f"{len(weights)} tensors staged", "staged": staged}
        return self.apply(weights, version, in_flight)

    def finish(self, version: Any = None, in_flight: Any = None) -> dict:
        """Apply everything staged since /start_weight_update as one update (or nothing: a 400 naming the tensor)."""
        return self.apply(self.staging.take(), version, in_flight)

    def apply(self, weights: dict[str, torch.Tensor], version: Any = None, in_flight: Any = None) -> dict:
        if in_flight is None and getattr(self.rollouts, "is_paused", False):
            in_flight = "recompute"  # waiting for requests a pause froze would never end
        new = self.rollouts.update_weights(weights, version=version, in_flight=in_flight)
        return {"success": True, "message": "Weights updated", "policy_version": int(new)}

    def join(self, info: dict, device: torch.device, group_name: str | None = None, where: str = "init_info") -> None:
        """Join a trainer's group (vLLM's, unnamed; or SGLang's, named); it replaces the last one (whose store and
        process group are dropped with it)."""
        self.group = None
        self.group = WeightReceiver(info, device, group_name, where)

    def leave(self, group_name: str) -> None:
        """SGLang's /destroy_weights_update_group: drop the group /init_weights_update_group joined as `group_name`
        (its store client and process group go with it); a later update from it is a 409 until one is joined."""
        if self.group is None or self.group.name != group_name:
            joined = "no named group" if self.group is None or self.group.name is None else repr(self.group.name)
            raise bad_request("group_name", f"group_name={group_name!r} is invalid: the group to be destroyed does not "
                              f"exist (this server has joined {joined}). Fix: send the name given to "
                              "/init_weights_update_group")
        self.group = None

    def from_group(self, body: dict) -> dict:
        if self.group is None:
            raise ApiError(409, "no weight transfer group: POST /init_weight_transfer_engine first", code="conflict")
        transfer = parse_update_info(body["update_info"])
        return self.update(self.group.receive(transfer), body.get("version"), body.get("in_flight"))

    def from_named_group(self, transfer: Transfer, group_name: str, version: Any = None, in_flight: Any = None) -> dict:
        """SGLang's update: from the group /init_weights_update_group joined under `group_name`."""
        if self.group is None or self.group.name is None:
            raise ApiError(409, "no weight update group: POST /init_weights_update_group first", code="conflict")
        if group_name != self.group.name:
            raise bad_request("group_name", f"group_name={group_name!r} is invalid: this server joined "
                              f"{self.group.name!r} (one group at a time). Fix: send that name, or join this one with "
                              "/init_weights_update_group")
        return self.update(self.group.receive(transfer), version, in_flight)

    def device(self) -> torch.device:
        """Where the model's weights are (a group's nccl tensors arrive there)."""
        model = getattr(self.rollouts, "model", None)
        return next(model.parameters()).device if model is not None else torch.device("cpu")

    def from_dir(self, body: dict, field: str) -> dict:
        return self.update(read_checkpoint(body.get(field), field), body.get("version"), body.get("in_flight"))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.group = None


def mount(app: FastAPI, control: Control, key: str | None, limits: RequestLimits) -> None:
    """Add the admin routes to `app`, each behind `key` when one is given."""
    guard = [Depends(_authorizer(key))]
    _generation_routes(app, control, guard)
    _weight_routes(app, control, guard, limits)
    sglang.mount(app, control, guard, lambda request, allowed: _body_of(request, allowed, limits))


def _authorizer(key: str | None) -> Callable[[Request], None]:
    """`Authorization: Bearer KEY` on every admin route: 401 without one, 403 with another."""
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

    return authorize


def _generation_routes(app: FastAPI, control: Control, guard: list) -> None:
    """pause / resume, sleep / wake_up, the prefix cache."""
    rollouts = control.rollouts

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
    async def sleep(level: int = 1, tags: list[str] | None = Query(None)) -> dict:
        if level not in SLEEP_LEVELS:
            raise bad_request("level", f"level={level} is invalid: must be 1 or 2 (vLLM's). Both free the KV cache, "
                              "step buffers and CUDA graphs; the weights stay. Fix: use level=1 (or 2, SkyRL's "
                              "default)")
        if tags and not set(tags) <= {"weights", "kv_cache"}:
            raise bad_request("tags", f"tags={tags} is invalid: must be among 'weights', 'kv_cache' (vLLM's)")
        if tags and set(tags) == {"weights"}:
            raise bad_request("tags", "tags=['weights'] is invalid: the weights stay on the device here (the trainer "
                              "shares or updates them in place). Fix: send 'kv_cache' (or no tags), which frees the "
                              "KV cache, step buffers and CUDA graphs")
        await control.run(control.sleep)
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


async def _body_of(request: Request, allowed: tuple[str, ...], limits: RequestLimits) -> dict:
    """The JSON object a control route was sent ({} when empty), each field among `allowed` (else a 400 naming it)."""
    body = read_json(await request.body() or b"{}", limits)
    if not isinstance(body, dict):
        raise bad_request(None, "the body must be a JSON object")
    known_fields(body, allowed)
    return body


def _weight_routes(app: FastAPI, control: Control, guard: list, limits: RequestLimits) -> None:
    """Updates from a checkpoint directory or a trainer's group, and the version they made."""
    rollouts = control.rollouts

    async def body_of(request: Request, allowed: tuple[str, ...]) -> dict:
        return await _body_of(request, allowed, limits)

    @app.get("/get_weight_version", dependencies=guard)
    async def weight_version() -> dict:
        fingerprint = await control.run(rollouts.weights_fingerprint)
        version = int(rollouts.policy_version)
        return {"weight_version": str(version), "policy_version": version, "weights_fingerprint": fingerprint}

    @app.post("/init_weight_transfer_engine", dependencies=guard)
    async def init_weight_transfer_engine(request: Request) -> dict:
        info = (await body_of(request, ("init_info",))).get("init_info")
        if not isinstance(info, dict):
            raise bad_request("init_info", "init_info is missing: send {\"init_info\": {\"master_address\", "
                              "\"master_port\", \"rank_offset\", \"world_size\", \"backend\"}}")
        await control.run(control.join, info, control.device())
        return {"message": "Weight transfer initialized"}

    @app.post("/update_weights", dependencies=guard)
    async def update_weights(request: Request) -> dict:
        body = await body_of(request, ("update_info", "weight_dir") + UPDATE)
        if "update_info" in body:
            return await control.run(control.from_group, body)
        return await control.run(control.from_dir, body, "weight_dir")

    @app.get("/get_world_size", dependencies=guard)
    @app.get("/get_world_size/", dependencies=guard)  # the slash: TRL before 1.16 asked for it (1.16 asks without)
    async def get_world_size(include_dp: bool = True) -> dict:
        return {"world_size": 1}  # the ranks this server joins a trainer's group with (one: rank_offset)

    @app.get("/server_info", dependencies=guard)
    async def server_info() -> dict:
        raise ApiError(501, "vLLM's /server_info (its VllmConfig) is not served. TRL's VLLMClient.init_communicator "
                       "reads it before building its rank 0 with vLLM's StatelessProcessGroup and PyNcclCommunicator, "
                       "a rendezvous this server's torch.distributed rank cannot join, so TRL's weight sync does not "
                       "run against this server. Fix: keep TRL's generation on this server and send the weights by a "
                       "route it serves (/update_weights with {\"weight_dir\"}, or a torch.distributed group: "
                       "docs/frameworks.md, \"TRL\")", code="not_implemented")

    @app.post("/start_weight_update", dependencies=guard)
    async def start_weight_update(request: Request) -> dict:
        body = await body_of(request, ("is_checkpoint_format",))
        if body.get("is_checkpoint_format", True) is not True:
            raise bad_request("is_checkpoint_format", "is_checkpoint_format=false is invalid: tensors are taken under "
                              "the checkpoint's (model.state_dict()) names, not an engine's fused layout. Fix: send "
                              "true (the default) with state_dict names")
        await control.run(control.staging.open)
        return {"message": "Weight update started"}

    @app.post("/finish_weight_update", dependencies=guard)
    async def finish_weight_update(request: Request) -> dict:
        body = sglang.from_sglang(await body_of(request, ("weight_version",) + UPDATE))
        return await control.run(control.finish, body.get("version"), body.get("in_flight"))
