"""The stress harness: real cache, controller and disk tier under pressure and faults."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from resources.kv_geometry import KVGeometry
from tiering.apps.cli import main as tiering_main
from tiering.apps.stress.accounting import account_faults, loss_kind
from tiering.apps.stress.cli import main as stress_main
from tiering.apps.stress.config import StressConfig
from tiering.apps.stress.crash import check_restart, crash_cache, expected_kv, run_crash_check
from tiering.apps.stress.faults import FAILING_KINDS, FAULT_KINDS, CopyFaultPlan, parse_faults
from tiering.apps.stress.harness import StressHarness
from tiering.apps.stress.kvdata import write_tokens
from tiering.apps.stress.runner import run_stress
from tiering.core.transfer import CopyFault

REPORT_KEYS = {
    "operations", "bytes_moved", "faults_injected", "faults_survived", "requests_lost",
    "data_errors", "integrity_violations", "peak_rss_bytes", "duration_s", "seed", "faults",
}


@pytest.fixture(autouse=True)
def _quiet_cache_logs():
    """Every injected fault is logged by the cache; the reports count them instead."""
    logger = logging.getLogger("tiering")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    yield
    logger.setLevel(level)


def small_config(faults: tuple[str, ...], *, seed: int = 7, steps: int = 250, **kw) -> StressConfig:
    """A small cache (512-byte pages) that a working set of 24 requests overwhelms."""
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_tokens=4,
                          dtype=torch.bfloat16)
    settings = dict(
        seed=seed, steps=steps, faults=faults, fault_rate=0.1, slow_seconds=0.25,
        geometry=geometry, device_pages=24, host_pages=16, disk_chunks=24,
        max_request_pages=4, max_live=24, check_every_op=True,
    )
    settings.update(kw)
    return StressConfig(**settings)


def run_small(tmp_path, faults, **kw):
    sleeps: list[float] = []
    report = run_stress(small_config(faults, **kw), tmp_path, sleep=sleeps.append)
    return report, sleeps


def assert_clean(report) -> None:
    """No wrong byte, no broken invariant, no leak, nothing unexpected, every fault explained."""
    assert report["errors"] == []
    assert report["data_errors"] == 0, report["data_error_examples"]
    assert report["integrity_violations"] == 0, report["integrity_examples"]
    assert report["accounting_problems"] == []
    assert all(v == 0 for v in report["faults_unaccounted"].values()), report
    assert report["ok"] is True
    # every check ran after every operation, and the load really moved KV all the time
    assert report["integrity_checks"] > report["operations"]
    moves = report["moves"]
    reloads = moves["reloads_from_host"] + moves["reloads_from_disk"]
    assert moves["offloads_to_host"] >= 30 and moves["demotions"] >= 10 and reloads >= 20, moves
    assert moves["offloads_to_disk"] > 0 and moves["reloads_from_disk"] > 0, moves
    # every reload that landed was read back layer by layer before it could move again
    assert report["requests"]["reloads_verified"] == reloads


@pytest.mark.parametrize("kind", FAULT_KINDS)
def test_each_fault_kind_is_survived_or_loses_only_its_request(tmp_path, kind):
    report, sleeps = run_small(tmp_path, (kind,))
    assert_clean(report)
    injected = report["faults_injected"]
    assert injected[kind] > 0, f"{kind} was armed but never struck"
    assert all(n == 0 for k, n in injected.items() if k != kind), injected
    lost = report["requests_lost"]
    if kind in ("eio_read", "corrupt"):
        # each read fault lost exactly the request being reloaded, with a reason naming it
        assert report["faults_lost"][kind] == injected[kind] == lost["count"]
        assert lost["by_kind"] == {kind: injected[kind]}
        assert all(loss_kind(r) == kind for r in lost["reasons"])
        assert report["requests"]["recomputed"] > 0
    else:
        # the request stayed where it was; nothing was lost
        assert report["faults_survived"][kind] == injected[kind]
        assert lost["count"] == 0 and report["moves"]["lost"] == 0
    if kind in ("enospc_write", "eio_write"):
        errno_name = "ENOSPC" if kind == "enospc_write" else "EIO"
        assert report["disk"]["fault_errnos"] == {errno_name: injected[kind]}
        assert report["moves"]["demote_failures"] + report["moves"]["offload_failures"] == (
            injected[kind]
        )
    if kind == "copy":
        assert report["moves"]["offload_failures"] > 0 and report["moves"]["reload_failures"] > 0
    if kind == "slow":
        assert sleeps == [0.25] * injected["slow"]
    else:
        assert sleeps == []


def test_all_faults_together(tmp_path):
    report, sleeps = run_small(tmp_path, FAULT_KINDS, seed=11, steps=300)
    assert_clean(report)
    injected = report["faults_injected"]
    assert all(injected[k] > 0 for k in FAULT_KINDS), injected
    for kind in FAULT_KINDS:
        assert injected[kind] == report["faults_survived"][kind] + report["faults_lost"][kind]
    lost = report["requests_lost"]
    assert lost["count"] == injected["eio_read"] + injected["corrupt"]
    assert len(lost["reasons"]) == lost["count"]
    assert len(sleeps) == injected["slow"]


@pytest.mark.cuda
def test_all_faults_together_on_cuda(tmp_path):
    report, _ = run_small(tmp_path, FAULT_KINDS, seed=12, steps=300, device="cuda")
    assert_clean(report)
    assert report["device"] == "cuda"
    assert all(report["faults_injected"][k] > 0 for k in FAULT_KINDS)


def test_without_failing_faults_requests_leave_in_the_middle_of_copies(tmp_path):
    # no failing fault armed: a cancelled request leaves at once, even with a copy in flight
    report, _ = run_small(tmp_path, ("slow",), seed=5, steps=300, cancel_rate=0.15)
    assert_clean(report)
    assert report["requests"]["removed_in_flight"] > 0
    assert report["requests_lost"]["count"] == 0


def test_a_wrong_byte_is_reported_as_a_data_error(tmp_path):
    harness = StressHarness(small_config(()), tmp_path)
    real_read = harness.kv.read
    flipped = []

    def read_with_a_flipped_bit(rid, layer):
        k, v = real_read(rid, layer)
        if not flipped and k.numel():
            k.view(torch.int16).view(-1)[0] ^= 1
            flipped.append(rid)
        return k, v

    harness.kv.read = read_with_a_flipped_bit
    try:
        for _ in range(30):
            harness.step()
        harness.drain()
    finally:
        harness.close()
    assert flipped
    assert harness.counts.data_errors == 1
    assert flipped[0] in harness.data_error_examples[0]
    assert harness.counts.integrity_violations == 0


def test_accounting_flags_a_fault_without_an_outcome_and_a_loss_without_a_fault():
    kv_stats = {"offload_failures": 1, "demote_failures": 0, "reload_failures": 0}
    disk = {"write_faults": 1, "read_faults": 2, "corruptions": 0,
            "fault_errnos": {"ENOSPC": 1, "EIO": 2}}
    eio = "reload from disk failed: DiskIOError: [Errno 5] read of extent (3,) failed: boom"
    ok = account_faults(
        injected={"enospc_write": 1, "eio_read": 2}, copy_injected={}, slow_waits=0,
        kv_stats=kv_stats, disk_stats=disk, lost_reasons=[eio, eio],
    )
    assert ok.balanced and ok.lost["eio_read"] == 2 and ok.survived["enospc_write"] == 1
    missing = account_faults(
        injected={"enospc_write": 1, "eio_read": 2}, copy_injected={}, slow_waits=0,
        kv_stats=kv_stats, disk_stats=disk, lost_reasons=[eio],
    )
    assert not missing.balanced and missing.unaccounted["eio_read"] == 1
    stray = account_faults(
        injected={"enospc_write": 1, "eio_read": 2}, copy_injected={}, slow_waits=0,
        kv_stats=kv_stats, disk_stats=disk, lost_reasons=[eio, eio, "checksum mismatch"],
    )
    assert not stray.balanced and stray.lost_unexplained == 1


def test_copy_fault_plan_is_seeded_and_counts_each_direction():
    def fire(plan, n):
        out = []
        for i in range(n):
            direction = ("d2h", "h2d")[i % 2]
            try:
                plan(direction)
                out.append(False)
            except CopyFault:
                out.append(True)
        return out

    a, b = CopyFaultPlan(3, 0.3), CopyFaultPlan(3, 0.3)
    pattern = fire(a, 200)
    assert pattern == fire(b, 200) and 20 < sum(pattern) < 100
    assert sum(a.injected.values()) == sum(pattern)
    assert a.injected["d2h"] == sum(pattern[0::2])
    with pytest.raises(ValueError, match="direction"):
        a("sideways")


def test_fault_selection_and_config_validation():
    assert parse_faults("all") == FAULT_KINDS
    assert parse_faults("none") == ()
    assert parse_faults("copy, eio_read") == ("eio_read", "copy")
    with pytest.raises(ValueError, match="bogus"):
        parse_faults("eio_read,bogus")
    assert set(FAILING_KINDS) == set(FAULT_KINDS) - {"slow"}
    with pytest.raises(ValueError, match="exactly one of steps and duration_s"):
        StressConfig(steps=10, duration_s=1.0)
    with pytest.raises(ValueError, match="max_request_pages"):
        StressConfig(steps=10, device_pages=8, max_request_pages=6)
    with pytest.raises(ValueError, match="faults"):
        StressConfig(steps=10, faults=("melt",))


def test_crash_mid_write_restart_reattaches_only_committed_requests(tmp_path):
    outcome = run_crash_check(tmp_path, seed=4)
    assert outcome.problems == ()
    assert outcome.writes_in_flight, "the child was not killed inside a chunk write"
    assert outcome.committed, "nothing had been committed before the kill"
    found = set(outcome.reattached)
    assert outcome.committed <= found <= outcome.committed | outcome.uncertain
    assert outcome.verified == len(outcome.reattached)


def test_crash_check_catches_wrong_bytes_and_missing_commits(tmp_path):
    # a directory left by a process that committed two requests and then stopped
    with crash_cache(tmp_path) as kv:
        for rid in ("a", "b"):
            kv.ingest_request(rid)
            assert kv.allocate(rid, 20)
            write_tokens(kv.write, rid, expected_kv(1, rid), 0, 20)
            kv.offload(rid)
        kv.synchronize(30)
    tokens = {"a": 20, "b": 20, "ghost": 20}
    # checked against another seed's data, every reattached request is flagged
    check = check_restart(tmp_path, 2, tokens, {"a", "b", "ghost"}, set())
    assert check.reattached == ("a", "b") and check.verified == 0
    assert any("ghost" in p and "did not come back" in p for p in check.problems)
    assert sum("stale or wrong bytes" in p for p in check.problems) == 2


def test_cli_writes_the_report(tmp_path, capsys):
    out = tmp_path / "s.json"
    rc = tiering_main(["stress", "--steps", "60", "--faults", "all", "--seed", "3",
                       "--fault-rate", "0.05", "--slow-ms", "0", "--out", str(out)])
    assert rc == 0
    report = json.loads(out.read_text())
    assert REPORT_KEYS <= set(report)
    assert report["seed"] == 3 and report["faults"] == list(FAULT_KINDS)
    assert report["data_errors"] == 0 and report["integrity_violations"] == 0
    assert report["operations"] > 0 and report["bytes_moved"] > 0
    assert set(report["faults_injected"]) == set(FAULT_KINDS)
    assert set(report["requests_lost"]) >= {"count", "reasons"}
    assert report["peak_rss_bytes"] > 0
    assert "PASS" in capsys.readouterr().out
    assert stress_main(["--faults", "melt"]) == 2


def test_a_run_by_duration_stops_on_the_injected_clock(tmp_path):
    ticks = iter(range(10_000))
    config = small_config((), steps=None, duration_s=30.0, check_every_op=False)
    report = run_stress(config, tmp_path, wall=lambda: float(next(ticks)))
    # one tick to start, one per loop check: 30 ticks of the clock are 29 steps
    assert report["steps"] == 29
    assert report["ok"] and report["data_errors"] == 0 and report["integrity_violations"] == 0
