"""The demo worker: a transformer over PagedKVCache, served under pressure and without.

The central test serves the same requests twice, once on a device pool of a
quarter of the working set (host and disk tiers behind it, the eviction
controller moving KV) and once with everything on the device, and checks that
every request's tokens and final logits are bitwise equal, after checking that
the pressured run really moved KV out to host and disk and back.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiering.resources.kv_cache import PagedKVCache

from tiering.apps.demo import main
from tiering.apps.demo.model import ModelConfig, TinyDecoder
from tiering.apps.demo.scenario import DemoConfig, compare_outputs, plan_tiers, run_demo
from tiering.apps.demo.worker import (
    DemoWorker,
    RequestOutput,
    StepClock,
    WorkerConfig,
    WorkerStalled,
)
from tiering.apps.demo.workload import conversation_requests, synthetic_requests
from tiering.control.pressure import ScriptedPressure
from tiering.tiered import TieredKV

SMALL_MODEL = ModelConfig(
    vocab=96, width=48, layers=2, q_heads=4, kv_heads=2, head_dim=12, mlp_hidden=96
)


def small_config(seed: int = 7, **over) -> DemoConfig:
    kw = dict(
        requests=16,
        seed=seed,
        model=SMALL_MODEL,
        page_tokens=8,
        prompt_tokens=(24, 90),
        system_tokens=(24, 60),
        system_prompts=2,
        continue_p=0.5,
        corrupt_every=6,
        new_tokens=(4, 9),
        batch=2,
        prefill_chunk=32,
        quantum=3,
        device_fraction=0.25,
        host_fraction=0.08,
        disk_chunk_bytes=4 * 1536,  # 4 pages per chunk
        settle_each_step=True,  # the same moves and hits however busy the machine is
    )
    kw.update(over)
    return DemoConfig(**kw)


@pytest.fixture(autouse=True)
def _restore_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return run_demo(small_config(), tmp_path_factory.mktemp("disk"))


def test_pressured_run_moves_kv_through_host_and_disk(report):
    s = report.pressured.kv_stats
    assert s["offloads_to_host"] > 0
    assert s["reloads_from_host"] > 0
    assert s["demotions"] + s["offloads_to_disk"] > 0
    assert s["reloads_from_disk"] > 0
    assert s["lost"] == 0
    plan = report.pressured.plan
    assert plan.device_pages < plan.working_set_pages / 2
    samples = report.pressured.result.samples
    pb = report.pressured.page_bytes
    assert max(x.host_bytes for x in samples) > 0
    assert max(x.disk_bytes for x in samples) > 0
    assert all(x.device_bytes <= plan.device_pages * pb for x in samples)
    # the reference really ran without pressure
    r = report.reference.kv_stats
    assert r["offloads_to_host"] == r["offloads_to_disk"] == r["reloads_from_host"] == 0


def test_outputs_are_bitwise_identical_with_and_without_pressure(report):
    requests = small_config().draw_requests()
    ref = report.reference.result.outputs
    got = report.pressured.result.outputs
    assert set(ref) == set(got) == {r.rid for r in requests}
    for r in requests:
        assert len(got[r.rid].tokens) == r.max_new_tokens
        assert got[r.rid].tokens == ref[r.rid].tokens
        assert torch.equal(got[r.rid].final_logits, ref[r.rid].final_logits)
    assert compare_outputs(ref, got) == []
    assert report.summary["identical"] is True


def test_both_readiness_modes_give_the_reference_outputs(report):
    lw = report.summary["layerwise"]
    assert lw["whole_identical"] is True and lw["whole_mismatches"] == []
    assert report.whole is not None
    assert report.whole.kv_stats["reloads_admitted_early"] == 0  # whole-request readiness
    assert report.pressured.kv_stats["reloads_from_host"] > 0
    for side in ("layer", "whole"):
        assert lw[side]["first_layer_s"] > 0 and lw[side]["reloads_from_disk"] > 0
    assert compare_outputs(report.reference.result.outputs, report.whole.result.outputs) == []
    long = report.summary["long_request"]
    assert long["streamed"] is True and long["identical"] is True


def test_summary_counts_agree_with_the_cache(report):
    s = report.summary
    kv = report.pressured.kv_stats
    assert s["offloads"]["device_to_host"] == kv["offloads_to_host"]
    assert s["reloads"]["from_disk"] == kv["reloads_from_disk"]
    assert s["bytes_moved"]["disk_to_device"] == kv["bytes_disk_to_device"]
    total_new = sum(r.max_new_tokens for r in small_config().draw_requests())
    assert s["generated_tokens"] == total_new
    json.dumps(s)  # JSON-ready


def test_compare_outputs_reports_every_kind_of_difference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, generator=gen)
    a = {"r0": RequestOutput("r0", (1, 2, 3), logits), "r1": RequestOutput("r1", (4,), logits)}
    assert compare_outputs(a, dict(a)) == []
    nudged = logits.clone()
    nudged[5] = torch.nextafter(nudged[5], torch.tensor(math.inf))
    b = {"r0": RequestOutput("r0", (1, 9, 3), logits), "r1": RequestOutput("r1", (4,), nudged)}
    problems = compare_outputs(a, b)
    assert problems == ["r0: tokens differ from position 1", "r1: final logits differ"]
    assert compare_outputs(a, {"r0": a["r0"]}) == ["r1: missing from the other run"]


def _cache(model_cfg: ModelConfig, pages: int = 64) -> PagedKVCache:
    return PagedKVCache(model_cfg.kv_geometry(8), "cpu", pages, 1)


def _prefill(model, kv, rid, prompt, chunk):
    kv.ingest_request(rid)
    logits = None
    for start in range(0, prompt.numel(), chunk):
        piece = prompt[start : start + chunk]
        assert kv.allocate(rid, start + piece.numel())
        logits = model.forward(kv, rid, piece, start)
    return logits


def test_chunked_prefill_matches_one_pass():
    """Causal masking and positions are right: any chunking gives the same logits
    up to rounding, and so does the decode step that follows."""
    model = TinyDecoder(SMALL_MODEL, seed=11)
    prompt = torch.randint(0, SMALL_MODEL.vocab, (70,), generator=torch.Generator().manual_seed(5))
    with _cache(SMALL_MODEL) as kv:
        whole = _prefill(model, kv, "whole", prompt, 70)
        chunked = _prefill(model, kv, "chunked", prompt, 9)
        torch.testing.assert_close(chunked, whole, rtol=1e-4, atol=1e-4)
        nxt = torch.tensor([int(whole.argmax())])
        for rid in ("whole", "chunked"):
            assert kv.allocate(rid, 71)
        a = model.forward(kv, "whole", nxt, 70)
        b = model.forward(kv, "chunked", nxt, 70)
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_model_attends_over_what_the_cache_holds():
    """Change one cached K vector of an early token and the next logits change:
    the model's only memory of the context is the cache."""
    model = TinyDecoder(SMALL_MODEL, seed=11)
    gen = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, SMALL_MODEL.vocab, (40,), generator=gen)
    with _cache(SMALL_MODEL) as kv:
        for rid in ("a", "b"):
            _prefill(model, kv, rid, prompt, 16)
        k, v = kv.read("b", 0)
        bad = torch.randn(1, SMALL_MODEL.kv_heads, SMALL_MODEL.head_dim, generator=gen)
        kv.write("b", 0, 3, bad, v[3:4])
        nxt = torch.tensor([7])
        for rid in ("a", "b"):
            assert kv.allocate(rid, 41)
        clean = model.forward(kv, "a", nxt, 40)
        tampered = model.forward(kv, "b", nxt, 40)
        assert not torch.allclose(clean, tampered)


def test_model_is_a_function_of_its_seed():
    prompt = torch.randint(0, SMALL_MODEL.vocab, (20,), generator=torch.Generator().manual_seed(1))
    outs = []
    for seed in (4, 4, 5):
        with _cache(SMALL_MODEL) as kv:
            outs.append(_prefill(TinyDecoder(SMALL_MODEL, seed=seed), kv, "r", prompt, 20))
    assert torch.equal(outs[0], outs[1])
    assert not torch.equal(outs[0], outs[2])


def test_forward_refuses_a_mismatched_cache_or_allocation():
    model = TinyDecoder(SMALL_MODEL, seed=0)
    other = ModelConfig(vocab=96, width=48, layers=3, q_heads=4, kv_heads=2, head_dim=12,
                        mlp_hidden=96)
    with _cache(other) as kv:
        kv.ingest_request("r")
        assert kv.allocate("r", 4)
        with pytest.raises(ValueError, match="does not match the model"):
            model.forward(kv, "r", torch.tensor([1, 2, 3, 4]), 0)
    with _cache(SMALL_MODEL) as kv:
        kv.ingest_request("r")
        assert kv.allocate("r", 4)
        with pytest.raises(ValueError, match="expected start"):
            model.forward(kv, "r", torch.tensor([1, 2, 3]), 0)


def test_worker_gives_up_loudly_instead_of_hanging():
    """A request that can never get device room: the worker raises after
    max_stalled_steps steps with nothing to run, naming what it waited on."""
    reqs = synthetic_requests(1, 0, SMALL_MODEL.vocab, (60, 60), (2, 2))
    # 16 tokens of room, the first chunk needs 32; no pressure, so nothing ever moves
    tkv = TieredKV.around(_cache(SMALL_MODEL, pages=2), pressure=ScriptedPressure([0.0]))
    with tkv:
        worker = DemoWorker(
            TinyDecoder(SMALL_MODEL, seed=0), tkv, reqs,
            WorkerConfig(batch=1, prefill_chunk=32, max_stalled_steps=5), StepClock(),
        )
        with pytest.raises(WorkerStalled, match="nothing could run for 5 steps"):
            worker.run()
        assert worker.counters.allocation_refusals == 6
        assert tkv.stats("controller")["evict_calls"] == 5
        tkv.check_integrity()


def test_plan_always_fits_the_largest_request_and_a_batch_step():
    cfg = small_config(device_fraction=0.01)
    reqs = cfg.draw_requests()
    plan = plan_tiers(cfg, reqs, pressured=True)
    g = cfg.model.kv_geometry(cfg.page_tokens)
    largest = max(g.pages_for(r.kv_tokens) for r in reqs)
    growth = cfg.batch * (g.pages_for(cfg.prefill_chunk) + 1)
    assert largest <= (plan.high - 0.02) * plan.device_pages
    assert growth <= (1.0 - plan.high) * plan.device_pages + 1e-9
    assert 0 < plan.low < plan.high <= 0.9


def test_workload_is_seeded_and_well_formed():
    a = synthetic_requests(6, 9, 50, (10, 20), (2, 3))
    b = synthetic_requests(6, 9, 50, (10, 20), (2, 3))
    c = synthetic_requests(6, 10, 50, (10, 20), (2, 3))
    assert [r.rid for r in a] == [r.rid for r in b]
    assert all(torch.equal(x.prompt, y.prompt) for x, y in zip(a, b, strict=True))
    assert not all(
        x.prompt.numel() == y.prompt.numel() and torch.equal(x.prompt, y.prompt)
        for x, y in zip(a, c, strict=True)
    )
    assert all(10 <= r.prompt.numel() <= 20 and 2 <= r.max_new_tokens <= 3 for r in a)
    assert all(int(r.prompt.max()) < 50 for r in a)
    steps = [r.arrival_step for r in a]
    assert steps == sorted(steps)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: WorkerConfig(batch=0), "batch"),
        (lambda: WorkerConfig(batch=4, reload_window=2), "reload_window"),
        (lambda: ModelConfig(q_heads=3, kv_heads=2), "q_heads"),
        (lambda: DemoConfig(device_fraction=0.0), "device_fraction"),
        (lambda: DemoConfig(quantum=0), "quantum"),
        (lambda: synthetic_requests(2, 0, 10, (5, 4)), "prompt_tokens"),
        (lambda: DemoConfig(system_tokens=(9, 3)), "system_tokens"),
        (lambda: DemoConfig(continue_p=1.5), "continue_p"),
        (lambda: DemoConfig(workload="chat"), "workload"),
        (lambda: DemoConfig(corrupt_every=-1), "corrupt_every"),
    ],
)
def test_bad_settings_name_the_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"device_fraction": True}, "device_fraction"), ({"host_fraction": "0.5"}, "host_fraction"),
        ({"prompt_tokens": (1.5, 3)}, "prompt_tokens"), ({"new_tokens": (True, 3)}, "new_tokens"),
        ({"system_tokens": 5}, "system_tokens"), ({"continue_p": True}, "continue_p"),
        ({"continue_p": "x"}, "continue_p"), ({"min_residency_steps": float("inf")}, "min_residency"),
        ({"aging_steps": "1"}, "aging_steps"), ({"arrival_every": -1}, "arrival_every"),
        ({"arrival_every": float("nan")}, "arrival_every"), ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"), ({"seed": True}, "seed"), ({"device": "tpu"}, "device"),
        ({"policy": "bogus"}, "policy"), ({"prefix": "yes"}, "prefix"), ({"disk": 1}, "disk"),
        ({"settle_each_step": "no"}, "settle_each_step"), ({"model": None}, "model"),
        ({"system_prompts": True}, "system_prompts"),
    ],
)
def test_every_bad_demo_setting_is_a_value_error_naming_its_field(kwargs, field):
    """Wrong types, bools for numbers, NaN/inf, unknown names: each a ValueError that names
    the field (some were accepted and failed later, some raised TypeError)."""
    with pytest.raises(ValueError, match=f"DemoConfig.{field}"):
        DemoConfig(**kwargs)
    assert DemoConfig(**{k: v for k, v in DemoConfig().__dict__.items() if k in kwargs})


def test_cli_writes_summary_and_plot(tmp_path, capsys):
    out = tmp_path / "out"
    rc = main(["--requests", "3", "--seed", "2", "--device", "cpu", "--out", str(out)])
    printed = capsys.readouterr().out
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["identical"] is True
    assert summary["requests"] == 3
    assert "identical: true" in printed
    png = (out / "occupancy.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit):
        main(["--requests", "0"])
    assert "--requests must be >= 1" in capsys.readouterr().err


def test_cli_refuses_a_bad_device_and_out_before_running(tmp_path, capsys, monkeypatch):
    ran: list[object] = []
    monkeypatch.setattr("tiering.apps.demo.scenario.run_demo",
                        lambda *a, **k: ran.append(a))
    a_file = tmp_path / "a-file"
    a_file.write_bytes(b"not a directory")
    cases = {
        ("--device", "tpu"): "expected auto, cpu, cuda or cuda:N",
        ("--device", "cuda:x"): "expected auto, cpu, cuda or cuda:N",
        ("--device", "cpu", "--out", str(a_file)): "cannot create the output directory",
        ("--device", "cpu", "--out", str(a_file / "sub")): "cannot create the output directory",
        ("--device", "cpu", "--seed", "-1", "--out", str(tmp_path / "o")): "DemoConfig.seed",
    }
    for argv, why in cases.items():
        with pytest.raises(SystemExit) as info:
            main(["--requests", "2", *argv])
        assert info.value.code == 2, argv
        assert why in capsys.readouterr().err, argv
    assert ran == []  # refused before the run
    assert a_file.read_bytes() == b"not a directory"
    assert not (tmp_path / "o").exists()  # a refused config made no output directory


def test_prefix_hits_come_from_every_tier_and_save_prefill(report):
    px = report.summary["prefix"]
    hits = px["hit_tokens"]
    assert hits["device"] > 0 and hits["host"] > 0 and hits["disk"] > 0, hits
    assert px["prefill_tokens_saved"] > 0
    # the reuse path really skipped prefill: fewer prompt tokens were run than in the reference
    assert px["prompt_tokens_run"] + px["prefill_tokens_saved"] == px["reference_prompt_tokens_run"]
    assert px["blocks_moved"]["host_to_disk"] > 0 and px["disk_block_writes"] > 0
    assert report.summary["identical"] is True


def test_corrupted_block_is_detected_and_recomputed(report):
    px = report.summary["prefix"]
    assert px["corruptions_injected"] >= 1
    assert px["corrupt_blocks_detected"] >= 1
    assert px["recomputed_after_corruption"] > 0
    assert report.summary["identical"] is True  # recomputed, never served from wrong bytes


def test_wrong_root_finds_no_cached_tokens(report):
    px = report.summary["prefix"]
    assert px["right_root_cached_tokens"] > 0
    assert px["wrong_root_cached_tokens"] == 0


def test_reference_run_reuses_nothing(report):
    assert report.reference.prefix_stats is None
    c = report.reference.result.counters
    assert c["prefix_attached_tokens"] == 0


def test_model_is_batch_invariant_bitwise():
    """Any chunking, token by token included, gives bitwise the same logits and K/V:
    what makes a reused prefix indistinguishable from a recomputed one."""
    model = TinyDecoder(SMALL_MODEL, seed=3)
    prompt = torch.randint(0, SMALL_MODEL.vocab, (45,), generator=torch.Generator().manual_seed(8))
    with _cache(SMALL_MODEL) as kv:
        outs = [_prefill(model, kv, f"c{chunk}", prompt, chunk) for chunk in (45, 1, 7, 16)]
        for o in outs[1:]:
            assert torch.equal(o, outs[0])
        for layer in range(SMALL_MODEL.layers):
            ref = kv.read("c45", layer)
            for chunk in (1, 7, 16):
                got = kv.read(f"c{chunk}", layer)
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_conversation_workload_is_seeded_and_continues_earlier_requests():
    kw = dict(system_prompts=2, system_tokens=(10, 20), user_tokens=(5, 9), new_tokens=(2, 3),
              continue_p=0.6, continue_after=2)
    a = conversation_requests(20, 4, 50, **kw)
    b = conversation_requests(20, 4, 50, **kw)
    assert all(torch.equal(x.prompt, y.prompt) and x.parent == y.parent for x, y in zip(a, b, strict=True))
    by = {r.rid: r for r in a}
    conts = [r for r in a if r.parent is not None]
    assert conts, "no continuation was drawn"
    for r in conts:
        p = by[r.parent]
        assert r.context_tokens == p.context_tokens + p.prompt.numel() + p.max_new_tokens
        assert r.kv_tokens == r.context_tokens + r.prompt.numel() + r.max_new_tokens - 1
    assert len({r.parent for r in conts}) == len(conts)  # each conversation continues once
    fresh = [r for r in a if r.parent is None]
    heads = {tuple(r.prompt[:10].tolist()) for r in fresh}
    assert len(heads) <= 2  # they share the system prompts
