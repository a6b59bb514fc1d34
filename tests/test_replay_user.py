"""Trace replay as its user tries it: what a request policy is told when it picks whom to
pause (``--preempt policy``), what the plots draw with ``--seeds``, and the messages of
refused sizes."""

from __future__ import annotations

import dataclasses
import json
import textwrap

import numpy as np
import pytest
from conftest import conversation_trace
from replay_helpers import COST, MODEL, SIM
from tiering.policies import LRU, Policy, register_policy

from tiering.apps.replay import main as replay_main
from tiering.apps.replay import simulator as simulator_mod
from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.simulator import RunSpec, simulate
from tiering.control.controller import ControllerConfig

PAUSE = dataclasses.replace(SIM, preempt="policy")


FAST = LinkRates(2e9, 2e9, 5e8, 1e9, 1e-5, 1e-5, 1e-4, 1e-4)


def _factory(made, host_pages=100, rates=FAST):
    def factory(clock):
        kv = ModeledKVCache(MODEL.kv_bytes_per_token, SIM.page_tokens, 300, host_pages, 800,
                            rates, clock)
        made.append(kv)
        return kv

    return factory


class _Recording(Policy):
    """Records every batch it orders while the worker decides whom to pause (``pausing`` is
    set around that decision by the test), then orders by ``key``."""

    name = "recording"

    def __init__(self, key: str = "none") -> None:
        self.key = key
        self.pausing: dict | None = None
        self.seen: list[dict] = []

    def sort_keys(self, batch, now):
        if self.pausing is not None:
            self.seen.append({**self.pausing, "now": now, "rids": list(batch.rids),
                              "last_used": batch.last_used.copy(),
                              "bytes": batch.reclaimable.copy(),
                              "cost": batch.reload_cost_s.copy()})
        if self.key == "largest":
            return (-batch.reclaimable.astype(np.float64),)
        if self.key == "smallest":
            return (batch.reclaimable.astype(np.float64),)
        return (np.zeros(len(batch)),)


def _run_recording(monkeypatch, key="none", seed=3, n=200, host_pages=100, sim=PAUSE,
                   rates=FAST):
    """A tiering run whose policy records each pause decision's batch, with the host's free
    bytes and each row's phase at that moment."""
    made: list = []
    workers: list = []
    original = simulator_mod._Worker._policy_victim

    def wrapped(self):
        workers.append(self)
        policy = self.retention.policy
        kv = self.kv
        policy.pausing = {
            "host_free": kv.host_capacity_bytes - kv.host_used_bytes(),
            "phase": {rid: self.by_rid[rid].phase for rid in self.active},
            "stalled_at": {rid: getattr(self.by_rid[rid], "stalled_at", None) for rid in self.active},
        }
        try:
            victim = original(self)
        finally:
            policy.pausing = None
        policy.seen[-1]["victim"] = victim.rid
        return victim

    monkeypatch.setattr(simulator_mod._Worker, "_policy_victim", wrapped)
    holder: list = []

    def make():
        holder.append(_Recording(key))
        return holder[-1]

    spec = RunSpec("tiering", "mine", ControllerConfig(high=0.85, low=0.7))
    res = simulate(conversation_trace(seed, n), COST, spec, sim,
                   kv_factory=_factory(made, host_pages, rates),
                   registry=register_policy("mine", make), check=True)
    made[0].check_integrity()
    return res, holder[0], workers


def test_whom_to_pause_is_told_the_reload_cost_from_where_the_request_would_go(monkeypatch):
    # the paused request stays on the device until the controller offloads it: to the host
    # where it has room, else to disk, and it comes back from there; its reload_cost_s must
    # be that one (before, always the host's, so a request the host cannot take looked as
    # cheap to bring back as one it can)
    # a host small enough that some paused requests do not fit on it
    res, policy, workers = _run_recording(monkeypatch, key="largest", host_pages=40)
    costs = workers[0].retention.costs
    assert len(policy.seen) > 3, "no pause decision with a choice was made"
    fits = too_big = 0
    for s in policy.seen:
        nbytes = s["bytes"].astype(np.float64)
        fit = s["bytes"] <= s["host_free"]
        want = np.where(fit, costs.from_host(nbytes), costs.from_disk(nbytes))
        np.testing.assert_allclose(s["cost"], want, rtol=0, atol=0)
        fits += int(fit.sum())
        too_big += int((~fit).sum())
    # both kinds of row were seen, so the test tells the two rules apart
    assert fits and too_big, (fits, too_big)
    assert res.counters.preemptions > 0


def test_whom_to_pause_is_told_each_request_last_ran_now(monkeypatch):
    # every request of the batch is running: its last use is now (a stalled one: when it
    # stalled), not when it was admitted or last preempted, which made requests decoding
    # this very step look idle for minutes to a policy that reads last_used
    _, policy, _ = _run_recording(monkeypatch)
    multi = [s for s in policy.seen if len(s["rids"]) > 1]
    assert multi, "every pause decision had one candidate"
    stalled_rows = 0
    for s in policy.seen:
        for rid, used in zip(s["rids"], s["last_used"].tolist(), strict=True):
            if s["phase"][rid] == simulator_mod.STALLED:
                stalled_rows += 1
                assert used == s["stalled_at"][rid] <= s["now"]
            else:
                assert used == s["now"], (rid, used, s["now"])


def test_equal_ranks_fall_to_the_policys_tie_break(monkeypatch):
    # a policy that ranks every request of the batch alike leaves the choice to its own
    # tie-break: the built-ins' is by rid, i.e. the earliest-arrived is paused (the docs
    # said the latest-arrived went first among equals, which no built-in did)
    res, policy, _ = _run_recording(monkeypatch, key="none")
    multi = [s for s in policy.seen if len(s["rids"]) > 1]
    assert multi
    assert all(s["victim"] == min(s["rids"]) for s in multi)
    # negative control: a policy that does rank them (largest first) pauses others
    other, big, _ = _run_recording(monkeypatch, key="largest")
    assert any(s["victim"] != min(s["rids"]) for s in big.seen if len(s["rids"]) > 1)
    assert other.requests != res.requests


class _RaisesWhenPausing(LRU):
    """Orders the controller's offloads; fails when asked whom to pause."""

    def __init__(self) -> None:
        self.running: set = set()

    def sort_keys(self, batch, now):
        if len(batch) > 1 and any(r in self.running for r in batch.rids):
            raise RuntimeError("nope")
        return super().sort_keys(batch, now)


def test_a_policy_failing_when_asked_whom_to_pause_is_named_with_that_decision(monkeypatch):
    original = simulator_mod._Worker._policy_victim

    def wrapped(self):
        self.retention.policy.running = set(self.active)
        return original(self)

    monkeypatch.setattr(simulator_mod._Worker, "_policy_victim", wrapped)
    spec = RunSpec("tiering", "mine", ControllerConfig(high=0.85, low=0.7))
    with pytest.raises(ValueError, match=r"candidate\(s\) \(which request of the batch to pause\)") as info:
        simulate(conversation_trace(3, 200), COST, spec, PAUSE, kv_factory=_factory([]),
                 registry=register_policy("mine", _RaisesWhenPausing), check=True)
    assert isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("sizes", [("0", "0"), ("0.5", "0"), ("1", "1")])
def test_pausing_when_no_tier_below_has_room_for_a_request_finishes_the_run(tmp_path, capsys,
                                                                           sizes):
    # a request of the batch that neither host nor disk has room for reclaims nothing: it
    # was handed to the policy anyway, and the batch refused it ("CandidateBatch.reclaimable
    # must be in [1, 2**63)"), which stopped every such run with exit status 2
    from replay_helpers import MOONCAKE

    out = tmp_path / "o"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--limit", "150", "--hardware",
                      "small", "--policy", "lru,largest", "--preempt", "policy",
                      "--host-gib", sizes[0], "--disk-gib", sizes[1], "--no-plots"])
    err = capsys.readouterr().err
    assert rc == 0, err
    runs = json.loads((out / "summary.json").read_text())["runs"]
    for key in ("lru", "largest"):
        assert runs[key]["finished"] + runs[key]["rejected"] == 150
        assert runs[key]["preemptions"] > 0


# -- the plots with --seeds -------------------------------------------------------------------


def _capture_errorbars(monkeypatch):
    import matplotlib.axes

    calls: list = []
    original = matplotlib.axes.Axes.errorbar

    def errorbar(self, x, y, yerr=None, **kw):
        calls.append((np.asarray(y, dtype=np.float64), np.asarray(yerr, dtype=np.float64)))
        return original(self, x, y, yerr=yerr, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "errorbar", errorbar)
    return calls


def _seed_rows(rng, n, ci: bool):
    rows = []
    for i in range(n):
        parts = rng.uniform(0.05, 0.35, 3)
        row = {"label": f"p{i}", "policy": f"p{i % 2}", "mode": "tiering",
               "high": 0.9, "low": 0.75, "host_gib": float(1 + i // 2),
               "token_hit_rate": float(parts.sum()),
               "ttft_p99_s": float(rng.uniform(5, 50))}
        for tier, v in zip(("device", "host", "disk"), parts, strict=True):
            row[f"token_hit_rate_{tier}"] = float(v)
        if ci:  # two seeds: intervals wider than the figures themselves
            row["token_hit_rate_ci95"] = float(rng.uniform(0.6, 1.5))
            row["ttft_p99_s_ci95"] = float(rng.uniform(60, 400))
        rows.append(row)
    return rows


def test_compare_intervals_stop_at_what_the_figure_can_be(monkeypatch, tmp_path):
    # with 2 seeds a 95% interval is wide: it was drawn to -3000 s of TTFT and past a hit
    # rate of 1, which also stretched the axes until the bars could not be told apart
    from tiering.apps.replay.plots import plot_compare

    calls = _capture_errorbars(monkeypatch)
    rows = _seed_rows(np.random.default_rng(5), 6, ci=True)
    plot_compare([r["label"] for r in rows], rows, [], tmp_path / "c.png")
    assert len(calls) == 2  # the hit rate, then TTFT
    (rate, rate_err), (ttft, ttft_err) = calls
    assert np.all(rate - rate_err[0] >= 0) and np.all(rate + rate_err[1] <= 1 + 1e-12)
    assert np.all(ttft - ttft_err[0] >= 0)
    assert np.all(ttft_err[1] > 0)  # the upper ends are kept
    assert (tmp_path / "c.png").stat().st_size > 0


def test_sweep_plots_draw_the_intervals_of_several_seeds(monkeypatch, tmp_path):
    from tiering.apps.replay.plots import plot_sweep

    calls = _capture_errorbars(monkeypatch)
    rng = np.random.default_rng(9)
    plot_sweep(_seed_rows(rng, 6, ci=False), tmp_path)
    assert calls == []  # one seed: no interval to draw
    rows = _seed_rows(rng, 6, ci=True)
    plot_sweep(rows, tmp_path)
    assert len(calls) == 4  # two policies x (hit rate, TTFT)
    for y, err in calls:
        assert np.all(err >= 0) and np.all(y - err[0] >= 0)
        assert err[1].max() > 0
    rate_calls = calls[:2]
    for y, err in rate_calls:
        assert np.all(y + err[1] <= 1 + 1e-12)


def test_interval_cuts_each_end_and_skips_what_is_not_finite():
    from tiering.apps.replay.plots import interval

    err = interval([0.2, 0.9, float("nan"), 3.0], [0.5, 0.5, 0.1, float("inf")], 0.0, 1.0)
    np.testing.assert_allclose(err, [[0.2, 0.5, 0.0, 0.0], [0.5, 0.1, 0.0, 0.0]])


def test_whom_to_pause_never_offers_a_request_whose_prefix_copy_is_landing(monkeypatch):
    # a request whose prefix blocks are still being copied up to the device cannot be
    # paused (the copy holds its pages); the run below (slow links: copies land late) has
    # pause decisions while one is in the batch, and none of them offers it
    _, policy, _ = _run_recording(monkeypatch, seed=8, n=300, host_pages=300,
                                  rates=LinkRates(5e7, 5e7, 1e7, 2e7))
    loading = [s for s in policy.seen
               if any(p == simulator_mod.LOADING for p in s["phase"].values())]
    assert loading, "no pause decision was made while a prefix copy was landing"
    for s in policy.seen:
        assert all(s["phase"][rid] != simulator_mod.LOADING for rid in s["rids"])



@pytest.mark.parametrize("value", ["-1", "0", "-0.5", "nan"])
def test_a_refused_device_size_says_the_bound_a_retry_must_meet(tmp_path, capsys, value):
    # --device-gib -1 said "must be a finite number >= 0", and 0 was then refused too
    from replay_helpers import MOONCAKE

    out = tmp_path / "o"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--device-gib", value])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert f"--device-gib: {value!r} must be a finite number > 0" in err, err


# -- the run named while it goes ----------------------------------------------------------------

_FAILS_AT_1GIB = """
    from tiering.policies import LRU

    class FailsLate(LRU):
        name = "fails-late"
        def sort_keys(self, batch, now):
            if len(batch) > 1:
                raise RuntimeError("late failure")
            return super().sort_keys(batch, now)
"""


def test_a_sweeps_progress_and_failure_name_the_run_as_the_summary_does(tmp_path, capsys,
                                                                        monkeypatch):
    # with --sweep every policy runs at several points, named label@high:low@host in
    # summary.json, the table and the CSVs; the progress lines and the message of a run
    # that failed named only the label, so six runs of 'lru' could not be told apart
    from replay_helpers import MOONCAKE

    out = tmp_path / "o"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--limit", "60", "--no-plots",
                      "--hardware", "small", "--sweep", "--policy", "lru", "--host-gib", "0,1",
                      "--watermarks", "0.9:0.75,0.8:0.6"])
    err = capsys.readouterr().err
    assert rc == 0
    keys = list(json.loads((out / "summary.json").read_text())["runs"])
    assert len(keys) == 6
    for i, key in enumerate(keys):
        assert f"replay [{i + 1}/6 {key}] started" in err, (key, err[:2000])
        assert f"replay [{i + 1}/6 {key}] done" in err

    name = f"user_{abs(hash(str(tmp_path))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_FAILS_AT_1GIB))
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = replay_main([str(MOONCAKE), "--out", str(tmp_path / "never"), "--limit", "300",
                      "--no-plots", "--hardware", "small", "--sweep", "--policy",
                      f"{name}:FailsLate", "--host-gib", "4", "--watermarks", "0.9:0.75",
                      "--preempt", "policy", "--seeds", "2", "--time-scale", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"run '{name}:FailsLate@0.9:0.75@4GiB' (seed 1 of 2) stopped" in err, err[-800:]
    assert "late failure" in err and not (tmp_path / "never").exists()


# -- jittered arrivals (--seeds) ----------------------------------------------------------------


def _gapped_trace(rng):
    """Bursts of requests a few tenths of a second apart (some on one timestamp) between
    idle gaps of ten minutes, as a service with quiet hours sees."""
    from tiering.apps.replay.traces import TraceRequest

    out, t = [], 0.0
    for burst in range(5):
        t += 600.0 if burst else 0.0
        for i in range(40):
            t += 0.0 if i % 8 == 0 else float(rng.exponential(0.3))
            out.append(TraceRequest(t, int(rng.integers(1, 4000)), int(rng.integers(0, 300))))
    return out


def test_jitter_moves_an_arrival_at_most_half_way_to_the_neighbour_it_moves_towards():
    # each arrival drew the gap to one neighbour and then moved by up to half of it either
    # way: the first request after ten idle minutes could arrive five minutes late, past
    # its whole burst, which is not noise in the arrival order but another trace
    from tiering.apps.replay.seeds import jitter

    rng = np.random.default_rng(21)
    trace = _gapped_trace(rng)
    t = np.array([r.arrival_s for r in trace])
    gaps = np.diff(t)
    before = np.concatenate(([gaps[0]], gaps))
    after = np.concatenate((gaps, [gaps[-1]]))
    moved_any = 0
    for seed in range(1, 30):
        j = np.array([r.arrival_s for r in jitter(trace, seed)])
        d = j - t
        assert np.all(d <= after / 2 + 1e-9), seed
        assert np.all(d >= -before / 2 - 1e-9) or np.all(j[d < -before / 2 - 1e-9] == 0.0)
        # so no arrival passes a neighbour: the order of the trace is kept
        assert np.all(np.diff(j) >= -1e-9), seed
        moved_any += int(np.count_nonzero(d))
    assert moved_any > 0  # it does move arrivals


# -- the bounds -----------------------------------------------------------------------------------


def test_the_belady_bound_never_exceeds_the_infinite_cache():
    # prompts that are whole blocks and come back in full: the replay (and the infinite
    # bound) still compute their last token, Belady's token figure counted every block
    # in full, and summary.json showed Belady above the infinite cache
    from tiering.apps.replay.bounds import belady, infinite
    from tiering.apps.replay.traces import TraceRequest

    rng = np.random.default_rng(13)
    trace = []
    for i in range(300):
        k = int(rng.integers(0, 6))
        n_blocks = int(rng.integers(1, 9))
        whole = rng.random() < 0.7
        n_in = n_blocks * 512 if whole else n_blocks * 512 + int(rng.integers(1, 512))
        trace.append(TraceRequest(float(i), n_in, int(rng.integers(0, 50)),
                                  tuple(range(k * 100, k * 100 + n_blocks))))
    inf = infinite(trace, 512)
    for cap in (4, 20, 10_000):
        b = belady(trace, 512, cap)
        assert b.token_hit_rate <= inf.token_hit_rate, (cap, b.token_hit_rate, inf)
        assert b.block_hit_rate <= inf.block_hit_rate
    # at a capacity that holds every block, MIN is the infinite cache
    big = belady(trace, 512, 10_000)
    assert big.token_hit_rate == inf.token_hit_rate and big.block_hit_rate == inf.block_hit_rate
    assert 0 < inf.token_hit_rate < 1


# -- a user's block policy that fails while a run goes -----------------------------------------

_BLOCK_MODULE = """
    from tiering.policies.blocks.generic import LRUBlocks

    class RaisesLate(LRUBlocks):
        name = "raises-late"
        def __init__(self, capacity=None):
            super().__init__(capacity)
            self.calls = 0
        def victims(self, now):
            self.calls += 1
            if self.calls > 20:
                raise RuntimeError("blew up choosing")
            yield from super().victims(now)

    class Foreign(LRUBlocks):
        name = "foreign"
        def victims(self, now):
            yield 987654321
            yield from super().victims(now)

    class AdmitsNone(LRUBlocks):
        name = "admits-none"
        def admit(self, key, depth, now):
            return None
"""


@pytest.mark.parametrize(("attr", "message"), [
    ("RaisesLate", "in victims at t="),
    ("Foreign", "in victims at t="),
    ("AdmitsNone", "in admit at t="),
])
def test_a_user_block_policy_failing_mid_run_is_named_and_exits_2(tmp_path, capsys,
                                                                  monkeypatch, attr, message):
    # a --block-policy module:Class is user code like a request policy, but a failure
    # inside it came out as a traceback (exit 1, the status of a failed write) from the
    # block index, a ValueError named as the run's own, or (admit answering None) not at all
    from replay_helpers import MOONCAKE

    name = f"blocks_{abs(hash((str(tmp_path), attr))) % 10**8}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(_BLOCK_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "never"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--limit", "200", "--no-plots",
                      "--hardware", "small", "--block-policy", f"{name}:{attr}"])
    err = capsys.readouterr().err
    assert rc == 2, err[-1500:]
    assert f"({name}.{attr}) of the device tier, {message}" in err, err[-800:]
    assert "Traceback" not in err and not out.exists()


def test_a_guarded_block_policy_runs_as_the_unguarded_one(monkeypatch):
    # the guard passes every answer through: a user's policy that behaves gives the run it
    # gives unwrapped (negative control: a guard that reverses the victims does not)
    from tiering.policies.blocks import default_block_registry

    from examples.replay_policies import KeepHeads
    from tiering.apps.replay import block_guard, block_tiers

    registry = default_block_registry().with_policy("heads", KeepHeads)
    sim = dataclasses.replace(SIM, block_policy="heads")
    spec = RunSpec("tiering", "lru", ControllerConfig(high=0.85, low=0.7))
    made: list = []
    real = block_guard.Guarded

    class Counting(real):
        def __init__(self, *a):
            super().__init__(*a)
            made.append(self)

    def run():
        return simulate(conversation_trace(5, 200), COST, spec, sim, kv_factory=_factory([]),
                        block_registry=registry, check=True)

    monkeypatch.setattr(block_tiers, "Guarded", Counting)
    guarded = run()
    assert len(made) == 3  # one per tier
    monkeypatch.setattr(block_tiers, "is_builtin", lambda p: True)
    plain = run()
    assert guarded.requests == plain.requests and guarded.decisions == plain.decisions
    assert guarded.counters == plain.counters

    class Reversed(real):
        def victims_except(self, now, *busy):
            yield from reversed(list(super().victims_except(now, *busy)))

    monkeypatch.setattr(block_tiers, "is_builtin", block_guard.is_builtin)
    monkeypatch.setattr(block_tiers, "Guarded", Reversed)
    assert run().decisions != plain.decisions


def test_a_defect_of_the_replay_itself_is_not_reported_as_a_bad_argument(tmp_path, capsys,
                                                                       monkeypatch):
    # every ValueError while a run went was printed as "run 'lru' stopped: ..." with exit
    # status 2, the status of a bad argument: the CandidateBatch refusal of --preempt
    # policy looked like the user's fault. Only a user's policy failing is reported so;
    # anything else keeps its traceback
    from replay_helpers import MOONCAKE

    def broken(self, *args, **kwargs):
        raise ValueError("an internal defect")

    monkeypatch.setattr(simulator_mod._Worker, "_serve_preempted", broken)
    with pytest.raises(ValueError, match="an internal defect"):
        replay_main([str(MOONCAKE), "--out", str(tmp_path / "o"), "--limit", "300",
                     "--no-plots", "--hardware", "small", "--time-scale", "0.2"])
    assert not (tmp_path / "o").exists()


def test_retention_refuses_an_unknown_destination_and_offload_without_the_hosts_room():
    from tiering.policies import LRU

    from tiering.apps.replay.presets import get_hardware
    from tiering.apps.replay.retention import ReloadCosts, Retention
    from tiering.types import Tier

    costs = ReloadCosts(get_hardware("small"), COST, MODEL.kv_bytes_per_token)
    blind = Retention(LRU(), costs, lambda rid: 50.0)
    with pytest.raises(ValueError, match="after must be one of"):
        blind.order(["a"], [1], [0.0], Tier.DEVICE, "tape", 1.0)
    with pytest.raises(ValueError, match="needs host_free_bytes"):
        blind.order(["a"], [1], [0.0], Tier.DEVICE, "offload", 1.0)
    assert blind.decisions == 0  # refused before anything was ordered
    rng = np.random.default_rng(2)
    sizes = [int(x) for x in rng.integers(1, 10**9, 6)]
    free = sorted(sizes)[3]
    seen = Retention(_Recording("largest"), costs, lambda rid: 50.0, lambda: free)
    seen.policy.pausing = {}
    order = seen.order([f"r{i}" for i in range(6)], sizes, [1.0] * 6, Tier.DEVICE, "offload",
                       2.0)
    assert order == [f"r{i}" for i in np.argsort(-np.array(sizes), kind="stable")]
    got = seen.policy.seen[0]["cost"]
    nbytes = np.array(sizes, dtype=np.float64)
    want = np.where(np.array(sizes) <= free, costs.from_host(nbytes), costs.from_disk(nbytes))
    np.testing.assert_array_equal(got, want)
