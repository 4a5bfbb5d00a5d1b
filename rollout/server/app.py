"""The HTTP surface: a FastAPI app over a `Service`.

    GET  /health                 {"status": "ok", "policy_version": N} (no key needed)
    GET  /v1/models              the one model served (and GET /v1/models/{id}: its card)
    POST /v1/chat/completions    chat.completion, or server-sent chunks with "stream": true
    POST /v1/completions         text_completion, likewise
    POST /v1/responses           a response, or its events with "stream": true (responses/turns.py, responses/replies.py); GET and
                                 DELETE /v1/responses/{id}: a stored one (responses/store.py)
    POST /inference/v1/generate  token ids in, token ids out (vLLM's shape: completions/tokens.py)
    POST /tokenize, /detokenize  the served tokenizer (vLLM's shapes); GET /tokenizer_info: its special tokens and
                                 chat template (what lm-eval's remote tokenizer reads)
    POST /generate               SGLang's native generate (sglang/generate.py: AReaL's SGLangBackend, slime)
    GET  /health_generate        SGLang's: an empty 200 once one greedy token is generated, else a 503 (no key
                                 needed, as /health and SGLang's)

Every error is OpenAI's shape (transport.errors.ApiError), unknown routes and unexpected failures included: one request never
takes the server down; every body is read within the server's RequestLimits (transport/limits.py). With an API key, every
route but /health and /health_generate needs `Authorization: Bearer KEY` (401 otherwise). A client that
disconnects cancels its request: nothing of it keeps running in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any

from fastapi import Depends, FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from .completions import tokens
from .completions.protocol import parse
from .completions.service import Service
from .responses import replies
from .responses.store import ResponseStore
from .responses.turns import turn_of
from .sglang import generate as sglang
from .transport.errors import ApiError
from .transport.limits import read_json


def build_app(service: Service, api_key: str | None = None, policy_version=lambda: 0) -> FastAPI:
    app = FastAPI(title="rollout", docs_url=None, redoc_url=None, openapi_url=None)
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def api_error(_, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(_, error: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(Exception)
    async def server_error(_, error: Exception) -> JSONResponse:
        body = ApiError(500, f"internal error: {type(error).__name__}: {error}", type="server_error").body()
        return JSONResponse(body, status_code=500)

    def authorize(request: HttpRequest) -> None:  # a dependency, not middleware: the app sees disconnects as sent
        given = request.headers.get("authorization", "")
        if api_key is not None and not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise ApiError(401, "Incorrect API key provided. Fix: send Authorization: Bearer <the key given to "
                           "rollout serve>", code="invalid_api_key")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok", "policy_version": policy_version()}

    card = {"id": service.model_name, "object": "model", "created": created, "owned_by": "rollout",
            "max_model_len": service.limits.max_tokens}

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}", dependencies=[Depends(authorize)])
    async def model(model_id: str) -> dict:
        if model_id != service.model_name:
            raise ApiError(404, f"The model `{model_id}` does not exist. Fix: use `{service.model_name}` "
                           "(GET /v1/models)", "model", "model_not_found")
        return card

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(request: HttpRequest):
        return await _serve(service, "chat", request)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: HttpRequest):
        return await _serve(service, "completion", request)

    stored = ResponseStore()

    @app.post("/v1/responses", dependencies=[Depends(authorize)])
    async def create_response(http: HttpRequest):
        turn = turn_of(service, stored, read_json(await http.body(), service.request_limits), _headers(http))
        generation = await service.start(turn.request, turn.prepared)
        if turn.request.stream:
            return StreamingResponse(replies.events(service, stored, turn, generation),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return JSONResponse(await _unless_disconnected(http, replies.complete(service, stored, turn, generation)))

    @app.api_route("/v1/responses/{response_id}", methods=["GET", "DELETE"], dependencies=[Depends(authorize)])
    async def stored_response(response_id: str, http: HttpRequest) -> dict:
        return replies.stored(stored, response_id, http.method == "DELETE")

    @app.post("/inference/v1/generate", dependencies=[Depends(authorize)])
    async def generate(http: HttpRequest):
        body = read_json(await http.body(), service.request_limits)
        request, prepared, request_id = tokens.generate_request(service, body, _headers(http))
        generation = await service.start(request, prepared)
        work = tokens.generate_response(service, request, prepared, generation, request_id)
        return JSONResponse(await _unless_disconnected(http, work))

    @app.post("/generate", dependencies=[Depends(authorize)])
    async def sglang_generate(http: HttpRequest):
        body = read_json(await http.body(), service.request_limits)
        request, prepared, plan = sglang.generate_request(service, body, _headers(http))
        generation = await service.start(request, prepared)
        work = sglang.generate_response(service, request, prepared, generation, plan)
        return JSONResponse(await _unless_disconnected(http, work))

    @app.get("/health_generate")
    async def health_generate() -> Response:
        await sglang.health_generate(service)
        return Response(status_code=200)

    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize(http: HttpRequest) -> dict:
        return tokens.tokenize(service, read_json(await http.body(), service.request_limits))

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize(http: HttpRequest) -> dict:
        return tokens.detokenize(service, read_json(await http.body(), service.request_limits))

    @app.get("/tokenizer_info", dependencies=[Depends(authorize)])
    async def tokenizer_info() -> dict:
        return tokens.tokenizer_info(service)

    return app


def _headers(http: HttpRequest) -> dict[str, str]:
    return {k.lower(): v for k, v in http.headers.items()}


async def _serve(service: Service, kind: str, http: HttpRequest):
    body = read_json(await http.body(), service.request_limits)
    request = parse(kind, body, _headers(http), service.request_limits)
    prepared = service.prepare(request)
    generation = await service.start(request, prepared)
    if request.stream:
        return StreamingResponse(_events(service.stream(request, prepared, generation)),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    return JSONResponse(await _unless_disconnected(http, service.complete(request, prepared, generation)))


async def _events(chunks) -> Any:
    """Server-sent events; when the client goes away, the response task is cancelled inside this generator and the
    service's `finally` cancels the generation."""
    async for chunk in chunks:
        yield f"data: {chunk if isinstance(chunk, str) else json.dumps(chunk)}\n\n"


async def _unless_disconnected(http: HttpRequest, work) -> Any:
    """Await `work`, cancelling it if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(http))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # its `finally` cancels the generation
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ApiError(499, "the client closed the request", code="client_closed")
    return task.result()


async def _disconnect(http: HttpRequest) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass
