"""``tiering replay`` as a user reads it: a default output directory, a table that fits 100
columns, the warnings that say when a comparison means little (a saturated worker, a
policy never consulted), another model's KV size, and figures that show what they claim."""

from __future__ import annotations

import json
import re

import pytest
from replay_helpers import MOONCAKE

from tiering.apps.replay import main as replay_main
from tiering.apps.replay import report
from tiering.apps.replay.bounds import BoundResult
from tiering.apps.replay.results import RequestRecord, Sample

AZURE = MOONCAKE.parent.parent / "azure2023" / "AzureLLMInferenceTrace_code.csv"


def _records(ttfts: list[float]) -> list[RequestRecord]:
    return [RequestRecord(f"r{i}", float(i), float(i) + w, float(i) + w + 1.0, 100, 10,
                          "finished", None, 0) for i, w in enumerate(ttfts)]


def test_saturation_is_a_queue_that_grows_through_the_run():
    import random

    rng = random.Random(5)
    growing = [0.5 + 2.0 * i + rng.random() for i in range(80)]
    steady = [0.5 + rng.random() for _ in range(80)]
    sat = report.saturation(_records(growing))
    assert sat.saturated and sat.late_s > 4 * sat.early_s
    assert not report.saturation(_records(steady)).saturated
    # slow from the start but not growing: not saturated (a long prefill is not a queue)
    assert not report.saturation(_records([30 + rng.random() for _ in range(80)])).saturated
    assert not report.saturation(_records(growing[:10])).saturated  # too few to tell


def test_warnings_name_each_run_a_caveat_applies_to():
    rows = [
        {"mode": "tiering", "rejected": 0, "requests": 10, "offloads_to_host": 0,
         "offloads_to_disk": 0, "demotions": 0},
        {"mode": "tiering", "rejected": 3, "requests": 10, "offloads_to_host": 2,
         "offloads_to_disk": 1, "demotions": 4},
        {"mode": "recompute", "rejected": 0, "requests": 10},
    ]
    sat = {"b": report.Saturation(True, 1.0, 50.0), "a": report.Saturation(False, 1.0, 1.0)}
    lines = report.warnings(["a", "b", "recompute"], rows, sat)
    assert report.policy_decisions(rows[1]) == 7
    assert len(lines) == 3
    assert "b 3 of 10" in lines[0]
    assert "made no decision" in lines[1] and ": a;" in lines[1]
    assert "saturated" in lines[2] and "b (1 s -> 50 s)" in lines[2]
    assert report.warnings(["b"], [dict(rows[1], rejected=0)], {}) == []


def test_the_table_fits_100_columns_whatever_the_run_names():
    row = {"mode": "tiering", "finished": 12031, "rejected": 4123, "requests": 16154,
           "throughput_tok_s": 123456.7, "ttft_p50_s": 1234.5, "ttft_p99_s": 98765.4,
           "tpot_p50_s": 0.0123, "offloads_to_host": 123456, "offloads_to_disk": 65432,
           "demotions": 4321, "token_hit_rate": 0.4567, "block_hit_rate": 0.5678, "seeds": 3}
    keys = ["examples.replay_policies:IdleBytes@0.95:0.85@1536GiB", "lru"]
    bounds = [BoundResult("infinite", float("inf"), 0.6, 0.61, 10, 640),
              BoundResult("belady", 123456789, 0.5, 0.51, 10, 640)]
    table = report.format_table(keys, [row, dict(row, mode="recompute")], bounds)
    lines = table.splitlines()
    assert max(len(line) for line in lines) <= 100, max(len(line) for line in lines)
    assert "…" in lines[2] and lines[2].startswith("examples.")  # shortened in the middle
    assert "193,209" in lines[2]  # the policy's decisions: 123,456 + 65,432 + 4,321
    assert lines[3].split()[7] == "-"  # no policy in a baseline
    assert "bound: belady" in table and "95% intervals" in lines[-1]


def _replay(tmp_path, capsys, *args: str):
    out = tmp_path / "out"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--no-plots", *args])
    captured = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text()) if rc == 0 else None
    return rc, summary, captured


def test_without_out_the_replay_writes_into_replay_out(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc = replay_main([str(MOONCAKE), "--limit", "40", "--no-plots", "-q"])
    assert rc == 0, capsys.readouterr().err
    assert (tmp_path / "replay-out" / "summary.json").is_file()
    assert "started" not in capsys.readouterr().err  # -q: no progress lines


def test_a_saturated_worker_and_an_idle_policy_are_warned_about(tmp_path, capsys):
    """The small worker at the trace's own rate cannot keep up (the queue grows); the same
    trace 30 times slower it can. On the large worker the policy is never needed."""
    rc, summary, cap = _replay(tmp_path, capsys, "--limit", "200", "--hardware", "small")
    assert rc == 0, cap.err
    assert summary["runs"]["lru"]["saturated"] is True
    assert any("saturated" in w and "lru (" in w for w in summary["warnings"])
    assert "the simulated worker is saturated" in cap.err
    run = summary["runs"]["lru"]
    assert run["policy_decisions"] == (run["offloads_to_host"] + run["offloads_to_disk"]
                                       + run["demotions"]) > 0
    assert not any("made no decision" in w for w in summary["warnings"])

    rc, slow, cap = _replay(tmp_path, capsys, "--limit", "200", "--hardware", "small",
                            "--time-scale", "30")
    assert rc == 0, cap.err
    assert slow["runs"]["lru"]["saturated"] is False
    assert "saturated" not in cap.err

    rc, idle, cap = _replay(tmp_path, capsys, "--limit", "40", "--time-scale", "30")
    assert rc == 0, cap.err
    assert idle["runs"]["lru"]["policy_decisions"] == 0
    assert "made no decision" in cap.err and "lru" in cap.err


def test_another_models_kv_size_from_a_flag_or_a_config_file(tmp_path, capsys):
    rc, base, cap = _replay(tmp_path, capsys, "--limit", "40")
    assert rc == 0, cap.err
    assert base["model"]["kv_bytes_per_token"] == 131072  # llama-3.1-8b's
    rc, half, cap = _replay(tmp_path, capsys, "--limit", "40", "--kv-bytes-per-token", "65536")
    assert rc == 0, cap.err
    assert half["model"]["kv_bytes_per_token"] == 65536
    assert half["bounds"]["belady"]["capacity_blocks"] == (
        2 * base["bounds"]["belady"]["capacity_blocks"])

    hf = tmp_path / "config.json"  # a Hugging Face config of an 8B-class model
    hf.write_text(json.dumps({
        "_name_or_path": "some-8b", "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
        "vocab_size": 128256, "torch_dtype": "bfloat16"}))
    rc, other, cap = _replay(tmp_path, capsys, "--limit", "40", "--model-config", str(hf))
    assert rc == 0, cap.err
    assert other["model"]["name"] == "some-8b"
    assert other["model"]["kv_bytes_per_token"] == 131072
    assert 7.5 < other["model"]["params_b"] < 8.5


@pytest.mark.parametrize("args,match", [
    (["--kv-bytes-per-token", "0"], "--kv-bytes-per-token"),
    (["--kv-bytes-per-token", "lots"], "--kv-bytes-per-token"),
    (["--model-config", "/nonexistent/config.json"], "--model-config"),
    (["--model-config", "{cfg}", "--model", "llama-3.1-70b"], "give one"),
    (["--model-config", "{bad}"], "missing field 'num_attention_heads'"),
])
def test_a_bad_model_argument_is_named_and_exits_2(tmp_path, capsys, args, match):
    (tmp_path / "cfg.json").write_text(json.dumps({
        "num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "params_b": 1.0}))
    (tmp_path / "bad.json").write_text(json.dumps({"num_hidden_layers": 2}))
    args = [a.format(cfg=tmp_path / "cfg.json", bad=tmp_path / "bad.json") for a in args]
    rc = replay_main([str(MOONCAKE), "--out", str(tmp_path / "o"), "--limit", "10", *args])
    assert rc == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_presets_are_described_in_the_help(capsys):
    assert replay_main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "llama-3.1-70b: 80 layers, 8 KV heads of 128, 320 KiB of KV a token" in text
    assert "small: 2 GiB device KV, 4 GiB host, 16 GiB disk" in text
    assert "--kv-bytes-per-token" in text and "--model-config" in text


def _rows(hit: bool):
    rows = []
    for i, rejected in enumerate((0, 7)):
        rows.append({"token_hit_rate_device": 0.3 * hit, "token_hit_rate_host": 0.1 * hit,
                     "token_hit_rate_disk": 0.05 * hit, "token_hit_rate": 0.45 * hit,
                     "lookup_blocks": 100 * hit, "ttft_p99_s": 2.5 + i, "rejected": rejected,
                     "saturated": bool(i)})
    return rows


def test_compare_draws_values_rejected_counts_and_both_bounds_apart():
    pytest.importorskip("matplotlib")
    from matplotlib import pyplot as plt

    from tiering.apps.replay.plots import compare_figure

    bounds = [BoundResult("infinite", float("inf"), 0.6, 0.6, 10, 640),
              BoundResult("belady", 1000, 0.6, 0.6, 10, 640)]  # equal: both must still show
    fig = compare_figure(["lru", "largest"], _rows(True), bounds)
    try:
        left, right = fig.axes
        assert [t.get_text() for t in left.texts] == ["0.450", "0.450"]
        assert [t.get_text() for t in right.texts] == ["2.5", "3.5"]
        ticks = [t.get_text() for t in left.get_xticklabels()]
        assert ticks == ["lru", "largest\n7 rejected\nsaturated"]
        lines = {line.get_label(): line for line in left.get_lines()}
        inf, bel = lines["infinite bound 0.600"], lines["belady bound 0.600"]
        assert inf.get_color() != bel.get_color()
        assert inf.get_linestyle() != bel.get_linestyle()
        assert bel.get_zorder() > inf.get_zorder()  # drawn over the infinite-cache line
    finally:
        plt.close(fig)


def test_compare_has_no_hit_rate_panel_for_a_trace_without_block_hashes():
    pytest.importorskip("matplotlib")
    from matplotlib import pyplot as plt

    from tiering.apps.replay.plots import compare_figure

    bounds = [BoundResult("infinite", float("inf"), 0.0, 0.0, 0, 0),
              BoundResult("belady", 1000, 0.0, 0.0, 0, 0)]
    fig = compare_figure(["lru", "largest"], _rows(False), bounds)
    try:
        assert len(fig.axes) == 1
        assert "no block hashes" in fig.axes[0].get_title()
    finally:
        plt.close(fig)
    fig = compare_figure(["lru", "largest"], _rows(True), bounds)  # hits without bounds
    try:
        assert len(fig.axes) == 2
    finally:
        plt.close(fig)


def test_timeline_lines_differ_in_more_than_colour(tmp_path):
    pytest.importorskip("matplotlib")
    from tiering.apps.replay import plots

    drawn = []
    samples = [Sample(float(t), 10 * t, 5 * t, 2 * t, 100 * t, 10 * t, 5 * t, 1 * t)
               for t in range(1, 60)]
    labels = ["recompute", "no-tiering", "lru", "largest"]
    caps = {k: {"device_bytes": 1000, "host_bytes": 1000, "disk_bytes": 1000} for k in labels}
    import matplotlib.axes

    original = matplotlib.axes.Axes.plot

    def spy(self, *a, **kw):
        drawn.append(kw)
        return original(self, *a, **kw)

    matplotlib.axes.Axes.plot = spy
    try:
        plots.plot_timeline({k: samples for k in labels}, caps, tmp_path / "t.png")
    finally:
        matplotlib.axes.Axes.plot = original
    styles = {}
    for kw in drawn:
        styles.setdefault(kw["label"], set()).add((kw["linestyle"], kw["marker"]))
    assert set(styles) == set(labels)
    assert all(len(s) == 1 for s in styles.values())  # one style per run in every panel
    assert len({next(iter(s)) for s in styles.values()}) == len(labels)


def test_a_sweep_without_block_hashes_draws_no_hit_rate_figure(tmp_path):
    pytest.importorskip("matplotlib")
    from tiering.apps.replay.plots import plot_sweep

    def rows(hit: float):
        out = [{"mode": "recompute", "label": "recompute", "token_hit_rate": hit,
                "ttft_p99_s": 9.0, "lookup_blocks": 0}]
        for policy in ("lru", "largest"):
            for host in (0.0, 4.0):
                out.append({"mode": "tiering", "policy": policy, "high": 0.9, "low": 0.75,
                            "host_gib": host, "token_hit_rate": hit, "ttft_p99_s": 3.0 + host,
                            "lookup_blocks": 0})
        return out

    (tmp_path / "none").mkdir()
    names = {p.name for p in plot_sweep(rows(0.0), tmp_path / "none")}
    assert names == {"ttft_p99_vs_host.png"}
    (tmp_path / "some").mkdir()
    names = {p.name for p in plot_sweep(rows(0.25), tmp_path / "some")}
    assert names == {"ttft_p99_vs_host.png", "hit_rate_vs_host.png"}


_HF = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
       "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256,
       "torch_dtype": "bfloat16"}


@pytest.mark.parametrize("field, value", [
    ("num_attention_heads", 0),  # was ZeroDivisionError, a traceback out of the command
    ("num_attention_heads", True),  # was head_dim 4096 (hidden // True): 32x the KV, silently
    ("num_attention_heads", -32),
    ("hidden_size", "4096"),  # was "unsupported operand type(s) for //", naming no field
    ("head_dim", 0),  # was taken for "absent", silently
    ("num_key_value_heads", 2.5),
    ("intermediate_size", False),
    ("vocab_size", -1),
])
def test_a_hugging_face_config_with_a_bad_count_is_refused_naming_the_field(
        tmp_path, field, value):
    from tiering.apps.replay.presets import model_from_file

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_HF, field: value}))
    with pytest.raises(ValueError, match=rf"--model-config {path}: {field} must be an int >= 1, "
                                         rf"got {re.escape(repr(value))}"):
        model_from_file(str(path))


def test_a_hugging_face_config_with_null_kv_heads_has_one_per_attention_head(tmp_path):
    from tiering.apps.replay.presets import model_from_file

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**_HF, "num_key_value_heads": None, "head_dim": None}))
    model = model_from_file(str(path))  # null is absent, as Hugging Face writes it
    assert (model.num_kv_heads, model.head_dim) == (32, 128)
    path.write_text(json.dumps(_HF))  # the control
    assert (model_from_file(str(path)).num_kv_heads, model_from_file(str(path)).head_dim) == (8, 128)


def test_the_replay_command_names_a_config_with_no_attention_heads(tmp_path, capsys):
    (tmp_path / "hf.json").write_text(json.dumps({**_HF, "num_attention_heads": 0}))
    rc = replay_main([str(MOONCAKE), "--out", str(tmp_path / "o"), "--limit", "10",
                      "--model-config", str(tmp_path / "hf.json")])
    assert rc == 2
    assert "num_attention_heads must be an int >= 1, got 0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
