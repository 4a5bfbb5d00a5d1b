"""The soak's HTTP client for the loopback `rollout.serve` server: raw http.client (so it can send what a real client
never would, and drop a connection mid-stream), every request recorded in the history.

Rows come back as history rows: /inference/v1/generate (token in, token out; `logprobs: 0` returns each sampled
token's logprob) and streamed /v1/completions with `prompt_token_ids` (the chunks' token_ids, token_versions and
token_logprobs added up).
"""

from __future__ import annotations

import http.client
import json
import time
from typing import Any
from urllib.parse import urlparse

MODEL = "chaos"


class Http:
    def __init__(self, url: str, history, version) -> None:
        parsed = urlparse(url)
        self.host, self.port, self.history, self.version = parsed.hostname, parsed.port, history, version

    def _post(self, path: str, body: bytes, timeout: float) -> tuple[http.client.HTTPConnection, Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        return conn, conn.getresponse()

    # ------------------------------------------------------------------ token in, token out
    def generate(self, prompt: list[int], sp: dict, op: str = "generate", fault: int | None = None,
                 timeout: float = 300.0) -> dict:
        sent = dict(prompts=[prompt], params=[_params(sp)], path="/inference/v1/generate", timeout=timeout)
        call = self.history.begin("server", op, sent, self.version(), fault)
        body = json.dumps({"model": MODEL, "token_ids": prompt, "sampling_params": {**sp, "logprobs": 0}}).encode()
        try:
            conn, response = self._post("/inference/v1/generate", body, timeout)
            status, payload = response.status, json.loads(response.read() or b"{}")
            conn.close()
        except (TimeoutError, OSError) as exc:  # the client gave up: the server must cancel the request
            self.history.end(call, "disconnected", self.version(), error={"type": type(exc).__name__,
                                                                          "message": str(exc)})
            return call
        if status != 200:
            self.history.end(call, "error", self.version(), error=_http_error(status, payload), status=status)
            return call
        rows = [_row(prompt, c["index"], c["token_ids"], [e["logprob"] for e in c["logprobs"]["content"]],
                     c["token_versions"], c["finish_reason"], sp) for c in payload["choices"]]
        self.history.end(call, "ok", self.version(), rows=rows, status=status)
        return call

    # ------------------------------------------------------------------ streamed completions
    def stream(self, prompt: list[int], sp: dict, drop_after: int | None = None, fault: int | None = None,
               timeout: float = 300.0) -> dict:
        """Stream a completion; with `drop_after`, close the connection after that many token chunks."""
        sent = dict(prompts=[prompt], params=[_params(sp)], path="/v1/completions", stream=True,
                    drop_after=drop_after)
        call = self.history.begin("server", "stream" if drop_after is None else "disconnect", sent, self.version(),
                                  fault)
        body = dict(model=MODEL, prompt_token_ids=prompt, stream=True, logprobs=0, **_completion_params(sp))
        got: dict[int, dict] = {}
        try:
            conn, response = self._post("/v1/completions", json.dumps(body).encode(), timeout)
            if response.status != 200:
                payload = json.loads(response.read() or b"{}")
                conn.close()
                self.history.end(call, "error", self.version(), error=_http_error(response.status, payload),
                                 status=response.status)
                return call
            error, chunks = _read_events(response, got, drop_after)
            conn.close()
        except (TimeoutError, OSError) as exc:
            self.history.end(call, "error", self.version(), error={"type": type(exc).__name__, "message": str(exc)})
            return call
        rows = [_row(prompt, i, g["ids"], g["lps"], g["versions"], g.get("finish"), sp) for i, g in sorted(got.items())]
        if drop_after is not None and chunks >= drop_after:
            self.history.end(call, "disconnected", self.version(), rows=rows, partial=True)
        elif error is not None:
            self.history.end(call, "error", self.version(), rows=rows, error=error, partial=True)
        else:
            self.history.end(call, "ok", self.version(), rows=rows)
        return call

    # ------------------------------------------------------------------ what no client should send
    def bad(self, path: str, body: bytes, expect_param: str | None, label: str, fault: int | None) -> dict:
        sent = dict(path=path, label=label, expect_param=expect_param, body_bytes=len(body))
        call = self.history.begin("server", "bad_request", sent, self.version(), fault)
        try:
            conn, response = self._post(path, body, 60)
            raw = response.read()
            conn.close()
            try:
                payload = json.loads(raw or b"{}")
            except ValueError:
                payload = {"raw": raw[:200].decode(errors="replace")}
        except (TimeoutError, OSError) as exc:
            self.history.end(call, "error", self.version(), error={"type": type(exc).__name__, "message": str(exc)})
            return call
        outcome = "ok" if response.status == 200 else "error"
        self.history.end(call, outcome, self.version(), error=_http_error(response.status, payload),
                         status=response.status)
        return call


def _read_events(response, got: dict[int, dict], drop_after: int | None) -> tuple[dict | None, int]:
    """Add up the stream's chunks into `got` (choice index -> ids, logprobs, versions, finish); returns the error
    event (if any) and the number of token chunks read."""
    chunks = 0
    for line in response:
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if "error" in event:
            return {"type": "stream_error", "message": json.dumps(event["error"])}, chunks
        for c in event.get("choices", []):
            g = got.setdefault(c["index"], {"ids": [], "lps": [], "versions": []})
            ids = c.get("token_ids") or []
            if ids:
                chunks += 1
                g["ids"] += ids
                g["versions"] += c.get("token_versions") or []
                g["lps"] += (c.get("logprobs") or {}).get("token_logprobs") or []
            if c.get("finish_reason"):
                g["finish"] = c["finish_reason"]
        if drop_after is not None and chunks >= drop_after:
            break
    return None, chunks


def _http_error(status: int, payload: dict) -> dict:
    error = payload.get("error") if isinstance(payload, dict) else None
    error = error if isinstance(error, dict) else {"message": json.dumps(payload)[:500]}
    return {"type": f"http_{status}", "message": str(error.get("message", ""))[:1000], "param": error.get("param"),
            "error_type": error.get("type"), "code": error.get("code")}


def _params(sp: dict) -> dict:
    return dict(n=sp.get("n", 1), temperature=sp.get("temperature", 1.0), top_k=sp.get("top_k", 0),
                top_p=sp.get("top_p", 1.0), max_new_tokens=sp.get("max_tokens", 16), seed=sp.get("seed"),
                ignore_eos=sp.get("ignore_eos", False))


def _completion_params(sp: dict) -> dict:
    return {k: v for k, v in sp.items() if k in ("n", "temperature", "top_p", "top_k", "max_tokens", "seed",
                                                 "ignore_eos")}


def _row(prompt, index, ids, lps, versions, finish, sp) -> dict:
    return dict(prompt_index=0, sample_index=int(index), prompt_ids=list(prompt), completion_ids=list(ids),
                logprobs=list(lps), token_versions=list(versions), action_mask=[True] * len(ids), finish_reason=finish,
                error="", temperature=sp.get("temperature", 1.0), seed=sp.get("seed"), segment_index=0)


def bad_bodies(vocab: int, context: int) -> list[tuple[str, bytes, str | None, str]]:
    """(path, body, the param a 400 must name or None, label): malformed and oversized requests."""
    ok = {"model": MODEL, "prompt_token_ids": [11, 12, 13], "max_tokens": 4}

    def j(**kw) -> bytes:
        return json.dumps({**ok, **kw}).encode()

    nested = b'{"model": "chaos", "prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    return [
        ("/v1/completions", b"{not json", None, "invalid JSON"),
        ("/v1/completions", b"[1, 2, 3]", None, "a body that is not an object"),
        ("/v1/completions", nested, None, "5,000 nested arrays"),
        ("/v1/completions", j(frobnicate=1), "frobnicate", "an unknown field"),
        ("/v1/completions", j(max_tokens="ten"), "max_tokens", "a string for an int"),
        ("/v1/completions", j(temperature=-1), "temperature", "a negative temperature"),
        ("/v1/completions", j(prompt_token_ids=[1, vocab + 5]), "prompt_token_ids", "a token id outside the vocab"),
        ("/v1/completions", j(prompt_token_ids=[]), "prompt_token_ids", "an empty prompt"),
        ("/v1/completions", j(n=0), "n", "n=0"),
        ("/v1/completions", j(n=10_000), "n", "n=10000 (oversized)"),
        ("/v1/completions", j(max_tokens=10**7), "max_tokens", "max_tokens=1e7 (oversized)"),
        ("/v1/completions", j(prompt_token_ids=[7] * (context + 50)), "prompt_token_ids", "a prompt past the context"),
        ("/v1/completions", j(logprobs=21), "logprobs", "21 alternatives (oversized)"),
        ("/v1/completions", j(stop=["x"] * 100), "stop", "100 stop strings (oversized)"),
        ("/inference/v1/generate", json.dumps({"model": MODEL, "token_ids": [1, 2], "sampling_params": {
            "temperature": "hot"}}).encode(), "sampling_params.temperature", "a string temperature"),
        ("/inference/v1/generate", json.dumps({"model": MODEL, "token_ids": [1, 2], "stream": True}).encode(),
         "stream", "stream on the token endpoint"),
        ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": "hello"}).encode(), "messages",
         "messages as a string"),
        ("/v1/nowhere", b"{}", None, "an unknown path"),
    ]
