"""Block policies as a replay axis: ``--block-policy a,b,module:Class`` and
``Grid.block_policies`` compare retention policies of the cached prefix blocks in one
run, a user's own class among them."""

from __future__ import annotations

import json

import pytest
from replay_helpers import MOONCAKE
from tiering.policies.blocks import default_block_registry

from examples.replay_policies import KeepHeads
from tiering.apps.replay import main as replay_main
from tiering.apps.replay.presets import get_hardware, get_model
from tiering.apps.replay.simulator import SimConfig
from tiering.apps.replay.sweep import Grid, run_grid
from tiering.apps.replay.traces import load_trace
from tiering.testing.blocks import check_block_policy

USER = "examples.replay_policies:KeepHeads"
SMALL = ["--hardware", "small", "--device-gib", "0.5", "--host-gib", "0.25", "--disk-gib", "1"]


def test_the_user_block_policy_passes_the_shipped_contract():
    check_block_policy(KeepHeads)
    check_block_policy(lambda capacity: KeepHeads(capacity, head=1))
    with pytest.raises(ValueError, match="KeepHeads.head must be an int >= 1"):
        KeepHeads(head=0)


def test_one_cli_run_compares_block_policies_a_user_class_among_them(tmp_path, capsys):
    out = tmp_path / "out"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--limit", "400", *SMALL,
                      "--block-policy", f"lru,chain,{USER}", "--no-plots"])
    assert rc == 0
    printed = capsys.readouterr().out
    runs = json.loads((out / "summary.json").read_text())["runs"]
    labels = ["recompute", "no-tiering", "lru | lru", "lru | chain", f"lru | {USER}"]
    assert list(runs) == labels
    assert all(label in printed for label in labels)
    assert [runs[k]["block_policy"] for k in labels] == ["lru", "lru", "lru", "chain", USER]
    hits = {k: runs[k]["token_hit_rate"] for k in labels[2:]}
    # the block policy decides what is kept: the three runs do not all reuse alike
    assert len({round(v, 9) for v in hits.values()}) > 1, hits
    assert all(0 < v <= 1 for v in hits.values())
    # and the user's class ran: its label's figures differ from plain LRU's somewhere
    fig = ("token_hit_rate", "block_hit_rate", "block_moves_host", "block_moves_disk",
           "block_drops")
    assert all(f in runs[k] for f in fig for k in labels[2:])
    assert any(runs[f"lru | {USER}"][f] != runs["lru | lru"][f] for f in fig)


def test_one_block_policy_keeps_the_labels_as_they_were(tmp_path, capsys):
    out = tmp_path / "out"
    assert replay_main([str(MOONCAKE), "--out", str(out), "--limit", "30", *SMALL,
                        "--block-policy", USER, "--no-plots"]) == 0
    capsys.readouterr()
    runs = json.loads((out / "summary.json").read_text())["runs"]
    assert list(runs) == ["recompute", "no-tiering", "lru"]
    assert runs["lru"]["block_policy"] == USER


@pytest.mark.parametrize(("value", "message"), [
    ("lru,nope", "unknown block policy 'nope'"),
    ("lru,lru", "names a block policy twice"),
    ("lru,", "has an empty name"),
    ("examples.replay_policies:IdleBytes", "is a class but not a tiering.policies.blocks.BlockPolicy"),
    ("examples.replay_policies:Missing", "has no attribute 'Missing'"),
    ("no_such_module_xyz:Thing", "cannot import module 'no_such_module_xyz'"),
    ("examples.replay_policies:math", "is not a BlockPolicy class or factory"),
])
def test_a_bad_block_policy_list_is_refused_before_any_run(tmp_path, capsys, value, message):
    out = tmp_path / "out"
    rc = replay_main([str(MOONCAKE), "--out", str(out), "--limit", "5", "--block-policy", value])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not out.exists()


def test_a_block_policy_class_that_cannot_be_built_is_named(tmp_path, capsys, monkeypatch):
    mod = tmp_path / "broken_blocks.py"
    mod.write_text("from examples.replay_policies import KeepHeads\n"
                   "class Broken(KeepHeads):\n"
                   "    def __init__(self, capacity=None):\n"
                   "        raise RuntimeError('no such thing')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = replay_main([str(MOONCAKE), "--out", str(tmp_path / "o"), "--limit", "5",
                      "--block-policy", "broken_blocks:Broken"])
    err = capsys.readouterr().err
    assert rc == 2 and "'broken_blocks:Broken' cannot be built (RuntimeError: no such thing)" in err


def test_run_grid_runs_each_block_policy_from_the_registry_given():
    trace = load_trace(MOONCAKE, limit=120)
    model, hw = get_model("llama-3.1-8b"), get_hardware("small")
    registry = default_block_registry().with_policy("heads", KeepHeads)
    grid = Grid(("lru",), ((0.9, 0.75),), (1 << 28,), block_policies=("lru", "heads"),
                device_bytes=1 << 29, disk_bytes=1 << 30)
    assert grid.runs() == 4 and grid.labels() == [
        "recompute", "no-tiering", "lru | lru", "lru | heads"]
    started: list[str] = []
    rows = run_grid(trace, model, hw, grid, SimConfig(), block_registry=registry,
                    on_start=lambda i, label: started.append(label))
    assert [r["label"] for r in rows] == grid.labels() == started
    assert [r["block_policy"] for r in rows] == ["lru", "lru", "lru", "heads"]
    with pytest.raises(ValueError, match="unknown block policy 'heads'"):
        run_grid(trace, model, hw, grid, SimConfig())  # not in the default registry
    with pytest.raises(TypeError, match="block_registry must be a BlockPolicyRegistry"):
        run_grid(trace, model, hw, grid, SimConfig(), block_registry={"heads": KeepHeads})
    with pytest.raises(ValueError, match="Grid.block_policies holds a value twice"):
        Grid(("lru",), ((0.9, 0.75),), (0,), block_policies=("lru", "lru"))
