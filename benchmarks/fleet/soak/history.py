"""The recorded history of a chaos run: what the driver writes and the checker reads (as JSON, nothing else).

    calls:   {"id", "surface" ("fleet" | "server"), "op", "t0", "sent", "fault" (the id of the fault this call
              carries, or None), "version_before", "ends": [{"t1", "outcome", "rows", "error", "version_after",
              "scores", "status"}]}
             "ends" holds every return of the call: exactly one is the promise (two would be a call that returned
             twice, none one that never returned).
    rows:    {"prompt_index", "sample_index", "prompt_ids", "completion_ids", "logprobs", "token_versions",
              "action_mask", "finish_reason", "error", "temperature", "seed"}
    faults:  {"id", "kind", "t", "target", "detail", "recovered_t"}
    updates: {"surface", "version", "mode", "t0", "t1", "fingerprint", "error"}
    samples: {"t", "rss_mb", "fds", "threads", "actors_alive"}   (the driver's process and the Ray cluster)
    probes:  the end state: {"baseline": sample, "final": sample, "server": {...}, "fleet": {...}}
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any


def rows_of(batch, params: list, surface_seed: Any = None) -> list[dict]:
    """A RolloutBatch's rows as plain data; `params` are the call's SamplingParams, one per prompt."""
    out = []
    for r in range(len(batch)):
        n = int(batch.completion_lengths[r])
        p = params[int(batch.prompt_index[r])]
        out.append(dict(prompt_index=int(batch.prompt_index[r]), sample_index=int(batch.sample_index[r]),
                        prompt_ids=list(batch.prompt_ids[r]), completion_ids=batch.completion_ids[r, :n].tolist(),
                        logprobs=batch.logprobs[r, :n].tolist(), token_versions=batch.token_versions[r, :n].tolist(),
                        action_mask=batch.action_mask[r, :n].tolist(), finish_reason=batch.finish_reason[r],
                        error=batch.errors[r], temperature=p.temperature, seed=p.seed,
                        segment_index=int(batch.segment_index[r])))
    return out


def error_of(exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": str(exc)[:2000]}


class History:
    """Thread-safe, append-only; `save` writes the JSON the checker reads. With `spill`, each call goes to that file
    (JSON lines) when it ends, and each end with its rows, and they come back into the history at `save`: the
    driver's memory then holds only the calls still running, so its RSS measures what the code under test keeps (a
    30-minute run's rows are ~500 MiB as Python objects, its 25,000 call records ~56 MiB, which a leak of that size
    would hide behind)."""

    def __init__(self, seed: int, duration_s: float, spill: Path | None = None) -> None:
        self.start = time.monotonic()
        self._lock = threading.Lock()
        self.data: dict[str, Any] = dict(seed=seed, duration_s=duration_s, calls=[], faults=[], updates=[],
                                         samples=[], probes={}, meta={})
        self._spill = None if spill is None else open(spill, "w")  # noqa: SIM115  (closed by save)
        self._running: dict[int, dict] = {}  # spilling: the calls begun and not yet ended (the rest is on disk)
        self._count = 0

    def now(self) -> float:
        return round(time.monotonic() - self.start, 4)

    def begin(self, surface: str, op: str, sent: dict, version: int, fault: int | None = None) -> dict:
        call = dict(id=None, surface=surface, op=op, t0=self.now(), sent=sent, fault=fault, version_before=version,
                    ends=[])
        with self._lock:
            call["id"], self._count = self._count, self._count + 1
            if self._spill is None:
                self.data["calls"].append(call)
            else:
                self._running[call["id"]] = call
        return call

    def end(self, call: dict, outcome: str, version: int, rows: list | None = None, error: dict | None = None,
            **extra: Any) -> None:
        record = dict(t1=self.now(), outcome=outcome, version_after=version, rows=rows or [], error=error, **extra)
        with self._lock:
            if self._spill is not None:
                if self._running.pop(call["id"], None) is not None:  # its first end: the call itself, once
                    self._spill.write(json.dumps(["call", {k: v for k, v in call.items() if k != "ends"}]) + "\n")
                self._spill.write(json.dumps(["end", call["id"], record]) + "\n")
                record = dict(record, rows=[])
            call["ends"].append(record)

    def fault(self, kind: str, fault_id: int, target: str, detail: str = "") -> dict:
        record = dict(id=fault_id, kind=kind, t=self.now(), target=target, detail=detail, recovered_t=None)
        with self._lock:
            self.data["faults"].append(record)
        return record

    def update(self, surface: str, version: int, mode: str, t0: float, fingerprint: str | None,
               error: dict | None = None) -> None:
        with self._lock:
            self.data["updates"].append(dict(surface=surface, version=version, mode=mode, t0=t0, t1=self.now(),
                                             fingerprint=fingerprint, error=error))

    def sample(self, sample: dict) -> None:
        with self._lock:
            self.data["samples"].append(dict(t=self.now(), **sample))

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        with self._lock:
            if self._spill is not None:  # the spilled calls back into the history, once
                self._spill.close()
                calls: list[Any] = [None] * self._count
                for call_id, call in self._running.items():  # never ended
                    calls[call_id] = call
                with open(self._spill.name) as spilled:
                    for line in spilled:
                        kind, *record = json.loads(line)
                        if kind == "call":
                            calls[record[0]["id"]] = dict(record[0], ends=[])
                        else:
                            calls[record[0]]["ends"].append(record[1])
                self.data["calls"], self._spill, self._running = calls, None, {}
            path.write_text(json.dumps(self.data))
        return path


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
