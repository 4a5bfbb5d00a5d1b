"""Re-scoring throughput: packed (rollout.score) vs a padded batched forward vs a per-sequence loop, same run.

All three compute the same numbers (the table shows each one's max |difference| from the per-sequence loop) and all
three compute logits only for the positions they need (`logits_to_keep`), so the ratios measure packing and padding,
not the lm_head. The padded baseline is the usual trainer recipe (TRL's GRPO): B rows in input order, prompts
left-padded, completions right-padded, position ids from the attention mask, logits kept for the completion span.
Tokens/s counts useful tokens (prompt + completion of every pair). MFU-style efficiency: 2 * non-embedding params *
tokens fed per second, against the fp32 matmul rate measured on this machine.

    python benchmarks/features/bench_scoring.py [--pairs 96] [--budget 2048] [--padded-batch 8] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import torch

from rollout.scoring import DEFAULT_MAX_BATCH_TOKENS, score
from rollout.testing import build_tiny_model, load_tiny_model


def ragged_dataset(num_pairs: int, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts 1-256 tokens, completions 1-768 with a long tail (RL rollouts), both log-uniform."""
    gen = torch.Generator().manual_seed(seed)

    def length(high: int) -> int:
        return max(1, int(torch.exp(torch.rand(1, generator=gen) * torch.log(torch.tensor(float(high))))))

    prompts, completions = [], []
    for _ in range(num_pairs):
        prompts.append(torch.randint(0, vocab, (length(256),), generator=gen).tolist())
        completions.append(torch.randint(0, vocab, (length(768),), generator=gen).tolist())
    return prompts, completions


def per_sequence(model, prompts, completions) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for p, c in zip(prompts, completions):
            ids = torch.tensor([p + c[:-1]])
            logits = model(ids, use_cache=False, logits_to_keep=len(c)).logits[0].float()
            out.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(c)[:, None]).squeeze(1))
    return out


def padded(model, prompts, completions, batch_size: int, pad_id: int) -> tuple[list[torch.Tensor], int]:
    """Returns the logprobs and the number of token positions computed (padding included)."""
    out, computed = [], 0
    with torch.no_grad():
        for s in range(0, len(prompts), batch_size):
            ps, cs = prompts[s:s + batch_size], completions[s:s + batch_size]
            max_p, max_c = max(map(len, ps)), max(map(len, cs))
            ids = torch.full((len(ps), max_p + max_c), pad_id)
            mask = torch.zeros_like(ids)
            for r, (p, c) in enumerate(zip(ps, cs)):
                ids[r, max_p - len(p):max_p + len(c)] = torch.tensor(p + c)
                mask[r, max_p - len(p):max_p + len(c)] = 1
            positions = (mask.cumsum(-1) - 1).clamp_min(0)
            logits = model(ids[:, :-1], attention_mask=mask[:, :-1], position_ids=positions[:, :-1],
                           use_cache=False, logits_to_keep=max_c).logits.float()  # [B, max_c, V]
            logp = torch.log_softmax(logits, -1).gather(2, ids[:, max_p:, None]).squeeze(2)
            out.extend(logp[r, :len(c)] for r, c in enumerate(cs))
            computed += ids[:, :-1].numel()
    return out, computed


def matmul_gflops(size: int = 1024, repeats: int = 10) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size ** 3 * repeats / (time.perf_counter() - start) / 1e9


def interleaved(runs: dict, repeats: int) -> dict:
    """Best wall and CPU time of each method, the methods taking turns so machine load hits them alike."""
    results = {name: dict(seconds=float("inf"), cpu_seconds=float("inf")) for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            wall, cpu = time.perf_counter(), time.process_time()
            logps, computed = fn()
            r = results[name]
            r.update(seconds=min(r["seconds"], time.perf_counter() - wall),
                     cpu_seconds=min(r["cpu_seconds"], time.process_time() - cpu), logps=logps, computed=computed)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=96)
    parser.add_argument("--budget", type=int, default=DEFAULT_MAX_BATCH_TOKENS)
    parser.add_argument("--padded-batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--size", default="small")
    args = parser.parse_args()

    path = build_tiny_model(os.path.join(tempfile.gettempdir(), f"rollout-bench-{args.size}"), size=args.size)
    model, tokenizer = load_tiny_model(path)
    model.eval()
    prompts, completions = ragged_dataset(args.pairs, model.config.vocab_size)
    useful = sum(len(p) + len(c) for p, c in zip(prompts, completions))
    fed = useful - len(prompts)
    embed = model.get_input_embeddings().weight.numel() + model.get_output_embeddings().weight.numel()
    body_params = sum(p.numel() for p in model.parameters()) - embed
    ceiling = matmul_gflops()

    runs = {
        "packed (rollout.score)": lambda: (score(model, prompts, completions, max_batch_tokens=args.budget), fed),
        f"padded forward, B={args.padded_batch}": lambda: padded(model, prompts, completions, args.padded_batch,
                                                                 tokenizer.pad_token_id),
        "per-sequence loop": lambda: (per_sequence(model, prompts, completions), fed),
    }
    results = interleaved(runs, args.repeats)
    reference = results["per-sequence loop"]["logps"]

    lens_p, lens_c = sorted(map(len, prompts)), sorted(map(len, completions))
    print("== config ==")
    for key, value in [("model", f"tiny Llama '{args.size}', {body_params / 1e6:.2f}M non-embedding params, fp32, "
                                 f"{model.config._attn_implementation}"),
                       ("dataset", f"{args.pairs} pairs, {useful} tokens; prompt len {lens_p[0]}-{lens_p[-1]} "
                                   f"(median {lens_p[len(lens_p) // 2]}), completion len {lens_c[0]}-{lens_c[-1]} "
                                   f"(median {lens_c[len(lens_c) // 2]})"),
                       ("packed budget", f"{args.budget} tokens per forward"),
                       ("machine", f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} "
                                   f"threads, torch {torch.__version__}"),
                       ("fp32 matmul ceiling", f"{ceiling:.1f} GFLOP/s (1024^3 matmul)"),
                       ("timing", f"best of {args.repeats} per method, methods interleaved; the machine is "
                                  f"shared, so CPU-seconds (both threads) are the load-robust figure")]:
        print(f"{key:>20}: {value}")
    padded_name = f"padded forward, B={args.padded_batch}"
    base, base_cpu = results[padded_name]["seconds"], results[padded_name]["cpu_seconds"]
    print(f"\n{'method':<26}{'wall s':>8}{'tokens/s':>10}{'vs padded':>10}{'CPU s':>8}{'vs padded':>10}"
          f"{'computed/useful':>16}{'GFLOP/s':>9}{'of ceiling':>11}{'|diff| loop':>12}")
    summary = {}
    for name, r in results.items():
        tps = useful / r["seconds"]
        gflops = 2 * body_params * r["computed"] / r["seconds"] / 1e9
        diff = max(float((a - b).abs().max()) for a, b in zip(r["logps"], reference))
        print(f"{name:<26}{r['seconds']:>8.2f}{tps:>10.0f}{base / r['seconds']:>9.2f}x{r['cpu_seconds']:>8.2f}"
              f"{base_cpu / r['cpu_seconds']:>9.2f}x{r['computed'] / fed:>16.2f}{gflops:>9.1f}"
              f"{gflops / ceiling:>10.0%}{diff:>12.1e}")
        summary[name] = dict(tokens_per_s=round(tps, 1), seconds=round(r["seconds"], 3),
                             vs_padded=round(base / r["seconds"], 3), cpu_seconds=round(r["cpu_seconds"], 3),
                             vs_padded_cpu=round(base_cpu / r["cpu_seconds"], 3), max_abs_diff=diff)
    print(json.dumps(dict(bench="scoring", model=args.size, pairs=args.pairs, useful_tokens=useful,
                          budget=args.budget, padded_batch=args.padded_batch, results=summary)))


if __name__ == "__main__":
    main()
