"""Re-scoring: teacher-forced logprobs of stored rollouts, under the sampling policy and under another model.

    python examples/rescoring.py

1. A RolloutWorker generates completions; each row carries its logprobs.
2. `rollout.score` recomputes them from the stored token ids: they match (the exactness check a trainer relies on).
3. The same completions scored under a second model (here: the policy after some noise on its weights) give the
   per-token log-ratio, i.e. an estimate of KL(policy || other): what a reference-KL penalty or an off-policy
   correction needs, without generating again.
"""

import copy
import tempfile

import torch

from rollout import RolloutWorker, SamplingParams, WorkerConfig, score
from rollout.testing import build_tiny_model, load_tiny_model


def main() -> None:
    policy, tokenizer = load_tiny_model(build_tiny_model(tempfile.mkdtemp() + "/tiny"))
    prompts = ["the cat is", "one plus two equals", "how many apples"]
    with RolloutWorker(policy, WorkerConfig(), tokenizer=tokenizer) as worker:
        batch = worker.generate(prompts, SamplingParams(n=4, temperature=0.8, max_new_tokens=12))

    completions = batch.completion_token_lists()
    rescored = score(policy, batch.prompt_ids, completions, temperature=0.8)
    gap = max(float((r - batch.logprobs[i, : len(r)]).abs().max()) for i, r in enumerate(rescored))
    print(f"{len(batch)} rows, {batch.num_tokens} tokens; max |rollout - rescored| logprob: {gap:.2e}")

    other = copy.deepcopy(policy)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.02 * torch.randn_like(p))
    other_lp = score(other, batch.prompt_ids, completions, temperature=0.8)
    log_ratio = torch.cat([a - b for a, b in zip(rescored, other_lp)])
    print(f"KL(policy || perturbed) ~ {float(log_ratio.mean()):.4f} nats/token (k1 estimate, "
          f"{log_ratio.numel()} samples)")
    for text, lp in list(zip(batch.completion_texts(), rescored))[:3]:
        print(f"  {text!r:40.40} sum logprob {float(lp.sum()):8.3f}")


if __name__ == "__main__":
    main()
