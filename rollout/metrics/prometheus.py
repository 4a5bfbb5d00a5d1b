"""Prometheus exposition of rollout's metrics, with the `prometheus_client` library.

    server = worker.serve_metrics(9400)          # http://127.0.0.1:9400/metrics; host is explicit: never 0.0.0.0
    server.url, server.port; server.close()      # (worker.close() closes it too)

Every scrape takes one fresh snapshot (`worker.metrics()` / `fleet.metrics()`) and renders it through a collector in
a registry of its own (never the process-global one, so several workers in one process each serve their own). Names
are `rollout_<name>` for every metric of rollout/metrics/snapshot.py (counters end in `_total`), labelled by finish_reason or
in_flight where the metric has such a label. A fleet's endpoint serves its totals under the same names (a dashboard
for one worker works for a fleet), its own figures as `rollout_fleet_<name>`, and each live actor's as
`rollout_actor_<name>{actor="<slot>"}` (separate names, so summing a total never counts an actor twice).
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from ..base.errors import check_int, invalid
from .snapshot import (COUNTER, FLEET_METRICS, GAUGE, HISTOGRAM, METRICS, VERSIONS_BEHIND_BUCKETS, FleetMetrics,
                       Histogram, Metric, WorkerMetrics)

PREFIX = "rollout_"
Snapshot = Callable[[], "WorkerMetrics | FleetMetrics"]


class SnapshotCollector(Collector):
    """Renders one snapshot per scrape."""

    def __init__(self, snapshot: Snapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snapshot = self.snapshot()
        if isinstance(snapshot, FleetMetrics):
            yield from families(METRICS, PREFIX, [({}, snapshot.total)])
            yield from families(FLEET_METRICS, PREFIX + "fleet_", [({}, snapshot)])
            yield from families(METRICS, PREFIX + "actor_",
                                [({"actor": str(slot)}, m) for slot, m in sorted(snapshot.actors.items())])
        else:
            yield from families(METRICS, PREFIX, [({}, snapshot)])


def families(metrics: tuple[Metric, ...], prefix: str, sources: list[tuple[dict[str, str], Any]]) -> Iterator[Any]:
    """One metric family per metric, a sample (or one per label value) per source (`extra labels, snapshot`)."""
    extra = list(sources[0][0]) if sources else []
    for metric in metrics:
        labels = extra + ([metric.label] if metric.label else [])
        text = f"{metric.help} ({metric.unit})"
        if metric.kind == COUNTER:
            family = CounterMetricFamily(prefix + metric.name, text, labels=labels)
        elif metric.kind == GAUGE:
            family = GaugeMetricFamily(prefix + metric.name, text, labels=labels)
        else:
            family = HistogramMetricFamily(prefix + metric.name, text, labels=labels)
        for extra_labels, snapshot in sources:
            _add(family, metric, list(extra_labels.values()), getattr(snapshot, metric.name))
        yield family


def _add(family: Any, metric: Metric, label_values: list[str], value: Any) -> None:
    if isinstance(value, Histogram):
        cumulative, buckets = 0, []
        for bound, count in zip(list(value.bounds) + [float("inf")], value.counts):
            cumulative += count
            buckets.append((_le(bound), cumulative))
        family.add_metric(label_values, buckets, value.sum)
    elif value is None:
        family.add_metric(label_values, [("+Inf", 0)], 0.0)
    elif isinstance(value, dict) and metric.kind == HISTOGRAM:  # tokens_by_versions_behind: exact, by version
        buckets = [(_le(bound), sum(n for k, n in value.items() if k <= bound)) for bound in VERSIONS_BEHIND_BUCKETS]
        buckets.append(("+Inf", sum(value.values())))
        family.add_metric(label_values, buckets, float(sum(k * n for k, n in value.items())))
    elif isinstance(value, dict):
        for label, number in value.items():
            family.add_metric(label_values + [str(label)], number)
    else:
        family.add_metric(label_values, value)


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


def _check_address(port: int, host: str) -> None:
    check_int("port", port, 0, "use a free TCP port, or 0 to let the system pick one (server.port says which)",
              maximum=65535)
    if not isinstance(host, str) or not host:
        raise invalid("host", host, "must be an address to listen on", "use '127.0.0.1' (this machine only)")


def _port_error(exc: OSError, port: int, host: str) -> OSError:
    why = exc.strerror or str(exc)
    error = OSError(f"cannot serve metrics on {host} port {port}: {why}. Fix: pick another port (0 lets the system "
                    "choose a free one), or stop what listens there")
    error.errno = exc.errno  # e.g. errno.EADDRINUSE, for callers that test it
    return error


def check_port(port: int, host: str = "127.0.0.1") -> None:
    """Fail now, as MetricsServer would, if `host:port` cannot be listened on (e.g. the port is in use)."""
    _check_address(port, host)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise _port_error(exc, port, host) from None


class MetricsServer:
    """An HTTP endpoint serving `/metrics` (Prometheus text format) on `host:port`, on a daemon thread."""

    def __init__(self, snapshot: Snapshot, port: int, host: str = "127.0.0.1") -> None:
        _check_address(port, host)
        registry = CollectorRegistry(auto_describe=False)
        registry.register(SnapshotCollector(snapshot))
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=registry)
        except OSError as exc:
            raise _port_error(exc, port, host) from None
        self.host, self.port = host, int(self._server.server_port)
        self.closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def __repr__(self) -> str:
        return f"MetricsServer({self.url}{', closed' if self.closed else ''})"


def serve(current: MetricsServer | None, snapshot: Snapshot, port: int, host: str, owner: str) -> MetricsServer:
    """A new endpoint for `owner` ("worker", "fleet"), refused while `current` still serves."""
    if current is not None and not current.closed:
        raise RuntimeError(f"this {owner} already serves its metrics on {current.url}. Fix: scrape that endpoint, or "
                           "close it (server.close()) before serving another")
    return MetricsServer(snapshot, port, host)
