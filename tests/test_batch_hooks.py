"""The block policies' batch hooks give the runs of the per-event hooks, for every built-in
and for a user's policy; ``--jobs`` gives the runs of one process; the policy meter counts
and warns."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import time
import zlib
from collections import OrderedDict
from unittest import mock

import pytest
from conftest import conversation_trace
from tiering.policies.blocks import (
    BlockPolicy,
    ChainOdds,
    LRUBlocks,
    default_block_registry,
    register_block_policy,
)

from tiering.apps.replay import cli
from tiering.apps.replay import jobs as jobs_mod
from tiering.apps.replay.block_guard import PolicyMeter
from tiering.apps.replay.model_kv import LinkRates, ModeledKVCache
from tiering.apps.replay.presets import StepCost, get_hardware, get_model
from tiering.apps.replay.simulator import RunSpec, SimConfig, simulate
from tiering.blocks.index import BlockIndex
from tiering.blocks.replay import replay_blocks
from tiering.blocks.synth import SynthConfig, synthetic_chains
from tiering.types import Tier

COST = StepCost(get_model("llama-3.1-8b"), get_hardware("h100-80g"))
SIM = SimConfig(max_batch=16, max_step_tokens=1024, page_tokens=16, block_tokens=64)
BUILTINS = default_block_registry().names


class MyLRU(BlockPolicy):
    """A user's policy with the per-event hooks only (the batch hooks are the defaults)."""

    name = "my-lru"

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self._order: OrderedDict = OrderedDict()
        self.calls: dict[str, int] = {}

    def _count(self, hook: str) -> None:
        self.calls[hook] = self.calls.get(hook, 0) + 1

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def admit(self, key, depth, now) -> bool:
        self._count("admit")
        return depth < 14  # refuses deep blocks, so a refusal happens

    def on_insert(self, info, now) -> None:
        self._count("on_insert")
        self._order[info.key] = info.depth

    def on_hit(self, info, now) -> None:
        self._count("on_hit")
        self._order.move_to_end(info.key)

    def on_remove(self, key) -> None:
        self._count("on_remove")
        del self._order[key]

    def victims(self, now):
        yield from self._order


class DropsLastHit(LRUBlocks):
    """Negative control: an on_commit that forgets the request's last hit."""

    name = "drops-last-hit"

    def on_commit(self, keys, hits, depths, get, now) -> None:
        super().on_commit(keys, hits[:-1], depths[:-1], get, now)


class ForgetsStay(ChainOdds):
    """Negative control: an on_removes that does not learn how long the blocks stayed."""

    name = "forgets-stay"

    def on_removes(self, keys) -> None:
        stay = self._stay
        super().on_removes(keys)
        self._stay = stay


def _chains(seed: int, n: int) -> list[list[int]]:
    return synthetic_chains(n, seed, SynthConfig(gap_median=6.0))


@pytest.mark.parametrize("name", [*BUILTINS, "user"])
def test_block_replay_batch_equals_per_event(name):
    """replay_blocks through the batch hooks gives the per-event loop's hits, inserts,
    refusals, evictions and orphans, over random workloads and tight capacities."""
    rng = random.Random(zlib.crc32(name.encode()))  # the same workloads in every process
    for trial in range(3):
        chains = _chains(rng.randrange(1 << 30), 120)
        cap = rng.randint(8, 60)
        make = (lambda c: MyLRU(c)) if name == "user" else (
            lambda c: default_block_registry().make(name, capacity=c))
        per = replay_blocks(chains, cap, make(cap), check_every=7, batch=False)
        bat = replay_blocks(chains, cap, make(cap), check_every=7, batch=True)
        assert per[:9] == bat[:9], (name, trial, cap)
        assert per.evicted > 0 and per.hits > 0  # the capacity was tight enough to matter


def test_block_replay_batch_hooks_ran_and_a_broken_one_shows():
    chains = _chains(3, 150)
    with mock.patch.object(LRUBlocks, "pop_victim", autospec=True,
                           side_effect=LRUBlocks.pop_victim) as pop, \
            mock.patch.object(LRUBlocks, "on_publish", autospec=True,
                              side_effect=LRUBlocks.on_publish) as publish:
        replay_blocks(chains, 20, LRUBlocks(20), batch=True)
    assert pop.call_count > 0 and publish.call_count > 0
    # the same comparison catches a batch hook that is not the per-event hooks' work
    per = replay_blocks(chains, 20, DropsLastHit(20), batch=False)
    bat = replay_blocks(chains, 20, DropsLastHit(20), batch=True)
    assert per[:9] != bat[:9]


def test_chain_batch_removes_ran_and_one_that_skips_learning_shows():
    """ChainOdds' on_removes leaves the state on_remove of each would: the same run and
    the same learned stay; one that skips the learning differs (so the comparison can
    fail)."""
    chains = _chains(9, 300)
    with mock.patch.object(ChainOdds, "on_removes", autospec=True,
                           side_effect=ChainOdds.on_removes) as removes:
        fast = ChainOdds(30)
        bat = replay_blocks(chains, 30, fast, check_every=11, batch=True)
    assert removes.call_count > 50
    slow = ChainOdds(30)
    per = replay_blocks(chains, 30, slow, check_every=11, batch=False)
    assert per[:9] == bat[:9] and per.evicted > 50
    assert fast._stay == slow._stay != ChainOdds(30)._stay
    fast.check_integrity()
    broken = replay_blocks(chains, 30, ForgetsStay(30), batch=True)
    assert broken[:9] != per[:9]


def _kv_factory(device, host, disk):
    def factory(clock):
        return ModeledKVCache(COST.model.kv_bytes_per_token, 16, device, host, disk,
                              LinkRates(2e9, 2e9, 5e8, 1e9, 1e-5, 1e-5, 1e-4, 1e-4), clock)
    return factory


def _digest(res) -> tuple:
    return (res.requests, res.counters, res.decisions, res.timeline, res.kv_stats,
            res.controller_stats, res.makespan_s)


@pytest.mark.parametrize("name", [*BUILTINS, "user"])
@pytest.mark.parametrize("make_room", ["offload", "drop"])
def test_full_replay_batch_equals_per_event(name, make_room):
    """A whole simulated run (commit, publish, loads, bursts down the tiers) is the same
    with the batch hooks and with the per-event hooks, checked after every round."""
    registry = register_block_policy("user", MyLRU) if name == "user" else None
    trace = conversation_trace(11, 160, shared=0.6)
    runs = []
    for batch in (False, True):
        sim = SimConfig(**{**SIM.__dict__, "block_policy": name, "batch_hooks": batch,
                           "make_room": make_room})
        runs.append(simulate(trace, COST, RunSpec("tiering", "lru"), sim,
                             kv_factory=_kv_factory(200, 60, 300), block_registry=registry,
                             check=True))
    per, bat = runs
    assert _digest(per) == _digest(bat)
    c = per.counters
    if make_room == "offload":  # every point was used
        assert c.block_moves_host and c.block_loads and c.reused_tokens
    else:  # device victims are dropped, as asked: no block goes below, none loads
        assert c.block_drops and c.reused_tokens and not c.block_moves_host


def test_full_replay_used_the_batch_hooks():
    trace = conversation_trace(4, 120, shared=0.6)
    calls = {}
    spies = {h: mock.patch.object(ChainOdds, h, autospec=True, side_effect=getattr(ChainOdds, h))
             for h in ("on_commit", "on_publish", "pop_victim", "on_inserts", "on_removes")}
    for batch in (True, False):
        with spies["on_commit"] as commit, spies["pop_victim"] as pop, \
                spies["on_inserts"] as inserts, spies["on_publish"] as publish, \
                spies["on_removes"] as removes:
            sim = SimConfig(**{**SIM.__dict__, "block_policy": "chain", "batch_hooks": batch})
            simulate(trace, COST, RunSpec("tiering", "lru"), sim,
                     kv_factory=_kv_factory(200, 60, 300))
            calls[batch] = (commit.call_count, publish.call_count, pop.call_count,
                            inserts.call_count, removes.call_count)
    assert all(calls[True]) and not any(calls[False])


def test_the_meter_counts_every_hook_and_warns_once_over_budget():
    trace = conversation_trace(8, 100, shared=0.6)
    registry = register_block_policy("user", MyLRU)
    ticks = iter(range(10**9))
    warned: list[str] = []
    # a fake clock: every call into the policy takes 1 ms, over a 20 µs budget
    meter = PolicyMeter("user", budget_s=20e-6, warn=warned.append,
                        timer=lambda: next(ticks) * 1e-3)
    sim = SimConfig(**{**SIM.__dict__, "block_policy": "user"})
    res = simulate(trace, COST, RunSpec("tiering", "lru"), sim,
                   kv_factory=_kv_factory(200, 60, 300), block_registry=registry,
                   block_meter=meter)
    assert len(warned) == 1 and "'user' is slow" in warned[0] and "budget 20 µs" in warned[0]
    by_hook: dict[str, int] = {}
    for row in res.policy_cost:
        by_hook[row.hook] = by_hook.get(row.hook, 0) + row.calls
        assert row.seconds == pytest.approx(row.calls * 1e-3)
    assert {"on_request", "on_hit", "admit", "on_insert", "on_remove"} <= set(by_hook)
    # every tier is told every attach, and every request is attached at least once (an
    # attach refused for room, or a request freed when its loads landed short of room, is
    # attached again later and told again, as the cache tells each attach)
    assert by_hook["on_request"] % 3 == 0 and by_hook["on_request"] >= 3 * len(trace)

    quiet: list[str] = []
    fast = PolicyMeter("user", budget_s=20e-6, warn=quiet.append, timer=lambda: 0.0)
    simulate(trace, COST, RunSpec("tiering", "lru"), sim, kv_factory=_kv_factory(200, 60, 300),
             block_registry=registry, block_meter=fast)
    assert quiet == [] and fast.events > 0


def test_meter_refuses_a_bad_budget():
    with pytest.raises(ValueError, match="budget_s"):
        PolicyMeter("x", budget_s=0)


def test_insert_run_equals_inserts_and_refuses_bad_runs_whole():
    rng = random.Random(5)
    a, b = BlockIndex(), BlockIndex()
    for idx in (a, b):
        idx.insert(1, None, Tier.DEVICE, "h1", 0.5)
    keys = [rng.randrange(10, 10**6) for _ in range(7)]
    handles = [f"h{k}" for k in keys]
    assert a.insert_run(keys, 1, Tier.DEVICE, handles, 2.0, acquire=True)
    parent = 1
    for k, h in zip(keys, handles, strict=True):
        assert b.insert(k, parent, Tier.DEVICE, h, 2.0)
        b.acquire(k)
        parent = k
    a.check_integrity()
    for name in ("_node", "_tier", "_refs", "_hits", "_last",
                 "_kids", "_below", "_counts"):
        assert getattr(a, name) == getattr(b, name), name
    before = dict(a._tier)
    with pytest.raises(ValueError, match="already in the index"):
        a.insert_run([10**7, keys[3]], keys[-1], Tier.DEVICE, ["x1", "x2"], 3.0)
    with pytest.raises(ValueError, match="handles"):
        a.insert_run([10**7, 10**7 + 1], keys[-1], Tier.DEVICE, ["x1", "x1"], 3.0)
    assert a._tier == before
    assert not a.insert_run([10**7], 999, Tier.DEVICE, ["x1"], 3.0)  # parent not cached
    with pytest.raises(ValueError, match="not mapped"):
        a.release_many([keys[0], keys[0]])  # mapped once
    assert a._refs[keys[0]] == 1
    a.release_many(keys)
    a.check_integrity()


def _cli(tmp_path, name, *extra):
    trace = conversation_trace(21, 90, shared=0.6)
    path = tmp_path / "trace.jsonl"
    with path.open("w") as f:
        for t in trace:
            f.write(json.dumps({"timestamp": int(t.arrival_s * 1000),
                                "input_length": t.input_tokens,
                                "output_length": t.output_tokens,
                                "hash_ids": list(t.hash_ids)}) + "\n")
    out = tmp_path / name
    argv = [str(path), "--out", str(out), "--sweep", "--policy", "lru,cost",
            "--host-gib", "0,4", "--watermarks", "0.9:0.75", "--device-gib", "1",
            "--no-plots", "--seeds", "2", *extra]
    return cli.main(argv), out


def test_jobs_gives_the_runs_of_one_process(tmp_path):
    code1, one = _cli(tmp_path, "one")
    code2, two = _cli(tmp_path, "two", "--jobs", "2")
    assert code1 == code2 == 0
    a = json.loads((one / "summary.json").read_text())
    b = json.loads((two / "summary.json").read_text())
    assert list(a["runs"]) == list(b["runs"]) and a["runs"] == b["runs"]
    assert a["bounds"] == b["bounds"]
    assert (one / "sweep.csv").read_text() == (two / "sweep.csv").read_text()
    assert not (one / "runs.jsonl").exists() and not (two / "runs.jsonl").exists()


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_keeps_every_finished_run(tmp_path, jobs, monkeypatch):
    """Ctrl-C after the second run came back: those runs are on disk, named, with the
    rows a whole replay gives them; nothing else is written; exit status 130."""
    code, full = _cli(tmp_path, "full", "--seeds", "1")
    assert code == 0
    rows = json.loads((full / "summary.json").read_text())["runs"]
    real = jobs_mod.Keeper.__call__

    def keep_then_interrupt(self, done):
        real(self, done)
        if self.kept == 2:
            raise KeyboardInterrupt

    monkeypatch.setattr(jobs_mod.Keeper, "__call__", keep_then_interrupt)
    code, out = _cli(tmp_path, "cut", "--seeds", "1", "--jobs", jobs)
    assert code == 130
    kept = [json.loads(line) for line in (out / "runs.jsonl").read_text().splitlines()]
    assert len(kept) == 2 and len(rows) > 2
    for k in kept:  # the run's own row (summary.json adds report columns to it)
        assert k["row"] and {c: rows[k["name"]][c] for c in k["row"]} == k["row"]
    assert sorted(p.name for p in out.iterdir()) == ["runs.jsonl"]


def _job_context(n: int) -> jobs_mod.JobContext:
    return jobs_mod.JobContext([], None, None, None, None, 1.0, None,
                               [f"run-{i}" for i in range(n)], 1, True, False)


def test_jobs_keep_no_state_at_module_level():
    """Each worker is handed its context; the module holds no table a worker fills."""
    mutable = [n for n, v in vars(jobs_mod).items()
               if not n.startswith("__") and isinstance(v, (list, dict, set))]
    assert mutable == []


fork_only = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(),
                               reason="the workers see the test's stand-in run only when forked")


@fork_only
def test_jobs_deliver_in_order_and_raise_a_workers_error(monkeypatch):
    rng = random.Random(5)
    pause = {i: rng.random() * 0.05 for i in range(6)}

    def fake_run(ctx, task, stream=None):
        time.sleep(pause[task[1]])  # finish out of order
        if task[1] == 4 and ctx.keys[0] == "boom":
            raise ValueError(f"run {task[1]} exploded")
        return jobs_mod.RunDone(task[0], task[1], {"i": task[1]}, None, None)

    monkeypatch.setattr(jobs_mod, "run_one", fake_run)
    got: list = []
    jobs_mod.run_all(_job_context(6), 3, got.append)
    assert [d.index for d in got] == list(range(6))
    ctx = _job_context(6)._replace(keys=["boom", *[f"run-{i}" for i in range(1, 6)]])
    with pytest.raises(ValueError, match="run 4 exploded"):
        jobs_mod.run_all(ctx, 3, lambda d: None)


@fork_only
def test_jobs_name_a_worker_that_died(monkeypatch):
    def dies(ctx, task, stream=None):
        os._exit(3)

    monkeypatch.setattr(jobs_mod, "run_one", dies)
    with pytest.raises(RuntimeError, match="exit status 3"):
        jobs_mod.run_all(_job_context(2), 2, lambda d: None)


@fork_only
def test_jobs_name_workers_that_all_ended_without_answering(monkeypatch):
    """A run that ends its worker with status 0 (a policy calling sys.exit(0), say) sends
    no answer: once every worker has ended, the sweep says so instead of waiting."""
    def leaves(ctx, task, stream=None):
        os._exit(0)

    monkeypatch.setattr(jobs_mod, "run_one", leaves)
    with pytest.raises(RuntimeError, match="every worker process ended while 2 runs"):
        jobs_mod.run_all(_job_context(2), 2, lambda d: None)
