"""Fault-free replay: seeded rows that ran on one version are generated again by a fresh RolloutWorker holding
that version's weights, alone, with nothing else in flight. Seeded samples draw from their own random stream keyed on
(seed, sample index), so a row that survived actor kills, engine restarts, preemption under KV pressure, sleep/wake
or an "abort" re-run must come back with the same tokens (and logprobs within the tolerance). A row cut short by a
client disconnect must be a prefix of its replay."""

from __future__ import annotations

import random
from collections import defaultdict

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig

TOL = 2e-5  # fp32's floor on these rows (checker.py)


def candidates(history: dict) -> dict[tuple, dict]:
    """(version, prompt, params) -> {sample index: (call, row)} for seeded single-version rows without episodes."""
    groups: dict[tuple, dict] = defaultdict(dict)
    for call in history["calls"]:
        if len(call["ends"]) != 1 or call["sent"].get("episode") or "params" not in call["sent"]:
            continue
        params = call["sent"]["params"]
        for r in call["ends"][0]["rows"]:
            versions = set(r["token_versions"])
            if r["seed"] is None or len(versions) != 1 or not r["completion_ids"] or r["segment_index"]:
                continue
            p = params[min(r["prompt_index"], len(params) - 1)]
            key = (versions.pop(), tuple(r["prompt_ids"]), tuple(sorted(p.items())))
            groups[key][r["sample_index"]] = (call, r)
    return groups


def replay(checker, versions) -> None:
    groups = candidates(checker.h)
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
                    _compare(checker, got, batch, r)


def _compare(checker, got: tuple, batch, r: int) -> None:
    call, row = got
    n = int(batch.completion_lengths[r])
    ids, lps = batch.completion_ids[r, :n].tolist(), batch.logprobs[r, :n]
    partial = call["ends"][0]["outcome"] != "ok"
    mine = row["completion_ids"]
    same = ids[: len(mine)] == mine if partial else ids == mine
    if not same:
        checker.violate("replay", f"{call['op']} on {call['surface']}: seeded row {row['prompt_index']}/"
                        f"{row['sample_index']} (seed {row['seed']}, version {row['token_versions'][0]}) differs from "
                        f"its fault-free replay at token {_first_difference(ids, mine)}", call=call["id"])
        return
    gap = float((lps[: len(mine)] - torch.tensor(row["logprobs"][: len(mine)])).abs().max())
    if gap > TOL / min(row["temperature"] or 1.0, 1.0):  # two fp32 runs of the same row
        checker.violate("replay", f"{call['op']}: replayed logprobs differ by {gap:.2e}", call=call["id"])
    checker.verified["seeded rows equal to their fault-free replay"] += 1


def _first_difference(a: list, b: list) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
