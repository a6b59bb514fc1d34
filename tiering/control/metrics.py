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
    ``prometheus_client.CollectorRegistry`` (default: the global one), which
    refuses (ValueError) a second exporter of the same names: close the first, or
    give each controller a registry. ``controller`` may be a ``TieredKV``: its
    controller is exported. ``close()`` unregisters (idempotent).
    """

    def __init__(self, controller: Any, registry: Any = None) -> None:
        prometheus_client = require("prometheus_client", "metrics", "PrometheusExporter")
        core = require("prometheus_client.core", "metrics", "PrometheusExporter")
        CounterMetricFamily, GaugeMetricFamily = core.CounterMetricFamily, core.GaugeMetricFamily
        inner = getattr(controller, "controller", None)
        if inner is not None and callable(getattr(inner, "stats", None)):
            controller = inner  # a TieredKV: its controller's figures, under their own names
        if not callable(getattr(controller, "stats", None)):
            raise TypeError(f"PrometheusExporter needs an object with stats(), got {controller!r}")
        if registry is None:
            registry = prometheus_client.REGISTRY
        if not (callable(getattr(registry, "register", None))
                and callable(getattr(registry, "unregister", None))):
            raise TypeError(f"PrometheusExporter: registry must be a prometheus_client "
                            f"CollectorRegistry (or None: the global one), got {registry!r}")
        self._controller = controller
        self._counter = CounterMetricFamily
        self._gauge = GaugeMetricFamily
        self._registry = registry
        # the names it exports, read once now: the registry refuses a second exporter of
        # the same names (two families of one name make a scrape Prometheus rejects)
        self._described = list(self._families())
        try:
            registry.register(self)
        except ValueError as err:
            raise ValueError(
                f"PrometheusExporter: the registry already exports {PREFIX}* metrics (another "
                "exporter, not closed?); close() it first, or give each controller a registry "
                "of its own") from err
        finally:
            self._described = []
        self._registered = True

    def describe(self) -> list:
        # The names registration checks for duplicates; only while registering, so a
        # later registration of anything else never scrapes the controller.
        return self._described

    def collect(self):
        return self._families()

    def _families(self):
        for key, value in sorted(self._controller.stats().items()):
            if key in COUNTER_KEYS:
                yield self._counter(PREFIX + key, f"eviction controller: {key}", value=value)
            else:
                yield self._gauge(PREFIX + key, f"eviction controller: {key}", value=value)

    def close(self) -> None:
        """Stop exporting (unregister from the registry); a second call does nothing."""
        if self._registered:
            self._registered = False
            self._registry.unregister(self)
