"""The demo scenario: the same requests served twice, with and without memory pressure.

``run_demo`` draws the requests, sizes the tiers, serves the requests once on
a device pool big enough to hold everything (the reference) and once on a
device pool that holds about ``device_fraction`` of the working set, with a
host tier for ``host_fraction`` of it and a disk tier for the rest, then
checks that every request produced the same tokens and bitwise the same final
logits in both runs. The requests share system prompts and continue earlier
conversations; the pressured run reuses cached KV blocks (device, host, disk;
see ``docs/prefix.md``), the reference computes everything, so identical
outputs also prove the reused bytes were the right ones.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from tiering.apps.demo.model import ModelConfig, TinyDecoder
from tiering.apps.demo.worker import (
    DemoWorker,
    RequestOutput,
    StepClock,
    WorkerConfig,
    WorkerResult,
)
from tiering.apps.demo.workload import DemoRequest, conversation_requests, synthetic_requests
from tiering.blocks import KeyRoot
from tiering.control.controller import ControllerConfig
from tiering.control.pressure import PoolPressure
from tiering.policies import default_registry
from tiering.resources.kv_cache import PagedKVCache
from tiering.tiered import TieredKV
from tiering.types import Tier

#: Admission keeps this fraction of the device free below ``high`` (see ControllerConfig).
RELOAD_HEADROOM = 0.02
#: The tightest ``high`` watermark the sizing will pick.
MAX_HIGH = 0.90
#: Gap between the high and low watermarks.
WATERMARK_GAP = 0.15


_DEVICE_NAME = re.compile(r"cpu|cuda(:\d+)?")


def is_device_name(name: object) -> bool:
    """Whether ``name`` names a device the demo runs on: ``cpu``, ``cuda`` or ``cuda:N``."""
    return isinstance(name, str) and _DEVICE_NAME.fullmatch(name) is not None


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"DemoConfig.{name} must be an int >= {minimum}, got {value!r}")
    return value


def _check_number(name: str, value: object) -> float:
    """A finite real number (not a bool); ValueError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"DemoConfig.{name} must be a finite number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class DemoConfig:
    """Everything that shapes a demo run; the defaults are the ``tiering demo`` ones.

    ``device_fraction`` / ``host_fraction``: the share of the whole working
    set (every request's final KV) the device and host tiers hold in the
    pressured run; the disk tier takes the rest. The device pool is grown if
    that share cannot hold the largest request plus one step of growth of a
    full batch. ``batch``, ``prefill_chunk`` and ``quantum`` shape the worker
    (see ``WorkerConfig``). ``disk_chunk_bytes`` is the disk tier's allocation
    unit (small, so that requests of a few MiB waste little). ``policy`` names
    the victim ranking (``tiering.policies.make_policy``). ``settle_each_step``: see
    ``WorkerConfig``. ``min_residency_steps`` and
    ``aging_steps`` are the controller's residency and ageing times, in steps.

    ``workload``: ``conversations`` (requests share ``system_prompts`` system
    prompts of ``system_tokens`` tokens, and continue earlier conversations
    with probability ``continue_p``; ``prompt_tokens`` is then the length of
    a user turn) or ``synthetic`` (independent random prompts). ``prefix``:
    the pressured run reuses cached KV blocks (``attach_prefix`` /
    ``publish_prefix``); the reference never does. ``corrupt_every``: every
    that many steps of the pressured run, until one is detected (at most
    ``max_corruptions``), one value of a cached host block is changed (the
    negative control: the load must detect it and the request recompute).
    The pressured run reloads from host layer by layer; ``compare_readiness``
    serves it once more with whole-request readiness (the same requests and
    tiers) to compare the reload stall. ``long_request`` also serves one request
    several times the device's KV capacity, streamed (``tiering.apps.demo.long``).
    """

    requests: int = 48
    seed: int = 0
    device: str = "cpu"
    model: ModelConfig = field(default_factory=ModelConfig)
    page_tokens: int = 16
    prompt_tokens: tuple[int, int] = (48, 320)
    new_tokens: tuple[int, int] = (8, 24)
    workload: str = "conversations"
    system_prompts: int = 3
    system_tokens: tuple[int, int] = (96, 320)
    continue_p: float = 0.45
    prefix: bool = True
    corrupt_every: int = 40
    max_corruptions: int = 3
    arrival_every: float = 1.0
    batch: int = 4
    prefill_chunk: int = 256
    quantum: int = 8
    device_fraction: float = 0.25
    host_fraction: float = 0.08
    disk: bool = True
    disk_chunk_bytes: int = 1 << 20
    policy: str = "lru"
    settle_each_step: bool = False
    min_residency_steps: float = 2.0
    aging_steps: float = 3.0
    compare_readiness: bool = True
    long_request: bool = True

    def __post_init__(self) -> None:
        for name in ("requests", "page_tokens", "batch", "prefill_chunk", "quantum",
                     "disk_chunk_bytes", "system_prompts"):
            _check_int(name, getattr(self, name), 1)
        for name in ("seed", "corrupt_every", "max_corruptions"):
            _check_int(name, getattr(self, name), 0)
        for name in ("device_fraction", "host_fraction"):
            v = _check_number(name, getattr(self, name))
            if not 0.0 < v <= 1.0:
                raise ValueError(f"DemoConfig.{name} must be in (0, 1], got {v!r}")
        if not 0.0 <= _check_number("continue_p", self.continue_p) <= 1.0:
            raise ValueError(f"DemoConfig.continue_p must be in [0, 1], got {self.continue_p!r}")
        for name in ("min_residency_steps", "aging_steps", "arrival_every"):
            if not _check_number(name, getattr(self, name)) >= 0:
                raise ValueError(f"DemoConfig.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("prompt_tokens", "system_tokens", "new_tokens"):
            lo_hi = getattr(self, name)
            if (
                not isinstance(lo_hi, tuple)
                or len(lo_hi) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in lo_hi)
                or not 1 <= lo_hi[0] <= lo_hi[1]
            ):
                raise ValueError(f"DemoConfig.{name} must be (low, high) ints with "
                                 f"1 <= low <= high, got {lo_hi!r}")
        if self.workload not in ("conversations", "synthetic"):
            raise ValueError(
                f"DemoConfig.workload must be 'conversations' or 'synthetic', got {self.workload!r}"
            )
        for name in ("prefix", "disk", "settle_each_step", "compare_readiness", "long_request"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"DemoConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.model, ModelConfig):
            raise ValueError(
                f"DemoConfig.model must be a ModelConfig, got {type(self.model).__name__}")
        if not is_device_name(self.device):
            raise ValueError(f"DemoConfig.device must be cpu, cuda or cuda:N, got {self.device!r}")
        if not isinstance(self.policy, str) or self.policy not in default_registry():
            raise ValueError(
                f"DemoConfig.policy must be a built-in policy name "
                f"({', '.join(default_registry().names)}), got {self.policy!r}"
            )

    def worker_config(self) -> WorkerConfig:
        return WorkerConfig(
            batch=self.batch, prefill_chunk=self.prefill_chunk, quantum=self.quantum,
            settle_each_step=self.settle_each_step,
        )

    def draw_requests(self) -> list[DemoRequest]:
        if self.workload == "conversations":
            return conversation_requests(
                self.requests, self.seed, self.model.vocab, system_prompts=self.system_prompts,
                system_tokens=self.system_tokens, user_tokens=self.prompt_tokens,
                new_tokens=self.new_tokens, continue_p=self.continue_p,
                arrival_every=self.arrival_every,
            )
        return synthetic_requests(
            self.requests, self.seed, self.model.vocab, self.prompt_tokens, self.new_tokens,
            self.arrival_every,
        )


class TierPlan(NamedTuple):
    """Pool sizes (in pages; the disk in bytes) and watermarks for one run."""

    device_pages: int
    host_pages: int
    disk_bytes: int  # 0: no disk tier
    working_set_pages: int
    high: float
    low: float


def plan_tiers(cfg: DemoConfig, requests: list[DemoRequest], *, pressured: bool) -> TierPlan:
    """Size the tiers for ``requests``.

    Pressured: the device gets ``device_fraction`` of the working set, but
    never less than the largest request plus a full batch's growth in one step
    (else a request could never fit, or a batch could never grow); ``high`` is
    set so that the space above it holds that growth. Reference: the device
    holds twice the working set, so pressure never passes ``high``; the host
    holds one page and there is no disk.
    """
    g = cfg.model.kv_geometry(cfg.page_tokens)
    pages = [g.pages_for(r.kv_tokens) for r in requests]
    total = sum(pages)
    growth = cfg.batch * (g.pages_for(cfg.prefill_chunk) + 1)
    if not pressured:
        return TierPlan(2 * total + growth, 1, 0, total, MAX_HIGH, MAX_HIGH - WATERMARK_GAP)
    floor = math.ceil((max(pages) + growth) / (1.0 - WATERMARK_GAP - RELOAD_HEADROOM))
    device = max(math.ceil(cfg.device_fraction * total), floor)
    high = min(MAX_HIGH, 1.0 - growth / device)
    host = max(1, math.ceil(cfg.host_fraction * total))
    disk = 2 * total * g.page_bytes if cfg.disk else 0
    return TierPlan(device, host, disk, total, high, high - WATERMARK_GAP)


class RunOutcome(NamedTuple):
    """One run: the worker's result, the cache's and the controller's stats, the plan,
    and (prefix reuse only) the block store's counters and the root checks."""

    result: WorkerResult
    kv_stats: dict[str, float]
    controller_stats: dict[str, float]
    plan: TierPlan
    page_bytes: int
    prefix_stats: dict[str, float] | None = None
    corruptions: int = 0
    root_check: dict[str, int] | None = None


def key_root(cfg: DemoConfig, kv: PagedKVCache, model_id: str | None = None) -> KeyRoot:
    """The block keys' root: the geometry, the model (its seed fixes its weights), the cache."""
    g = kv.geometry
    return KeyRoot(g.fingerprint(), model_id or f"tiny-decoder/{cfg.model}/seed={cfg.seed}",
                   resource_fingerprints=(("kv", kv.fingerprint()),), page_tokens=g.page_tokens)


class _Corrupter:
    """The demo's negative control: now and then, one value of a cached host block changes.

    Every ``every`` steps it arms; the next request attached with a host block still
    to load then has one value of that block changed before its load starts, so the
    load must meet it (at most ``most`` times, and no more once one was detected)."""

    def __init__(self, kv: PagedKVCache, every: int, most: int) -> None:
        self.kv, self.every, self.most = kv, every, most
        self.injected = 0
        self._armed = False

    def step(self, step: int) -> None:
        if self.every and step and step % self.every == 0:
            self._armed = True

    def attached(self, rid: str) -> None:
        kv = self.kv
        if not self._armed or self.injected >= self.most:
            return
        if kv.prefix_stats().get("load_corrupt", 0):
            return  # detected once: enough
        r = kv._reqs[rid]
        if r.prefix_load is None or r.load_work is not None:
            return  # nothing to load, or its load has started
        for pos, tier in zip(r.prefix_load.positions, r.prefix_load.tiers, strict=True):
            if tier is Tier.HOST:
                key = r.blocks[pos]
                kv._host[kv._prefix.index.location(key).handle].view(-1)[0] += 1.0
                self.injected += 1
                self._armed = False
                return


def serve(
    cfg: DemoConfig,
    requests: list[DemoRequest],
    plan: TierPlan,
    disk_path: Path | None = None,
    on_token: Callable[[], None] | None = None,
    *,
    prefix: bool = True,
    layerwise: bool = True,
    cache_options: dict[str, Any] | None = None,
) -> RunOutcome:
    """Serve ``requests`` once on tiers sized by ``plan`` (disk under ``disk_path``),
    reusing cached prefixes when ``prefix`` and ``cfg.prefix``; host reloads land
    layer by layer when ``layerwise`` (else each request waits for all its layers).
    ``cache_options``: more keyword options of the ``PagedKVCache`` (a fault hook)."""
    geometry = cfg.model.kv_geometry(cfg.page_tokens)
    disk = None
    if plan.disk_bytes:
        if disk_path is None:
            raise ValueError("the plan has a disk tier but no disk_path was given")
        from tiering.disk import DiskConfig

        disk = DiskConfig(
            path=str(disk_path), capacity_bytes=plan.disk_bytes, chunk_bytes=cfg.disk_chunk_bytes
        )
    torch.manual_seed(cfg.seed)
    model = TinyDecoder(cfg.model, cfg.seed, cfg.device)
    # admitting a step from layer 0 depends on how fast the copy threads are, which
    # settle_each_step rules out: such a run reloads whole requests
    kv = PagedKVCache(geometry, cfg.device, plan.device_pages, plan.host_pages, disk=disk,
                      layerwise_reload=layerwise and not cfg.settle_each_step,
                      **(cache_options or {}))
    reuse = cfg.prefix and prefix
    try:
        corrupter = None
        if reuse:
            kv.enable_prefix_cache(key_root(cfg, kv))
            corrupter = _Corrupter(kv, cfg.corrupt_every, cfg.max_corruptions)
        clock = StepClock()
        # the cache keeps the wall clock (its reload-stall figure is in seconds);
        # the controller counts residency and ageing in steps
        tkv = TieredKV.around(
            kv,
            policy=cfg.policy,
            pressure=PoolPressure,
            controller=ControllerConfig(
                high=plan.high,
                low=plan.low,
                host_high=0.85,
                host_low=0.65,
                min_residency_s=cfg.min_residency_steps,
                reload_headroom=RELOAD_HEADROOM,
                aging_s=cfg.aging_steps,
            ),
            clock=clock,
        )
    except BaseException:
        kv.close()
        raise
    with tkv:
        worker = DemoWorker(
            model, tkv, requests, cfg.worker_config(), clock, on_token=on_token,
            on_step=corrupter.step if corrupter else None,
            on_attach=corrupter.attached if corrupter else None,
        )
        result = worker.run()
        tkv.check_integrity()
        pstats = root_check = None
        if reuse:
            pstats = kv.prefix_stats()
            root_check = _root_check(cfg, kv, worker)
        return RunOutcome(
            result, tkv.stats("kv"), tkv.stats("controller"), plan, geometry.page_bytes,
            pstats, corrupter.injected if corrupter else 0, root_check,
        )


def _root_check(cfg: DemoConfig, kv: PagedKVCache, worker: DemoWorker) -> dict[str, int]:
    """Every request's full prompt looked up in the final cache under the run's root and
    under another model's root (the wrong-root control: it must find nothing)."""
    prompts = worker.full_prompts()
    right = sum(kv.cached_prefix(p).tokens for p in prompts.values())
    kv._prefix.root, saved = key_root(cfg, kv, "another-model").key, kv._prefix.root
    try:
        wrong = sum(kv.cached_prefix(p).tokens for p in prompts.values())
    finally:
        kv._prefix.root = saved
    return {"right_root_cached_tokens": right, "wrong_root_cached_tokens": wrong}


def compare_outputs(
    reference: dict[str, RequestOutput], other: dict[str, RequestOutput]
) -> list[str]:
    """Every difference between two runs' outputs, in words (empty: identical).

    Tokens must be equal and final logits bitwise equal (``torch.equal``).
    """
    problems = []
    for rid in sorted(set(reference) | set(other)):
        a, b = reference.get(rid), other.get(rid)
        if a is None or b is None:
            problems.append(f"{rid}: missing from the {'reference' if a is None else 'other'} run")
            continue
        if a.tokens != b.tokens:
            first = next(
                (i for i, (x, y) in enumerate(zip(a.tokens, b.tokens, strict=False)) if x != y),
                min(len(a.tokens), len(b.tokens)),
            )
            problems.append(f"{rid}: tokens differ from position {first}")
        if not torch.equal(a.final_logits, b.final_logits):
            problems.append(f"{rid}: final logits differ")
    return problems


def summarize(
    cfg: DemoConfig, pressured: RunOutcome, reference: RunOutcome, problems: list[str]
) -> dict[str, Any]:
    """The demo's figures as a JSON-ready dict."""
    r = pressured.result
    s = pressured.kv_stats
    c = r.counters
    pb = pressured.page_bytes
    plan = pressured.plan
    gen = int(c["generated_tokens"])
    return {
        "requests": cfg.requests,
        "seed": cfg.seed,
        "device": cfg.device,
        "steps": int(c["steps"]),
        "prompt_tokens": int(c["prompt_tokens"]),
        "generated_tokens": gen,
        "wall_s": round(r.wall_s, 3),
        "tokens_per_s": round(gen / r.wall_s, 2) if r.wall_s > 0 else None,
        "prompt_tokens_per_s": round(c["prompt_tokens"] / r.wall_s, 1) if r.wall_s > 0 else None,
        "reference_wall_s": round(reference.result.wall_s, 3),
        "reference_tokens_per_s": (
            round(gen / reference.result.wall_s, 2) if reference.result.wall_s > 0 else None
        ),
        "tiers": {
            "working_set_bytes": plan.working_set_pages * pb,
            "device_bytes": plan.device_pages * pb,
            "host_bytes": plan.host_pages * pb,
            "disk_bytes": plan.disk_bytes,
            "high": round(plan.high, 4),
            "low": round(plan.low, 4),
        },
        "offloads": {
            "device_to_host": int(s["offloads_to_host"]),
            "device_to_disk": int(s["offloads_to_disk"]),
            "host_to_disk": int(s["demotions"]),
        },
        "reloads": {
            "from_host": int(s["reloads_from_host"]),
            "from_disk": int(s["reloads_from_disk"]),
        },
        "bytes_moved": {
            "device_to_host": int(s["bytes_device_to_host"]),
            "device_to_disk": int(s["bytes_device_to_disk"]),
            "host_to_disk": int(s["bytes_host_to_disk"]),
            "host_to_device": int(s["bytes_host_to_device"]),
            "disk_to_device": int(s["bytes_disk_to_device"]),
        },
        "reload_stall_s": round(float(s["reload_stall_s_total"]), 4),
        "stalled_steps": int(c["stalled_steps"]),
        "stall_wait_s": round(float(c["stall_wait_s"]), 4),
        "allocation_refusals": int(c["allocation_refusals"]),
        "lost": int(s["lost"]),
        "prefix": _prefix_summary(pressured, reference),
        "identical": not problems,
        "mismatches": problems[:20],
    }


def _prefix_summary(pressured: RunOutcome, reference: RunOutcome) -> dict[str, Any] | None:
    p = pressured.prefix_stats
    if p is None:
        return None
    c = pressured.result.counters
    return {
        "hit_tokens": {t: int(p.get(f"hit_tokens_{t}", 0)) for t in ("device", "host", "disk")},
        "attached_tokens": int(c["prefix_attached_tokens"]),
        "prefill_tokens_saved": int(c["prefix_valid_tokens"]),
        "recomputed_after_corruption": int(c["prefix_recomputed_tokens"]),
        "prompt_tokens_run": int(c["prompt_tokens"]),
        "reference_prompt_tokens_run": int(reference.result.counters["prompt_tokens"]),
        "blocks_published": int(p.get("blocks_published", 0)),
        "blocks_moved": {
            "device_to_host": int(p.get("blocks_device_to_host", 0)),
            "device_to_disk": int(p.get("blocks_device_to_disk", 0)),
            "host_to_disk": int(p.get("blocks_host_to_disk", 0)),
            "host_to_device": int(p.get("blocks_host_to_device", 0)),
            "disk_to_device": int(p.get("blocks_disk_to_device", 0)),
        },
        "disk_block_writes": int(p.get("disk_block_writes", 0)),
        "blocks_evicted": int(p.get("dropped_evicted", 0)),
        "corruptions_injected": pressured.corruptions,
        "corrupt_blocks_detected": int(p.get("load_corrupt", 0)),
        **(pressured.root_check or {}),
    }


class DemoReport(NamedTuple):
    summary: dict[str, Any]
    pressured: RunOutcome
    reference: RunOutcome
    whole: RunOutcome | None = None


def _layerwise_summary(layer: RunOutcome, whole: RunOutcome, problems: list[str]) -> dict[str, Any]:
    """Per-layer against whole-request readiness: the same requests, the same tiers."""
    def side(run: RunOutcome) -> dict[str, Any]:
        s = run.kv_stats
        return {
            "first_layer_s": round(float(s["reload_first_layer_s_total"]), 4),
            "layer_wait_s": round(float(s["layer_wait_s_total"]), 4),
            "stall_s": round(float(s["reload_first_layer_s_total"] + s["layer_wait_s_total"]), 4),
            "admitted_early": int(s["reloads_admitted_early"]),
            "reloads_from_host": int(s["reloads_from_host"]),
            "reloads_from_disk": int(s["reloads_from_disk"]),
            "wall_s": round(run.result.wall_s, 3),
        }

    return {"layer": side(layer), "whole": side(whole), "whole_identical": not problems,
            "whole_mismatches": problems[:5]}


def run_demo(
    cfg: DemoConfig,
    disk_path: Path | None,
    *,
    on_token: Callable[[], None] | None = None,
    on_reference_token: Callable[[], None] | None = None,
) -> DemoReport:
    """Serve ``cfg``'s requests under pressure and without, and compare them."""
    requests = cfg.draw_requests()
    tight = plan_tiers(cfg, requests, pressured=True)
    if cfg.disk and disk_path is None:
        raise ValueError("DemoConfig.disk is on but no disk_path was given")
    pressured = serve(cfg, requests, tight, disk_path, on_token)
    roomy = plan_tiers(cfg, requests, pressured=False)
    reference = serve(cfg, requests, roomy, None, on_reference_token, prefix=False)
    problems = compare_outputs(reference.result.outputs, pressured.result.outputs)
    summary = summarize(cfg, pressured, reference, problems)
    whole = None
    if cfg.compare_readiness:
        whole_dir = None if disk_path is None else disk_path / "whole"
        whole = serve(cfg, requests, tight, whole_dir, layerwise=False)
        whole_problems = compare_outputs(reference.result.outputs, whole.result.outputs)
        summary["layerwise"] = _layerwise_summary(pressured, whole, whole_problems)
        summary["identical"] = summary["identical"] and not whole_problems
    if cfg.long_request:
        from tiering.apps.demo.long import LongConfig, run_long

        long = run_long(LongConfig(seed=cfg.seed, page_tokens=cfg.page_tokens), cfg.model,
                        cfg.device)
        summary["long_request"] = long
        summary["identical"] = summary["identical"] and long["identical"]
    return DemoReport(summary, pressured, reference, whole)
