"""benchmarks/prefix.py keeps its tuning split apart from the rows it reports."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import prefix  # noqa: E402
from tiering.blocks import synth  # noqa: E402
from tiering.blocks.replay import load_chains  # noqa: E402


def test_tuning_split_is_the_first_half_and_the_tuning_seeds():
    n = 300
    tune = prefix.tuning_sets(prefix.DEFAULT_TRACE, n)
    assert {split for _, split, _ in tune} == {"tuning"}
    labels = [label for label, _, _ in tune]
    assert len(labels) == len(set(labels)) == 1 + 5 * len(prefix.TUNING_SEEDS)
    chains = load_chains(prefix.DEFAULT_TRACE)
    by_label = {label: ch for label, _, ch in tune}
    assert by_label["bundled-1st-half"] == chains[:len(chains) // 2]
    for s in prefix.TUNING_SEEDS:
        assert by_label[f"synth-sessions-s{s}"] == synth.session_chains(n, s)
        assert by_label[f"synth-agents-s{s}"] == synth.agent_chains(n, s)
        assert by_label[f"synth-shifted-s{s}"] == synth.synthetic_chains(n, s + 1, prefix.SHIFTED)


def test_reported_rows_share_no_trace_with_the_tuning_split():
    n = 300
    tune = {label: ch for label, _, ch in prefix.tuning_sets(prefix.DEFAULT_TRACE, n)}
    report = prefix.trace_sets(prefix.DEFAULT_TRACE, None, n, 0)
    tuned = [ch for ch in tune.values()]
    for label, split, chains in report:
        if split == "held-out":
            assert all(chains != t for t in tuned), label
    # the bundled halves do not overlap as request lists
    halves = {label: ch for label, _, ch in report if label.startswith("bundled")}
    assert halves["bundled-1st-half"] == tune["bundled-1st-half"]
    assert halves["bundled-2nd-half"] != tune["bundled-1st-half"]


@pytest.mark.parametrize("argv", [["--seed", "100"], ["--seed", "99"], ["--seed", "103"],
                                  ["--split", "tuning", "--seed", "3"]])
def test_a_reported_run_at_a_tuning_seed_is_refused(argv, tmp_path, capsys):
    out = tmp_path / "p.json"
    with pytest.raises(SystemExit):
        prefix.main(["--out", str(out), *argv])
    assert "seed" in capsys.readouterr().err
    assert not out.exists()
