"""What a weight update that lands mid-generation costs and does to logprobs, per in_flight mode.

    python benchmarks/throughput/bench_inflight.py            # "small" Llama (~5M params), 16 prompts x 96 tokens (~1 min)
    python benchmarks/throughput/bench_inflight.py --size tiny

One worker holding its own weights; a call of 16 prompts (24-64 tokens) x 96 new tokens (ignore_eos) is submitted;
once every request has sampled 24 tokens, `update_weights(new, in_flight=mode)` lands (new = the weights plus
noise of 10% of each tensor's std, so the versions differ as they do after an optimizer step or a few). Reported per
mode: how long the update call blocked, the call's total time, the versions its tokens carry, and the logprob gap
of the tokens sampled after the switch against a teacher-forced forward of the weights of their version (the
model's own full-vocabulary logprobs; "keep" continues on KV computed by the old weights, so its gap is the price of
not recomputing). The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import build_tiny_model, load_tiny_model


def perturbed(model, scale: float, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen) * v.std() if v.is_floating_point() and v.numel() > 1
            else v.clone() for k, v in model.state_dict().items()}


def forward_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="small")
    parser.add_argument("--scale", type=float, default=0.1, help="noise of the new weights, in tensor stds")
    args = parser.parse_args()
    path = build_tiny_model(f"{tempfile.gettempdir()}/rollout-bench-{args.size}", size=args.size)
    old, _ = load_tiny_model(path)
    new, _ = load_tiny_model(path)
    new.load_state_dict(perturbed(old, args.scale, 1))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, old.config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(24, 65, (16,), generator=gen)]
    params = SamplingParams(max_new_tokens=96, ignore_eos=True, seed=0)
    rows = []
    for mode in ("wait", "abort", "recompute", "keep"):
        with RolloutWorker(path, WorkerConfig(page_size=16, max_batch_tokens=256)) as worker:
            worker.generate(prompts[:2], SamplingParams(max_new_tokens=4))  # warm-up
            start = time.perf_counter()
            future = worker.submit(prompts, params)
            while True:
                counts = [len(v) for v in list(worker.engine._requests.ledger.versions.values())]
                if len(counts) == len(prompts) and min(counts) >= 24:
                    break
                time.sleep(0.002)
            update_start = time.perf_counter()
            worker.update_weights(new.state_dict(), in_flight=mode)
            update_s = time.perf_counter() - update_start
            batch = future.result()
            total_s = time.perf_counter() - start
            gaps = []
            for r, ids in enumerate(batch.completion_token_lists()):
                versions = batch.token_versions[r, : len(ids)]
                for version, model in ((0, old), (1, new)):
                    at = versions == version
                    if at.any():
                        gap = (batch.logprobs[r, : len(ids)][at] - forward_logprobs(model, prompts[r], ids)[at]).abs()
                        gaps.append((version, gap))
            after = torch.cat([g for v, g in gaps if v == 1]) if any(v == 1 for v, _ in gaps) else torch.zeros(1)
            before = torch.cat([g for v, g in gaps if v == 0]) if any(v == 0 for v, _ in gaps) else torch.zeros(1)
            rows.append(dict(mode=mode, update_s=update_s, total_s=total_s,
                             tokens_v0=int((batch.token_versions == 0).sum()),
                             tokens_v1=int((batch.token_versions == 1).sum()),
                             recomputed=worker.engine.num_recomputed, aborted=worker.engine.num_aborted,
                             gap_before_max=float(before.max()), gap_after_max=float(after.max()),
                             gap_after_mean=float(after.mean())))
    print(f"# in-flight card: {args.size} Llama ({sum(p.numel() for p in old.parameters()) / 1e6:.1f}M params, fp32, "
          f"cpu); 16 prompts 24-64 tokens x 96 new tokens; update after 24 tokens; new = old + {args.scale} std noise")
    print(f"{'mode':<10}{'update s':>9}{'call s':>8}{'tokens v0':>10}{'tokens v1':>10}{'recomputed':>11}"
          f"{'gap v0 max':>11}{'gap v1 max':>11}{'gap v1 mean':>12}")
    for r in rows:
        print(f"{r['mode']:<10}{r['update_s']:>9.3f}{r['total_s']:>8.2f}{r['tokens_v0']:>10}{r['tokens_v1']:>10}"
              f"{r['recomputed']:>11}{r['gap_before_max']:>11.1e}{r['gap_after_max']:>11.1e}{r['gap_after_mean']:>12.1e}")
    print(json.dumps({"benchmark": "inflight", "size": args.size, "scale": args.scale, "rows": rows}))


if __name__ == "__main__":
    main()
