"""Trace replay as a policy-tuning tool: user policies, policy-made retention, real reload
costs, bounds, seeds, tier sizes, plots, progress and argument checking."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import random
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
from conftest import conversation_trace
from replay_helpers import COST, MODEL, MOONCAKE, ROOT, SIM, SMALL
from tiering.policies import LRU, CandidateBatch, Policy, register_policy

from tiering.apps.replay import main as replay_main
from tiering.apps.replay.bounds import belady, infinite
from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.plots import needs_log
from tiering.apps.replay.policy_spec import PolicySpec, parse_option
from tiering.apps.replay.presets import get_hardware, reload_seconds
from tiering.apps.replay.progress import Progress
from tiering.apps.replay.seeds import aggregate, jitter, t95
from tiering.apps.replay.simulator import RunSpec, SimConfig, simulate
from tiering.apps.replay.sweep import Grid, run_grid
from tiering.apps.replay.traces import TraceRequest
from tiering.control.controller import ControllerConfig
from tiering.types import Tier


def _trace(seed: int, n: int, *, shared: float = 0.6) -> list[TraceRequest]:
    return conversation_trace(seed, n, shared=shared)


class CheckedKV(ModeledKVCache):
    """Checks its ledger at every poll (every safe point); counts the checks per instance."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.checks = 0

    def poll(self):
        done = super().poll()
        self.check_integrity()
        self.checks += 1
        return done


def _factory(device_pages, host_pages, disk_pages, made):
    def factory(clock):
        kv = CheckedKV(MODEL.kv_bytes_per_token, SIM.page_tokens, device_pages, host_pages,
                       disk_pages, LinkRates(2e9, 2e9, 5e8, 1e9, 1e-5, 1e-5, 1e-4, 1e-4), clock)
        made.append(kv)
        return kv

    return factory


@dataclass(frozen=True)
class Recording(Policy):
    """LRU, or most recently used first with ``reverse``, remembering every batch it saw
    (tier, rids, reload costs, bytes). The record list is per instance."""

    reverse: bool = False
    seen: list = None  # type: ignore[assignment]
    name = "recording"

    def __post_init__(self) -> None:
        if self.seen is None:
            object.__setattr__(self, "seen", [])

    def sort_keys(self, batch: CandidateBatch, now: float):
        self.seen.append((batch.tier, tuple(batch.rids), batch.reload_cost_s.copy(),
                          None if batch.reclaimable is None else batch.reclaimable.copy()))
        return (-batch.last_used,) if self.reverse else (batch.last_used,)


def _run(policy_factory, trace, pages=(300, 100, 800), registry_name="rec", sim=SIM, **kw):
    made: list = []
    holder: list = []

    def factory(**options):
        p = policy_factory(**options)
        holder.append(p)
        return p

    registry = register_policy(registry_name, factory)
    spec = RunSpec("tiering", registry_name, ControllerConfig(high=0.85, low=0.7), **kw)
    res = simulate(trace, COST, spec, sim, kv_factory=_factory(*pages, made), registry=registry)
    made[0].check_integrity()
    assert made[0].checks > 10
    return res, holder[0], made[0]


# -- 1. the policy given makes every retention decision -------------------------------------


def test_registry_policy_orders_offloads_demotions_and_prefix_drops():
    # the request policy orders the live requests' device offloads (via the controller);
    # cached prefix blocks follow the block policy (tests/test_replay_blocks.py)
    trace = _trace(3, 160)
    res, policy, kv = _run(Recording, trace)
    assert {tier for tier, *_ in policy.seen} <= {Tier.DEVICE, Tier.HOST}
    dev_batches = [s for s in policy.seen if s[0] is Tier.DEVICE]
    offloaded = [d.rid for d in res.decisions if d.kind == "offload"]
    assert offloaded and kv.stats.offloads_to_host + kv.stats.offloads_to_disk > 0
    # the first offload is the policy's first choice in some device batch
    assert offloaded[0] in {rids[0] for _, rids, *_ in dev_batches}
    # only live requests are offered: every candidate is a request of the trace
    rids = {r.rid for r in res.requests}
    assert all(set(b[1]) <= rids for b in policy.seen)
    assert all(r.status == "finished" for r in res.requests)


def test_the_host_cascade_is_the_controllers_as_over_the_cache():
    """The replay demotes host requests with the controller's own cascade (the front door's
    over the cache), not one of its own: every demotion is the controller's, ordered by
    its policy over a batch of host candidates. Before, the worker demoted by itself and the
    controller's cascade never ran (its demotions stat stayed 0)."""
    trace = _trace(3, 160)  # no cached blocks: they would fill the disk a demotion needs
    res, policy, kv = _run(Recording, trace, pages=(300, 100, 800),
                           sim=dataclasses.replace(SIM, prefix_reuse=False))
    demoted = [d.rid for d in res.decisions if d.kind == "demote"]
    assert demoted and res.controller_stats["demotions"] == len(demoted)
    host_batches = [rids for tier, rids, *_ in policy.seen if tier is Tier.HOST]
    assert host_batches and demoted[0] in {rids[0] for rids in host_batches}
    assert kv.stats.demotions >= len(demoted) - res.controller_stats["demotions_in_flight"]


def test_module_class_path_and_options(monkeypatch):
    monkeypatch.chdir(ROOT)
    spec = PolicySpec("examples.replay_policies:IdleBytes", {"cost_weight": 2.5})
    policy = spec.build()
    assert type(policy).__name__ == "IdleBytes" and policy.cost_weight == 2.5
    assert spec.label == "examples.replay_policies:IdleBytes[cost_weight=2.5]"
    trace = _trace(4, 80)
    made: list = []
    run = simulate(trace, COST, RunSpec("tiering", spec.name, ControllerConfig(0.85, 0.7),
                                        spec.options), SIM, kv_factory=_factory(300, 100, 800, made))
    assert all(r.status == "finished" for r in run.requests)
    assert run.spec.label.endswith("[cost_weight=2.5]")
    with pytest.raises(ValueError, match="cost_weight must be a finite number"):
        PolicySpec("examples.replay_policies:IdleBytes", {"cost_weight": -1}).build()
    with pytest.raises(ValueError, match="cannot import module 'nowhere_at_all'"):
        PolicySpec("nowhere_at_all:X").build()
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        PolicySpec("examples.replay_policies:Nope").build()
    with pytest.raises(ValueError, match="not a tiering.policies.Policy subclass"):
        PolicySpec("tiering.policies:CandidateBatch").build()
    with pytest.raises(ValueError, match="not a Policy class or factory"):
        PolicySpec("examples.replay_policies:np").build()
    with pytest.raises(TypeError, match="not a Policy"):
        PolicySpec("examples.replay_policies:dataclass").build()
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        PolicySpec("mru").build()
    assert parse_option("aging_s=5") == ("aging_s", 5)
    assert parse_option("x=0.5") == ("x", 0.5) and parse_option("f=false") == ("f", False)
    assert parse_option("name=kv") == ("name", "kv")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_option("novalue")


def test_run_grid_takes_a_registry():
    class MRU(LRU):
        def sort_keys(self, batch, now):
            return (-batch.last_used,)

    registry = register_policy("mru", MRU)
    grid = Grid(("mru", "lru"), ((0.85, 0.7),), (SMALL.host_bytes,), baselines=False)
    rows = run_grid(_trace(5, 60), MODEL, SMALL, grid, SIM, registry=registry)
    assert [r["label"] for r in rows] == ["mru", "lru"]
    with pytest.raises(ValueError, match="unknown policy 'mru'"):
        run_grid(_trace(5, 10), MODEL, SMALL, grid, SIM)


# -- 2. real reload costs ---------------------------------------------------------------------


def test_controller_batches_carry_reload_costs_from_the_links():
    trace = _trace(6, 120)
    res, policy, kv = _run(Recording, trace)
    hw = SMALL
    device = [s for s in policy.seen if s[0] is Tier.DEVICE and s[3] is not None]
    assert device
    checked = 0
    for _, rids, cost, sizes in device:
        host = np.array([reload_seconds(hw, float(b), "host") for b in sizes])
        disk = np.array([reload_seconds(hw, float(b), "disk") for b in sizes])
        recompute = sizes / MODEL.kv_bytes_per_token * COST.prefill_s_per_token
        if np.allclose(cost, recompute, rtol=1e-9):
            continue  # a drop of retained prefixes: only recomputation brings them back
        # every row is the reload from host or from disk, per the preset, never a default
        ok = np.isclose(cost, host, rtol=1e-9) | np.isclose(cost, disk, rtol=1e-9)
        assert ok.all() and (cost > 0).all()
        checked += len(rids)
    assert checked > 0
    host_rows = [s for s in policy.seen if s[0] is Tier.HOST]
    for _, _, cost, sizes in host_rows:  # a demotion: brought back from disk afterwards
        want = [reload_seconds(hw, float(b), "disk") for b in sizes]
        assert np.allclose(cost, want, rtol=1e-9)


def test_reload_seconds_depend_on_the_preset_and_tier():
    nbytes = random.Random(2).randint(1 << 20, 1 << 30)
    h100, a10 = get_hardware("h100-80g"), get_hardware("a10-24g")
    assert reload_seconds(h100, nbytes, "host") == pytest.approx(
        h100.h2d_latency_s + nbytes / h100.h2d_bps)
    assert reload_seconds(a10, nbytes, "host") > reload_seconds(h100, nbytes, "host")
    assert reload_seconds(h100, nbytes, "disk") > reload_seconds(h100, nbytes, "host")
    with pytest.raises(ValueError, match="tier must be"):
        reload_seconds(h100, nbytes, "device")


# -- 3. bounds, hit rates, seeds ------------------------------------------------------------


def _req(t, chain, n_in=None):
    return TraceRequest(t, n_in if n_in is not None else 4 * len(chain) + 1, 1, tuple(chain))


def test_bounds_on_a_hand_checked_trace():
    # block_tokens 4; requests of 3 blocks (+1 token), in arrival order
    trace = [_req(0, [1, 2, 3]), _req(1, [1, 2, 4]), _req(2, [5, 6, 7]), _req(3, [1, 2, 3])]
    inf = infinite(trace, 4)
    # hits: 0, then 2 (1,2), then 0, then 3 (1,2,3): 5 of 12 blocks
    assert inf.block_hit_rate == pytest.approx(5 / 12)
    assert inf.token_hit_rate == pytest.approx((8 + 12) / 52)
    # capacity 3: MIN keeps 1, 2 and 3 (all needed again), never admits 4, 5, 6, 7
    b3 = belady(trace, 4, 3)
    assert b3.block_hit_rate == pytest.approx(5 / 12)
    # capacity 2: 1 and 2 stay; the last request reuses two blocks, not three
    b2 = belady(trace, 4, 2)
    assert b2.block_hit_rate == pytest.approx(4 / 12)
    assert belady(trace, 4, 0).block_hit_rate == 0.0
    with pytest.raises(ValueError, match="capacity_blocks"):
        belady(trace, 4, -1)


def _lru_cache_hits(trace, bt, cap):
    """A plain LRU block cache of ``cap`` blocks with the same prefix rule."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = 0
    for t in sorted(trace, key=lambda t: t.arrival_s):
        chain = t.hash_ids[: t.input_tokens // bt]
        run = True
        for b in chain:
            if b in cache:
                hit += run
                cache.move_to_end(b)
            else:
                run = False
                cache[b] = None
                if len(cache) > cap:
                    cache.popitem(last=False)
    return hit


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_belady_is_between_lru_and_infinite(seed):
    trace = _trace(seed, 200)
    inf = infinite(trace, 64)
    for cap in (10, 40, 120):
        b = belady(trace, 64, cap)
        lru_hits = _lru_cache_hits(trace, 64, cap)
        assert lru_hits / b.blocks <= b.block_hit_rate + 1e-12 <= inf.block_hit_rate + 1e-12
    assert belady(trace, 64, 10**6).block_hit_rate == pytest.approx(inf.block_hit_rate)


def test_replay_hit_rates_add_up_and_stay_under_the_infinite_bound():
    trace = _trace(9, 150)
    res, _, _ = _run(Recording, trace)
    from tiering.apps.replay.metrics import summarize

    row = summarize(res)
    tiers = ("device", "host", "disk")
    assert sum(row[f"token_hit_rate_{t}"] for t in tiers) == pytest.approx(row["token_hit_rate"])
    assert sum(row[f"block_hit_rate_{t}"] for t in tiers) == pytest.approx(row["block_hit_rate"])
    assert row["token_hit_rate_host"] > 0 or row["token_hit_rate_disk"] > 0
    bound = infinite(trace, SIM.block_tokens)
    assert 0 < row["token_hit_rate"] <= bound.token_hit_rate
    assert 0 < row["block_hit_rate"] <= bound.block_hit_rate


def test_jitter_and_aggregate():
    trace = _trace(10, 50)
    assert jitter(trace, 0) == trace
    j = jitter(trace, 3)
    assert len(j) == len(trace) and j != trace
    assert [(r.input_tokens, r.hash_ids) for r in j] == [(r.input_tokens, r.hash_ids)
                                                         for r in trace]
    assert jitter(trace, 3) == j  # seeded
    assert all(r.arrival_s >= 0 for r in j)
    rng = random.Random(4)
    vals = [rng.uniform(1, 2) for _ in range(5)]
    rows = [[{"label": "a", "x": v, "n": 7}] for v in vals]
    agg = aggregate(rows)[0]
    mean = sum(vals) / 5
    sd = float(np.std(vals, ddof=1))
    assert agg["x"] == pytest.approx(mean)
    assert agg["x_ci95"] == pytest.approx(2.776 * sd / math.sqrt(5))
    assert agg["n"] == 7 and agg["n_ci95"] == 0.0 and agg["seeds"] == 5
    assert t95(1) == pytest.approx(12.706)
    with pytest.raises(ValueError, match="different configurations"):
        aggregate([[{"label": "a"}], [{"label": "b"}]])


# -- 4. the CLI: sizes, bounds, seeds, rejections, outputs, bad arguments ---------------------


def _cli(tmp_path, *extra):
    out = tmp_path / "out"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--limit", "50", "--hardware", "small",
                      "--time-scale", "3", *extra])
    return rc, out


def test_cli_sizes_bounds_seeds_and_outputs(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    rc, out = _cli(tmp_path, "--policy", "lru,examples.replay_policies:IdleBytes",
                   "--host-gib", "1.5", "--device-gib", "3", "--disk-gib", "5", "--seeds", "3",
                   "--requests-csv", "--decisions")
    assert rc == 0
    captured = capsys.readouterr()
    s = json.loads((out / "summary.json").read_text())
    runs = s["runs"]
    assert set(runs) == {"recompute", "no-tiering", "lru", "examples.replay_policies:IdleBytes"}
    gib = 1 << 30
    for key in ("lru", "examples.replay_policies:IdleBytes"):
        assert (runs[key]["device_bytes"], runs[key]["host_bytes"], runs[key]["disk_bytes"]) == (
            3 * gib, int(1.5 * gib), 5 * gib)
    for key in ("recompute", "no-tiering"):
        assert runs[key]["host_bytes"] == 0 and runs[key]["disk_bytes"] == 0
    assert s["tier_bytes"]["host"] == int(1.5 * gib)
    assert s["bounds"]["infinite"]["capacity_blocks"] is None
    assert s["bounds"]["belady"]["capacity_blocks"] == (3 + 1.5 + 5) * gib // (512 * 128 * 1024)
    for r in runs.values():
        assert r["seeds"] == 3 and "ttft_p99_s_ci95" in r
        assert r["token_hit_rate"] <= s["bounds"]["infinite"]["token_hit_rate"] + 1e-9
    assert any(r["ttft_p99_s_ci95"] > 0 for r in runs.values())
    table = captured.out
    assert "bound: infinite" in table and "bound: belady" in table and "±" in table
    assert "tok hit %" in table and "block hit %" in table
    with (out / "requests.csv").open() as f:
        reqs = list(csv.DictReader(f))
    assert len(reqs) == 4 * 50 and {r["run"] for r in reqs} == set(runs)
    with (out / "decisions.csv").open() as f:
        decs = list(csv.DictReader(f))
    kinds = {d["kind"] for d in decs}
    assert kinds <= {"offload", "reload", "demote", "drop", "block-host", "block-disk",
                     "block-drop"}
    assert "block-host" in kinds and "block-drop" in kinds
    for name in ("compare.png", "timeline.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    # progress: plain lines on a non-terminal stderr, naming the run in progress
    assert "[3/4 lru]" in captured.err and "started" in captured.err


def test_cli_reports_rejections(tmp_path, capsys):
    rc, out = _cli(tmp_path, "--device-gib", "0.5", "--no-plots")
    assert rc == 0
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert runs["lru"]["rejected"] > 0
    assert runs["lru"]["finished"] + runs["lru"]["rejected"] == 50
    err = capsys.readouterr().err
    assert "requests rejected" in err and f"lru {runs['lru']['rejected']} of 50" in err


@pytest.mark.parametrize(("args", "message"), [
    (("--time-scale", "0"), "--time-scale: '0' must be a finite number > 0"),
    (("--time-scale", "-2"), "--time-scale: '-2' must be"),
    (("--time-scale", "nan"), "--time-scale: 'nan' must be"),
    (("--time-scale", "inf"), "--time-scale: 'inf' must be"),
    (("--time-scale", "fast"), "--time-scale: 'fast' is not a number"),
    (("--policy", "mru"), "unknown policy 'mru'"),
    (("--policy", "nowhere_at_all:X"), "cannot import module 'nowhere_at_all'"),
    (("--policy", "lru", "--policy-option", "aging_s=3"), "--policy lru[aging_s=3]"),
    (("--policy-option", "oops"), "--policy-option: 'oops' is not KEY=VALUE"),
    (("--seeds", "0"), "--seeds: '0' must be >= 1"),
    (("--limit", "x"), "--limit: 'x' is not a whole number"),
    (("--device-gib", "-1"), "--device-gib: '-1' must be"),
    (("--disk-gib", "nan"), "--disk-gib: 'nan' must be"),
    (("--host-gib", "1,2"), "need --sweep"),
    (("--model", "llama-3.1-70b", "--hardware", "h100-80g"), "do not fit"),
    (("--device-gib", "200", "--hardware", "h100-80g"), "do not fit"),
    (("--watermarks", "0.9"), "HIGH:LOW"),
    (("--model", "gpt"), "invalid choice"),
    (("--make-room", "keep"), "invalid choice"),
    (("--block-policy", "mru"), "--block-policy: unknown block policy 'mru'"),
])
def test_cli_bad_arguments_exit_2_and_create_nothing(tmp_path, capsys, args, message):
    out = tmp_path / "never"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--limit", "5", *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err
    assert not out.exists()


# -- 5. plots and progress ----------------------------------------------------------------------


def test_needs_log():
    assert needs_log([236.0, 5.0, 8.0]) and not needs_log([5.0, 8.0, 7.5])
    assert not needs_log([math.nan, 3.0]) and not needs_log([])


def test_progress_plain_lines_name_the_run():
    stream = io.StringIO()
    ticks = iter(range(100))
    p = Progress(2, 20, stream=stream, tty=False, clock=lambda: float(next(ticks)))
    p.start(0, "lru")
    for _ in range(20):
        p.advance(1)
    p.finished({"finished": 19, "rejected": 1})
    p.start(1, "cost")
    p.advance(5)
    p.close()
    lines = stream.getvalue().splitlines()
    assert lines[0] == "replay [1/2 lru] started, 20 requests"
    assert "replay [1/2 lru] 2/20 requests" in lines
    assert "replay [1/2 lru] done in 1.0 s: 19 finished, 1 rejected" in lines
    assert lines[-2] == "replay [2/2 cost] started, 20 requests"
    assert lines[-1] == "replay [2/2 cost] 5/20 requests"


# -- 6. speed shortcuts change nothing ---------------------------------------------------------


@pytest.mark.parametrize("make_room", ["drop", "offload"])
def test_quiet_safe_points_change_nothing_when_the_worker_offloads(monkeypatch, make_room):
    from tiering.apps.replay import simulator

    sim = dataclasses.replace(SIM, make_room=make_room)
    trace = _trace(25, 150)
    for name in ("lru", "cost"):
        spec = RunSpec("tiering", name, ControllerConfig(high=0.85, low=0.7))
        skipping = simulate(trace, COST, spec, sim, kv_factory=_factory(300, 100, 800, []))
        with monkeypatch.context() as m:
            m.setattr(simulator._Worker, "_still_quiet", lambda self: False)
            every = simulate(trace, COST, spec, sim, kv_factory=_factory(300, 100, 800, []))
        assert skipping.counters.quiet_safe_points > 50
        assert every.counters.quiet_safe_points == 0
        assert skipping.decisions == every.decisions and skipping.requests == every.requests


def _same_run(a, b) -> None:
    assert a.requests == b.requests and a.decisions == b.decisions
    assert a.counters == b.counters and a.timeline == b.timeline
    assert a.makespan_s == b.makespan_s and a.kv_stats == b.kv_stats
    assert a.controller_stats == b.controller_stats


@pytest.mark.parametrize("make_room", ["drop", "offload"])
def test_hopeless_admissions_are_left_waiting_untouched(monkeypatch, make_room):
    """An admission the device could not hold even with every cached block no request
    maps gone is refused before it is attached: the block store and its policies are not
    touched (as a worker on the cache that checks ``device_used_bytes`` first leaves
    them), and the check really ran. A check that ignores the cached blocks' room (the
    negative control) changes the run."""
    from tiering.apps.replay import simulator

    sim = dataclasses.replace(SIM, make_room=make_room)
    real, real_try = simulator._Worker._hopeless, simulator._Worker._try_admit
    taken = []

    def counting(self, peek, tokens):
        out = real(self, peek, tokens)
        taken.append(out)
        if out:
            self._seen = (self.prefixes.changes,
                          tuple(len(p) for p in self.prefixes.policies.values()))
        return out

    def checked(self, r, budget):
        self._seen = None
        got = real_try(self, r, budget)
        if self._seen is not None:  # refused as hopeless: nothing changed
            assert got is None and (r.rid not in self.kv or not self.kv.num_tokens(r.rid))
            assert self._seen == (self.prefixes.changes,
                                  tuple(len(p) for p in self.prefixes.policies.values()))
        return got

    trace = _trace(7, 200)
    for mode, policy, pages in (("tiering", "lru", (300, 100, 800)),
                                ("tiering", "cost", (300, 100, 800)),
                                ("recompute", "lru", (300, 0, 0))):
        spec = RunSpec(mode, policy, ControllerConfig(high=0.85, low=0.7))
        taken.clear()
        with monkeypatch.context() as m:
            m.setattr(simulator._Worker, "_hopeless", counting)
            m.setattr(simulator._Worker, "_try_admit", checked)
            quick = simulate(trace, COST, spec, sim, kv_factory=_factory(*pages, []),
                             check=True)
        assert sum(taken) > 20, "the check never refused"
        full = simulate(trace, COST, spec, sim, kv_factory=_factory(*pages, []))
        _same_run(quick, full)
    with monkeypatch.context() as m:  # negative control
        m.setattr(simulator._Worker, "_hopeless",
                  lambda self, peek, tokens: self.kv.device_free_pages()
                  < self.prefixes.need_pages(peek, tokens))
        wrong = simulate(trace, COST, spec, sim, kv_factory=_factory(*pages, []))
    assert wrong.requests != full.requests or wrong.decisions != full.decisions


@pytest.mark.parametrize("make_room", ["drop", "offload"])
def test_tier_policies_sharing_one_history_change_nothing(monkeypatch, make_room):
    """The block store lets its host and disk ChainOdds read the device one's ghost
    history (share_history); with each keeping its own copy the run is identical, and
    the sharing really happened."""
    from tiering.policies.blocks.chain import ChainOdds

    sim = dataclasses.replace(SIM, make_room=make_room, block_policy="chain")
    real = ChainOdds.share_history
    shared = []

    def counting(self, others):
        out = real(self, others)
        shared.append(out)
        return out

    trace = _trace(25, 200)
    spec = RunSpec("tiering", "lru", ControllerConfig(high=0.85, low=0.7))
    with monkeypatch.context() as m:
        m.setattr(ChainOdds, "share_history", counting)
        one = simulate(trace, COST, spec, sim, kv_factory=_factory(300, 100, 800, []),
                       check=True)
    assert shared == [True]
    with monkeypatch.context() as m:
        m.setattr(ChainOdds, "share_history", lambda self, others: False)
        own = simulate(trace, COST, spec, sim, kv_factory=_factory(300, 100, 800, []))
    _same_run(one, own)
    c = one.counters
    if make_room == "offload":
        assert c.block_moves_host > 20 and c.block_moves_disk > 5 and c.reused_blocks_host > 0
    else:  # device victims are dropped: no block reaches the host
        assert c.block_drops > 20 and c.block_moves_host == 0


@pytest.mark.parametrize("scale", [1.0, 6.0])
@pytest.mark.parametrize("make_room", ["drop", "offload"])
def test_fast_forward_changes_nothing(monkeypatch, scale, make_room):
    """Decode-only stretches run in a tight loop; with the loop turned off the run is the
    same request for request and decision for decision (and the loop really ran)."""
    from tiering.apps.replay import simulator

    SIM = dataclasses.replace(globals()["SIM"], make_room=make_room)  # noqa: N806
    trace = _trace(31, 150)
    for name in ("lru", "cost"):
        spec = RunSpec("tiering", name, ControllerConfig(high=0.85, low=0.7))
        made: list = []
        fast = simulate(trace, COST, spec, SIM, time_scale=scale,
                        kv_factory=_factory(300, 100, 800, made))
        with monkeypatch.context() as m:
            m.setattr(simulator._Worker, "_fast_forward", lambda self, a, b: None)
            slow = simulate(trace, COST, spec, SIM, time_scale=scale,
                            kv_factory=_factory(300, 100, 800, made))
        assert fast.counters.fast_steps > 100 and slow.counters.fast_steps == 0
        assert fast.requests == slow.requests
        assert fast.decisions == slow.decisions and len(fast.decisions) > 10
        assert fast.counters.steps == slow.counters.steps
        assert fast.makespan_s == slow.makespan_s
    for mode in ("recompute", "no-tiering"):
        made = []
        fast = simulate(trace, COST, RunSpec(mode), SIM, time_scale=scale,
                        kv_factory=_factory(300, 0, 0, made))
        with monkeypatch.context() as m:
            m.setattr(simulator._Worker, "_fast_forward", lambda self, a, b: None)
            slow = simulate(trace, COST, RunSpec(mode), SIM, time_scale=scale,
                            kv_factory=_factory(300, 0, 0, made))
        assert fast.requests == slow.requests and fast.counters.steps == slow.counters.steps


def test_cached_blocks_move_down_not_dropped_while_a_tier_below_has_room():
    """Room needed at once on the device: with make_room="offload" (the default) cached
    blocks go down a tier rather than being dropped; without a tier below they are
    dropped."""
    assert SimConfig().make_room == "offload"
    trace = _trace(7, 160)
    offload = dataclasses.replace(SIM, make_room="offload")
    moved, _, _ = _run(Recording, trace, sim=offload)
    dropping, _, _ = _run(Recording, trace, sim=dataclasses.replace(SIM, make_room="drop"))
    m, d = moved.counters, dropping.counters
    assert m.block_moves_host + m.block_moves_disk > d.block_moves_host + d.block_moves_disk
    assert m.block_drops < d.block_drops
    assert moved.requests != dropping.requests  # the path changed the run
    # no tier below: nothing can move, blocks are dropped instead
    none_below, _, _ = _run(Recording, trace, pages=(300, 0, 0), sim=offload)
    n = none_below.counters
    assert n.block_moves_host == n.block_moves_disk == 0 and n.block_drops > 0
    with pytest.raises(ValueError, match="make_room must be one of"):
        SimConfig(make_room="keep")


def test_cached_blocks_make_room_for_a_reload(monkeypatch):
    """A preempted request's reload gets its room from cached device blocks no request
    maps, as the cache's reload does (``ensure_device``): blocks are not in the used
    figure the controller admits reloads by, so without that room a reload it starts is
    refused (the negative control: a reload that does not ask the block store)."""
    from tiering.apps.replay.model_kv import ModeledKVCache

    trace = _trace(7, 200)
    spec = RunSpec("tiering", "lru", ControllerConfig(high=0.85, low=0.7))
    fixed = simulate(trace, COST, spec, SIM, kv_factory=_factory(300, 100, 800, []),
                     check=True)
    real = ModeledKVCache.reload

    def blind(self, rid):
        blocks, self._blocks = self._blocks, None
        try:
            return real(self, rid)
        finally:
            self._blocks = blocks

    with monkeypatch.context() as m:
        m.setattr(ModeledKVCache, "reload", blind)
        held = simulate(trace, COST, spec, SIM, kv_factory=_factory(300, 100, 800, []))
    assert fixed.counters.preemptions > 0 and fixed.kv_stats["reloads_from_host"] > 0
    assert fixed.kv_stats["reload_refusals"] == 0
    assert held.kv_stats["reload_refusals"] > 0
