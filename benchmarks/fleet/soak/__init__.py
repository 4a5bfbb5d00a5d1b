"""The chaos soak's parts (benchmarks/fleet/chaos.py runs them), one concept per module:

- schedule.py: the fault schedule, drawn from the seed alone (what, when, against which target).
- history.py: the recorded history (every call: what was sent, its seed and versions, rows or the error; every
  fault and weight update; resource samples and the end-state probes) and its JSON form: the only thing the driver
  and the checker share.
- envs.py: the environments the episodes run (healthy, raising, hanging, answering garbage); picklable for Ray.
- weights.py: the weights of every policy version, derived from the seed (the driver applies them, the checker keeps
  its own copies from the same rule and compares the fingerprints the history recorded).
- driver.py: starts a 2-node local Ray cluster with a RolloutFleet and a RolloutWorker behind `rollout.serve`, runs
  the traffic (traffic.py) and injects the faults (faults.py) at their times, then records the end state.
- checker.py: reads the history (never the driver's objects) and checks every promise; replay.py re-runs seeded
  rows without faults.
- report.py: faults by kind, calls and rows, retries, recovery times, what was verified, violations; JSON last.
"""
