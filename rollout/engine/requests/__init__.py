"""What the engine tracks of accepted work until each sample comes back exactly once.

- call.py: `Call` (one generate call) and `Sample` (one sample of one prompt, or an episode);
- inflight.py: `Requests`, what is in flight (pending samples, re-runs, prompt counts);
- ledger.py: each request's row spec, logprobs, versions and top lists as they are sampled.

May import: rollout's `base`, and the engine's `sampling` (row specs, top lists) and `upstream` (the child id
separator). The episodes room drives samples; a Sample names its `Episode` as a type only.
"""
