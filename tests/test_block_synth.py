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
