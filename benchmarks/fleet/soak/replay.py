"""Fault-free replay: seeded rows that ran on one version are generated again by a fresh RolloutWorker holding that
version's weights, alone, with nothing else in flight. Seeded samples draw from their own random stream keyed on
(seed, sample index), so a row that survived actor kills, engine restarts, preemption under KV pressure, sleep/wake
or an "abort" re-run must come back with the same tokens (and logprobs within the tolerance). A row cut short by a
client disconnect must be a prefix of its replay. Up to fp32's floor: the engine's distribution is the fp64 truth's
within TOL, so where a draw's uniform lies that close to the boundary between two tokens, a batch of other rows may
tip it either way (seed 2, 30 minutes: a row at T=0.7 drew token 121 at a uniform 5.8e-7 below the fp64 boundary with
token 122, its replay 122); the rows are compared up to such a draw, checked against the fp64 reference. A row in
flight at a "keep" switch is not replayed: it continued over KV of older weights (approximate by design, the
checker's `kept_in_flight`), which no fault-free run reproduces."""

from __future__ import annotations

import random
from collections import defaultdict

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.engine.delivery import SEEDED  # the first word of a seeded row's stream key
from rollout.engine.sampling.streams import stream_key, uniform_reference

TOL = 2e-5  # fp32's floor on these rows (checker.py)


def candidates(history: dict, kept=lambda call, row, version: False) -> dict[tuple, dict]:
    """(version, prompt, params) -> {sample index: (call, row)} for seeded single-version rows without episodes,
    but those `kept(call, row, version)` says continued over older weights' KV."""
    groups: dict[tuple, dict] = defaultdict(dict)
    for call in history["calls"]:
        if len(call["ends"]) != 1 or call["sent"].get("episode") or "params" not in call["sent"]:
            continue
        params = call["sent"]["params"]
        for r in call["ends"][0]["rows"]:
            versions = set(r["token_versions"])
            if r["seed"] is None or len(versions) != 1 or not r["completion_ids"] or r["segment_index"]:
                continue
            p, version = params[min(r["prompt_index"], len(params) - 1)], versions.pop()
            if kept(call, r, version):
                continue
            key = (version, tuple(r["prompt_ids"]), tuple(sorted(p.items())))
            groups[key][r["sample_index"]] = (call, r)
    return groups


def replay(checker, model, versions) -> None:
    groups = candidates(checker.h, checker.kept_in_flight)
    keys = sorted(groups, key=repr)
    keys = random.Random(f"chaos-replay-{checker.seed}").sample(keys, min(checker.replays, len(keys)))
    if not keys:
        return
    with RolloutWorker(checker.model_path, WorkerConfig(page_size=16, num_blocks=256)) as worker:
        for version in sorted({k[0] for k in keys}):
            worker.update_weights(versions[version], version=version)
            chosen = [k for k in keys if k[0] == version]
            params = [SamplingParams(**dict(k[2])) for k in chosen]
            batch = worker.generate([list(k[1]) for k in chosen], params)
            for r in range(len(batch)):
                key = chosen[int(batch.prompt_index[r])]
                got = groups[key].get(int(batch.sample_index[r]))
                if got is not None:
                    _compare(checker, got, batch, r, lambda: _reference(model, versions, version))


def _reference(model, versions, version: int):
    model.load_state_dict(versions[version])
    return model


def _compare(checker, got: tuple, batch, r: int, reference) -> None:
    call, row = got
    n = int(batch.completion_lengths[r])
    ids, lps = batch.completion_ids[r, :n].tolist(), batch.logprobs[r, :n]
    partial = call["ends"][0]["outcome"] != "ok"
    mine = row["completion_ids"]
    same = ids[: len(mine)] == mine if partial else ids == mine
    at = _first_difference(ids, mine)
    params = call["sent"]["params"][min(row["prompt_index"], len(call["sent"]["params"]) - 1)]
    tie = not same and at < min(len(ids), len(mine)) and _near_tie(reference(), row, params, at, ids[at])
    if tie:
        lps, mine = lps[:at], mine[:at]
    elif not same:
        checker.violate("replay", f"{call['op']} on {call['surface']}: seeded row {row['prompt_index']}/"
                        f"{row['sample_index']} (seed {row['seed']}, version {row['token_versions'][0]}) differs from "
                        f"its fault-free replay at token {at}", call=call["id"])
        return
    gap = float((lps[: len(mine)] - torch.tensor(row["logprobs"][: len(mine)])).abs().max()) if mine else 0.0
    if gap > TOL / min(row["temperature"] or 1.0, 1.0):  # two fp32 runs of the same row
        checker.violate("replay", f"{call['op']}: replayed logprobs differ by {gap:.2e}", call=call["id"])
    checker.verified["seeded rows equal to their fault-free replay" + (" up to a near-tie draw" if tie else "")] += 1


def _near_tie(model, row: dict, params: dict, at: int, other: int) -> bool:
    """Whether completion token `at` of the row (whose earlier tokens its replay shares) and `other`, the replay's,
    are both within fp32's floor of the row's draw there, under the fp64 reference: greedy, logprobs within TOL of
    each other; sampled, the uniform of its stream at that position within TOL / min(T, 1) of both tokens' intervals
    of the CDF (vocabulary order, over the top-k / top-p truncated distribution, as the engine draws)."""
    ids = torch.tensor([row["prompt_ids"] + row["completion_ids"][:at]])
    with torch.no_grad():
        logits = model(ids).logits[0, -1].double()
    temperature, mine = row["temperature"], row["completion_ids"][at]
    if not temperature:
        full = torch.log_softmax(logits, -1)
        return abs(float(full[mine] - full[other])) <= TOL
    probs = _truncated(torch.softmax(logits / temperature, -1), params["top_k"], params["top_p"])
    cdf = probs.cumsum(0) / probs.sum()
    u = uniform_reference(stream_key(SEEDED, row["seed"], row["sample_index"]), len(row["prompt_ids"]) - 1 + at)
    tol = TOL / min(temperature, 1.0)
    return all(float(cdf[t]) - float(probs[t] / probs.sum()) - tol <= u < float(cdf[t]) + tol for t in (mine, other))


def _truncated(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The top-k / top-p truncation of `probs` (not renormalised), in vocabulary order."""
    ordered, order = torch.sort(probs, descending=True)
    keep = torch.ones_like(ordered, dtype=torch.bool)
    if top_k:
        keep[top_k:] = False
    if top_p < 1.0:
        keep &= (ordered.cumsum(0) - ordered) < top_p * ordered[keep].sum()
    keep[0] = True
    return torch.zeros_like(probs).scatter(0, order, ordered * keep)


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
