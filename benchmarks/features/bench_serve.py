"""The OpenAI-compatible server under load: 64 concurrent `openai` clients against the same prompts through the
in-process worker, at the same concurrency and all at once.

    python benchmarks/features/bench_serve.py                 # 25M Llama, 256 chat requests x 64 tokens, 64 clients (~5 min)
    python benchmarks/features/bench_serve.py --quick         # tiny model, 64 requests: a smoke run

One worker, one server (`rollout.serve`, in this process, as a trainer would run it). The clients run in a child
process (so their JSON and HTTP work is not on the server's interpreter lock, as it would not be in a real harness):
`--clients` concurrent callers of one `openai.AsyncOpenAI` client (its connection pool), each taking the
next request from a shared list as soon as its last one returns. Every request is one chat prompt (rendered by the
chat template), n=1, `max_tokens` tokens with `ignore_eos` and a per-request seed, so the server and the in-process
call generate exactly the same tokens (checked).

- in-process, all: `worker.generate(prompts, chat_template=True)`, one call with every prompt (the best case: no
  HTTP, and every row in one batch from the first step).
- in-process, N in flight: `--clients` threads, each calling `worker.generate` on one request at a time, as the
  clients do: the same concurrency as the server's, without HTTP. server / this is the server's own cost; this /
  "all" is the cost of fewer rows per step, which any server with that many clients pays.
- server, N clients: the same requests over loopback HTTP; latency per request (p50 / p99).
- streamed, N clients: the same requests with `stream=True`; time to first token (p50 / p99) and throughput.
- server, R clients (unless --no-wide): one caller per request, so every row can be in flight at once, as in the
  first run (compared with it).

Reported: tokens/s of each, and its ratio to "in-process, all" and to the in-process run at the same concurrency
(target >= 0.9), latencies, TTFT. The order of the runs rotates with --repeats; each ratio is taken within one round.
The last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders

WORDS = ("the a one two three four five six seven eight nine ten plus minus what how many apple cat dog red blue "
         "green big small count add sum total number word letter sky sea tree").split()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="25m", help="tiny model size (rollout.testing.SIZES; default 25m)")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the three runs (order rotates)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 64 requests")
    parser.add_argument("--no-wide", action="store_true", help="skip the run with one client per request")
    parser.add_argument("--client", nargs=2, metavar=("URL", "JOB"), help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    if args.quick:
        args.size, args.requests = "tiny", 64
    return args


def messages_of(i: int) -> list[dict]:
    words = [WORDS[(i * 7 + k * 3) % len(WORDS)] for k in range(8 + i % 17)]
    return [{"role": "user", "content": " ".join(words)}]


# ---------------------------------------------------------------------------------------------- the clients
async def run_clients(url: str, job: dict) -> dict:
    import openai

    from clock import RunClock

    clock = RunClock()

    pending = list(range(job["requests"]))
    latencies, ttfts, tokens, ids = [], [], 0, {}
    # one client (one connection pool: up to 1000 connections) shared by the callers, built before the clock starts:
    # a harness builds its client once; one per caller, built inside the timed part, measured the package's start-up
    client = openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=600)

    async def one_client() -> None:
        nonlocal tokens
        while pending:
            i = pending.pop(0)
            kwargs = dict(model=job["model"], messages=messages_of(i), max_tokens=job["max_tokens"], seed=i,
                          extra_body={"ignore_eos": True})
            start = clock.now()
            if job["stream"]:
                got, first = [], None
                async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                    for c in chunk.choices:
                        new = (c.model_extra or {}).get("token_ids", [])
                        if new and first is None:
                            first = clock.now() - start
                        got += new
                ttfts.append(first)
            else:
                r = await client.chat.completions.create(**kwargs)
                got = r.choices[0].model_extra["token_ids"]
            latencies.append(clock.now() - start)
            tokens += len(got)
            ids[i] = got

    start = clock.now()
    await asyncio.gather(*(one_client() for _ in range(job["clients"])))
    seconds = clock.now() - start
    await client.close()
    return {"seconds": seconds, "tokens": tokens, "latencies": latencies, "ttfts": ttfts, "ids": ids,
            "paused": clock.paused}


def client_main(url: str, job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    result = asyncio.run(run_clients(url, job))
    with open(job_path + ".out", "w") as f:
        json.dump(result, f)


def drive(url: str, model: str, args: argparse.Namespace, stream: bool, clients: int) -> dict:
    """The clients, in a child process; returns their measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path = os.path.join(tmp, "job.json")
        with open(job_path, "w") as f:
            json.dump({"model": model, "requests": args.requests, "clients": clients,
                       "max_tokens": args.max_tokens, "stream": stream}, f)
        subprocess.run([sys.executable, __file__, "--client", url, job_path], check=True)
        with open(job_path + ".out") as f:
            out = json.load(f)
    out["ids"] = {int(k): v for k, v in out["ids"].items()}
    return out


# ---------------------------------------------------------------------------------------------- the runs
def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    args = parse_args()
    if args.client:
        client_main(*args.client)
        return
    import torch

    import rollout
    from rollout import RolloutWorker, SamplingParams, WorkerConfig
    from rollout.testing import build_tiny_model, load_tiny_model

    from clock import RunClock

    clock = RunClock()  # the runs' times leave out the time this process was paused (SIGSTOP)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    path = build_tiny_model(os.path.join(tempfile.gettempdir(), f"rollout_bench_serve_{args.size}"), size=args.size)
    model, tokenizer = load_tiny_model(path)
    worker = RolloutWorker(model, WorkerConfig(), tokenizer=tokenizer)
    server = rollout.serve(worker, port=0, model_name="bench")
    prompts = [messages_of(i) for i in range(args.requests)]
    params = [SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True, seed=i) for i in range(args.requests)]
    worker.generate(prompts[:8], params[:8], chat_template=True)  # warm-up: first-call costs out of the runs
    print(f"config: model {args.size} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, fp32, CPU, "
          f"{torch.get_num_threads()} threads), {args.requests} chat requests x {args.max_tokens} tokens, "
          f"{args.clients} concurrent requests (one AsyncOpenAI client, child process), rollout_paged, "
          f"load average {os.getloadavg()[0]:.2f}")

    def in_process() -> dict:
        start = clock.now()
        batch = worker.generate(prompts, params, chat_template=True)
        seconds = clock.now() - start
        return {"seconds": seconds, "tokens": batch.num_tokens,
                "ids": dict(enumerate(batch.completion_token_lists()))}

    def in_flight(clients: int) -> dict:
        """`clients` threads, each generating one request at a time: the server's concurrency, without HTTP."""
        pending, lock, ids, latencies = list(range(args.requests)), threading.Lock(), {}, []

        def one_client() -> None:
            while True:
                with lock:
                    if not pending:
                        return
                    i = pending.pop(0)
                begin = clock.now()
                ids[i] = worker.generate([prompts[i]], [params[i]], chat_template=True).completion_token_lists()[0]
                latencies.append(clock.now() - begin)

        start = clock.now()
        with ThreadPoolExecutor(clients) as pool:
            for f in [pool.submit(one_client) for _ in range(clients)]:
                f.result()
        return {"seconds": clock.now() - start, "tokens": sum(len(v) for v in ids.values()),
                "latencies": latencies, "ids": ids}

    n = args.clients
    runs = {"in-process, all": in_process, f"in-process, {n} in flight": lambda: in_flight(n),
            f"server, {n} clients": lambda: drive(server.url, "bench", args, False, n),
            f"streamed, {n} clients": lambda: drive(server.url, "bench", args, True, n)}
    if not args.no_wide and args.requests > n:
        runs[f"server, {args.requests} clients"] = lambda: drive(server.url, "bench", args, False, args.requests)
    rounds = []
    for r in range(args.repeats):
        names = list(runs)[r % len(runs):] + list(runs)[: r % len(runs)]
        rounds.append({name: runs[name]() for name in names})
    server.close()
    worker.close()
    report(args, rounds, n, clock.paused)


def report(args: argparse.Namespace, rounds: list[dict], n: int, paused: float) -> None:
    """The table of the last round (ratios: to "in-process, all" and to the in-process run at the same concurrency),
    the server's ratio per round, and the JSON line."""
    reference = rounds[0]["in-process, all"]["ids"]
    for results in rounds:
        for name, result in results.items():
            assert result["ids"] == reference, f"{name}: other tokens than the in-process call"
    rate = [{k: v["tokens"] / v["seconds"] for k, v in res.items()} for res in rounds]
    inflight = f"in-process, {n} in flight"
    same = {f"server, {n} clients": inflight, f"streamed, {n} clients": inflight,
            f"server, {args.requests} clients": "in-process, all"}
    print(f"\n{'run':<24} {'tok/s':>7} {'x all':>6} {'x same':>7} {'p50 s':>7} {'p99 s':>7} {'TTFT p50':>9} "
          f"{'TTFT p99':>9}")
    last, last_rate = rounds[-1], rate[-1]
    nan = float("nan")
    for name in rounds[0]:  # the first round's order is the runs' own
        lat, ttft = last[name].get("latencies"), last[name].get("ttfts")
        vs_same = last_rate[name] / last_rate[same[name]] if name in same else nan
        print(f"{name:<24} {last_rate[name]:>7.0f} {last_rate[name] / last_rate['in-process, all']:>6.2f} "
              f"{vs_same:>7.2f} {percentile(lat, .5) if lat else nan:>7.2f} "
              f"{percentile(lat, .99) if lat else nan:>7.2f} "
              f"{percentile(ttft, .5) if ttft else nan:>9.3f} {percentile(ttft, .99) if ttft else nan:>9.3f}")
    own = [r[f"server, {n} clients"] / r[f"in-process, {n} in flight"] for r in rate]
    streamed = [r[f"streamed, {n} clients"] / r[f"in-process, {n} in flight"] for r in rate]
    if len(rounds) > 1:
        print("server / in-process at the same concurrency, per round: "
              + ", ".join(f"{a:.2f} (streamed {b:.2f})" for a, b in zip(own, streamed)))
    print("tokens: identical across the runs (seeded, ignore_eos)")
    clients_paused = sum(r.get("paused", 0.0) for res in rounds for r in res.values())
    print(f"paused (SIGSTOP by the machine's owner) and left out of the times: {paused:.0f} s in this process, "
          f"{clients_paused:.0f} s in the clients' processes; load average at the end {os.getloadavg()[0]:.2f}")
    summary = {"bench": "serve", "size": args.size, "requests": args.requests, "clients": n,
               "max_tokens": args.max_tokens, "tokens_per_s": {k: round(v, 1) for k, v in last_rate.items()},
               "ratio_server_same_concurrency": round(statistics.median(own), 3),
               "ratio_streamed_same_concurrency": round(statistics.median(streamed), 3),
               "ratio_server_to_all": round(statistics.median(r[f"server, {n} clients"] / r["in-process, all"]
                                                              for r in rate), 3),
               "latency_p50_s": round(percentile(last[f"server, {n} clients"]["latencies"], .5), 3),
               "latency_p99_s": round(percentile(last[f"server, {n} clients"]["latencies"], .99), 3),
               "ttft_p50_s": round(percentile(last[f"streamed, {n} clients"]["ttfts"], .5), 3),
               "ttft_p99_s": round(percentile(last[f"streamed, {n} clients"]["ttfts"], .99), 3),
               "paused_s": round(paused, 1), "load_average": round(os.getloadavg()[0], 2)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
