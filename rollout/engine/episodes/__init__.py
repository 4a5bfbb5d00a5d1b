"""Multi-turn episodes: a sample whose turns alternate with an environment's steps.

- episode.py: `Episode`, the segments and context of one episode;
- driver.py: `EpisodeDriver`, a finished turn's environment step and the next turn's submission;
- stepper.py: the environment steps, off the engine thread.

May import: rollout's `base`, and the engine's `requests` (samples), `sampling` (top lists) and `observe` (counters).
"""
