"""What the engine counts and records as it runs, for metrics and for replay.

- counters.py: tokens, rows, KV peak, soft resets and weight switches (what `RolloutWorker.metrics()` reports);
- trace.py: `TurnTrace`, the timing of episodes' turns;
- recorder.py: MoE routing recorded per position (WorkerConfig.record_routing), kept with the prefix cache.

May import: rollout's `base` and `moe`, and the engine's `upstream` (page counts, the child id separator).
"""
