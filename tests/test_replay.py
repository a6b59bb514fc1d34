"""Trace replay: loaders, the modeled cache, the simulated worker, metrics, sweep and CLI."""

from __future__ import annotations

import csv
import json
import math
import random
from collections import Counter
from datetime import datetime, timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import conversation_trace
from tiering.resources.engine_types import ResourceReqConfig
from tiering.resources.kv_cache import PagedKVCache
from tiering.resources.kv_geometry import KVGeometry

from tiering.apps.replay import main as replay_main
from tiering.apps.replay.metrics import percentile, summarize
from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.presets import (
    HardwarePreset,
    ModelPreset,
    StepCost,
    get_hardware,
    get_model,
)
from tiering.apps.replay.real_kv import SynchronizedKV
from tiering.apps.replay.simulator import RunSpec, SimClock, SimConfig, simulate
from tiering.apps.replay.traces import TraceFormatError, TraceRequest, detect_format, load_trace
from tiering.control.controller import ControllerConfig
from tiering.types import IllegalTransition, Move, RequestState, Tier, TransferResult

TRACES = Path(__file__).resolve().parent.parent / "benchmarks" / "traces"
MOONCAKE = TRACES / "mooncake" / "conversation_trace.jsonl"
AZURE = TRACES / "azure2023" / "AzureLLMInferenceTrace_code.csv"
POLICIES = ("lru", "priority", "largest", "cost")
COST = StepCost(get_model("llama-3.1-8b"), get_hardware("small"))


# -- loaders ---------------------------------------------------------------------------


def _random_rows(rng: random.Random, n: int) -> list[tuple[int, int, int, list[int]]]:
    """(timestamp ms, input, output, hash ids), in a shuffled arrival order."""
    rows = []
    for _ in range(n):
        n_in = rng.randint(1, 5000)
        ids = [rng.randint(0, 10_000) for _ in range(-(-n_in // 512))]
        rows.append((rng.randint(0, 3_600_000), n_in, rng.randint(0, 900), ids))
    return rows


def test_mooncake_loader_sorts_rebases_and_keeps_hash_ids(tmp_path):
    rng = random.Random(11)
    rows = _random_rows(rng, 40)
    path = tmp_path / "t.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
        for t, i, o, h in rows
    ))
    got = load_trace(path)
    assert detect_format(path) == "mooncake"
    want = sorted(rows, key=lambda r: r[0])
    t0 = want[0][0]
    assert [(r.input_tokens, r.output_tokens, r.hash_ids) for r in got] == [
        (i, o, tuple(h)) for _, i, o, h in want
    ]
    assert [r.arrival_s for r in got] == pytest.approx([(t - t0) / 1000 for t, *_ in want])
    with pytest.raises(Exception):  # noqa: B017 - frozen dataclass
        got[0].input_tokens = 5  # type: ignore[misc]
    assert len(load_trace(path, limit=7)) == 7


def test_azure_loader_reads_datetimes(tmp_path):
    rng = random.Random(12)
    base = datetime(2023, 11, 16, 18, 17, 3, 979960)
    offsets = sorted(rng.uniform(0, 3000) for _ in range(25))
    sizes = [(rng.randint(1, 8000), rng.randint(0, 400)) for _ in offsets]
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for off, (i, o) in zip(offsets, sizes, strict=True):
        stamp = (base + timedelta(seconds=off)).strftime("%Y-%m-%d %H:%M:%S.%f") + "0"
        lines.append(f"{stamp},{i},{o}")
    path = tmp_path / "azure.csv"
    path.write_text("\n".join(lines) + "\n")
    got = load_trace(path)
    assert detect_format(path) == "azure"
    assert [(r.input_tokens, r.output_tokens) for r in got] == sizes
    assert [r.arrival_s for r in got] == pytest.approx([o - offsets[0] for o in offsets],
                                                       abs=1e-5)
    assert all(r.hash_ids == () for r in got)


def test_burstgpt_loader(tmp_path):
    rng = random.Random(13)
    rows = [(rng.uniform(0, 500), rng.randint(1, 3000), rng.randint(0, 700)) for _ in range(30)]
    lines = ["Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type"]
    lines += [f"{t:.3f},ChatGPT,{i},{o},{i + o},Conversation log" for t, i, o in rows]
    path = tmp_path / "burst.csv"
    path.write_text("\n".join(lines) + "\n")
    got = load_trace(path)
    assert detect_format(path) == "burstgpt"
    want = sorted(rows, key=lambda r: round(r[0], 3))
    assert [(r.input_tokens, r.output_tokens) for r in got] == [(i, o) for _, i, o in want]
    assert got[0].arrival_s == 0.0
    assert got[-1].arrival_s == pytest.approx(round(want[-1][0], 3) - round(want[0][0], 3))


@pytest.mark.parametrize(
    ("name", "text", "lineno", "what"),
    [
        ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
                      '{"timestamp": 3, "input_length": 7, "output_length": 2}\n'
                      '{"timestamp": 9, "input_length": 7, "output_len\n', 3, "JSON"),
        ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1}\n'
                      '{"timestamp": 4, "input_length": -3, "output_length": 1}\n', 2,
         "input_length"),
        ("bad.jsonl", '{"timestamp": 0, "input_length": 5, "output_length": 1,'
                      ' "hash_ids": [1, "x"]}\n', 1, "hash_ids"),
        ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:03.1,10,2\n2023-11-16 18:17:04.2,11,2\n"
                    "2023-11-16 18:17:05.3,twelve,2\n", 4, "ContextTokens"),
        ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nnot-a-date,10,2\n", 2,
         "TIMESTAMP"),
        ("bad.csv", "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                    "1.5,ChatGPT,10,3,13,Conversation log\n2.5,ChatGPT\n", 3, "fields"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, name, text, lineno, what):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    assert f"{path}:{lineno}:" in str(err.value)
    assert what in str(err.value)


def test_format_detection_and_override(tmp_path):
    path = tmp_path / "trace.txt"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n')
    with pytest.raises(TraceFormatError, match="extension"):
        load_trace(path)
    assert load_trace(path, "mooncake")[0].input_tokens == 5
    odd = tmp_path / "odd.csv"
    odd.write_text("a,b,c\n1,2,3\n")
    with pytest.raises(TraceFormatError, match=r"odd\.csv:1: header"):
        load_trace(odd)
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(path, "nope")


def test_stored_traces_load():
    conv = load_trace(MOONCAKE)
    assert len(conv) == 12031
    assert all(r.hash_ids and r.hash_ids[0] == 0 for r in conv[:200])
    assert 3000 < conv[-1].arrival_s < 3700
    code = load_trace(AZURE)
    assert len(code) == 8819
    assert 3000 < code[-1].arrival_s < 3700


# -- presets and the modeled cache ---------------------------------------------------------


def test_presets_bytes_per_token():
    assert get_model("llama-3.1-8b").kv_bytes_per_token == 128 * 1024
    assert get_model("llama-3.1-70b").kv_bytes_per_token == 320 * 1024
    with pytest.raises(ValueError, match="unknown hardware preset 'h300'"):
        get_hardware("h300")
    with pytest.raises(ValueError, match="d2h_bps"):
        HardwarePreset("x", 1, 0, 0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0)


def test_modeled_cache_transfers_take_link_time():
    clock = SimClock()
    kv = ModeledKVCache(100, 10, 10, 10, 10, LinkRates(1000.0, 500.0, 200.0, 400.0), clock)
    kv.ingest_request("a")
    kv.ingest_request("b")
    assert kv.allocate("a", 35) and kv.allocate("b", 20)  # 4 + 2 pages of 1000 bytes
    assert not kv.allocate("b", 80)  # 8 pages would make 12 > 10
    assert kv.offload("a") == 4000
    assert kv.offload("b") == 2000
    assert kv.state_of("a") is RequestState.OFFLOADING
    assert kv.next_completion() == pytest.approx(4.0)  # 4000 bytes at 1000 B/s
    clock.now = 3.9
    assert kv.poll() == []
    kv.check_integrity()
    clock.now = 6.0  # b queued behind a on d2h: done at 6.0
    assert kv.poll() == [
        TransferResult("a", Move.OFFLOAD_TO_HOST, True, 4000, RequestState.ON_HOST),
        TransferResult("b", Move.OFFLOAD_TO_HOST, True, 2000, RequestState.ON_HOST),
    ]
    assert kv.poll() == []  # each completion is reported once
    kv.check_integrity()
    assert kv.tier_of("a") is Tier.HOST and kv.device_used_bytes() == 0
    assert kv.reload("a")
    assert kv.next_completion() == pytest.approx(6.0 + 4000 / 500)
    assert kv.demote("b")
    clock.now = 20.0
    assert kv.poll() == [  # a lands at 14.0, b's 2000 bytes at 200 B/s at 16.0
        TransferResult("a", Move.RELOAD_FROM_HOST, True, 4000, RequestState.RESIDENT),
        TransferResult("b", Move.DEMOTE, True, 2000, RequestState.ON_DISK),
    ]
    assert kv.state_of("a") is RequestState.RESIDENT and kv.state_of("b") is RequestState.ON_DISK
    assert kv.stats.bytes_d2h == 6000 and kv.stats.bytes_h2d == 4000
    assert kv.stats.bytes_disk_write == 2000
    kv.check_integrity()
    with pytest.raises(IllegalTransition, match="'a' is resident"):
        kv.reload("a")


def test_modeled_poll_reports_a_removed_requests_transfer_once():
    clock = SimClock()
    rng = random.Random(5)
    kv = ModeledKVCache(100, 10, 10, 10, 10, LinkRates(1000.0, 500.0, 200.0, 400.0), clock)
    tokens = rng.randint(11, 40)
    kv.ingest_request("a")
    assert kv.allocate("a", tokens)
    nbytes = kv.offload("a")
    kv.remove_request("a")
    kv.check_integrity()
    assert kv.device_used_bytes() == kv.host_used_bytes() == 0
    clock.now = 100.0
    got = kv.poll()
    assert got == [TransferResult("a", Move.OFFLOAD_TO_HOST, False, nbytes, None,
                                  "request removed during the copy")]
    assert kv.poll() == []
    kv.check_integrity()


def test_modeled_cache_offers_nothing_when_no_tier_below_has_room():
    kv = ModeledKVCache(10, 4, 8, 2, 0, LinkRates.instant(), SimClock())
    kv.ingest_request("big")
    kv.ingest_request("small")
    assert kv.allocate("big", 12) and kv.allocate("small", 5)  # 3 and 2 pages
    assert kv.reclaimable("big") == 0  # the host has 2 pages, no disk
    assert kv.offload("big") == 0 and kv.state_of("big") is RequestState.RESIDENT
    assert kv.reclaimable("small") == 2 * 40
    assert kv.offload("small") == 80
    assert kv.reclaimable("small") == 0  # in flight
    kv.poll()
    assert kv.host_used_bytes() == 80 and kv.device_used_bytes() == 120
    kv.check_integrity()
    rids = ["big", "small"]
    assert kv.reclaimable_many(rids).tolist() == [kv.reclaimable(r) for r in rids]


def test_modeled_cache_bulk_answers_match_single_ones():
    rng = random.Random(7)
    clock = SimClock()
    kv = ModeledKVCache(10, 4, 60, 12, 9, LinkRates(50.0, 50.0, 20.0, 20.0), clock)
    rids = [f"q{i}" for i in range(20)]
    for rid in rids:
        kv.ingest_request(rid, ResourceReqConfig(retention_priority=rng.uniform(0, 100)))
        kv.allocate(rid, rng.randint(0, 12))
    for rid in rng.sample(rids, 8):
        if kv.reclaimable(rid):
            kv.offload(rid)
    clock.now = 1.0
    kv.poll()
    assert kv.reclaimable_many(rids).tolist() == [kv.reclaimable(r) for r in rids]
    assert kv.get_offload_priority_many(rids).tolist() == pytest.approx(
        [kv.get_offload_priority(r) for r in rids])
    with pytest.raises(KeyError, match="'nope'"):
        kv.reclaimable_many(["q1", "nope"])


# -- the simulated worker ----------------------------------------------------------------------


class CheckedKV(ModeledKVCache):
    """A modeled cache that checks its own ledger at every poll (every safe point); counts
    its checks per instance."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.checks = 0

    def poll(self) -> list:
        done = super().poll()
        self.check_integrity()
        self.checks += 1
        return done


def _checked_factory(device_pages, host_pages, disk_pages, rates=None, sim=None):
    page_tokens = (sim or SimConfig()).page_tokens

    def factory(clock):
        return CheckedKV(COST.model.kv_bytes_per_token, page_tokens, device_pages, host_pages,
                         disk_pages, rates or LinkRates(2e9, 2e9, 5e8, 1e9), clock)

    return factory


SMALL_SIM = SimConfig(max_batch=16, max_step_tokens=1024, page_tokens=16, block_tokens=64)


@pytest.mark.parametrize("policy", POLICIES)
def test_tiering_conserves_bytes_and_finishes_everything(policy):
    trace = conversation_trace(21, 120)
    caches = []

    def factory(clock):
        kv = _checked_factory(160, 120, 400, sim=SMALL_SIM)(clock)
        caches.append(kv)
        return kv

    res = simulate(trace, COST, RunSpec("tiering", policy), SMALL_SIM, kv_factory=factory,
                   check=True)
    kv = caches[0]
    assert kv.checks > 100
    assert all(r.status == "finished" and r.finish_s >= r.first_token_s >= r.arrival_s
               for r in res.requests)
    st = kv.stats
    assert st.max_device_pages <= 160 and st.max_host_pages <= 120 and st.max_disk_pages <= 400
    m = summarize(res)
    # the tiers were really used, by live requests and by cached blocks (an offload finds
    # room on the host by sending cached host blocks to disk, as in the cache, so here no
    # live request goes straight to disk)
    assert st.offloads_to_host > 0
    assert m["block_moves_host"] > 0 and m["block_moves_disk"] > 0 and m["block_drops"] > 0
    assert m["token_hit_rate_host"] > 0 and m["token_hit_rate_disk"] > 0
    kv.check_integrity()
    # no request is left, only cached blocks, and their pages are all the cache holds
    assert not kv._reqs
    assert sum(kv.block_pages(t) for t in Tier) == sum(kv._used) > 0
    assert m["finished"] == len(trace) and m["rejected"] == 0
    assert m["offloads_to_host"] == st.offloads_to_host


def test_a_request_whose_loads_land_short_of_room_waits_again_and_finishes(monkeypatch):
    """As on the cache, a request with host or disk hits takes its own pages once its loads
    have landed; when the device has no room for them then, its KV is freed and it waits
    again, first in line. The books stay sound after every round and every request
    finishes; the path really ran."""
    from tiering.apps.replay import simulator

    real = simulator._Worker._requeue
    requeued: list[str] = []

    def counting(self, r):
        requeued.append(r.rid)
        real(self, r)
        assert r.rid not in self.kv and r.phase == simulator.WAITING and not r.blocks

    monkeypatch.setattr(simulator._Worker, "_requeue", counting)
    res = simulate(conversation_trace(21, 200), COST, RunSpec("tiering", "lru"), SMALL_SIM,
                   kv_factory=_checked_factory(160, 120, 400, sim=SMALL_SIM), check=True)
    assert requeued
    assert all(r.status == "finished" for r in res.requests)


@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "16"])
def test_a_bad_disk_batch_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="SimConfig.disk_batch_blocks must be an int >= 1"):
        SimConfig(disk_batch_blocks=bad)


def test_a_request_too_large_for_the_device_is_rejected():
    trace = [TraceRequest(0.0, 500, 10), TraceRequest(0.1, 5000, 10), TraceRequest(0.2, 300, 5)]
    res = simulate(trace, COST, RunSpec("tiering", "lru"), SMALL_SIM,
                   kv_factory=_checked_factory(100, 50, 0, sim=SMALL_SIM))
    assert [r.status for r in res.requests] == ["finished", "rejected", "finished"]


@pytest.mark.parametrize("mode", ["recompute", "no-tiering"])
def test_baselines_run_and_finish(mode):
    trace = conversation_trace(22, 100, shared=0.3)
    res = simulate(trace, COST, RunSpec(mode), SMALL_SIM,
                   kv_factory=_checked_factory(120, 0, 0, sim=SMALL_SIM))
    m = summarize(res)
    assert m["finished"] == len(trace)
    assert m["offloads_to_host"] == m["offloads_to_disk"] == m["reloads_from_host"] == 0
    # no controller: the only moves are drops of cached blocks (no tier below)
    assert {d.kind for d in res.decisions} == {"block-drop"} and m["block_moves_host"] == 0
    if mode == "no-tiering":
        assert m["preemptions"] == 0 and m["recomputed_tokens"] == 0
    else:
        assert m["preemptions"] > 0 and m["recomputed_tokens"] > 0


@pytest.mark.parametrize("disk_pages", [200, 0], ids=["disk", "no-disk"])
def test_without_a_host_tier_cached_blocks_go_straight_to_the_disk(disk_pages):
    """As in the cache: a device block the host cannot take (there is none) goes straight
    to the disk when the disk's policy admits it, and B's prefix is found there; they
    were dropped. With no disk either (the control) they are dropped and B finds nothing."""
    sim = SimConfig(page_tokens=16, block_tokens=16, block_policy="lru")
    res = simulate(_prefix_trace(0.5), COST, RunSpec("tiering", "lru"), sim,
                   kv_factory=_checked_factory(120, 0, disk_pages, sim=sim))
    b = res.requests[-1]
    kinds = Counter(d.kind for d in res.decisions)
    assert kinds["block-host"] == 0
    if disk_pages:
        assert b.prefix_tier == "disk" and b.reused_tokens == 320
        assert kinds["block-disk"] == 20 and kinds["block-drop"] == 0
    else:
        assert b.prefix_tier is None and b.reused_tokens == 0
        assert kinds["block-drop"] > 0 and kinds["block-disk"] == 0


def test_tiering_preempts_offloads_and_reloads_without_recomputing():
    trace = conversation_trace(23, 100, shared=0.0)
    res = simulate(trace, COST, RunSpec("tiering", "lru"), SMALL_SIM,
                   kv_factory=_checked_factory(120, 600, 0, sim=SMALL_SIM))
    m = summarize(res)
    kinds = Counter(d.kind for d in res.decisions)
    assert m["preemptions"] > 0 and kinds["offload"] > 0 and kinds["reload"] > 0
    assert m["reloads_from_host"] == kinds["reload"]
    assert m["recomputed_tokens"] == 0
    assert m["reload_stall_s"] > 0


def _prefix_trace(gap_s: float) -> list[TraceRequest]:
    """A: 20 blocks; C1-C3: unrelated requests (no block ids) live at once, filling the
    device, so A's retained prefix must make room: all of it goes a tier down (cached
    blocks leave only for room, as in the cache); B: A's 20 blocks plus two of its own."""
    a = TraceRequest(0.0, 320, 2, tuple(range(20)))
    cs = [TraceRequest(1.0, 632, 2) for _ in range(3)]
    b = TraceRequest(1.0 + gap_s, 352, 2, tuple(range(20)) + (500, 501))
    return [a, *cs, b]


@pytest.mark.parametrize(("host_pages", "disk_pages", "tier"), [(200, 0, "host"),
                                                                 (1, 200, "disk")])
def test_prefix_reuse_hits_the_tier_that_holds_it(host_pages, disk_pages, tier):
    # lru admits every block (this test is about where they are, not which are kept); a
    # block reaches the disk through the host, as in the cache (a one-page host passes
    # A's blocks on)
    sim = SimConfig(page_tokens=16, block_tokens=16, block_policy="lru")
    res = simulate(_prefix_trace(0.5), COST, RunSpec("tiering", "lru"), sim,
                   kv_factory=_checked_factory(120, host_pages, disk_pages, sim=sim))
    a, *cs, b = res.requests
    assert a.prefix_tier is None and all(c.prefix_tier is None for c in cs)
    assert b.prefix_tier == tier and b.reused_tokens == 320
    m = summarize(res)
    # A and B look up a prefix (C1-C3 have no block ids); B's is all on ``tier``
    assert m[f"hit_rate_{tier}"] == pytest.approx(1 / 2)
    assert m["miss_rate"] == pytest.approx(1 / 2)
    assert m["token_hit_rate"] == pytest.approx(320 / (320 + 352))
    assert m["prefix_load_stall_s"] > 0
    assert m["bytes_h2d"] >= 320 * COST.model.kv_bytes_per_token


def test_prefix_reuse_on_device_skips_prefill():
    sim = SimConfig(page_tokens=16, block_tokens=16)
    trace = [TraceRequest(0.0, 320, 2, tuple(range(20))),
             TraceRequest(1.0, 352, 2, tuple(range(20)) + (500, 501))]
    factory = _checked_factory(400, 0, 0, sim=sim)
    hit = simulate(trace, COST, RunSpec("tiering", "lru"), sim, kv_factory=factory)
    cold = simulate(trace, COST, RunSpec("tiering", "lru"),
                    SimConfig(page_tokens=16, block_tokens=16, prefix_reuse=False),
                    kv_factory=factory)
    assert hit.requests[1].prefix_tier == "device" and hit.requests[1].reused_tokens == 320
    assert cold.requests[1].prefix_tier is None
    ttft_hit = hit.requests[1].first_token_s - hit.requests[1].arrival_s
    ttft_cold = cold.requests[1].first_token_s - cold.requests[1].arrival_s
    # 32 tokens prefilled instead of 352 (the step time is the larger of compute and memory)
    assert ttft_hit == pytest.approx(COST.step_s(32, 0, 0))
    assert ttft_cold == pytest.approx(COST.step_s(352, 0, 0))
    assert summarize(hit)["hit_rate_device"] == pytest.approx(0.5)


def test_runs_are_deterministic():
    trace = conversation_trace(24, 80)
    factory = _checked_factory(140, 100, 300, sim=SMALL_SIM)
    one = simulate(trace, COST, RunSpec("tiering", "cost"), SMALL_SIM, kv_factory=factory)
    two = simulate(trace, COST, RunSpec("tiering", "cost"), SMALL_SIM, kv_factory=factory)
    assert one.requests == two.requests and one.decisions == two.decisions


def test_quiet_safe_points_change_nothing(monkeypatch):
    # the worker skips the controller's safe point while nothing it looks at has changed
    # since a call that found nothing to do; calling it every time must give the same run
    from tiering.apps.replay import simulator

    trace = conversation_trace(25, 150)
    # slow links, so that transfers are in flight across many steps
    factory = _checked_factory(150, 60, 300, rates=LinkRates(2e8, 2e8, 5e7, 1e8), sim=SMALL_SIM)
    for policy in POLICIES:
        spec = RunSpec("tiering", policy, ControllerConfig(high=0.85, low=0.7))
        skipping = simulate(trace, COST, spec, SMALL_SIM, kv_factory=factory)
        with monkeypatch.context() as m:
            m.setattr(simulator._Worker, "_still_quiet", lambda self: False)
            every = simulate(trace, COST, spec, SMALL_SIM, kv_factory=factory)
        assert skipping.counters.quiet_safe_points > 100
        assert every.counters.quiet_safe_points == 0
        assert skipping.decisions == every.decisions and len(every.decisions) > 30
        assert skipping.requests == every.requests


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="max_batch"):
        SimConfig(max_batch=0)
    with pytest.raises(ValueError, match="max_step_tokens"):
        SimConfig(max_batch=64, max_step_tokens=32)
    with pytest.raises(ValueError, match="mode"):
        RunSpec("swap")
    with pytest.raises(ValueError, match="time_scale"):
        simulate([TraceRequest(0.0, 5, 1)], COST, RunSpec(), time_scale=0)
    with pytest.raises(ValueError, match="unknown policy 'fifo'"):
        simulate([TraceRequest(0.0, 5, 1)], COST, RunSpec("tiering", "fifo"))


# -- metrics by hand -------------------------------------------------------------------------


def test_metrics_on_a_hand_checked_trace():
    # prefill costs 1 ms a token (2 * 0.5e9 FLOP / 1e12 FLOP/s); a decode step reads 1e9 bytes
    # of weights at 1e11 B/s = 10 ms, plus 4 bytes of KV per context token (4e-11 s each)
    model = ModelPreset("toy", 1, 1, 1, 2, 0.5)
    hw = HardwarePreset("toy", 1 << 20, 0, 0, 1e9, 1e9, 1e9, 1e9, 1e12, 1e11, 0.0)
    cost = StepCost(model, hw)
    kv_s = 4 / 1e11
    trace = [TraceRequest(0.0, 100, 3), TraceRequest(0.05, 50, 2)]
    res = simulate(trace, cost, RunSpec("no-tiering"), SimConfig(page_tokens=16))
    # step 1 at t=0: r0 prefills 100 tokens -> 0.1 s; r0's first token at 0.1
    t1 = 0.1
    # step 2 at t=0.1: r1 (arrived at 0.05) prefills 50, r0 decodes with 100 tokens of KV
    t2 = t1 + max(51e-3, 0.01 + 100 * kv_s)
    # step 3: both decode (r0: 101 tokens of KV, r1: 50) -> r0 makes its 3rd token, r1 its 2nd
    t3 = t2 + max(2e-3, 0.01 + 151 * kv_s)
    r0, r1 = res.requests
    assert r0.first_token_s == pytest.approx(t1) and r0.finish_s == pytest.approx(t3)
    assert r1.first_token_s == pytest.approx(t2) and r1.finish_s == pytest.approx(t3)
    m = summarize(res)
    ttft = [t1, t2 - 0.05]
    tpot = [(t3 - t1) / 2, (t3 - t2) / 1]
    assert m["ttft_p50_s"] == pytest.approx((ttft[0] + ttft[1]) / 2)
    assert m["ttft_p99_s"] == pytest.approx(min(ttft) + 0.99 * abs(ttft[1] - ttft[0]))
    assert m["tpot_p50_s"] == pytest.approx(sum(tpot) / 2)
    assert m["tpot_p99_s"] == pytest.approx(min(tpot) + 0.99 * abs(tpot[0] - tpot[1]))
    assert m["duration_s"] == pytest.approx(t3)
    assert m["throughput_tok_s"] == pytest.approx((100 + 3 + 50 + 2) / t3)
    assert m["output_tok_s"] == pytest.approx(5 / t3)
    assert m["preemptions"] == 0 and m["finished"] == 2


def test_percentile_matches_numpy():
    rng = np.random.default_rng(5)
    values = rng.exponential(2.0, size=257).tolist()
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert math.isnan(percentile([], 50))


# -- the modeled cache and the real cache lead to the same decisions --------------------------


@pytest.mark.parametrize("preempt", ["latest", "policy"])
def test_simulator_and_real_cache_make_the_same_decisions(preempt):
    base = load_trace(MOONCAKE, limit=80)
    # the slice keeps the trace's arrivals and shapes, scaled down to a tiny cache
    trace = [TraceRequest(t.arrival_s, max(1, t.input_tokens // 24), max(1, t.output_tokens // 4))
             for t in base]
    geom = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=32,
                      dtype=torch.float32)
    sim = SimConfig(max_batch=8, max_step_tokens=512, page_tokens=32, prefix_reuse=False,
                    preempt=preempt)
    for policy in ("lru", "largest"):
        spec = RunSpec("tiering", policy, ControllerConfig(high=0.85, low=0.6))
        caches = []

        def real(clock, caches=caches):
            cache = PagedKVCache(geom, "cpu", 40, 24, clock=clock)
            caches.append(cache)
            return SynchronizedKV(cache, clock)

        def model(clock):
            return CheckedKV(geom.bytes_per_token, 32, 40, 24, 0, LinkRates.instant(), clock)

        modeled = simulate(trace, COST, spec, sim, kv_factory=model)
        try:
            actual = simulate(trace, COST, spec, sim, kv_factory=real)
            caches[0].check_integrity()
        finally:
            for cache in caches:
                cache.close()
        kinds = Counter(d.kind for d in modeled.decisions)
        assert kinds["offload"] >= 5 and kinds["reload"] >= 5
        assert modeled.counters.preemptions >= 5
        assert actual.decisions == modeled.decisions
        assert actual.requests == modeled.requests
        # scans_skipped counts the controller's own shortcut, not a decision: it differs
        # while the controller reads the modeled poll()'s list of TransferResult as "done"
        skip = {"scans_skipped"}
        assert ({k: v for k, v in actual.controller_stats.items() if k not in skip}
                == {k: v for k, v in modeled.controller_stats.items() if k not in skip})


# -- sweep and CLI ---------------------------------------------------------------------------


def test_cli_writes_summary_table_sweep_csv_and_plots(tmp_path, capsys):
    out = tmp_path / "out"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--limit", "40", "--policy",
                      "lru,largest", "--model", "llama-3.1-8b", "--hardware", "small",
                      "--time-scale", "3", "--sweep", "--host-gib", "0,2",
                      "--watermarks", "0.9:0.75"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "recompute" in text and "no-tiering" in text and "ttft p99" in text
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["runs"]) == {"recompute", "no-tiering", "lru@0.9:0.75@0GiB",
                                    "lru@0.9:0.75@2GiB", "largest@0.9:0.75@0GiB",
                                    "largest@0.9:0.75@2GiB"}
    for run in summary["runs"].values():
        assert run["finished"] + run["rejected"] == 40
    with (out / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 6
    assert {r["host_gib"] for r in rows if r["mode"] == "tiering"} == {"0", "2"}
    for name in ("hit_rate_vs_host.png", "ttft_p99_vs_host.png", "compare.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_single_run_has_one_entry_per_policy_and_baseline(tmp_path):
    out = tmp_path / "single"
    rc = replay_main([str(AZURE), "--out", str(out), "--limit", "60", "--policy", "all",
                      "--hardware", "a10-24g"])
    assert rc == 0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert set(runs) == {"lru", "priority", "largest", "cost", "recompute", "no-tiering"}
    assert all(r["finished"] == 60 for r in runs.values())
    assert runs["lru"]["prefix_lookups"] == 0  # the Azure trace has no block ids
    assert not (out / "sweep.csv").exists()


def test_cli_reports_bad_arguments(tmp_path, capsys):
    rc = replay_main([str(MOONCAKE), "--out", str(tmp_path), "--policy", "fifo"])
    assert rc == 2 and "unknown policy 'fifo'" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())
    rc = replay_main([str(MOONCAKE), "--out", str(tmp_path), "--watermarks", "0.9"])
    assert rc == 2 and "HIGH:LOW" in capsys.readouterr().err
    rc = replay_main([str(MOONCAKE), "--out", str(tmp_path), "--host-gib", "1,2"])
    assert rc == 2 and "need --sweep" in capsys.readouterr().err
    rc = replay_main([str(tmp_path / "missing.jsonl"), "--out", str(tmp_path)])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
