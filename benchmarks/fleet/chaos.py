"""Chaos soak: a seeded, time-bounded run that drives a RolloutFleet on a 2-node local Ray cluster and a
RolloutWorker behind `rollout.serve` (loopback HTTP) with a trainer's and agent harnesses' traffic while faults
drawn from the seed land at random times (actor kills, a Ray node kill and re-join, engine-thread deaths,
environments that raise / hang / answer garbage, client disconnects mid-stream, cancels, timeouts, sleep/wake,
KV exhaustion, oversized and malformed requests); then an independent checker verifies the recorded history.

    python benchmarks/fleet/chaos.py --minutes 5 --seed 1          # the recorded runs (benchmarks/results/chaos.md)
    python benchmarks/fleet/chaos.py --seconds 40 --seed 0         # what tests/test_chaos.py runs
    python benchmarks/fleet/chaos.py --check HISTORY.json          # check a recorded history again

The parts live in benchmarks/fleet/soak/ (schedule, driver, traffic, faults, checker, replay, report); docs/reliability.md
says what is promised and what is checked. Exit status 1 when the checker finds a violation; the last line is JSON.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from soak import checker, driver, history, report  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=None, help="length of the faulty run")
    parser.add_argument("--seconds", type=float, default=None, help="length of the faulty run, in seconds")
    parser.add_argument("--seed", type=int, default=0, help="draws the faults, their times and the traffic")
    parser.add_argument("--mean-gap", type=float, default=2.0, help="mean seconds between faults")
    parser.add_argument("--workdir", type=Path, default=None, help="where the model and history go (default: tmp)")
    parser.add_argument("--check", type=Path, default=None, help="only check this recorded history")
    parser.add_argument("--rows", type=int, default=300, help="rows the exactness check samples")
    parser.add_argument("--replays", type=int, default=40, help="seeded groups replayed without faults")
    args = parser.parse_args(argv)
    if args.check is not None:
        path = args.check
    else:
        seconds = args.seconds if args.seconds is not None else 60 * (args.minutes or 1.0)
        workdir = args.workdir or Path(tempfile.mkdtemp(prefix=f"chaos-{args.seed}-"))
        start = time.monotonic()
        path = driver.run(args.seed, seconds, workdir, mean_gap_s=args.mean_gap)
        print(f"ran {seconds:.0f} s of faults in {time.monotonic() - start:.0f} s; history: {path}", flush=True)
    recorded = history.load(path)
    start = time.monotonic()
    result = checker.Checker(recorded, max_rows=args.rows, replays=args.replays)
    outcome = result.run()
    outcome["max_gap"] = getattr(result, "max_gap", None)
    print(f"checked in {time.monotonic() - start:.0f} s", flush=True)
    summary = report.summarize(recorded, outcome)
    print(report.render(summary))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
