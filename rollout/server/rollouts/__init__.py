"""The rollout side as the server sees it: requests submitted to any `Rollouts`, its rows read back as choices, and
the calls of an episode recorded as the RolloutBatch a trainer takes.

Files: `backend.py` (the rollout side seen from the event loop: one request's `Generation`, streamed or batched),
`choices.py` (rows to choices: stop strings, incremental detokenizing, streaming deltas), `episodes.py`
(EpisodeRecorder: episode recording, segments; EpisodeBatch). May import: `base` and `model` of rollout's folders,
nothing else of the server: no HTTP, no API's shapes (tests/test_layout.py checks it).
"""
