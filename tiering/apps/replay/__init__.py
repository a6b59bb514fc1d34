"""Trace replay: a simulated serving worker driven by production request traces.

``tiering replay TRACE --out DIR ...`` (see ``tiering.apps.replay.cli``) replays a
trace through the real ``EvictionController`` and policies over a modeled KV
cache, next to the ``recompute`` and ``no-tiering`` baselines, and reports
throughput, latency, moves per tier and prefix reuse. The pieces:
``traces`` (loaders), ``presets`` (models, hardware, step time), ``model_kv``
(the modeled cache), ``block_tiers`` (cached prefix blocks in every tier on the
block index, under the block policies), ``bounds`` (infinite cache, Belady), ``config`` and ``results`` (what a run takes and gives),
``simulator`` (the worker), ``metrics``, ``sweep``, ``cli`` and ``real_kv``
(a real cache as the backend).
"""

from tiering.apps.replay.cli import main

__all__ = ["main"]
