"""Multi-turn episodes: episode-level continuous batching against the turn-synchronous loop, on one worker.

    python benchmarks/features/bench_episodes.py             # 25M Llama, 64 episodes, latency x0 / x0.5 / x1 / x2 (~5 min)
    python benchmarks/features/bench_episodes.py --quick     # tiny model, 16 episodes, x1 only: a smoke run
    python benchmarks/features/bench_episodes.py --episodes 48 --turns 4 --scales 1   # the issue's held-out shape

The workload: 64 episodes (one prompt each, 16-48 tokens) of 1-4 model turns (drawn per episode) of 8-32 tokens
(drawn per episode, `ignore_eos=True`, so both methods generate exactly the same number of tokens), each turn
answered by an environment whose step sleeps for a heavy-tailed latency, like slow tools and sandboxes: with
probability 0.9 a log-normal draw with median 0.5 s (sigma 0.4), else ~4 s (3.5-4.5 s uniform). Observations are
8-24 tokens. Every latency, length and observation is drawn from the episode's seed, so both methods see the same
episodes and the same delays.

- episodes (`worker.generate(env=...)`): each episode's environment steps off the engine thread and its next turn
  is submitted as soon as the observation is back; history comes from the prefix cache.
- turn-synchronous (what TRL's tool loop does): generate the current turn of every live episode in one call (the
  whole history as the prompt, so this worker's prefix cache serves it too), then run every live environment step
  concurrently (a thread each) and wait for all of them, then the next turn.

Reported per latency scale: episodes/s of each and their ratio; prefill tokens per turn of the episode path against
what re-prefilling the whole history every turn would cost (the same calls' prompt tokens); and, from the engine's
`TurnTrace` on the episode path, per turn after the first: the time from the environment's answer (observation
ready) to the next turn's first token (p50, p99) against the median engine step, and the fraction of wall time the
engine ran no step while some episode's next turn was ready (idle with ready work), and where a wait went: to the
start of the next step (the step running when the turn got ready), steps begun before its first token (1: the first
step after the observation served it), and the duration of the step that sampled it. The card gives the ratio the
two methods would reach with free compute (latencies alone). Methods alternate
(episodes first at x1, then synchronous; the order flips at the next scale), one run each per scale. The last
line is JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from rollout import RolloutWorker, SamplingParams, Turn, WorkerConfig
from rollout.engine import TurnTrace
from rollout.testing import build_tiny_model, load_tiny_model


@dataclass(frozen=True)
class Episode:
    prompt: list[int]
    turn_tokens: int
    num_turns: int
    latencies: tuple[float, ...]  # one per turn
    observations: tuple[tuple[int, ...], ...]


def draw_episodes(num: int, seed: int, vocab: int, fixed: int | None = None) -> list[Episode]:
    """`fixed`: every episode's number of model turns (None: drawn per episode, 1-4)."""
    episodes = []
    for i in range(num):
        rng = random.Random(f"{seed}-{i}")
        drawn = rng.randint(1, 4)
        turns = drawn if fixed is None else fixed
        latencies = tuple(rng.uniform(3.5, 4.5) if rng.random() < 0.1 else math.exp(rng.gauss(math.log(0.5), 0.4))
                          for _ in range(turns))
        observations = tuple(tuple(rng.randrange(10, vocab) for _ in range(rng.randint(8, 24))) for _ in range(turns))
        episodes.append(Episode([rng.randrange(10, vocab) for _ in range(rng.randint(16, 48))], rng.randint(8, 32),
                                turns, latencies, observations))
    return episodes


class Scripted:
    """The environment of one drawn episode: sleeps its latency, answers its observation, ends at its turn count."""

    def __init__(self, episode: Episode, scale: float) -> None:
        self.episode, self.scale, self.turn = episode, scale, 0

    def step(self, completion_ids: list[int]) -> Turn:
        time.sleep(self.episode.latencies[self.turn] * self.scale)
        self.turn += 1
        return Turn(list(self.episode.observations[self.turn - 1]), reward=1.0,
                    done=self.turn == self.episode.num_turns)


def latency_ratio(episodes: list[Episode]) -> float:
    """The ratio the two methods would reach with free compute: the turn-synchronous loop waits for each round's
    slowest step, episodes only for the slowest episode's own chain of steps."""
    rounds = sum(max(e.latencies[r] for e in episodes if e.num_turns > r)
                 for r in range(max(e.num_turns for e in episodes)))
    return rounds / max(sum(e.latencies) for e in episodes)


def params_of(episodes: list[Episode]) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=e.turn_tokens, ignore_eos=True) for e in episodes]


def run_episodes(worker: RolloutWorker, episodes: list[Episode], scale: float) -> dict:
    worker.engine.trace = trace = TurnTrace()
    start = time.perf_counter()
    try:
        batch = worker.generate([e.prompt for e in episodes], params_of(episodes),
                                env=lambda p, s: Scripted(episodes[p], scale), max_turns=4)
    finally:
        worker.engine.trace = None
    seconds = time.perf_counter() - start
    assert batch.num_turns.tolist() == [e.num_turns for e in episodes], "episodes ended early"
    return dict(seconds=seconds, model_tokens=int(batch.action_mask.sum()), turns=int(batch.num_turns.sum()),
                trace=trace.summary(), **batch.stats)


def run_turn_synchronous(worker: RolloutWorker, episodes: list[Episode], scale: float) -> dict:
    """Generate a turn for all live episodes, run all their steps concurrently, repeat."""
    start = time.perf_counter()
    envs = [Scripted(e, scale) for e in episodes]
    history: list[list[int]] = [[] for _ in episodes]
    live = list(range(len(episodes)))
    tokens = turns = prompt_tokens = reused = 0
    with ThreadPoolExecutor(len(episodes)) as pool:
        while live:
            batch = worker.generate([episodes[i].prompt + history[i] for i in live], params_of([episodes[i]
                                                                                               for i in live]))
            prompt_tokens += batch.stats["prompt_tokens"]
            reused += batch.stats["reused_tokens"]
            outs = batch.completion_token_lists()
            answers = list(pool.map(lambda pair: envs[pair[0]].step(pair[1]), zip(live, outs)))
            still = []
            for i, out, turn in zip(live, outs, answers):
                history[i] += out
                tokens, turns = tokens + len(out), turns + 1
                if not turn.done:
                    history[i] += turn.observation_ids
                    still.append(i)
            live = still
    return dict(seconds=time.perf_counter() - start, model_tokens=tokens, turns=turns, prompt_tokens=prompt_tokens,
                reused_tokens=reused, prefill_tokens=prompt_tokens - reused)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="25m", help="rollout.testing size (default 25m)")
    parser.add_argument("--episodes", type=int, default=64)
    parser.add_argument("--scales", default="0,0.5,1,2", help="latency multipliers, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--turns", type=int, default=None,
                        help="model turns of every episode, 1-4 (default: drawn per episode)")
    parser.add_argument("--quick", action="store_true", help="tiny model, 16 episodes, scale 1 only")
    args = parser.parse_args()
    if args.quick:
        args.size, args.episodes, args.scales = "tiny", 16, "1"
    torch.manual_seed(args.seed)
    model, _ = load_tiny_model(build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-{args.size}", size=args.size))
    vocab = model.config.vocab_size
    if args.turns is not None and not 1 <= args.turns <= 4:
        parser.error(f"--turns {args.turns}: must be 1 to 4 (the environments' max_turns)")
    episodes = draw_episodes(args.episodes, args.seed, vocab, args.turns)
    config = WorkerConfig(page_size=16, max_batch_tokens=512, kv_cache_memory_mb=512)
    results = []
    with RolloutWorker(model, config) as worker:
        run_episodes(worker, episodes[:4], 0.0)  # warm-up: first forwards, thread pools
        for k, scale in enumerate(float(s) for s in args.scales.split(",")):
            methods = [("episodes", run_episodes), ("turn-synchronous", run_turn_synchronous)]
            row = {"scale": scale}
            for name, run in (methods if k % 2 == 0 else methods[::-1]):
                worker.engine.forget_prefix_cache()  # neither method inherits the other's cached pages
                row[name] = run(worker, episodes, scale)
                print(f"# scale x{scale} {name}: {row[name]['seconds']:.1f} s", file=sys.stderr, flush=True)
            results.append(row)
    num_turns = sum(e.num_turns for e in episodes)
    print(f"# episodes card: {args.size} Llama ({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
          f"fp32, cpu, {torch.get_num_threads()} threads); {args.episodes} episodes, {num_turns} model turns, "
          f"{sum(e.num_turns * e.turn_tokens for e in episodes)} model tokens; latency median 0.5 s, 10% ~4 s, "
          f"x scale; with free compute the ratio would be {latency_ratio(episodes):.2f}x (each round's slowest step "
          f"against the slowest episode's chain)")
    print(f"{'latency':>8}{'episodes/s':>12}{'sync ep/s':>11}{'ratio':>7}{'prefill/turn':>14}{'re-prefill/turn':>17}"
          f"{'sync prefill/turn':>19}{'ready->token p50':>18}{'p99':>8}{'step p50':>10}{'idle w/ ready':>15}"
          f"{'to step start':>15}{'steps begun':>13}{'token step':>12}")
    for row in results:
        ep, sync, tr = row["episodes"], row["turn-synchronous"], row["episodes"]["trace"]
        print(f"{'x' + str(row['scale']):>8}{args.episodes / ep['seconds']:>12.2f}"
              f"{args.episodes / sync['seconds']:>11.2f}"
              f"{sync['seconds'] / ep['seconds']:>6.2f}x{ep['prefill_tokens'] / ep['turns']:>14.1f}"
              f"{ep['prompt_tokens'] / ep['turns']:>17.1f}{sync['prefill_tokens'] / sync['turns']:>19.1f}"
              f"{tr['latency_p50_s'] * 1e3:>16.0f}ms{tr['latency_p99_s'] * 1e3:>6.0f}ms{tr['step_p50_s'] * 1e3:>8.0f}ms"
              f"{tr['idle_with_ready_fraction'] * 100:>14.2f}%{tr['boundary_p50_s'] * 1e3:>13.0f}ms"
              f"{tr['steps_started_p50']:>13.0f}{tr['token_step_p50_s'] * 1e3:>10.0f}ms")
    print(json.dumps({"benchmark": "episodes", "size": args.size, "episodes": args.episodes, "turns": num_turns,
                      "free_compute_ratio": latency_ratio(episodes),
                      "results": [{"scale": r["scale"], "episodes_s": r["episodes"]["seconds"],
                                   "sync_s": r["turn-synchronous"]["seconds"],
                                   "ratio": r["turn-synchronous"]["seconds"] / r["episodes"]["seconds"],
                                   "prefill_per_turn": r["episodes"]["prefill_tokens"] / r["episodes"]["turns"],
                                   "reprefill_per_turn": r["episodes"]["prompt_tokens"] / r["episodes"]["turns"],
                                   **{k: r["episodes"]["trace"][k] for k in ("latency_p50_s", "latency_p99_s",
                                                                              "step_p50_s",
                                                                              "idle_with_ready_fraction",
                                                                              "boundary_p50_s", "steps_started_p50",
                                                                              "token_step_p50_s")}}
                                  for r in results]}))


if __name__ == "__main__":
    main()
