"""The HTTP surface: a FastAPI app over a `Service`.

    GET  /health                 {"status": "ok", "policy_version": N} (no key needed)
    GET  /v1/models              the one model served
    POST /v1/chat/completions    chat.completion, or server-sent chunks with "stream": true
    POST /v1/completions         text_completion, likewise

Every error is OpenAI's shape (errors.ApiError), unknown routes and unexpected failures included: one request never
takes the server down. With an API key, /v1/* needs `Authorization: Bearer KEY` (401 otherwise). A client that
disconnects cancels its request: nothing of it keeps running in the engine.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from typing import Any

from fastapi import Depends, FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from .errors import ApiError, bad_request
from .protocol import parse
from .service import Service


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

    @app.get("/v1/models", dependencies=[Depends(authorize)])
    async def models() -> dict:
        card = {"id": service.model_name, "object": "model", "created": created, "owned_by": "rollout",
                "max_model_len": service.limits.max_tokens}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorize)])
    async def chat(request: HttpRequest):
        return await _serve(service, "chat", request)

    @app.post("/v1/completions", dependencies=[Depends(authorize)])
    async def completions(request: HttpRequest):
        return await _serve(service, "completion", request)

    return app


async def _serve(service: Service, kind: str, http: HttpRequest):
    try:
        body = json.loads(await http.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise bad_request(None, f"We could not parse the JSON body of your request ({error}). Fix: send a JSON "
                          "object with Content-Type: application/json") from None
    request = parse(kind, body, {k.lower(): v for k, v in http.headers.items()})
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
