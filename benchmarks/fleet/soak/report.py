"""The soak's report: a config card, faults by kind with recovery-time percentiles, calls and rows by surface and
outcome, retries, what the checker verified, the violations (each with the seed), and one JSON line last."""

from __future__ import annotations

import json
from collections import Counter

from .checker import recovery_times


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summarize(history: dict, result: dict) -> dict:
    calls = history["calls"]
    outcomes = Counter(f"{c['surface']}/{_outcome(c)}" for c in calls)
    rows = sum(len(c["ends"][0]["rows"]) for c in calls if len(c["ends"]) == 1)
    recovery = recovery_times(history)
    probes = history["probes"]
    retries = {"fleet actor replacements": probes.get("fleet", {}).get("actor_replacements"),
               "fleet engine restarts": probes.get("fleet", {}).get("engine_restarts"),
               "server engine restarts": probes.get("server", {}).get("engine_restarts"),
               "server preemptions (KV pressure)": probes.get("server", {}).get("preemptions")}
    late = [round(c["ends"][0]["t1"] - c["t0"] - c["sent"]["timeout"], 3) for c in calls
            if c["sent"].get("timeout") is not None and c["op"] == "timeout" and len(c["ends"]) == 1
            and (c["ends"][0].get("error") or {}).get("type") == "TimeoutError"]
    return dict(seed=history["seed"], duration_s=history["duration_s"],
                faults=dict(Counter(f["kind"] for f in history["faults"])),
                updates=dict(Counter(f"{u['surface']}/{u['mode']}" for u in history["updates"])),
                calls=len(calls), outcomes=dict(outcomes), ops=dict(Counter(c["op"] for c in calls)), rows=rows,
                retries=retries,
                timeouts_late_s=dict(n=len(late), p50=percentile(late, 0.5), max=max(late, default=None)),
                recovery_s={k: dict(n=len(v), p50=percentile(v, 0.5), p90=percentile(v, 0.9), max=max(v))
                            for k, v in sorted(recovery.items())},
                verified=result["verified"], max_logprob_gap=result.get("max_gap"),
                violations=result["violations"], passed=not result["violations"],
                baseline=probes.get("baseline"), final=probes.get("final"))


def render(summary: dict) -> str:
    lines = [f"chaos soak: seed {summary['seed']}, {summary['duration_s']:.0f} s of faults",
             "", "faults injected:"]
    lines += [f"  {k:<22} {v:>4}   recovery p50 {_r(summary, k, 'p50')} p90 {_r(summary, k, 'p90')} "
              f"max {_r(summary, k, 'max')}" for k, v in sorted(summary["faults"].items())]
    lines += ["", f"weight updates: {summary['updates']}",
              f"calls: {summary['calls']} ({summary['outcomes']}), rows: {summary['rows']}",
              f"retries: {summary['retries']}",
              f"TimeoutErrors, seconds past the call's timeout: {summary['timeouts_late_s']}", "", "verified:"]
    lines += [f"  {v:>8}  {k}" for k, v in summary["verified"].items()]
    lines += [f"  max logprob gap x min(T, 1) (tolerance 2e-5): {summary['max_logprob_gap']}", "",
              f"resources: baseline {summary['baseline']}", f"           final    {summary['final']}", ""]
    if summary["violations"]:
        lines.append(f"VIOLATIONS ({len(summary['violations'])}; reproduce with --seed {summary['seed']}):")
        lines += [f"  [{v['check']}] call {v.get('call')}: {v['detail']}" for v in summary["violations"][:50]]
    else:
        lines.append("no violation")
    lines.append(json.dumps(summary, default=str))
    return "\n".join(lines)


def _outcome(call: dict) -> str:
    return call["ends"][0]["outcome"] if len(call["ends"]) == 1 else f"returned {len(call['ends'])} times"


def _r(summary: dict, kind: str, key: str) -> str:
    value = summary["recovery_s"].get(kind, {}).get(key)
    return "-" if value is None else f"{value:.2f}s"
