"""How often a draft model's token is the one the policy draws: its coupled draw against its argmax (issue 30).

    python benchmarks/speculation/draft_agreement.py                        # the 2500-step policy, its 500-step checkpoint
    python benchmarks/speculation/draft_agreement.py --draft-steps 150 --windows 8

The policy and the draft are the stdlib Llamas of benchmarks/speculation/policy.py (trained and cached on first use). Both read
`--windows` held-out windows of 256 tokens (teacher-forced); at every position, for each of `--keys` random streams,
the policy's token is drawn by the engine's own sampler (`rollout.engine.sampling.sampler.sample_rows`: the stream's uniform
at that position, inverse CDF in vocabulary order) and compared with two draft tokens: the draft model's draw with
the same params, stream and position (the coupled draw of `rollout/engine/speculation/draft_model.py`) and its argmax. Besides
the draft model itself it scores drafts whose logits are a mix a x policy + (1 - a) x draft: drafts between the
trained draft and the policy, by total variation from it, so the table shows where the coupled draw starts to win.
Prints, per sampling and draft: mean total variation distance (after temperature and top-p), the share of draws
where each draft token is the policy's. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: clock.py, machine.py, the folders
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # speculation/: policy.py

from rollout import SamplingParams  # noqa: E402
from rollout.engine.sampling.sampler import RowSpec, SamplingRows, sample_rows, truncation_mask  # noqa: E402

import machine  # noqa: E402  benchmarks/machine.py: the config card
import policy  # noqa: E402  benchmarks/speculation/policy.py: the trained policy

SAMPLINGS = {"T=1": SamplingParams(temperature=1.0), "T=0.7/top_p=0.95": SamplingParams(temperature=0.7, top_p=0.95)}
MIXES = (0.5, 0.75, 0.9)


def held_out_logits(model, windows: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(windows).logits[:, :-1].reshape(-1, model.config.vocab_size).float()


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What a row of these params samples from: softmax(logits / T) after the sampler's own top-k / top-p cut."""
    scaled = logits / params.temperature
    ordered, order = scaled.sort(dim=-1, descending=True)
    rows = len(scaled)
    removed = truncation_mask(ordered, torch.full((rows,), params.top_k), torch.full((rows,), float(params.top_p)))
    removed = torch.empty_like(removed).scatter_(1, order, removed)
    return torch.softmax(scaled.masked_fill(removed, float("-inf")), dim=-1)


def agreement(policy_logits: torch.Tensor, draft_logits: torch.Tensor, params: SamplingParams, keys: int) -> dict:
    positions = torch.arange(policy_logits.shape[0])
    coupled = argmax_hits = draws = 0
    argmax = draft_logits.argmax(-1)
    for key in range(keys):
        rows = SamplingRows.of([RowSpec(params, key=1000 + key)] * policy_logits.shape[0])
        drawn = sample_rows(policy_logits, rows, positions).tokens
        coupled += int((sample_rows(draft_logits, rows, positions).tokens == drawn).sum())
        argmax_hits += int((argmax == drawn).sum())
        draws += drawn.numel()
    tv = 0.5 * (distribution(policy_logits, params) - distribution(draft_logits, params)).abs().sum(-1).mean()
    return dict(tv=round(float(tv), 3), coupled=round(coupled / draws, 3), argmax=round(argmax_hits / draws, 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy-steps", type=int, default=2500)
    parser.add_argument("--draft-steps", type=int, default=500)
    parser.add_argument("--windows", type=int, default=16, help="held-out windows of 256 tokens")
    parser.add_argument("--keys", type=int, default=32, help="random streams (uniforms) per position")
    args = parser.parse_args()
    print(machine.card(), flush=True)
    target, tokenizer, _ = policy.load_policy(args.policy_steps)
    draft, _, _ = policy.load_policy(args.draft_steps)
    _, held = policy.stdlib_files()
    stream = policy.token_stream(tokenizer, held)
    windows = policy.windows(stream, torch.Generator().manual_seed(1), args.windows)[:, :256]
    policy_logits, draft_logits = held_out_logits(target, windows), held_out_logits(draft, windows)
    drafts = {f"{args.draft_steps}-step checkpoint": draft_logits, "the policy itself": policy_logits}
    for a in MIXES:
        drafts[f"mix a={a}"] = a * policy_logits + (1 - a) * draft_logits
    rows = []
    print("| sampling | draft | TV from the policy | coupled draw = policy's | argmax = policy's |")
    print("| --- | --- | ---: | ---: | ---: |")
    for sampling, params in SAMPLINGS.items():
        for name, logits in sorted(drafts.items(), key=lambda item: -distance(item[1], policy_logits)):
            row = dict(sampling=sampling, draft=name, **agreement(policy_logits, logits, params, args.keys))
            rows.append(row)
            print(f"| {sampling} | {name} | {row['tv']:.3f} | {row['coupled']:.1%} | {row['argmax']:.1%} |",
                  flush=True)
    print(json.dumps(dict(policy_steps=args.policy_steps, draft_steps=args.draft_steps, positions=len(policy_logits),
                          keys=args.keys, rows=rows)))


def distance(logits: torch.Tensor, policy_logits: torch.Tensor) -> float:
    """Mean absolute logit difference: the table lists drafts from the farthest to the policy itself."""
    return float((logits - policy_logits).abs().mean())


if __name__ == "__main__":
    main()
