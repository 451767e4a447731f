"""Prometheus metrics of a running server (`h5replay serve --metrics-port P`).

prometheus-client is an optional extra (`pip install h5replay[metrics]`): the service runs
without it. Counters and gauges are read from the service's own figures at scrape time (no
second copy to keep in step); request latency is a histogram the writer loop feeds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from h5replay.errors import ConfigError
from h5replay.sampling import described_tables

__all__ = ["Metrics"]

_COUNTERS = {
    "rows_in": "rows received from actors",
    "bytes_in": "bytes of rows received from actors",
    "commits": "episodes committed",
    "aborts": "segments aborted",
    "requests": "requests served by the writer",
    "errors": "requests refused with an error reply",
    "read_requests": "requests served by the reader processes",
    "rows_out": "rows sent to learners (not those a learner on the file's host draws itself)",
    "rows_sampled": "rows drawn for learners by the writer and the readers (of rows_out)",
}
_GAUGES = {
    "open_segments": "segments being streamed",
    "clients": "clients known to the writer",
    "length": "rows held",
    "num_episodes": "complete episodes held",
    "file_bytes": "size of the HDF5 file",
}

# Each table's figures (`table.<name>.<figure>` of the service's), labelled by table.
_TABLE_COUNTERS = {
    "sampled": ("table_sampled_rows", "rows the table handed out (what its rate limit counts)"),
    "priority_updates": ("table_priority_updates", "priority updates the table applied"),
}
_TABLE_GAUGES = {"sampleable": ("table_sampleable_rows", "rows the table may still hand out")}


def _table_families(figures: dict[str, Any], counter: Any, gauge: Any) -> Iterator[Any]:
    """One family per table figure, a sample per table (label `table`)."""
    names = described_tables(figures)
    for kinds, family in ((_TABLE_COUNTERS, counter), (_TABLE_GAUGES, gauge)):
        for figure, (name, doc) in kinds.items():
            metric = family(f"h5replay_{name}", doc, labels=["table"])
            for table in names:
                value = figures.get(f"table.{table}.{figure}")
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    metric.add_metric([table], float(value))
            yield metric


class Metrics:
    """Serves /metrics over HTTP from a daemon thread; `observe` records a request's latency."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], port: int, address: str = "127.0.0.1") -> None:
        try:
            import prometheus_client
            from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        except ImportError as exc:
            raise ConfigError("--metrics-port needs prometheus-client: pip install 'h5replay[metrics]'") from exc
        self._registry = prometheus_client.CollectorRegistry()

        class _Figures:
            def collect(self) -> Iterator[Any]:
                figures = snapshot()
                for name, doc in _COUNTERS.items():
                    yield CounterMetricFamily(f"h5replay_{name}", doc, value=float(figures.get(name, 0) or 0))
                for name, doc in _GAUGES.items():
                    yield GaugeMetricFamily(f"h5replay_{name}", doc, value=float(figures.get(name, 0) or 0))
                yield from _table_families(figures, CounterMetricFamily, GaugeMetricFamily)

        self._registry.register(_Figures())
        self._latency = prometheus_client.Histogram(
            "h5replay_request_seconds", "time to serve a request in the writer, by kind", ["kind"],
            registry=self._registry,
            buckets=(0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0),
        )
        self._server, self._thread = prometheus_client.start_http_server(port, addr=address, registry=self._registry)

    def observe(self, kind: str, seconds: float) -> None:
        self._latency.labels(kind).observe(seconds)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
