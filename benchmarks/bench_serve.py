"""The OpenAI-compatible server under load: 64 concurrent `openai` clients against the same prompts through the
in-process worker.

    python benchmarks/bench_serve.py                 # 25M Llama, 256 chat requests x 64 tokens, 64 clients (~3 min)
    python benchmarks/bench_serve.py --quick         # tiny model, 64 requests: a smoke run

One worker, one server (`rollout.serve`, in this process, as a trainer would run it). The clients run in a child
process (so their JSON and HTTP work is not on the server's interpreter lock, as it would not be in a real harness):
`--clients` `openai.AsyncOpenAI` instances, each taking the next request from a shared list as soon as its last one
returns. Every request is one chat prompt (rendered by the chat template), n=1, `max_tokens` tokens with
`ignore_eos` and a per-request seed, so the server and the in-process call generate exactly the same tokens (checked).

- in-process: `worker.generate(prompts, chat_template=True)`, one call with every prompt (the best case: no HTTP).
- server: the same requests over loopback HTTP; latency per request (p50 / p99).
- server, streamed: the same requests with `stream=True`; time to first token (p50 / p99) and throughput.

Reported: tokens/s of each, the ratio server / in-process (target >= 0.9), latencies, TTFT. The order of the three
runs rotates with --repeats; each ratio is taken within one round. The last line is JSON.
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
import time

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

    pending = list(range(job["requests"]))
    latencies, ttfts, tokens, ids = [], [], 0, {}

    async def one_client() -> None:
        nonlocal tokens
        client = openai.AsyncOpenAI(base_url=url, api_key="-", max_retries=0, timeout=600)
        while pending:
            i = pending.pop(0)
            kwargs = dict(model=job["model"], messages=messages_of(i), max_tokens=job["max_tokens"], seed=i,
                          extra_body={"ignore_eos": True})
            start = time.perf_counter()
            if job["stream"]:
                got, first = [], None
                async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                    for c in chunk.choices:
                        new = (c.model_extra or {}).get("token_ids", [])
                        if new and first is None:
                            first = time.perf_counter() - start
                        got += new
                ttfts.append(first)
            else:
                r = await client.chat.completions.create(**kwargs)
                got = r.choices[0].model_extra["token_ids"]
            latencies.append(time.perf_counter() - start)
            tokens += len(got)
            ids[i] = got
        await client.close()

    start = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(job["clients"])))
    return {"seconds": time.perf_counter() - start, "tokens": tokens, "latencies": latencies, "ttfts": ttfts,
            "ids": ids}


def client_main(url: str, job_path: str) -> None:
    with open(job_path) as f:
        job = json.load(f)
    result = asyncio.run(run_clients(url, job))
    with open(job_path + ".out", "w") as f:
        json.dump(result, f)


def drive(url: str, model: str, args: argparse.Namespace, stream: bool) -> dict:
    """The clients, in a child process; returns their measurements."""
    with tempfile.TemporaryDirectory() as tmp:
        job_path = os.path.join(tmp, "job.json")
        with open(job_path, "w") as f:
            json.dump({"model": model, "requests": args.requests, "clients": args.clients,
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
          f"{args.clients} concurrent openai clients (AsyncOpenAI, child process), rollout_paged, "
          f"load average {os.getloadavg()[0]:.2f}")

    def in_process() -> dict:
        start = time.perf_counter()
        batch = worker.generate(prompts, params, chat_template=True)
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "tokens": batch.num_tokens,
                "ids": dict(enumerate(batch.completion_token_lists()))}

    runs = {"in-process": in_process, "server": lambda: drive(server.url, "bench", args, False),
            "server, streamed": lambda: drive(server.url, "bench", args, True)}
    rounds = []
    for r in range(args.repeats):
        names = list(runs)[r % 3:] + list(runs)[: r % 3]
        rounds.append({name: runs[name]() for name in names})
    server.close()
    worker.close()

    reference = rounds[0]["in-process"]["ids"]
    for results in rounds:
        for name, result in results.items():
            assert result["ids"] == reference, f"{name}: other tokens than the in-process call"
    last = rounds[-1]
    rates = {name: result["tokens"] / result["seconds"] for name, result in last.items()}
    ratios = [{k: res[k]["tokens"] / res[k]["seconds"] / (res["in-process"]["tokens"] / res["in-process"]["seconds"])
               for k in ("server", "server, streamed")} for res in rounds]
    print(f"\n{'run':<18} {'tok/s':>8} {'ratio':>6} {'p50 s':>7} {'p99 s':>7} {'TTFT p50':>9} {'TTFT p99':>9}")
    for name, result in last.items():
        lat, ttft = result.get("latencies"), result.get("ttfts")
        ratio = 1.0 if name == "in-process" else ratios[-1][name]
        print(f"{name:<18} {rates[name]:>8.0f} {ratio:>6.2f} "
              f"{percentile(lat, .5) if lat else float('nan'):>7.2f} {percentile(lat, .99) if lat else float('nan'):>7.2f} "
              f"{percentile(ttft, .5) if ttft else float('nan'):>9.3f} "
              f"{percentile(ttft, .99) if ttft else float('nan'):>9.3f}")
    if args.repeats > 1:
        print("ratios per round: " + ", ".join(f"{r['server']:.2f}/{r['server, streamed']:.2f}" for r in ratios))
    print("tokens: identical across the three runs (seeded, ignore_eos)")
    summary = {"bench": "serve", "size": args.size, "requests": args.requests, "clients": args.clients,
               "max_tokens": args.max_tokens, "tokens_per_s": {k: round(v, 1) for k, v in rates.items()},
               "ratio_server": round(statistics.median(r["server"] for r in ratios), 3),
               "ratio_streamed": round(statistics.median(r["server, streamed"] for r in ratios), 3),
               "latency_p50_s": round(percentile(last["server"]["latencies"], .5), 3),
               "latency_p99_s": round(percentile(last["server"]["latencies"], .99), 3),
               "ttft_p50_s": round(percentile(last["server, streamed"]["ttfts"], .5), 3),
               "ttft_p99_s": round(percentile(last["server, streamed"]["ttfts"], .99), 3),
               "load_average": round(os.getloadavg()[0], 2)}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
