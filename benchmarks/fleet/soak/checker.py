"""The checker: reads a history (history.py's JSON) and checks every promise, independently of the driver (it never
sees the driver's objects: only what was sent, what came back, and the end-state probes).

Checks (each violation names the call or fault, and the run's seed reproduces it):
- returns:    every call returned exactly once; an error is explained by the fault the call carried or by a fault
              or weight update that overlapped it (its message names it), never unexplained.
- rows:       an accepted call's rows are each (prompt, sample) it asked for exactly once, with the prompt it sent;
              a collector's groups are complete and never handed out twice; episodes end in "error" exactly when
              their environment was made faulty, the error naming the fault.
- versions:   on a row, token versions never go backwards, and lie between the call's versions at start and end.
- exactness:  sampled rows, every model token's logprob against a teacher-forced forward of the weights of its
              recorded version, in fp64 (the truth the fp32 engine approximates: an fp32 reference is itself up to
              ~1e-5 off on these rows, measured), within 2e-5 / min(T, 1) (fp32's floor here; log_softmax(logits / T)
              scales the logits' rounding by 1 / T); a row in flight at a "keep" switch excused from the switch on
              (approximate by design, docs/async.md), a request still prefilling then included: its first token
              is the new version's, over KV the old weights computed;
              score results likewise; every update's fingerprint is the fingerprint of the weights sent.
- replay:     seeded rows generated on one version equal a fault-free replay (replay.py), but rows in flight at a
              "keep" switch (as for exactness); up to a draw whose uniform lay within fp32's floor of the boundary
              between the two tokens drawn (under the fp64 reference), after which they may differ.
- end state:  no requests, ledger entries or KV pages left on any engine, every actor slot live and no extra actor
              in Ray, threads back to the warmed-up baseline (pools within their caps), file descriptors too, RSS
              growth bounded.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict
from typing import Any

import torch

from .envs import ERROR_TEXT
from .weights import Versions

# fp32's floor on these rows: the engine, an fp32 sdpa forward and rollout.score (packed, fp32) are each up to 1.35e-5
# from the fp64 value at T = 1 (measured on the soak's rows, docs/reliability.md); a real fault (stale KV, a token
# from other weights) is off by 1e-3 or more (tests/test_async.py)
TOL = 2e-5
# what an error may say when it comes from a fault (kind -> text in the message); a call's error is explained when a
# fault of that kind overlapped it and the text is in the message
EXPLAINS = {
    "engine_death_fleet": ("chaos: injected engine fault",),
    "engine_death_server": ("chaos: injected engine fault",),
    "actor_kill": ("died", "actor"),
    "node_kill": ("died", "actor", "node"),
    "update_abort": ("aborted_by_weight_update",),
    # a streamed row re-run on weights updated meanwhile (an engine restart after any update) may sample otherwise
    "update_server": ("aborted_by_weight_update",),
}
# RSS: the driver holds no records of its own (history.py spills them, weights.py keeps 4 versions), so its growth is
# the code under test's: +54 to +58 MiB on three 30-minute runs, ~30 of it in the first 4 minutes (thread pools
# filling to their caps, their allocator arenas), within 7 MiB over the second 15; 150 MiB catches a leak of ~3 MiB a
# minute over 30 minutes
SLACK = dict(fds=32, rss_mb=150.0, rss_fraction=0.25)
# thread pools that grow on demand up to a cap and keep their idle threads (name, digits stripped -> cap): any other
# group of threads must be back to its baseline count at the end
POOLS = {"rollout-serve": 8 + 1, "rollout-fleet": 16, "AnyIO worker thread": 40, "rollout-env": 64,
         "rollout-reward": 4, "rollout-serve-score": 1}


class Checker:
    def __init__(self, history: dict, model_path: str | None = None, max_rows: int = 300, replays: int = 40) -> None:
        self.h, self.seed = history, history["seed"]
        self.model_path = model_path or history["meta"]["model"]
        self.max_rows, self.replays = max_rows, replays
        self.violations: list[dict] = []
        self.verified: Counter = Counter()
        self._windows = self._fault_windows()
        self._keeps = self._keep_switches()

    def violate(self, check: str, detail: str, **where: Any) -> None:
        self.violations.append(dict(check=check, detail=detail[:600], seed=self.seed, **where))

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        calls = self.h["calls"]
        for call in calls:
            self.check_returns(call)
            if len(call["ends"]) == 1:
                self.check_rows(call, call["ends"][0])
                self.check_versions(call, call["ends"][0])
        model, versions = self._model()
        self.check_exactness(model, versions)
        self.check_scores(model, versions)
        self.check_fingerprints(versions)
        from .replay import replay

        replay(self, model, versions)
        self.check_end_state()
        return dict(violations=self.violations, verified=dict(self.verified))

    def _model(self):
        """The reference model in fp64, and the versions' weights derived from the fp32 checkpoint (as sent)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32, attn_implementation="sdpa")
        versions = Versions(model.state_dict(), self.seed)  # before the model turns fp64
        return _Fp64(model), versions

    def _fault_windows(self) -> list[tuple[str, float, float]]:
        """(kind, start, end) of every fault and every "abort" update: an error inside a window may be explained."""
        windows = [(f["kind"], f["t"], f["t"] + 60.0) for f in self.h["faults"]]
        windows += [("update_abort", u["t0"], u["t1"] + 1.0) for u in self.h["updates"] if u["mode"] == "abort"]
        windows += [("update_server", u["t0"], u["t1"] + 1.0) for u in self.h["updates"] if u["surface"] == "server"]
        return windows

    # ------------------------------------------------------------------ returns
    def check_returns(self, call: dict) -> None:
        ends = call["ends"]
        if len(ends) != 1:
            self.violate("returns", f"{call['op']} returned {len(ends)} times", call=call["id"])
            return
        self.verified["calls returned exactly once"] += 1
        end = ends[0]
        if call["op"] == "bad_request":
            return self._check_refusal(call, end)
        if end["outcome"] == "ok":
            return
        if self._expected_failure(call, end) or self._explained(call, end):
            self.verified["failures explained by their fault"] += 1
            return
        self.violate("returns", f"unexplained {end['outcome']} of {call['op']}: {end.get('error')}", call=call["id"])

    def _check_refusal(self, call: dict, end: dict) -> None:
        status, error, want = end.get("status"), end.get("error") or {}, call["sent"]["expect_param"]
        ok = status is not None and 400 <= status < 500 and error.get("error_type") == "invalid_request_error"
        if not ok or (want is not None and error.get("param") != want):
            self.violate("refusal", f"{call['sent']['label']}: status {status}, param {error.get('param')!r} "
                         f"(want 4xx naming {want!r}): {error.get('message')}", call=call["id"])
        else:
            self.verified["bad requests refused with a 4xx naming the field"] += 1

    def _expected_failure(self, call: dict, end: dict) -> bool:
        error = end.get("error") or {}
        op = call["op"]
        return (op == "cancel" and end["outcome"] == "cancelled") or \
            (op == "timeout" and error.get("type") == "TimeoutError") or \
            (op == "disconnect" and end["outcome"] == "disconnected")

    def _explained(self, call: dict, end: dict) -> bool:
        message = str((end.get("error") or {}).get("message", "")).lower()
        t0, t1 = call["t0"], end["t1"]
        return any(s <= t1 and t0 <= e and any(text in message for text in EXPLAINS.get(kind, ()))
                   for kind, s, e in self._windows)

    # ------------------------------------------------------------------ rows
    def check_rows(self, call: dict, end: dict) -> None:
        if call["op"] in ("bad_request", "score") or not end["rows"]:
            return
        sent, rows = call["sent"], end["rows"]
        firsts = [r for r in rows if r["segment_index"] == 0]
        keys = Counter((r["prompt_index"], r["sample_index"]) for r in firsts)
        duplicated = [k for k, c in keys.items() if c > 1]
        if duplicated:
            self.violate("rows", f"{call['op']}: (prompt, sample) {duplicated[:5]} returned more than once",
                         call=call["id"])
        if any(r["prompt_ids"] != sent["prompts"][r["prompt_index"]] for r in firsts):
            self.violate("rows", f"{call['op']}: a row's prompt is not the prompt sent", call=call["id"])
        if call["op"] == "collector":
            n = sent["params"][0]["n"]
            groups = Counter(p for p, _ in keys)
            if any(c != n for c in groups.values()):
                self.violate("rows", f"collector: incomplete groups {dict(groups)}", call=call["id"])
        elif end["outcome"] == "ok":
            wanted = {(i, j) for i, p in enumerate(sent["params"]) for j in range(p["n"])}
            if set(keys) != wanted:
                self.violate("rows", f"{call['op']}: rows {sorted(set(keys) ^ wanted)[:6]} lost or extra",
                             call=call["id"])
        self.verified["rows returned exactly once"] += len(firsts)
        if sent.get("episode"):
            self._check_episodes(call, rows, sent["episode"])

    def _check_episodes(self, call: dict, rows: list[dict], episode: dict) -> None:
        faulty = episode["faulty"]
        for r in rows:
            kind = faulty.get(f"{r['prompt_index']},{r['sample_index']}")
            if kind is None and r["finish_reason"] == "error" and not self._explained(call, dict(
                    t1=call["ends"][0]["t1"], error={"message": r["error"]})):
                self.violate("episodes", f"a healthy episode ended in error: {r['error']}", call=call["id"])
            elif kind is not None and (r["finish_reason"] != "error" or ERROR_TEXT[kind] not in r["error"]):
                self.violate("episodes", f"a {kind} episode ended {r['finish_reason']!r}: {r['error']!r}",
                             call=call["id"])
            else:
                self.verified["episodes ended as their environment said"] += 1

    # ------------------------------------------------------------------ versions
    def check_versions(self, call: dict, end: dict) -> None:
        low = None if call["op"] == "collector" else call["version_before"]
        for r in end["rows"]:
            v = [x for x, a in zip(r["token_versions"], r["action_mask"]) if a]
            if any(b < a for a, b in zip(v, v[1:])):
                self.violate("versions", f"{call['op']}: a row's versions go backwards: {v}", call=call["id"])
            elif v and ((low is not None and v[0] < low) or v[-1] > end["version_after"]):
                self.violate("versions", f"{call['op']}: versions {v[0]}..{v[-1]} outside the call's "
                             f"{call['version_before']}..{end['version_after']}", call=call["id"])
            else:
                self.verified["rows whose versions never go backwards"] += 1

    # ------------------------------------------------------------------ exactness
    def _keep_switches(self) -> dict[str, list[tuple[int, float]]]:
        """Per surface, (version, time the update returned) of every "keep" switch."""
        out: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for u in self.h["updates"]:
            if u["mode"] == "keep" and u["error"] is None:
                out[u["surface"]].append((u["version"], u["t1"]))
        return out

    def sampled_rows(self) -> list[tuple[dict, dict]]:
        rows = [(call, r) for call in self.h["calls"] if len(call["ends"]) == 1 and call["op"] != "bad_request"
                for r in call["ends"][0]["rows"] if r["completion_ids"]]
        return random.Random(f"chaos-check-{self.seed}").sample(rows, min(self.max_rows, len(rows)))

    def kept_in_flight(self, call: dict, r: dict, v: int) -> bool:
        """Whether the row's version-v tokens may attend to KV of older weights kept by a "keep" switch to k <= v: its
        tokens before k came from older weights (it was decoding then), or its first token is k's and its call began
        before that update returned: its request may have been prefilling then (the engine prefills all but the last
        prompt token of an n > 1 prompt, then forks its samples: seed 2, 30 minutes, a row's first 7 of 8 prompt
        tokens prefilled by version 434, the 8th and every token after by 435). A row whose call began after the
        switch returned is never excused: no KV of older weights serves it."""
        first = min(x for x in r["token_versions"] if x >= 0)
        return any(first < k <= v or (first == k <= v and call["t0"] < t1) for k, t1 in self._keeps[call["surface"]])

    def check_exactness(self, model, versions: Versions) -> None:
        by_version: dict[int, list] = defaultdict(list)
        for call, r in self.sampled_rows():
            for v in set(r["token_versions"]) - {-1}:
                by_version[v].append((call, r))
        for v, items in sorted(by_version.items()):
            model.load_state_dict(versions[v])
            for call, r in items:
                self._check_row(model, call, r, v)

    def _check_row(self, model, call: dict, r: dict, v: int) -> None:
        ids = torch.tensor([r["prompt_ids"] + r["completion_ids"]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(r["prompt_ids"]) - 1: -1]
        temperature = r["temperature"] or 1.0
        full = torch.log_softmax(logits.double() / temperature, dim=-1)
        expected = full.gather(1, torch.tensor(r["completion_ids"])[:, None]).squeeze(1)
        got = torch.tensor(r["logprobs"][: len(r["completion_ids"])], dtype=torch.float64)
        excused = self.kept_in_flight(call, r, v)
        mask = torch.tensor([a and x == v for a, x in zip(r["action_mask"], r["token_versions"])])
        if excused:
            self.verified["tokens after a keep switch (approximate by design, not checked)"] += int(mask.sum())
            return
        gap = float((got[mask] - expected[mask]).abs().max()) if mask.any() else 0.0
        if gap > TOL / min(temperature, 1.0):
            self.violate("exactness", f"{call['op']} on {call['surface']}: logprob gap {gap:.2e} at version {v} "
                         f"(row {r['prompt_index']}/{r['sample_index']}, versions {sorted(set(r['token_versions']))})",
                         call=call["id"])
        self.verified["tokens checked against a teacher-forced forward"] += int(mask.sum())
        self.max_gap = max(getattr(self, "max_gap", 0.0), gap * min(temperature, 1.0))  # in units of the tolerance

    def check_scores(self, model, versions: Versions) -> None:
        for call in self.h["calls"]:
            end = call["ends"][0] if len(call["ends"]) == 1 else None
            if call["op"] != "score" or end is None or end["outcome"] != "ok":
                continue
            if end["version_after"] != call["version_before"]:
                continue  # an update landed meanwhile: which weights scored it is not recorded
            model.load_state_dict(versions[call["version_before"]])
            for p, c, got in zip(call["sent"]["prompts"], call["sent"]["completions"], end["scores"]):
                with torch.no_grad():
                    logits = model(torch.tensor([p + c])).logits[0, len(p) - 1: -1]
                want = torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None]).squeeze(1)
                gap = float((torch.tensor(got, dtype=torch.float64) - want).abs().max())
                if gap > TOL:
                    self.violate("exactness", f"score: gap {gap:.2e}", call=call["id"])
                self.verified["scored tokens checked"] += len(c)

    def check_fingerprints(self, versions: Versions) -> None:
        from rollout.model.weights import fingerprint

        for u in self.h["updates"]:
            if u["error"] is not None:
                if not self._explained(dict(t0=u["t0"]), dict(t1=u["t1"], error=u["error"])):
                    self.violate("updates", f"{u['surface']} update to {u['version']} ({u['mode']}) failed: "
                                 f"{u['error']}")
                continue
            if u["fingerprint"] != fingerprint(versions[u["version"]]):
                self.violate("updates", f"{u['surface']} holds other weights than version {u['version']}")
            self.verified["weight updates whose fingerprint is the weights sent"] += 1

    # ------------------------------------------------------------------ end state
    def check_end_state(self) -> None:
        probes, meta = self.h["probes"], self.h["meta"]
        for name in ("stuck_loops", "stuck_faults"):
            if meta.get(name):
                self.violate("end state", f"{name}: {meta[name]} never finished")
        if "server" not in probes:
            return self.violate("end state", "the run ended before its end state was probed")
        leftovers = {k: v for k, v in probes["server"].items() if k in ("pending", "calls", "ledger",
                     "requests_running", "requests_waiting", "kv_pages_used") and v}
        fleet = probes["fleet"]
        leftovers |= {f"actor {k} {name}": v for k, a in fleet["actors"].items() for name, v in a.items() if v}
        if fleet["actors_ready"] != fleet["num_workers"]:
            leftovers["actors ready"] = fleet["actors_ready"]
        base, final = probes["baseline"], probes["final"]
        if final["actors_alive"] != fleet["num_workers"]:
            leftovers["actors alive in Ray"] = final["actors_alive"]
        if final["fds"] > base["fds"] + SLACK["fds"]:
            leftovers["fds"] = f"{base['fds']} -> {final['fds']}"
        leftovers |= _grown_threads(base.get("thread_names", {}), final.get("thread_names", {}))
        if final["rss_mb"] > base["rss_mb"] + max(SLACK["rss_mb"], SLACK["rss_fraction"] * base["rss_mb"]):
            leftovers["rss_mb"] = f"{base['rss_mb']} -> {final['rss_mb']}"
        if leftovers:
            self.violate("end state", f"left behind: {leftovers}")
        self.verified["end-state probes (requests, pages, actors, threads, fds, RSS)"] += 1


def _grown_threads(base: dict[str, int], final: dict[str, int]) -> dict[str, str]:
    """Thread groups past their baseline (pools: past their cap)."""
    return {f"threads {name!r}": f"{base.get(name, 0)} -> {n}" for name, n in final.items()
            if n > (POOLS[name] if name in POOLS else base.get(name, 0))}


class _Fp64:
    """The model in fp64, loading fp32 state dicts (upcast exactly)."""

    def __init__(self, model) -> None:
        self.model = model.double().eval()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict({k: v.double() if v.is_floating_point() else v for k, v in state.items()})

    def __call__(self, ids):
        return self.model(ids)


def recovery_times(history: dict) -> dict[str, list[float]]:
    """Per fault kind: seconds from the fault to the end of the first call on its surface that started after it and
    succeeded (the system serving again)."""
    server_kinds = ("engine_death_server", "sleep_wake_server", "kv_exhaustion", "disconnect", "oversized",
                    "malformed")
    ok = {"fleet": [], "server": []}
    for call in history["calls"]:
        if len(call["ends"]) == 1 and call["ends"][0]["outcome"] == "ok" and call["op"] != "bad_request":
            ok[call["surface"]].append((call["t0"], call["ends"][0]["t1"]))
    out: dict[str, list[float]] = defaultdict(list)
    for f in history["faults"]:
        surface = "server" if f["kind"] in server_kinds else "fleet"
        after = [t1 for t0, t1 in ok[surface] if t0 >= f["t"]]
        if after:
            out[f["kind"]].append(round(min(after) - f["t"], 3))
    return dict(out)
