"""Speculative decoding: drafts verified in the step that would have sampled them, changing the cost and never a
token.

- speculator.py: `Speculator`, the engine's side (which rows draft, how many, whether drafting pays);
- drafts.py: draft sources by n-gram lookup (the row's context, earlier rows of its prompt);
  draft_model.py: a draft model's tokens;
- verifier.py: `Verifier`, the verify step's plan, acceptance and rollback, which upstream's scheduler, runner and
  processor call (handed in at construction).

May import: rollout's `base`, and the engine's `sampling` (the sampler the draft model shares) and `upstream` (request
states, the pages a rollback frees).
"""
