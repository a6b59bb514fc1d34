"""``tiering.core.validate``: the one set of config-field checks, and the configs using it."""

from __future__ import annotations

import math

import pytest

from tiering.coldtier.breaker import BreakerConfig
from tiering.coldtier.lease import LeaseConfig
from tiering.coldtier.sweeper import SweeperConfig
from tiering.core.staging import StagingConfig
from tiering.core.validate import check_fields, check_int, check_number, check_timeout


@pytest.mark.parametrize("value", [1, 7, 2**40])
def test_check_int_accepts_ints_at_or_above_the_minimum(value):
    check_int("C", "f", value, 1)


@pytest.mark.parametrize("value", [0, -3, True, 1.0, "2", None])
def test_check_int_refuses_by_name(value):
    with pytest.raises(ValueError, match=rf"^C\.f must be an int >= 1, got {value!r}$"):
        check_int("C", "f", value, 1)


@pytest.mark.parametrize(
    "value,kw",
    [(0.5, {}), (3, {}), (0, {"zero_ok": True}), (0.0, {"zero_ok": True}), (1, {"maximum": 1})],
)
def test_check_number_accepts(value, kw):
    check_number("C", "f", value, **kw)


@pytest.mark.parametrize(
    "value,kw,want",
    [
        (0, {}, "must be a number > 0"),
        (-1.0, {"zero_ok": True}, "must be a number >= 0"),
        (math.nan, {}, "must be a number > 0"),
        (math.nan, {"zero_ok": True}, "must be a number >= 0"),
        (True, {}, "must be a number > 0"),
        ("1", {}, "must be a number > 0"),
        (1.5, {"maximum": 1}, "must be a number > 0 and <= 1"),
    ],
)
def test_check_number_refuses_by_name(value, kw, want):
    with pytest.raises(ValueError, match="^C\\.f " + want) as err:
        check_number("C", "f", value, **kw)
    assert repr(value) in str(err.value)


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: StagingConfig(pages=True), "StagingConfig.pages"),
        (lambda: StagingConfig(timeout_s=0), "StagingConfig.timeout_s"),
        (lambda: LeaseConfig(ttl_s=True), "LeaseConfig.ttl_s"),
        (lambda: LeaseConfig(safety_s=math.nan), "LeaseConfig.safety_s"),
        (lambda: BreakerConfig(failure_threshold=True), "BreakerConfig.failure_threshold"),  # took True before
        (lambda: BreakerConfig(cooldown_s=-1), "BreakerConfig.cooldown_s"),
        (lambda: SweeperConfig(cap_bytes=False), "SweeperConfig.cap_bytes"),
        (lambda: SweeperConfig(cap_bytes=10, low_fraction=1.5), "SweeperConfig.low_fraction"),
    ],
)
def test_configs_refuse_bad_fields_by_name(make, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        make()


def test_configs_keep_their_defaults_valid():
    staging = StagingConfig()
    assert (staging.buffers, staging.pages, staging.timeout_s) == (4, 16, 10.0)
    for cfg in (LeaseConfig(), BreakerConfig(), SweeperConfig(cap_bytes=1 << 20)):
        # each default passes the record's own check again (a changed default that breaks
        # its own bound raises here)
        assert type(cfg)(**{f: getattr(cfg, f) for f in cfg.__dataclass_fields__}) == cfg


def test_check_fields_names_the_record_and_the_first_bad_field():
    class Rec:
        a = 2
        b = 0
        c = -1.0

    check_fields(Rec(), ints={"a": 1})
    with pytest.raises(ValueError, match=r"^Rec\.b must be an int >= 1, got 0$"):
        check_fields(Rec(), ints={"a": 1, "b": 1}, zero_ok=("c",))
    with pytest.raises(ValueError, match=r"^Rec\.c must be a number >= 0, got -1\.0$"):
        check_fields(Rec(), ints={"a": 1}, numbers=("a",), zero_ok=("c",))
    with pytest.raises(ValueError, match=r"^Rec\.b must be a number > 0, got 0$"):
        check_fields(Rec(), numbers=("b",))


@pytest.mark.parametrize("value", [0, 0.0, 1, 2.5, 3600])
def test_check_timeout_accepts_finite_seconds(value):
    assert check_timeout("thing.wait", value) == float(value)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -1, -0.5, True, False, "1",
                                   None, [1]])
def test_check_timeout_refuses_unbounded_or_odd_waits_by_name(value):
    with pytest.raises(ValueError, match=r"thing\.wait: timeout must be a finite number") as err:
        check_timeout("thing.wait", value)
    assert repr(value) in str(err.value)
