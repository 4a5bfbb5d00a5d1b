"""Generation with LoRA adapters: unmerged (PEFT's forward adds each low-rank branch) against merged for generation
(adapters folded into the base weights for the call, base bytes restored exactly after), and the base model alone.

    python benchmarks/features/bench_lora.py                       # 25M Llama, rank-8 adapters on every projection
    python benchmarks/features/bench_lora.py --size tiny --rounds 1   # a smoke run

One step: P prompts of lengths in [prompt-min, prompt-max], N samples each, `--new-tokens` tokens each (ignore_eos,
T=1.0), through one RolloutWorker per variant (started once, one warmup step). Variants are interleaved round by
round; the table shows medians of wall and CPU seconds (CPU seconds are the load-robust figure on a shared machine).
"merged" is charged its merge and restore on every call (`WorkerConfig(merge_adapters=True)`, the default: a
trainer sharing the model needs the unmerged model back between calls); "unmerged" is `merge_adapters=False`. Checked on the last round: the base weights' fingerprint
is unchanged after a merged call, and the merged rows' logprobs against the unmerged model's forward (the
trainer/rollout gap merging costs).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.model.adapters import merged
from rollout.model.weights import fingerprint
from rollout.testing import build_tiny_model, load_tiny_model

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_model(path, rank: int, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    model, tok = load_tiny_model(path)
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=PROJECTIONS,
                                                  lora_dropout=0.0))
    with torch.no_grad():  # a trained-looking adapter: B is zero at init, which would make the branch a no-op
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.02)
    return peft_model.eval(), tok


def prompts(num: int, low: int, high: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (int(torch.randint(low, high + 1, (1,), generator=gen)),),
                          generator=gen).tolist() for _ in range(num)]


def timed(fn) -> tuple[float, float, object]:
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def trainer_gap(model, batch) -> float:
    """max |rollout logprob - the unmerged model's teacher-forced logprob| over the batch's tokens."""
    worst = 0.0
    with torch.no_grad():
        for i in range(len(batch)):
            n = int(batch.completion_lengths[i])
            ids = torch.tensor([batch.prompt_ids[i] + batch.completion_ids[i, :n].tolist()])
            logits = model(input_ids=ids).logits[0, len(batch.prompt_ids[i]) - 1: -1].float()
            lp = torch.log_softmax(logits, -1).gather(1, batch.completion_ids[i, :n, None]).squeeze(1)
            worst = max(worst, float((lp - batch.logprobs[i, :n]).abs().max()))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="25m")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--prompt-min", type=int, default=32)
    parser.add_argument("--prompt-max", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    path = build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-{args.size}", size=args.size)
    base, _ = load_tiny_model(path)
    peft_unmerged, _ = lora_model(path, args.rank)
    peft_merged, _ = lora_model(path, args.rank)
    adapter_params = sum(p.numel() for n, p in peft_unmerged.named_parameters() if "lora_" in n)
    work = prompts(args.prompts, args.prompt_min, args.prompt_max, base.config.vocab_size)
    sampling = SamplingParams(n=args.samples, temperature=1.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    workers = {"base (no adapters)": RolloutWorker(base, WorkerConfig(num_blocks=1024)),
               "lora unmerged": RolloutWorker(peft_unmerged, WorkerConfig(num_blocks=1024, merge_adapters=False)),
               "lora merged per call": RolloutWorker(peft_merged, WorkerConfig(num_blocks=1024, merge_adapters=True))}
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in workers}
    tokens = args.prompts * args.samples * args.new_tokens
    for worker in workers.values():
        worker.generate(work, sampling)  # warmup
    before = fingerprint(peft_merged)
    last = {}
    for _ in range(args.rounds):
        for name, worker in workers.items():
            wall, cpu, last[name] = timed(lambda w=worker: w.generate(work, sampling))
            times[name].append((wall, cpu))
    exact_restore = fingerprint(peft_merged) == before
    merge_wall, merge_cpu, _ = timed(lambda: _merge_restore(peft_merged))
    gap_merged = trainer_gap(peft_merged, last["lora merged per call"])
    gap_unmerged = trainer_gap(peft_unmerged, last["lora unmerged"])
    for worker in workers.values():
        worker.close()

    print(f"# lora card: {args.size} Llama ({sum(p.numel() for p in base.parameters()) / 1e6:.1f}M params, fp32, "
          f"cpu, {torch.get_num_threads()} threads, torch {torch.__version__}); rank-{args.rank} LoRA on "
          f"{','.join(PROJECTIONS)}: {adapter_params / 1e6:.2f}M adapter params")
    print(f"# step: {args.prompts} prompts x {args.samples} samples, prompts {args.prompt_min}-{args.prompt_max} "
          f"tokens, {args.new_tokens} new tokens each ({tokens} tokens), T=1.0; medians of {args.rounds} rounds "
          "after 1 warmup, variants interleaved")
    ref = statistics.median(c for _, c in times["lora unmerged"])
    print(f"{'variant':<24}{'wall s':>8}{'tok/s':>8}{'CPU s':>8}{'CPU vs unmerged':>17}")
    rows = []
    for name, samples in times.items():
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        rows.append(dict(variant=name, wall_s=wall, cpu_s=cpu, tokens_per_s=tokens / wall, cpu_vs_unmerged=cpu / ref))
        print(f"{name:<24}{wall:>8.2f}{tokens / wall:>8.0f}{cpu:>8.2f}{cpu / ref:>16.2f}x")
    print(f"# merge + exact restore alone: {merge_wall * 1e3:.1f} ms wall, {merge_cpu * 1e3:.1f} ms CPU; base bytes "
          f"restored exactly: {exact_restore}")
    print(f"# trainer/rollout gap (vs the unmerged forward): unmerged {gap_unmerged:.1e}, merged {gap_merged:.1e}")
    print(json.dumps({"benchmark": "lora_generation", "size": args.size, "rank": args.rank, "results": rows,
                      "merge_restore_s": merge_wall, "exact_restore": exact_restore,
                      "gap_unmerged": gap_unmerged, "gap_merged": gap_merged}))


def _merge_restore(model) -> None:
    with merged(model):
        pass


if __name__ == "__main__":
    main()
