"""SGLang's names for the control plane (its `http_server.py`, as AReaL's SGLangBackend and slime call them), and the
names AReaL's own vLLM server extension adds (`areal/engine/vllm_ext/areal_vllm_server.py`, which AReaL's
VLLMBackend calls). Each runs the operation routes.py's `Control` runs for vLLM's name; only the bodies and answers
differ. Mounted by routes.py's `mount`, behind the same key.

    POST /pause_generation               {"mode"?: "abort" | "retract" | "in_place"}: /pause (abort; retract and
                                         in_place both freeze what is in flight with its KV: "keep")
    POST /continue_generation            /resume
    POST /release_memory_occupation      {"tags"?: [...]}: /sleep (the KV cache, step buffers and CUDA graphs)
    POST /resume_memory_occupation       {"tags"?: [...]}: /wake_up, unless the tags name only "weights" (they never
                                         left the device: nothing to do)
    GET|POST /flush_cache                /reset_prefix_cache (forget every cached prefix), answered as SGLang answers:
                                         200 "Cache flushed." (text); requests in flight keep their own KV, so it is
                                         never refused for them (SGLang refuses with a 400 then)
    POST /update_weights_from_disk       {"model_path": DIR}: a checkpoint directory
    POST /init_weights_update_group      {master_address, master_port, rank_offset, world_size, group_name?,
                                         backend?}: join the trainer's group, keyed as SGLang's
                                         init_custom_process_group keys it (transfer.py)
    POST /destroy_weights_update_group   {"group_name"?}: leave that group (a 400 when it is not the one joined)
    POST /update_weights_from_distributed  {names, dtypes, shapes, group_name?, load_format?, weight_version?,
                                         abort_all_requests?, flush_cache?, torch_empty_cache?}: one broadcast per
                                         tensor from rank 0 (or one flattened bucket), then one update
    POST /update_weights_from_tensor     refused (400): its tensors are pickled CUDA-IPC / shared-memory handles

AReaL's VLLMBackend names (the same operations; the answers {"success", "message"} as AReaL's server gives them):

    POST /areal_init_weights_update_group   /init_weights_update_group, the same body
    POST /areal_set_update_weight_meta      {names, dtypes, shapes, group_name}: what the next
    POST /areal_update_weights_xccl         {} receives from the group and applies (AReaL's two-step update)
    POST /areal_update_weights              {"model_path", "load_format"?: "auto", "abort_all_requests"?}:
                                            /update_weights_from_disk
    POST /areal_pause_generation            /pause_generation with mode "abort" (AReaL's server aborts)
    POST /areal_continue_generation         /continue_generation

The weight routes (SGLang's and AReaL's) answer SGLang's shape: {"success": true, "message": ..., "policy_version": N} (the version is this
server's addition), and a failure {"success": false, "message": ...} with the status and, as every error here, the
`error` object naming the field at fault; nothing is applied then.
"""

from __future__ import annotations

import functools
from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from ..transport.errors import ApiError, bad_request
from .transfer import SGLANG_GROUP, parse_sglang_update

UPDATE = ("version", "in_flight")  # what every update body may add to its source (as routes.py's)
SGLANG = ("weight_version", "abort_all_requests", "flush_cache")  # SGLang's update fields that mean here
# SGLang's pause modes -> the worker's: "in_place" keeps requests and their KV; "retract" (SGLang frees their KV and
# recomputes it on continue) is frozen in place here too: an update while paused recomputes them anyway
SGLANG_PAUSE = {"abort": "abort", "retract": "keep", "in_place": "keep"}
# SGLang's memory tags: what each means here. The KV cache and the CUDA graphs are freed together (worker.sleep());
# the weights never leave the device
MEMORY_TAGS = ("kv_cache", "cuda_graph", "weights")
INIT_GROUP = ("master_address", "master_port", "rank_offset", "world_size", "group_name", "backend", "timeout_s")
DISTRIBUTED = ("names", "dtypes", "shapes", "group_name", "load_format", "torch_empty_cache") + SGLANG + UPDATE
AREAL_META = ("names", "dtypes", "shapes", "group_name")

BodyOf = Callable[[Request, tuple[str, ...]], Awaitable[dict]]


def mount(app: FastAPI, control: Any, guard: list, body_of: BodyOf) -> None:
    _generation_routes(app, control, guard, body_of)
    _weight_routes(app, control, guard, body_of)
    _areal_routes(app, control, guard, body_of)


def sglang_answer(route: Callable) -> Callable:
    """A weight route's failure in SGLang's shape ({"success": false, "message"}) beside the `error` object."""
    @functools.wraps(route)
    async def answer(*args, **kwargs) -> Any:
        try:
            return await route(*args, **kwargs)
        except ApiError as error:
            return JSONResponse({"success": False, "message": error.message, **error.body()}, status_code=error.status)

    return answer


def from_sglang(body: dict, keep_cache_allowed: bool = False) -> dict:
    """SGLang's fields in this server's terms: weight_version (an int here) is the version, abort_all_requests the
    "abort" mode. The prefix cache is always flushed by an update; `flush_cache: false` is a 400 unless the route
    takes it (`keep_cache_allowed`) and says in its answer that the cache was flushed all the same."""
    body = dict(body)
    if body.pop("flush_cache", True) is not True and not keep_cache_allowed:
        raise bad_request("flush_cache", "flush_cache=false is invalid: an update always forgets the prefix cache "
                          "(KV of the old weights is never reused)")
    if "weight_version" in body:
        version = body.pop("weight_version")
        body.setdefault("version", int(version) if isinstance(version, str) and version.isdigit() else version)
    if body.pop("abort_all_requests", False):
        body.setdefault("in_flight", "abort")
    return body


def _generation_routes(app: FastAPI, control: Any, guard: list, body_of: BodyOf) -> None:
    """SGLang's names for pause / resume, sleep / wake and the prefix cache (AReaL's SGLangBackend, slime)."""

    @app.post("/pause_generation", dependencies=guard)
    async def pause_generation(request: Request) -> dict:
        mode = (await body_of(request, ("mode",))).get("mode", "abort")
        if mode not in SGLANG_PAUSE:
            raise bad_request("mode", f"mode={mode!r} is invalid: must be one of {tuple(SGLANG_PAUSE)} (SGLang's). "
                              "Fix: 'abort' re-runs requests in flight after /continue_generation, 'in_place' freezes "
                              "them")
        await control.run(control.method("pause"), SGLANG_PAUSE[mode])
        return {"status": "paused", "mode": mode}

    @app.post("/continue_generation", dependencies=guard)
    async def continue_generation(request: Request) -> dict:
        await body_of(request, ("torch_empty_cache",))  # SGLang's option; the worker's wake decides
        await control.run(control.method("resume"))
        return {"status": "resumed"}

    @app.post("/release_memory_occupation", dependencies=guard)
    async def release_memory_occupation(request: Request) -> dict:
        tags = _tags(await body_of(request, ("tags",)))
        if tags == {"weights"}:
            raise bad_request("tags", "tags=['weights'] is invalid: the weights stay on the device here (the trainer "
                              "shares or updates them in place). Fix: release 'kv_cache' (or send no tags), which "
                              "frees the KV cache, step buffers and CUDA graphs")
        await control.run(control.sleep)
        return {"success": True, "message": "KV cache, step buffers and CUDA graphs released; weights kept"}

    @app.post("/resume_memory_occupation", dependencies=guard)
    async def resume_memory_occupation(request: Request) -> dict:
        tags = _tags(await body_of(request, ("tags",)))
        if tags != {"weights"}:  # the weights never left: "weights" alone has nothing to bring back
            await control.run(control.method("wake"))
        return {"success": True, "is_sleeping": bool(getattr(control.rollouts, "is_sleeping", False))}

    @app.api_route("/flush_cache", methods=["GET", "POST"], dependencies=guard)
    async def flush_cache(request: Request) -> PlainTextResponse:
        await body_of(request, ())  # SGLang's takes no body (slime sends a GET)
        await control.run(control.method("reset_prefix_cache"))
        return PlainTextResponse("Cache flushed.\n")


def _tags(body: dict) -> set[str]:
    """SGLang's memory tags (None: all of them), each one it names."""
    tags = body.get("tags")
    if tags is None:
        return set(MEMORY_TAGS)
    if not isinstance(tags, list) or not tags or not all(isinstance(t, str) and t in MEMORY_TAGS for t in tags):
        raise bad_request("tags", f"tags={tags!r} is invalid: must be a non-empty list among {MEMORY_TAGS} (SGLang's), "
                          "or left out for all")
    return set(tags)


def _weight_routes(app: FastAPI, control: Any, guard: list, body_of: BodyOf) -> None:
    """SGLang's weight updates: from a checkpoint directory, from the trainer's named group; from tensors: refused."""

    @app.post("/update_weights_from_disk", dependencies=guard)
    @sglang_answer
    async def update_weights_from_disk(request: Request) -> dict:
        body = from_sglang(await body_of(request, ("model_path",) + UPDATE + SGLANG))
        return await control.run(control.from_dir, body, "model_path")

    @app.post("/init_weights_update_group", dependencies=guard)
    @sglang_answer
    async def init_weights_update_group(request: Request) -> dict:
        return await _join(control, await body_of(request, INIT_GROUP))

    @app.post("/destroy_weights_update_group", dependencies=guard)
    @sglang_answer
    async def destroy_weights_update_group(request: Request) -> dict:
        name = (await body_of(request, ("group_name",))).get("group_name", SGLANG_GROUP)
        await control.run(control.leave, name)
        return {"success": True, "message": f"left weight update group {name!r}"}

    @app.post("/update_weights_from_distributed", dependencies=guard)
    @sglang_answer
    async def update_weights_from_distributed(request: Request) -> dict:
        body = await body_of(request, DISTRIBUTED)
        # slime sends flush_cache: false (it flushes on its own); the cache is flushed here whatever it says
        kept = body.get("flush_cache", True) is False
        body = from_sglang(body, keep_cache_allowed=True)
        body.pop("torch_empty_cache", None)  # SGLang's allocator option; nothing to empty here
        transfer = parse_sglang_update(body)
        out = await control.run(control.from_named_group, transfer, body.get("group_name", SGLANG_GROUP),
                                body.get("version"), body.get("in_flight"))
        if kept:
            out["message"] += ("; the prefix cache was flushed all the same (flush_cache=false is not honoured: KV "
                               "computed under the old weights is never reused here)")
        return out

    @app.post("/update_weights_from_tensor", dependencies=guard)
    @sglang_answer
    async def update_weights_from_tensor(request: Request) -> dict:
        raise bad_request("serialized_named_tensors", "/update_weights_from_tensor is not served: its "
                          "serialized_named_tensors are pickles (SGLang's MultiprocessingSerializer) whose tensors are "
                          "CUDA IPC handles (or shared-memory handles for CPU tensors) into the sender's process, "
                          "readable only on its host and by unpickling what the sender wrote. Fix: broadcast the "
                          "tensors over a group (/init_weights_update_group, then /update_weights_from_distributed), "
                          "or save them and POST /update_weights_from_disk")


def _areal_routes(app: FastAPI, control: Any, guard: list, body_of: BodyOf) -> None:
    """AReaL's VLLMBackend names (its areal_vllm_server.py): one more name each for the routes above, except the
    two-step distributed update, whose first step holds the tensors' description until the second receives them."""

    @app.post("/areal_init_weights_update_group", dependencies=guard)
    @sglang_answer
    async def areal_init_weights_update_group(request: Request) -> dict:
        return await _join(control, await body_of(request, INIT_GROUP))

    @app.post("/areal_set_update_weight_meta", dependencies=guard)
    @sglang_answer
    async def areal_set_update_weight_meta(request: Request) -> dict:
        body = await body_of(request, AREAL_META)
        control.areal_meta = (parse_sglang_update(body), body.get("group_name", SGLANG_GROUP))
        return {"success": True, "message": f"{len(control.areal_meta[0].names)} tensors described"}

    @app.post("/areal_update_weights_xccl", dependencies=guard)
    @sglang_answer
    async def areal_update_weights_xccl(request: Request) -> dict:
        await body_of(request, ())
        if control.areal_meta is None:
            raise ApiError(409, "no tensors described: POST /areal_set_update_weight_meta first", code="conflict")
        transfer, group_name = control.areal_meta
        return await control.run(control.from_named_group, transfer, group_name, None, None)

    @app.post("/areal_update_weights", dependencies=guard)
    @sglang_answer
    async def areal_update_weights(request: Request) -> dict:
        body = await body_of(request, ("model_path", "load_format", "abort_all_requests"))
        if body.pop("load_format", "auto") != "auto":
            raise bad_request("load_format", "load_format must be 'auto' (AReaL's default): the directory's "
                              "*.safetensors are read")
        return await control.run(control.from_dir, from_sglang(body), "model_path")

    @app.post("/areal_pause_generation", dependencies=guard)
    async def areal_pause_generation(request: Request) -> dict:
        await body_of(request, ())
        await control.run(control.method("pause"), "abort")
        return {"success": True, "message": "Generation paused; requests in flight re-run after "
                "/areal_continue_generation"}

    @app.post("/areal_continue_generation", dependencies=guard)
    async def areal_continue_generation(request: Request) -> dict:
        await body_of(request, ())
        await control.run(control.method("resume"))
        return {"success": True, "message": "Generation continued"}


async def _join(control: Any, body: dict) -> dict:
    body = dict(body)
    name = body.pop("group_name", SGLANG_GROUP)
    if not isinstance(name, str) or not name:
        raise bad_request("group_name", f"group_name={name!r} is invalid: must be a non-empty string")
    await control.run(control.join, body, control.device(), name, "")
    return {"success": True, "message": f"joined weight update group {name!r}"}
