"""The synthetic conversation trace: seeded, shaped as described, validated."""

from __future__ import annotations

import pytest

from tiering.blocks.synth import SynthConfig, synthetic_chains


def test_seeded_and_deterministic():
    a = synthetic_chains(500, seed=7)
    assert a == synthetic_chains(500, seed=7)
    assert a != synthetic_chains(500, seed=8)


def test_shape_system_prompts_continuations_and_one_offs():
    cfg = SynthConfig(system_prompts=3, one_off_fraction=0.3)
    chains = synthetic_chains(3000, seed=1, config=cfg)
    firsts = {c[0] for c in chains}
    assert len(firsts) <= 3, "every request opens with one of the shared system prompts"
    # a continuation holds the whole earlier prompt but its last block
    prompts = {tuple(c) for c in chains}
    cont = 0
    for i, c in enumerate(chains):
        for j in range(i):
            p = chains[j]
            if len(p) > 1 and len(c) > len(p) - 1 and c[: len(p) - 1] == p[:-1] and p[-1] not in c:
                if len(p) - 1 > 3:  # longer than any system prompt: a real continuation
                    cont += 1
                    break
        if i > 600:
            break
    assert cont > 20, "some requests continue an earlier conversation"
    assert len(prompts) > 0.9 * len(chains), "nearly every prompt is new"


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"system_prompts": 0}, "system_prompts"),
        ({"system_blocks": (3, 1)}, "system_blocks"),
        ({"one_off_fraction": 1.0}, "one_off_fraction"),
        ({"cont_step": -0.1}, "cont_step"),
        ({"new_blocks_mean": 0.5}, "new_blocks_mean"),
        ({"gap_median": 0}, "gap_median"),
    ],
)
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        SynthConfig(**kw)


def test_bad_count():
    with pytest.raises(ValueError, match="n must be"):
        synthetic_chains(-1, seed=0)


@pytest.mark.parametrize(
    "kw, field",
    [  # each was taken: NaN passed every bound check, inf overflowed later, a bool was a count
        ({"cont_step": float("nan")}, "cont_step"),
        ({"new_blocks_mean": float("nan")}, "new_blocks_mean"),
        ({"gap_median": float("inf")}, "gap_median"),
        ({"gap_sigma": float("nan")}, "gap_sigma"),
        ({"system_prompts": True}, "system_prompts"),
        ({"system_prompts": 2.5}, "system_prompts"),
        ({"system_blocks": (1.5, 3)}, "system_blocks"),
        ({"system_blocks": [1, 3]}, "system_blocks"),
        ({"gap_sigma": "1"}, "gap_sigma"),
    ],
)
def test_a_nan_infinite_or_mistyped_field_is_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=f"SynthConfig.{field}"):
        SynthConfig(**kw)


def test_a_bool_count_is_refused():
    with pytest.raises(ValueError, match="n must be an int"):
        synthetic_chains(True, seed=0)
    assert len(synthetic_chains(1, seed=0)) == 1  # the control


# -- the other generators -------------------------------------------------------------------

from tiering.blocks import synth  # noqa: E402

_GENERATORS = [
    lambda n, s: synth.session_chains(n, s),
    lambda n, s: synth.agent_chains(n, s),
    lambda n, s: synth.scan_mix_chains(n, s),
    lambda n, s: synth.shift_chains(n, s, 200, n // 2),
    lambda n, s: synth.scan_chains(n, s, 200, 500, n // 2),
]


@pytest.mark.parametrize("gen", _GENERATORS, ids=["sessions", "agents", "scan-mix", "shift", "scan"])
def test_other_generators_are_seeded_and_deterministic(gen):
    a = gen(400, 3)
    assert len(a) == 400 and all(a)
    assert a == gen(400, 3)
    assert a != gen(400, 4)


def test_sessions_reread_their_whole_conversation():
    chains = synth.session_chains(2000, 1, synth.SessionConfig(live=20, regen_prob=0.0))
    system = chains[0][:2]
    assert all(c[:2] == system for c in chains)
    seen = {tuple(c) for c in chains}
    # a later turn of a session extends an earlier request of it by new blocks
    extends = sum(1 for c in chains if any(tuple(c[:k]) in seen for k in range(3, len(c))))
    assert extends > 0.5 * len(chains)


def test_agents_share_long_prefixes_and_extend_their_steps():
    cfg = synth.AgentConfig(agents=3, system_blocks=10, toolsets=2, tool_blocks=4, live=5)
    chains = synth.agent_chains(1500, 2, cfg)
    heads = {tuple(c[:14]) for c in chains}
    assert len(heads) <= 3 * 2, "every request opens with one agent's prompt and tool set"
    seen = {tuple(c) for c in chains}
    steps = sum(1 for c in chains if any(tuple(c[:k]) in seen for k in range(15, len(c))))
    assert steps > 0.5 * len(chains)


def test_scan_mix_scans_are_read_once_and_the_hot_set_again():
    chains = synth.scan_mix_chains(3000, 5, synth.ScanMixConfig(hot=50, scan_prob=0.4))
    counts: dict[int, int] = {}
    for c in chains:
        for b in c:
            counts[b] = counts.get(b, 0) + 1
    once = sum(1 for v in counts.values() if v == 1)
    assert once > 0.5 * len(counts), "most blocks are scanned once"
    assert max(counts.values()) > 50, "the hot documents are read again and again"


def test_loop_cycles_over_exactly_its_blocks():
    chains = synth.loop_chains(30, 44, chain_blocks=8)
    assert chains[0] == list(range(8)) and chains[6] == chains[0]
    assert chains[5] == list(range(40, 44)), "the last chain of the loop is shorter"
    assert {b for c in chains for b in c} == set(range(44))


def test_shift_replaces_the_working_set():
    chains = synth.shift_chains(1000, 0, 100, 500)
    before = {b for c in chains[:500] for b in c}
    after = {b for c in chains[500:] for b in c}
    assert before and after and not before & after


@pytest.mark.parametrize("make, field", [
    (lambda: synth.SessionConfig(live=0), "live"),
    (lambda: synth.SessionConfig(end_prob=1.5), "end_prob"),
    (lambda: synth.AgentConfig(system_blocks=0), "system_blocks"),
    (lambda: synth.AgentConfig(zipf=0.0), "zipf"),
    (lambda: synth.ScanMixConfig(scan_prob=-0.1), "scan_prob"),
    (lambda: synth.ScanMixConfig(scan_blocks_mean=0.5), "scan_blocks_mean"),
    (lambda: synth.loop_chains(5, 0), "loop_blocks"),
    (lambda: synth.shift_chains(5, 0, 10, -1), "at"),
    (lambda: synth.scan_chains(-1, 0, 10, 10, 1), "n"),
])
def test_other_generators_name_a_bad_field(make, field):
    with pytest.raises(ValueError, match=field):
        make()
