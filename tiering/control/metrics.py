"""Prometheus export of the eviction controller's ``stats()``.

``prometheus_client`` is an optional extra (``pip install 'tiering[metrics]'``);
it is imported only when an exporter is made.
"""

from __future__ import annotations

from typing import Any

from tiering._optional import require
from tiering.control.stats import COUNTER_KEYS

PREFIX = "tiering_controller_"


class PrometheusExporter:
    """Exposes a controller's ``stats()`` on a Prometheus registry.

    Each scrape calls ``controller.stats()`` once: counters (offloads, bytes
    moved per link, ...) become ``tiering_controller_<key>_total``; figures of
    the moment (waiting reloads, reserved bytes, ...) become gauges
    ``tiering_controller_<key>``. ``registry``: a
    ``prometheus_client.CollectorRegistry`` (default: the global one).
    ``close()`` unregisters.
    """

    def __init__(self, controller: Any, registry: Any = None) -> None:
        prometheus_client = require("prometheus_client", "metrics", "PrometheusExporter")
        core = require("prometheus_client.core", "metrics", "PrometheusExporter")
        CounterMetricFamily, GaugeMetricFamily = core.CounterMetricFamily, core.GaugeMetricFamily
        if not callable(getattr(controller, "stats", None)):
            raise TypeError(f"PrometheusExporter needs an object with stats(), got {controller!r}")
        self._controller = controller
        self._counter = CounterMetricFamily
        self._gauge = GaugeMetricFamily
        self._registry = registry if registry is not None else prometheus_client.REGISTRY
        self._registry.register(self)

    def describe(self) -> list:
        # Nothing up front: metric names come from stats() at scrape time, and an
        # empty description keeps registration from scraping the controller.
        return []

    def collect(self):
        for key, value in sorted(self._controller.stats().items()):
            if key in COUNTER_KEYS:
                yield self._counter(PREFIX + key, f"eviction controller: {key}", value=value)
            else:
                yield self._gauge(PREFIX + key, f"eviction controller: {key}", value=value)

    def close(self) -> None:
        """Stop exporting (unregister from the registry)."""
        self._registry.unregister(self)
