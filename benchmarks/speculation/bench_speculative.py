"""Speculative rollouts (issue 30): how much of what a policy samples its draft sources would have predicted.

    python benchmarks/speculation/bench_speculative.py --offline               # the acceptance table (trains the policy once)
    python benchmarks/speculation/bench_speculative.py --offline --prompts 4   # a smoke run
    python benchmarks/speculation/bench_speculative.py --rounds 3              # the engine: off vs "auto" vs "always", timed
    python benchmarks/speculation/bench_speculative.py --workloads longtail     # one workload (policy, longtail, random)
    python benchmarks/speculation/bench_speculative.py --workloads oracle --rounds 2   # drafts always right: the engine's ceiling
    python benchmarks/speculation/bench_speculative.py --vllm --workloads policy       # vLLM's CPU build: off vs its n-gram drafts
    python benchmarks/speculation/bench_speculative.py --workloads policy --draft-policy-steps 500   # a draft model's drafts
    python benchmarks/speculation/bench_speculative.py --workloads policy --modes auto --rounds 3       # "auto" alone against off

Engine mode (without --offline): each mode in a fresh worker, modes interleaved round by round; each worker first
runs one untimed step of the same shape on other prompts (`warm_up`), then both epochs timed. With --rounds > 1 a
table of each cell's median speedup over the rounds follows the per-round table.

Workloads (functions, so each mode runs the same steps):
- `policy_workload`: the small Llama of benchmarks/speculation/policy.py, trained here on the standard library (cached under
  benchmarks/.cache/), prompted with snippets of held-out stdlib modules; GRPO-shaped steps: `--prompts` prompts,
  n = 8, budgets 32/64/128 new tokens in turn (ragged), two epochs over the same prompts (other seeds), at T = 1 and
  at T = 0.7 with top_p 0.95.
- `longtail_workload`: the same policy and prompts, the long tail of a GRPO step: one group in 16 runs to 256 new
  tokens, the others stop at 32, so the step ends with a few groups' rows decoding alone (thin steps, where a verify
  row costs about what a plain one does). Both epochs, both temperatures.
- `random_workload`: rollout.testing's tiny random Llama (where drafts fail), the same steps at T = 1.
- `oracle` (engine mode only): what the engine does when drafts are right, whatever a source would find: a random
  25M Llama (init std 0.02), 1 / 4 / 16 / 64 rows of 64 new tokens at T = 1, drafts replayed from the plain run of
  the same call (`rollout.testing.replay`, every draft right), speculation off vs "auto" vs "always".

`--offline`: the completions are sampled by a `RolloutWorker` with speculation off, then replayed through
`rollout.engine.speculation.drafts` as the engine would see them: one `DraftIndex` per configuration, kept across both epochs;
a group's 8 rows advance in lockstep, one verify step each at a time: the row proposes k tokens, the leading ones
equal to what it really sampled next are accepted, and the step yields those plus one sampled token (fewer at the
row's end); a row that finishes is recorded into the history, where the rest of its group (from the next step) and
the next epoch see it. The first token of a row comes from its prefill and is never drafted. Reported per workload,
epoch, sources and k: the fraction of completion tokens accepted from drafts, completion tokens per verify step
(what speculation divides a row's decode steps by), draft tokens fed per verify step, and accepted / drafted tokens
(the rest is what verify rows waste).
The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # speculation/: policy.py

from rollout import RolloutWorker, SamplingParams  # noqa: E402
from rollout.base import Speculation  # noqa: E402
from rollout.engine.speculation.drafts import DraftIndex  # noqa: E402

import machine  # noqa: E402  benchmarks/machine.py: the config card
import policy  # noqa: E402  benchmarks/speculation/policy.py: the trained policy

N = 8
BUDGETS = (32, 64, 128)
LONG_TAIL = (32,) * 15 + (256,)  # budgets of the long-tail workload: one group in 16 runs 8x longer
TEMPERATURES = {"T=1": dict(temperature=1.0), "T=0.7/top_p=0.95": dict(temperature=0.7, top_p=0.95)}
SOURCES = {"context": dict(drafts=("context",)), "history": dict(drafts=("history",)),
           "both": dict(drafts=("context", "history")), "both, history first": dict(drafts=("history", "context")),
           "both, min_ngram 1": dict(drafts=("context", "history"), min_ngram=1)}
DRAFT_LENGTHS = (2, 4, 8)


@dataclass
class Workload:
    """What every mode runs: a model directory, its prompts, and the sampling of each step (one per temperature)."""

    name: str
    path: str
    prompts: list[list[int]]
    temperatures: dict[str, dict]
    epochs: int = 2
    budgets: tuple[int, ...] = BUDGETS  # prompt i's max_new_tokens: budgets[i % len(budgets)]


def policy_workload(num_prompts: int, steps: int = policy.STEPS) -> tuple[Workload, dict]:
    """The trained stdlib policy and held-out prompts; also its training card (held-out loss, ...)."""
    path = policy.build_policy(steps)
    _, tokenizer, card = policy.load_policy(steps)
    return Workload("stdlib policy", str(path), policy.held_out_prompts(tokenizer, num_prompts),
                    TEMPERATURES), card


def longtail_workload(policy_load: Workload) -> Workload:
    """The policy's prompts with a long tail of budgets (`LONG_TAIL`)."""
    return Workload("stdlib long tail", policy_load.path, policy_load.prompts, TEMPERATURES, budgets=LONG_TAIL)


def random_workload(num_prompts: int, root: str) -> Workload:
    """rollout.testing's tiny random Llama: random prompts of 48-128 ids, T = 1 only."""
    import random

    from rollout.testing import build_tiny_model

    path = build_tiny_model(os.path.join(root, "random-llama"))
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 512) for _ in range(rng.randrange(48, 129))] for _ in range(num_prompts)]
    return Workload("random tiny", str(path), prompts, {"T=1": TEMPERATURES["T=1"]})


def grpo_sampling(workload: Workload, temperature: str, epoch: int) -> list[SamplingParams]:
    """One GRPO-shaped step: n = 8 per prompt, the workload's budgets in turn, seeds that differ by epoch."""
    budgets = workload.budgets
    return [SamplingParams(n=N, max_new_tokens=budgets[i % len(budgets)], seed=1000 * epoch + i,
                           **workload.temperatures[temperature]) for i in range(len(workload.prompts))]


def sample_epochs(worker, workload: Workload, temperature: str) -> list[list[list[list[int]]]]:
    """[epoch][prompt][sample] -> completion ids, sampled with speculation off."""
    epochs = []
    for epoch in range(workload.epochs):
        batch = worker.generate(workload.prompts, grpo_sampling(workload, temperature, epoch))
        rows = batch.completion_token_lists()
        epochs.append([rows[p * N: (p + 1) * N] for p in range(len(workload.prompts))])
    return epochs


def verify(row, completion: list[int], pos: int, k: int, totals: dict) -> int:
    """One verify step of a row that has sampled `pos` tokens: propose k, accept the leading draft tokens equal to
    what it sampled next; the step yields those and one sampled token (fewer at the row's end). Returns that count.
    At pos 0 the step is the prefill's, undrafted and not counted."""
    draft = row.propose(k) if pos else []
    accepted = 0
    while accepted < len(draft) and pos + accepted < len(completion) and draft[accepted] == completion[pos + accepted]:
        accepted += 1
    step = min(accepted + 1, len(completion) - pos)
    row.extend(completion[pos: pos + step])
    if pos:
        for name, value in (("drafted", len(draft)), ("accepted", accepted), ("verifies", 1), ("decoded", step)):
            totals[name] += value
    return step


def replay_group(index: DraftIndex, prompt: list[int], completions: list[list[int]], k: int, totals: dict) -> None:
    """The group's rows in lockstep, one verify step each per round; a row that finishes is recorded into the
    history after its round (see the docstring)."""
    rows = [index.row(prompt) for _ in completions]
    done = [0] * len(completions)
    live = list(range(len(completions)))
    while live:
        for i in live:
            done[i] += verify(rows[i], completions[i], done[i], k, totals)
        for i in live:
            if done[i] >= len(completions[i]):
                index.record(prompt, completions[i])
        live = [i for i in live if done[i] < len(completions[i])]
    totals["tokens"] += sum(len(c) for c in completions)


def replay(workload: Workload, epochs, sources: dict, k: int) -> list[dict]:
    """Per epoch: drafted, accepted, verify steps and tokens over every group, through one DraftIndex built with
    `sources` (Speculation's fields)."""
    index = DraftIndex(Speculation(max_draft_tokens=k, **sources))
    results = []
    for groups in epochs:
        totals = dict(tokens=0, decoded=0, drafted=0, accepted=0, verifies=0)
        for prompt, completions in zip(workload.prompts, groups):
            replay_group(index, prompt, completions, k, totals)
        results.append(totals)
    return results


def offline_rows(workload: Workload, worker) -> list[dict]:
    rows = []
    for temperature in workload.temperatures:
        start = time.monotonic()
        epochs = sample_epochs(worker, workload, temperature)
        sampled = time.monotonic() - start
        for label, sources in SOURCES.items():
            for k in DRAFT_LENGTHS:
                for epoch, totals in enumerate(replay(workload, epochs, sources, k), 1):
                    rows.append(dict(workload=workload.name, sampling=temperature, epoch=epoch, sources=label, k=k,
                                     accepted_fraction=totals["accepted"] / max(totals["tokens"], 1),
                                     tokens_per_verify=totals["decoded"] / max(totals["verifies"], 1),
                                     accepted_per_drafted=totals["accepted"] / max(totals["drafted"], 1),
                                     drafted_per_verify=totals["drafted"] / max(totals["verifies"], 1),
                                     tokens=totals["tokens"], sample_seconds=round(sampled, 1)))
    return rows


def print_offline(rows: list[dict]) -> None:
    """One line per workload, sampling, sources and k; each figure for epoch 1 / epoch 2."""
    print("| workload | sampling | sources | k | accepted / tokens | tokens per verify | drafted per verify "
          "| accepted / drafted |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for first, second in zip(rows[::2], rows[1::2]):
        figures = [f"{first[name]:{spec}} / {second[name]:{spec}}" for name, spec in (
            ("accepted_fraction", ".1%"), ("tokens_per_verify", ".2f"), ("drafted_per_verify", ".2f"),
            ("accepted_per_drafted", ".1%"))]
        print(f"| {first['workload']} | {first['sampling']} | {first['sources']} | {first['k']} | "
              + " | ".join(figures) + " |")


def run_mode(args, mode: str, rows_of, print_rows) -> dict:
    """The trained policy's and the random model's rows of one mode (`rows_of(workload)`), printed."""
    workload, card = policy_workload(args.prompts, args.policy_steps)
    print(f"policy: {workload.path}\n  {json.dumps(card)}")
    rows = []
    with tempfile.TemporaryDirectory() as root:
        workloads = dict(policy=lambda: workload, longtail=lambda: longtail_workload(workload),
                         random=lambda: random_workload(args.prompts, root))
        for name in args.workloads.split(","):
            rows += rows_of(workloads[name]())
    print_rows(rows)
    return dict(mode=mode, policy=card, rows=rows)


def run_offline(args) -> dict:
    def rows_of(w: Workload) -> list[dict]:
        with RolloutWorker(w.path) as worker:
            return offline_rows(w, worker)

    return run_mode(args, "offline", rows_of, print_offline)


# ---------------------------------------------------------------------------------------------------- engine
MODES = ["off", "auto", "always"]  # what engine mode times: off first, then the modes of --modes


SOURCES_RUN: dict = {}  # engine mode's draft sources: the defaults, or the draft model of --draft-policy-steps


def worker_source(path: str, device: str):
    """What a worker is built from: the saved model's directory on "cpu" (each worker loads it); elsewhere the model
    loaded once onto `device` in fp32 and shared by every worker (`_loaded`)."""
    if device == "cpu":
        return path
    if (path, device) not in _loaded:
        import torch
        from transformers import AutoModelForCausalLM

        _loaded[(path, device)] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
    return _loaded[(path, device)]


_loaded: dict = {}


def engine_rows(workload: Workload, rounds: int, device: str = "cpu") -> list[dict]:
    """Both epochs of every temperature's steps, with speculation off, "auto" and "always", each in a fresh worker
    (the history index carries from epoch 1 to epoch 2 inside it), modes interleaved round by round."""
    from rollout import Speculation, WorkerConfig

    source = worker_source(workload.path, device)
    rows = []
    for temperature in workload.temperatures:
        for round_ in range(rounds):
            runs = {}
            for mode in MODES:
                spec = None if mode == "off" else Speculation(mode=mode, **SOURCES_RUN)
                with RolloutWorker(source, WorkerConfig(speculation=spec)) as worker:
                    warm_up(worker, workload, temperature)
                    runs[mode] = [timed_epoch(worker, workload, temperature, epoch)
                                  for epoch in range(workload.epochs)]
            for epoch in range(workload.epochs):
                off = runs["off"][epoch]
                for mode in MODES[1:]:
                    run = runs[mode][epoch]
                    rows.append(dict(workload=workload.name, sampling=temperature, round=round_, epoch=epoch + 1,
                                     mode=mode, speedup=off["seconds"] / run["seconds"],
                                     tok_s_off=off["tokens"] / off["seconds"], tok_s=run["tokens"] / run["seconds"],
                                     same_tokens=same_fraction(off["ids"], run["ids"]),
                                     **{k: run[k] for k in ("drafted", "accepted", "per_verify", "gap")}))
    return rows


def warm_up(worker, workload: Workload, temperature: str) -> None:
    """One untimed step of the same shape on prompts of the same lengths that are none of the workload's (each one
    reversed), with other seeds: oneDNN builds its kernels for the step's row counts and "auto" measures its cost
    buckets here, not in the timed epochs; the history index never sees a workload prompt."""
    prompts, budgets = [list(reversed(p)) for p in workload.prompts], workload.budgets
    sampling = [SamplingParams(n=N, max_new_tokens=budgets[i % len(budgets)], seed=7919 + i,
                               **workload.temperatures[temperature]) for i in range(len(prompts))]
    worker.generate(prompts, sampling)


def timed_epoch(worker, workload: Workload, temperature: str, epoch: int) -> dict:
    run = timed_call(worker, workload.prompts, grpo_sampling(workload, temperature, epoch))
    del run["batch"]
    return run


def logprob_gap(worker, batch, temperature: float, rows: int = 8) -> float:
    """Max |logprob - fp32 teacher-forced forward of log_softmax(logits / T)| over the first `rows` rows."""
    import torch

    worst = 0.0
    for r in range(min(rows, len(batch))):
        n = int(batch.completion_lengths[r])
        ids = torch.tensor([list(batch.prompt_ids[r]) + batch.completion_ids[r, :n].tolist()])
        with torch.no_grad():
            logits = worker.model(ids.to(worker.model.device)).logits[0, len(batch.prompt_ids[r]) - 1: -1]
        logits = logits.float().cpu()
        full = torch.log_softmax(logits / temperature, dim=-1).gather(1, batch.completion_ids[r, :n, None]).squeeze(1)
        worst = max(worst, float((full - batch.logprobs[r, :n]).abs().max()))
    return worst


def same_fraction(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of rows whose tokens are identical."""
    return sum(x == y for x, y in zip(a, b)) / max(len(a), 1)


def print_engine(rows: list[dict]) -> None:
    print("| workload | sampling | epoch | mode | tok/s off | tok/s | speedup | accepted / drafted | tokens per "
          "verify | identical rows | logprob gap |")
    print("| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = f"{r['accepted']} / {r['drafted']}"
        print(f"| {r['workload']} | {r['sampling']} | {r['epoch']} | {r['mode']} | {r['tok_s_off']:.0f} | "
              f"{r['tok_s']:.0f} | {r['speedup']:.2f}x | {ratio} | {r['per_verify']:.2f} | "
              f"{100 * r['same_tokens']:.0f}% | {r['gap']:.1e} |")
    rounds = {}
    for r in rows:
        rounds.setdefault((r["workload"], r["sampling"], r["epoch"], r["mode"]), []).append(r["speedup"])
    if any(len(v) > 1 for v in rounds.values()):
        print("\n| workload | sampling | epoch | mode | median speedup | each round |")
        print("| --- | --- | ---: | --- | ---: | --- |")
        for (workload, sampling, epoch, mode), speedups in rounds.items():
            print(f"| {workload} | {sampling} | {epoch} | {mode} | {statistics.median(speedups):.2f}x | "
                  + ", ".join(f"{x:.2f}" for x in speedups) + " |")


ORACLE_ROWS = (1, 4, 16, 64)


def oracle_rows(rounds: int, root: str, device: str = "cpu", sizes: tuple[str, ...] = ("25m",)) -> list[dict]:
    """Off, "auto" and "always" on random fp32 Llamas (init std 0.02) with drafts replayed from the off run of the
    same call; on `device` (on "cpu" each worker loads the saved model itself, elsewhere one model is loaded onto the
    device and every worker shares it)."""
    rows_out = []
    for size in sizes:
        rows_out += oracle_size_rows(rounds, root, device, size)
    return rows_out


def oracle_size_rows(rounds: int, root: str, device: str, size: str) -> list[dict]:
    import random

    from rollout import Speculation, WorkerConfig
    from rollout.engine.speculation import speculator
    from rollout.testing import SIZES, build_tiny_model
    from rollout.testing import ReplayDrafts

    path = str(build_tiny_model(os.path.join(root, f"llama-{size}"), size=size, init_std=0.02))
    source = worker_source(path, device)
    vocab, rows_out, index = SIZES[size][-1], [], speculator.DraftIndex
    for count in ORACLE_ROWS:
        rng = random.Random(count)
        prompts = [[rng.randrange(10, 500) for _ in range(32)] for _ in range(count)]
        params = SamplingParams(max_new_tokens=64, ignore_eos=True, temperature=1.0, seed=3)
        for round_ in range(rounds):
            runs = {}
            for mode in MODES:
                spec = None if mode == "off" else Speculation(mode=mode)
                if mode != "off":
                    speculator.DraftIndex = ReplayDrafts.of_batch(runs["off"]["batch"], vocab, wrong_every=10**9)
                try:
                    with RolloutWorker(source, WorkerConfig(speculation=spec)) as worker:
                        worker.generate([p[::-1] for p in prompts], SamplingParams(max_new_tokens=64, seed=9))
                        runs[mode] = timed_call(worker, prompts, params)
                finally:
                    speculator.DraftIndex = index
            off = runs["off"]
            for mode in MODES[1:]:
                run = runs[mode]
                label = f"{size} {device}, drafts right, {count} rows"
                rows_out.append(dict(workload=label, sampling="T=1", round=round_,
                                     epoch=1, mode=mode, speedup=off["seconds"] / run["seconds"],
                                     tok_s_off=off["tokens"] / off["seconds"], tok_s=run["tokens"] / run["seconds"],
                                     same_tokens=same_fraction(off["ids"], run["ids"]),
                                     **{k: run[k] for k in ("drafted", "accepted", "per_verify", "gap")}))
    return rows_out


def timed_call(worker, prompts, params) -> dict:
    before = worker.metrics()
    start = time.perf_counter()
    batch = worker.generate(prompts, params)
    seconds = time.perf_counter() - start
    verifies = worker.metrics().draft_verify_row_steps - before.draft_verify_row_steps
    accepted = batch.stats.get("accepted_tokens", 0)
    return dict(seconds=seconds, tokens=int(batch.completion_mask.sum()), ids=batch.completion_token_lists(),
                batch=batch, drafted=batch.stats.get("draft_tokens", 0), accepted=accepted,
                per_verify=(accepted + verifies) / verifies if verifies else 1.0,
                gap=logprob_gap(worker, batch, (params[0] if isinstance(params, list) else params).temperature))


VLLM_NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def vllm_rows(workload: Workload, rounds: int) -> list[dict]:
    """vLLM's CPU build (benchmarks/throughput/vllm_ngram.py in its own virtualenv, through bench_vllm.run_child) on the
    workload's steps, speculation off and
    with its n-gram drafts (`VLLM_NGRAM`: the row's own prompt and completion, as this engine's "context" source),
    each in a fresh process, alternating round by round. vLLM rows are unseeded (a seed crashes its CPU sampler) and
    its speculation draws its own randomness, so the two runs need not sample the same tokens."""
    from pathlib import Path

    import torch

    from throughput.bench_vllm import run_child, vllm_ready

    why_not = vllm_ready()
    if why_not is not None:
        print(f"# vLLM not measured: {why_not} (python benchmarks/throughput/bench_vllm.py --setup)")
        return []
    steps = []
    for temperature, sampling in workload.temperatures.items():
        for epoch in range(workload.epochs):
            params = [dict(n=p.n, temperature=p.temperature, top_p=p.top_p, max_tokens=p.max_new_tokens)
                      for p in grpo_sampling(workload, temperature, epoch)]
            steps.append(dict(name=f"{temperature}|{epoch + 1}", prompts=workload.prompts, params=params))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(rounds):
            runs = {}
            for mode, spec in (("off", None), ("ngram", VLLM_NGRAM)):
                job = dict(model=workload.path, threads=torch.get_num_threads(), kv_gib=4, speculation=spec,
                           steps=steps)
                runs[mode] = run_child("vllm-ngram", job, Path(tmp), timeout=3600)
                if "error" in runs[mode]:
                    print(f"# vLLM {mode} failed: {runs[mode]['error']}")
                    return rows
            spec = runs["ngram"]["spec"] or {}
            for off, on in zip(runs["off"]["steps"], runs["ngram"]["steps"]):
                temperature, epoch = off["name"].split("|")
                rows.append(dict(workload=workload.name, sampling=temperature, epoch=int(epoch), round=round_,
                                 tok_s_off=off["tokens"] / off["seconds"], tok_s=on["tokens"] / on["seconds"],
                                 speedup=(on["tokens"] / on["seconds"]) / (off["tokens"] / off["seconds"]),
                                 draft_tokens=spec.get("draft_tokens"), accepted=spec.get("accepted_tokens")))
    return rows


def print_vllm(rows: list[dict]) -> None:
    print("| workload | sampling | epoch | round | vLLM tok/s off | vLLM tok/s n-gram | speedup | accepted / drafted "
          "(whole run) |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = "-" if r["draft_tokens"] is None else f"{r['accepted']:.0f} / {r['draft_tokens']:.0f}"
        print(f"| {r['workload']} | {r['sampling']} | {r['epoch']} | {r['round']} | {r['tok_s_off']:.0f} | "
              f"{r['tok_s']:.0f} | {r['speedup']:.2f}x | {ratio} |")


def run_engine(args) -> dict:
    if args.workloads == "oracle":
        with tempfile.TemporaryDirectory() as root:
            rows = oracle_rows(args.rounds, root, args.device, tuple(args.oracle_sizes.split(",")))
        print_engine(rows)
        return dict(mode="engine", rows=rows)
    return run_mode(args, "engine", lambda w: engine_rows(w, args.rounds, args.device), print_engine)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--offline", action="store_true", help="draft acceptance replayed on sampled completions")
    parser.add_argument("--prompts", type=int, default=16, help="prompts per step (n = 8 samples each)")
    parser.add_argument("--policy-steps", type=int, default=policy.STEPS, help="the policy's training steps")
    parser.add_argument("--rounds", type=int, default=1, help="engine mode: interleaved rounds of off/auto/always")
    parser.add_argument("--modes", default="auto,always", help="engine mode: the speculation modes timed against off")
    parser.add_argument("--workloads", default="policy,longtail,random",
                        help="comma-separated, of policy (GRPO budgets), longtail, random; or oracle alone")
    parser.add_argument("--vllm", action="store_true",
                        help="vLLM's CPU build on the same steps, off vs its n-gram speculation (benchmarks/.vllm/)")
    parser.add_argument("--draft-policy-steps", type=int, default=None,
                        help="engine mode: draft with the \"model\" source alone, the policy trained this many steps "
                             "(cached like the policy) as the draft model")
    parser.add_argument("--device", default="cpu", help="engine mode: the device (e.g. cuda)")
    parser.add_argument("--oracle-sizes", default="25m", help="oracle workload: comma-separated rollout.testing sizes")
    args = parser.parse_args()
    modes = args.modes.split(",")
    if not set(modes) <= {"auto", "always"}:
        parser.error(f"--modes {args.modes!r}: each must be auto or always")
    MODES[1:] = modes
    if args.draft_policy_steps is not None:
        SOURCES_RUN.update(drafts=("model",), draft_model=str(policy.build_policy(args.draft_policy_steps)))
    print(f"machine: {machine.card()}")
    if args.workloads == "oracle":
        print(f"workload: {args.oracle_sizes} Llama (fp32, init std 0.02) on {args.device}, {ORACLE_ROWS} rows x 64 "
              f"new tokens, T=1, drafts replayed from the plain run (all right)")
    else:
        print(f"workload: {args.prompts} prompts x n={N}, budgets {BUDGETS} (long tail: 32, one group in 16 256), "
              f"2 epochs; draft lengths {DRAFT_LENGTHS}")
    if args.vllm:
        result = run_mode(args, "vllm", lambda w: vllm_rows(w, args.rounds), print_vllm)
    else:
        result = run_offline(args) if args.offline else run_engine(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
