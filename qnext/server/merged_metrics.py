"""The metrics of N data parallel replicas as one server's (data_parallel.py): each replica keeps its own registry,
its samples labelled engine="i"; the exposition merges them, one family per metric name."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from qnext.server.metrics import ServerMetrics


class MergedMetrics:
    """What the app asks of its metrics: HTTP errors counted (on replica 0's registry), and the exposition."""

    def __init__(self, replicas: list[ServerMetrics]):
        self._replicas = replicas

    def count_error(self, status: int) -> None:
        self._replicas[0].count_error(status)

    def render(self) -> bytes:
        registry = CollectorRegistry()
        registry.register(MergedCollector([m.registry for m in self._replicas]))
        return generate_latest(registry)


class MergedCollector:
    def __init__(self, registries: list[CollectorRegistry]):
        self._registries = registries

    def collect(self):
        merged: dict[str, Metric] = {}
        for registry in self._registries:
            for family in registry.collect():
                if family.name not in merged:
                    merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                merged[family.name].samples.extend(family.samples)
        yield from merged.values()
