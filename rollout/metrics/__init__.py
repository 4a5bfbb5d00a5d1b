"""Observability: `snapshot.py` (the metrics' one list of names, kinds, units and meanings; WorkerMetrics and
FleetMetrics snapshots), `prometheus.py` (their exposition and the HTTP endpoint, imported when served). May import:
rollout.base and prometheus_client (tests/test_layout.py checks it).
"""

from .snapshot import COUNTER, FLEET_METRICS, GAUGE, METRICS, FleetMetrics, Metric, WorkerMetrics, fleet_total

__all__ = ["COUNTER", "FLEET_METRICS", "GAUGE", "METRICS", "FleetMetrics", "Metric", "WorkerMetrics", "fleet_total"]
