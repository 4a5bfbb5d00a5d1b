"""How every row of a step draws its token: exact, per-row parameters, on the device.

- sampler.py: `sample_rows`, temperature / min-p / top-k / top-p and both logprobs from one set of logits, drawn by
  inverse CDF from each row's counter-based uniform (streams.py);
- slots.py: the per-request parameter table on the device; penalties.py: penalties, logit bias, min_new_tokens;
  grammar.py: constrained rows' masks (xgrammar);
- step.py: `StepSampler`, the engine's side of upstream's model-runner step (the slots written into the step's
  inputs, the step's typed `StepChoice`, the forward's kernel contexts, the read-back's columns).

May import: rollout's `base`, and the engine's `upstream` (a request's history).
"""
