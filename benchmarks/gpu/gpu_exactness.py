"""Exactness of rollout logprobs on a GPU: bf16 (and fp32) with sdpa and, when the wheel is present, flash attention.

For each attention implementation, a RolloutWorker generates a mixed batch (greedy, temperatures, top-k, top-p,
n > 1, a resent prompt that hits the prefix cache), then a plain teacher-forced forward of the same weights in the
same dtype recomputes every token's logprob. Prints the max and mean |difference| per setting and one JSON line.

    python benchmarks/gpu/gpu_exactness.py                       # on a CUDA machine (about 2 minutes)
    python benchmarks/gpu/gpu_exactness.py --device cpu --size tiny --dtypes float32   # dry run here
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import tempfile
import time

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.testing import build_tiny_model

SIZES = {"tiny": "tiny", "small": "small", "100m": "100m"}


def plain_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    temp = 1.0 if temperature == 0 else temperature
    return torch.log_softmax(logits / temp, -1).gather(1, torch.tensor(completion, device=model.device)[:, None])[:, 0]


def check(path, attn, dtype, device, args):
    from transformers import AutoModelForCausalLM

    # "auto" is the worker's default (rollout_paged on CPU; on CUDA flash when it imports and the dtype allows it,
    # else rollout_paged) on an sdpa model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype,
                                                 attn_implementation="sdpa" if attn == "auto" else attn).to(device)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 400, (int(n),), generator=gen).tolist() for n in torch.randint(1, 200, (16,),
                                                                                                generator=gen)]
    params = [SamplingParams(n=4, temperature=[0.0, 0.7, 1.0, 1.2][i % 4], top_k=[0, 0, 50, 0][i % 4],
                             top_p=[1.0, 1.0, 1.0, 0.9][i % 4], max_new_tokens=args.max_new_tokens)
              for i in range(len(prompts))]
    config = WorkerConfig(page_size=args.page_size, max_batch_tokens=args.max_batch_tokens,
                          kv_cache_memory_mb=args.kv_mb, attn_implementation=attn)
    with RolloutWorker(model, config) as worker:
        worker.generate(prompts[:4], params[:4])  # warm the prefix cache for the resent prompts
        start = time.perf_counter()
        batch = worker.generate(prompts, params)
        seconds = time.perf_counter() - start
    diffs = []
    for r, completion in enumerate(batch.completion_token_lists()):
        p = params[int(batch.prompt_index[r])]
        ref = plain_logprobs(model, batch.prompt_ids[r], completion, p.temperature)
        diffs.append((batch.logprobs[r, : len(completion)].to(device) - ref).abs())
    diffs = torch.cat(diffs)
    return {"attn": attn, "dtype": str(dtype).replace("torch.", ""), "rows": len(batch),
            "tokens": batch.num_tokens, "seconds": round(seconds, 3), "max_abs_diff": float(diffs.max()),
            "mean_abs_diff": float(diffs.mean())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--size", default="100m", choices=sorted(SIZES))
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=2048)
    parser.add_argument("--kv-mb", type=int, default=2048)
    parser.add_argument("--init-std", type=float, default=0.02,
                        help="the weights' init std: 0.02 is where the exactness rule holds (1e-5 max, 1e-6 mean in "
                             "fp32); rollout.testing's default 0.2 peaks the distributions and scales fp32 rounding "
                             "with the activations (2e-3 max on the 100m model, on CPU as on an H200)")
    parser.add_argument("--attns", default="sdpa,auto",
                        help="engine attentions to check (auto: the worker's default); flash_attention_2 is added on "
                             "CUDA when the wheel is present")
    args = parser.parse_args()
    attns = args.attns.split(",")
    if args.device == "cuda" and importlib.util.find_spec("flash_attn") is not None and \
            "flash_attention_2" not in attns:
        attns.append("flash_attention_2")
    path = build_tiny_model(tempfile.mkdtemp() + "/model", size=SIZES[args.size], arch="qwen2", init_std=args.init_std)
    print(f"# exactness card: device={args.device} size={args.size} init_std={args.init_std} attns={attns} "
          f"dtypes={args.dtypes} "
          f"torch={torch.__version__} gpu={torch.cuda.get_device_name() if torch.cuda.is_available() else '-'}")
    results = []
    print(f"{'attn':<20}{'dtype':<10}{'rows':>6}{'tokens':>8}{'max|d|':>12}{'mean|d|':>12}")
    for attn in attns:
        for name in args.dtypes.split(","):
            if attn.startswith("flash") and name == "float32":
                continue  # flash has no fp32 kernels
            res = check(path, attn, getattr(torch, name), args.device, args)
            results.append(res)
            print(f"{attn:<20}{res['dtype']:<10}{res['rows']:>6}{res['tokens']:>8}"
                  f"{res['max_abs_diff']:>12.2e}{res['mean_abs_diff']:>12.2e}")
    print(json.dumps({"benchmark": "gpu_exactness", "results": results}))


if __name__ == "__main__":
    main()
