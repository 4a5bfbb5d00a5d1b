"""Colocation and weight checks on a GPU: what `sleep()` gives back to a trainer, what `wake()` costs, and what a
fingerprint of 7B-sized weights costs against the old host-side hash.

    python benchmarks/gpu/gpu_colocation.py                # on a CUDA machine (~1 minute)
    python benchmarks/gpu/gpu_colocation.py --dry-run      # here, on CPU: the same steps on small sizes

Sleep / wake: a RolloutWorker on the Qwen2.5-0.5B-shaped bench model (bf16) with a KV budget of --kv-mb; memory is
what the process holds from the device (torch.cuda.memory_reserved; RSS on CPU) awake, asleep and woken, and the
device's free memory (what a trainer could take); sleep() and wake() are timed; the rollouts after wake are checked
against a plain forward of the same weights.
Fingerprint: rollout.model.weights.fingerprint over bf16 tensors of Qwen2.5-7B's shapes (7.6B parameters), warm, against
the old way (copy every tensor to the host, sha256 of the bytes) timed on two layers and scaled to the whole model.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig
from rollout.model.weights import fingerprint

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders

# Qwen2.5-7B: hidden 3584, 28 layers, 28 query / 4 KV heads of 128, MLP 18944, vocabulary 152064
SHAPE_7B = dict(hidden=3584, layers=28, kv=512, mlp=18944, vocab=152064)
SHAPE_DRY = dict(hidden=256, layers=4, kv=64, mlp=512, vocab=4096)


def held_mb(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() / 2**20
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def free_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.mem_get_info()[0] / 2**20
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def sleep_wake(args, device: torch.device) -> dict:
    from throughput import bench_rollout  # benchmarks/throughput/bench_rollout.py (benchmarks/ is on sys.path)

    bench_args = argparse.Namespace(size="tiny" if args.dry_run else "0.5b", arch="llama", dtype="bfloat16",
                                    device=str(device))
    model, _, label = bench_rollout.load_model(bench_args)
    vocab = min(model.config.vocab_size, 30000)
    prompts = [torch.randint(10, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (40, 90, 7)]
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=32, ignore_eos=True)
    with RolloutWorker(model, WorkerConfig(kv_cache_memory_mb=args.kv_mb)) as worker:
        worker.generate(prompts, params)
        awake, awake_free = held_mb(device), free_mb(device)
        sleep_s, _ = timed(worker.sleep)
        asleep, asleep_free = held_mb(device), free_mb(device)
        wake_s, _ = timed(worker.wake)
        woken = held_mb(device)
        batch = worker.generate(prompts, params)
        gap = bench_rollout.logprob_gap(model, batch, rows=4)
        attn = worker._engine_attn
    return {"model": label, "attention": attn, "kv_mb": args.kv_mb, "held_awake_mb": round(awake),
            "held_asleep_mb": round(asleep), "held_woken_mb": round(woken), "freed_mb": round(awake - asleep),
            "freed_of_kv": round((awake - asleep) / args.kv_mb, 3), "free_gain_mb": round(asleep_free - awake_free),
            "sleep_s": round(sleep_s, 3), "wake_s": round(wake_s, 3), "logprob_gap_after_wake": gap}


def shaped_weights(shape: dict, layers: int, device: torch.device) -> torch.nn.Module:
    """Random bf16 tensors in a model's shapes (embeddings and head, then `layers` decoder layers)."""
    h, kv, mlp = shape["hidden"], shape["kv"], shape["mlp"]
    per_layer = {"q": (h, h), "q_bias": (h,), "k": (kv, h), "k_bias": (kv,), "v": (kv, h), "v_bias": (kv,),
                 "o": (h, h), "gate": (mlp, h), "up": (mlp, h), "down": (h, mlp), "norm1": (h,), "norm2": (h,)}
    module = torch.nn.Module()
    gen = torch.Generator(device=device).manual_seed(0)
    module.register_buffer("embed", torch.randn(shape["vocab"], h, generator=gen, device=device, dtype=torch.bfloat16))
    module.register_buffer("head", torch.randn(shape["vocab"], h, generator=gen, device=device, dtype=torch.bfloat16))
    for i in range(layers):
        for name, dims in per_layer.items():
            module.register_buffer(f"l{i}_{name}", torch.randn(*dims, generator=gen, device=device,
                                                               dtype=torch.bfloat16))
    return module


def host_sha256(module: torch.nn.Module) -> str:
    """The fingerprint this project used before: every tensor copied to the host, sha256 of its bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy())
    return digest.hexdigest()[:16]


def fingerprint_cost(args, device: torch.device) -> dict:
    shape = SHAPE_DRY if args.dry_run else SHAPE_7B
    module = shaped_weights(shape, shape["layers"], device)
    params = sum(t.numel() for t in module.state_dict().values())
    fingerprint(module)  # warm: kernels loaded, allocator primed
    seconds, _ = timed(lambda: fingerprint(module))
    module = None  # frees the full-size set before the two-layer one is built
    two = shaped_weights(shape, 2, device)
    two_params = sum(t.numel() for t in two.state_dict().values())
    old_s, _ = timed(lambda: host_sha256(two))
    old_scaled = old_s * params / two_params
    return {"params_b": round(params / 1e9, 2), "fingerprint_s": round(seconds, 3),
            "old_host_sha256_s_scaled": round(old_scaled, 2), "old_over_new": round(old_scaled / seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny model, small tensor shapes")
    parser.add_argument("--kv-mb", type=int, default=None, help="KV budget of the worker (default 8192; dry run 256)")
    args = parser.parse_args()
    args.kv_mb = args.kv_mb or (256 if args.dry_run else 8192)
    device = torch.device("cpu" if args.dry_run else "cuda")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# colocation card: device={name} torch={torch.__version__} kv_mb={args.kv_mb}", flush=True)
    colocation = sleep_wake(args, device)
    print(f"sleep/wake ({colocation['model']}, {colocation['attention']}): held {colocation['held_awake_mb']} MiB "
          f"awake, {colocation['held_asleep_mb']} asleep, {colocation['held_woken_mb']} woken; freed "
          f"{colocation['freed_mb']} MiB = {colocation['freed_of_kv']:.0%} of the KV budget (device free memory "
          f"+{colocation['free_gain_mb']} MiB); sleep {colocation['sleep_s']} s, wake {colocation['wake_s']} s; "
          f"logprob gap after wake {colocation['logprob_gap_after_wake']:.1e}", flush=True)
    weights = fingerprint_cost(args, device)
    print(f"fingerprint of {weights['params_b']}B bf16 parameters: {weights['fingerprint_s']} s on the device; the "
          f"old host copy + sha256: {weights['old_host_sha256_s_scaled']} s (two layers, scaled) = "
          f"{weights['old_over_new']}x", flush=True)
    print(json.dumps({"benchmark": "gpu_colocation", "device": name, "sleep_wake": colocation,
                      "fingerprint": weights}))


if __name__ == "__main__":
    main()
