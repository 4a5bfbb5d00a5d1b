"""Multi-process training with accelerate: each rollout layout of examples/grpo_accelerate.py under a real
`accelerate launch` on 2 CPU processes (gloo), proving the ranks form one group and end equal; then the pieces
that need no launch (sharding, the agreement check, the CPU trap's detection, unwrapping)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed: pip install 'rollout[accelerate]'")

from rollout.fleet.collective import free_port  # noqa: E402
from trainers_integration.distributed import check_agreement, check_process_group, rank_prompts, shard  # noqa: E402
from trainers_integration.rollouts import shares_model, unwrapped  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "grpo_accelerate.py"
REPORT = re.compile(r"^rank (\d): fingerprint (\w+) rollout (\w+) policy_version (\d+) worst_gap (\S+) ", re.M)
GROUP = re.compile(r"^rank (\d): group of (\d+) \((\w+), backend (\w+)\), all_reduce\(1\) = (\d+)$", re.M)


def launch(layout: str, model_path: Path, tmp_path: Path, *extra: str, steps: int = 2) -> subprocess.CompletedProcess:
    """`accelerate launch --multi_gpu --num_processes 2` of the example, forced onto the CPU (no GPU visible)."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
           "RAY_DEDUP_LOGS": "0"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "--main_process_port", str(free_port()), str(EXAMPLE), "--layout", layout, "--steps", str(steps),
               "--model", str(model_path), "--out", str(tmp_path), "--prompts", "4", "--generations", "4",
               "--max-new-tokens", "8", "--fleet-workers", "1", *extra]
    return subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("layout, extra, kind", [
    ("colocated", (), "MULTI_CPU"),
    ("sharded", (), "FSDP"),
    ("fleet", ("--lora",), "MULTI_CPU"),  # the fleet built from a PEFT model, adapter-only pushes from rank 0
])
def test_a_layout_runs_under_accelerate_launch_as_one_group_of_two_ranks_that_end_equal(
        layout, extra, kind, tiny_path, tmp_path):
    result = launch(layout, tiny_path, tmp_path, *extra)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-6000:]
    groups = {int(m[0]): m[1:] for m in GROUP.findall(out)}
    assert groups == {0: ("2", kind, "gloo", "2"), 1: ("2", kind, "gloo", "2")}, out[-6000:]  # not two lone rank 0s
    reports = {int(m[0]): m[1:] for m in REPORT.findall(out)}
    assert sorted(reports) == [0, 1], out[-6000:]
    assert len({fp for fp, _, _, _ in reports.values()}) == 1  # identical weights on every rank ...
    assert all(fp == rollout_fp for fp, rollout_fp, _, _ in reports.values())  # ... on both sides
    assert {version for _, _, version, _ in reports.values()} == {"2"}
    assert all(float(gap) < 1e-4 for _, _, _, gap in reports.values())
    assert "ranks agree: True" in out
    assert len(re.findall(r"^\[rank [01]\] step +\d", out, re.M)) == 4  # 2 steps on each rank
    # rank 0 logged every step through accelerate's TensorBoard tracker, the rollout side's counters included:
    # colocated, its own worker made its 2 prompts x 4 rows per step; otherwise rank 0's backend made every rank's
    (run,) = (tmp_path / "tensorboard").iterdir()
    scalars = tensorboard_scalars(run)
    rows = {name: values for name, values in scalars.items() if name.startswith("rollout/rows_finished/")}
    per_step = 8 if layout == "colocated" else 16
    assert [sum(v[i][1] for v in rows.values()) for i in range(2)] == [per_step, 2 * per_step], rows
    assert [step for step, _ in scalars["rollout/generated_tokens"]] == [1, 2]
    assert all(abs(value) < 1e-4 for _, value in scalars["offpolicy/gap_current"])


def test_a_run_whose_ranks_fail_the_check_exits_nonzero_naming_why(tiny_path, tmp_path):
    result = launch("colocated", tiny_path, tmp_path, "--max-gap", "0", steps=1)  # no gap is < 0
    out = result.stdout + result.stderr
    assert result.returncode != 0, out[-6000:]
    assert "ranks agree: False" in out and "DISAGREE: logprob gap >= 0" in out
    assert len(REPORT.findall(out)) == 2  # both ranks still report


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def report(rank: int, **overrides) -> dict:
    return {"rank": rank, "fingerprint": "aa", "rollout_fingerprint": "aa", "policy_version": 3, "worst_gap": 1e-6,
            **overrides}


def test_the_agreement_check_names_every_way_ranks_can_disagree():
    assert check_agreement([report(0), report(1)]) == []
    problems = check_agreement([report(0), report(1, fingerprint="bb", rollout_fingerprint="bb")])
    assert problems == ["trainer weights differ across ranks: ['aa', 'bb']"]
    assert "rollout weights differ from the trainer's on ranks [1]" in check_agreement(
        [report(0), report(1, rollout_fingerprint="cc")])
    assert "policy_version differs" in check_agreement([report(0), report(1, policy_version=2)])[0]
    assert "logprob gap" in check_agreement([report(0), report(1, worst_gap=3e-2)])[0]


def test_the_cpu_trap_is_caught_when_the_launcher_started_more_processes_than_the_group_holds(monkeypatch):
    class Alone:  # what each process sees after `--multi_gpu` without Accelerator(cpu=True) on a GPU-less machine
        num_processes, process_index = 1, 0

    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="not one group. Fix: build the Accelerator with cpu=True"):
        check_process_group(Alone())


def test_each_rank_gets_an_equal_contiguous_shard_of_every_step():
    class Rank:
        num_processes = 2

        def __init__(self, index):
            self.process_index = index

    prompts = lambda step: [f"{step}-{i}" for i in range(4)]  # noqa: E731
    assert [rank_prompts(prompts, Rank(r))(7) for r in (0, 1)] == [["7-0", "7-1"], ["7-2", "7-3"]]
    assert shard(list(range(6)), 2, 3) == [4, 5]
    with pytest.raises(ValueError, match="multiple of 2"):
        rank_prompts(lambda step: ["a", "b", "c"], Rank(0))(0)


def test_a_worker_on_the_unwrapped_replica_shares_the_wrapped_policy(tiny):
    model, _ = tiny

    class Wrapped(torch.nn.Module):  # DDP's shape: the replica under .module
        def __init__(self, module):
            super().__init__()
            self.module = module

    class Worker:
        pass

    worker = Worker()
    worker.model = model
    assert unwrapped(Wrapped(Wrapped(model))) is model
    assert shares_model(worker, Wrapped(model)) and not shares_model(worker, Wrapped(torch.nn.Linear(1, 1)))
