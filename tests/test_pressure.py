"""Pressure sources and the poller, with fake NVML / torch modules where the real ones can't run."""

from __future__ import annotations

import logging
import math
import random
import threading
from types import SimpleNamespace

import pytest

from tiering.pressure import (
    CompositePressure,
    NvmlPressure,
    PoolAdjustedPressure,
    PoolPressure,
    PressurePoller,
    PressureReading,
    PressureSource,
    ScriptedPressure,
    TorchCudaPressure,
)

LOGGER = "tiering.pressure"


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


class FakeNvmlError(Exception):
    pass


class FakeNvml:
    """A pynvml-like module: one device whose memory figures the test sets."""

    def __init__(self, used: int, total: int, fail_init: bool = False) -> None:
        self.used, self.total = used, total
        self.fail_init = fail_init
        self.fail_read = False
        self.handles_asked: list[int] = []
        self.init_calls = 0
        self.shutdown_calls = 0

    def nvmlInit(self) -> None:  # noqa: N802 - the pynvml spelling
        self.init_calls += 1
        if self.fail_init:
            raise FakeNvmlError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdown_calls += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:  # noqa: N802
        self.handles_asked.append(index)
        return ("handle", index)

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> SimpleNamespace:  # noqa: N802
        assert handle == ("handle", self.handles_asked[-1])
        if self.fail_read:
            raise FakeNvmlError("GPU is lost")
        return SimpleNamespace(total=self.total, free=self.total - self.used, used=self.used)


def test_nvml_reads_used_over_total_from_the_injected_module():
    rng = random.Random(1)
    total = rng.randint(2**30, 2**37)
    fake = FakeNvml(used=rng.randint(1, total), total=total)
    index = rng.randint(0, 7)
    source = NvmlPressure(device_index=index, nvml=fake)
    assert source.available
    assert source.name == f"nvml:{index}"
    assert fake.handles_asked == [index]
    assert source.read() == pytest.approx(fake.used / total)
    fake.used = rng.randint(1, total)
    assert source.read() == pytest.approx(fake.used / total)
    source.close()
    assert fake.shutdown_calls == 1
    assert not source.available and source.read() == 0.0


def test_nvml_init_failure_warns_once_and_reads_zero(caplog):
    rng = random.Random(2)
    fake = FakeNvml(used=rng.randint(1, 100), total=100, fail_init=True)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = NvmlPressure(nvml=fake)
        readings = [source.read() for _ in range(5)]
    assert not source.available
    assert readings == [0.0] * 5
    (record,) = _warnings(caplog)
    assert "nvml:0" in record.getMessage() and "nvmlInit" in record.getMessage()
    assert "NVML Shared Library Not Found" in record.getMessage()
    assert fake.shutdown_calls == 0  # never initialised, nothing to release


def test_nvml_read_failure_warns_once_and_becomes_unavailable(caplog):
    rng = random.Random(3)
    total = rng.randint(2**30, 2**34)
    fake = FakeNvml(used=rng.randint(1, total), total=total)
    source = NvmlPressure(nvml=fake)
    assert source.read() == pytest.approx(fake.used / total)
    fake.fail_read = True
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert [source.read() for _ in range(4)] == [0.0] * 4
    assert not source.available
    (record,) = _warnings(caplog)
    assert "GPU is lost" in record.getMessage()
    assert fake.shutdown_calls == 1


def test_nvml_inconsistent_figures_make_it_unavailable(caplog):
    fake = FakeNvml(used=200, total=100)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = NvmlPressure(nvml=fake)
        assert source.read() == 0.0
    assert not source.available
    assert "outside [0, 100]" in _warnings(caplog)[0].getMessage()


@pytest.mark.parametrize("index", [-1, 1.0, True, "0"])
def test_nvml_rejects_a_bad_device_index(index):
    with pytest.raises(ValueError, match="device_index"):
        NvmlPressure(device_index=index, nvml=FakeNvml(1, 2))


def test_real_nvml_never_crashes(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = NvmlPressure()
        value = source.read()
    if source.available:  # a machine with a GPU and its driver
        assert 0.0 < value <= 1.0
        source.close()
    else:
        assert value == 0.0
        assert len(_warnings(caplog)) == 1


def _fake_torch(free: int, total: int, available: bool = True, error: Exception | None = None):
    asked: list[object] = []

    def mem_get_info(device=None):
        asked.append(device)
        if error is not None:
            raise error
        return free, total

    cuda = SimpleNamespace(is_available=lambda: available, mem_get_info=mem_get_info)
    return SimpleNamespace(cuda=cuda), asked


def test_torch_cuda_reads_one_minus_free_over_total():
    rng = random.Random(4)
    total = rng.randint(2**30, 2**37)
    free = rng.randint(0, total - 1)
    fake, asked = _fake_torch(free, total)
    source = TorchCudaPressure(device="cuda:1", torch_module=fake)
    assert source.available
    assert source.read() == pytest.approx(1 - free / total)
    assert asked and set(asked) == {"cuda:1"}


@pytest.mark.parametrize(
    "available, error",
    [
        (False, None),
        (True, AssertionError("Torch not compiled with CUDA enabled")),
        (True, RuntimeError("CUDA driver initialization failed")),
    ],
)
def test_torch_cuda_unavailable_warns_once(caplog, available, error):
    fake, _ = _fake_torch(1, 2, available=available, error=error)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = TorchCudaPressure(torch_module=fake)
        assert [source.read() for _ in range(3)] == [0.0] * 3
    assert not source.available
    assert len(_warnings(caplog)) == 1


def test_torch_cuda_on_this_machine_does_not_crash(caplog):
    torch = pytest.importorskip("torch")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = TorchCudaPressure()
        value = source.read()
    if torch.cuda.is_available():
        assert source.available and 0.0 < value <= 1.0
    else:
        assert not source.available and value == 0.0
        assert len(_warnings(caplog)) == 1


class FakePool:
    def __init__(self, used: int, capacity: int) -> None:
        self.used = used
        self._capacity = capacity

    def device_used_bytes(self) -> int:
        return self.used

    @property
    def device_capacity_bytes(self) -> int:
        return self._capacity


def test_pool_pressure_is_exact_occupancy():
    rng = random.Random(5)
    capacity = rng.randint(2**20, 2**32)
    pool = FakePool(rng.randint(1, capacity), capacity)
    source = PoolPressure(pool)
    assert source.available and source.name == "pool"
    assert source.read() == pool.used / capacity
    pool.used = capacity
    assert source.read() == 1.0


def test_pool_pressure_rejects_objects_without_the_hooks_and_bad_ledgers():
    with pytest.raises(TypeError, match="device_used_bytes"):
        PoolPressure(SimpleNamespace(device_capacity_bytes=10))
    with pytest.raises(TypeError, match="device_capacity_bytes"):
        PoolPressure(SimpleNamespace(device_used_bytes=lambda: 3))
    rng = random.Random(6)
    capacity = rng.randint(100, 10_000)
    source = PoolPressure(FakePool(capacity + rng.randint(1, 50), capacity))
    with pytest.raises(ValueError, match="outside"):
        source.read()
    with pytest.raises(ValueError, match="total memory"):
        PoolPressure(FakePool(0, 0)).read()


def test_scripted_plays_values_then_holds_the_last():
    rng = random.Random(7)
    values = [rng.random() for _ in range(4)]
    source = ScriptedPressure(values)
    assert [source.read() for _ in range(6)] == values + [values[-1]] * 2
    new = rng.random()
    source.set(new)
    assert [source.read() for _ in range(2)] == [new, new]


@pytest.mark.parametrize("bad", [1.5, -0.25, math.nan, "0.3", None])
def test_scripted_rejects_values_outside_zero_one(bad):
    with pytest.raises(ValueError, match=repr(bad).replace("(", r"\(")):
        ScriptedPressure([0.2, bad])
    source = ScriptedPressure([0.4])
    with pytest.raises(ValueError, match="pressure"):
        source.set(bad)
    assert source.read() == 0.4  # the failed set changed nothing


def test_scripted_needs_a_value():
    with pytest.raises(ValueError, match="at least one"):
        ScriptedPressure([])


class Unavailable(PressureSource):
    name = "gone"

    def __init__(self) -> None:
        self.reads = 0

    @property
    def available(self) -> bool:
        return False

    def read(self) -> float:
        self.reads += 1
        return 1.0


def test_composite_takes_the_worst_available_source():
    rng = random.Random(8)
    values = [rng.random() for _ in range(3)]
    gone = Unavailable()
    composite = CompositePressure(*(ScriptedPressure([v]) for v in values), gone)
    assert composite.available
    assert composite.read() == max(values)
    assert gone.reads == 0
    assert composite.name == "max(scripted,scripted,scripted,gone)"


def test_composite_with_failing_nvml_falls_back_to_the_pool():
    rng = random.Random(9)
    capacity = rng.randint(2**20, 2**30)
    pool = FakePool(rng.randint(1, capacity), capacity)
    nvml = NvmlPressure(nvml=FakeNvml(1, 1, fail_init=True))
    composite = CompositePressure(nvml, PoolPressure(pool))
    assert composite.read() == pool.used / capacity


def test_composite_of_nothing_available_reads_zero_and_needs_a_source():
    composite = CompositePressure(Unavailable())
    assert not composite.available and composite.read() == 0.0
    with pytest.raises(ValueError, match="at least one source"):
        CompositePressure()
    with pytest.raises(TypeError, match="not a PressureSource"):
        CompositePressure(ScriptedPressure([0.5]), 0.5)


def test_poller_sample_now_advances_seq_and_stamps_the_injected_clock():
    rng = random.Random(10)
    values = [rng.random() for _ in range(3)]
    ticks = iter([100.0, 101.5, 103.25, 107.0])
    poller = PressurePoller(ScriptedPressure(values), interval_s=60.0, clock=lambda: next(ticks))
    assert poller.latest() == PressureReading(0.0, 0, 100.0)
    readings = [poller.sample_now() for _ in range(3)]
    assert readings == [
        PressureReading(values[0], 1, 101.5),
        PressureReading(values[1], 2, 103.25),
        PressureReading(values[2], 3, 107.0),
    ]
    assert poller.latest() == readings[-1]


class Flaky(PressureSource):
    name = "flaky"

    def __init__(self, outcomes) -> None:
        self.outcomes = list(outcomes)

    def read(self) -> float:
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_poller_keeps_the_last_reading_when_the_source_fails(caplog):
    rng = random.Random(11)
    good, later = rng.random(), rng.random()
    source = Flaky([good, OSError("sensor gone"), 1.7, OSError("still gone"), later])
    poller = PressurePoller(source, interval_s=1.0)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first = poller.sample_now()
        kept = [poller.sample_now() for _ in range(3)]
        last = poller.sample_now()
    assert first.fraction == good and first.seq == 1
    assert kept == [first] * 3
    assert poller.failures == 3
    assert (last.fraction, last.seq) == (later, 2)
    (record,) = _warnings(caplog)
    assert "flaky" in record.getMessage() and "sensor gone" in record.getMessage()


class Signalling(PressureSource):
    """Scripted values; sets an event once it has been read ``after`` times."""

    name = "signalling"

    def __init__(self, values, after: int) -> None:
        self._inner = ScriptedPressure(values)
        self.after = after
        self.count = 0
        self.reached = threading.Event()

    def read(self) -> float:
        self.count += 1
        if self.count >= self.after:
            self.reached.set()
        return self._inner.read()


def test_poller_thread_samples_until_stopped():
    rng = random.Random(12)
    values = [rng.random() for _ in range(5)]
    source = Signalling(values, after=5)
    poller = PressurePoller(source, interval_s=0.001)
    poller.start()
    try:
        assert poller.latest().seq >= 1  # start samples once before returning
        with pytest.raises(RuntimeError, match="already running"):
            poller.start()
        assert source.reached.wait(timeout=30.0)
    finally:
        assert poller.stop(timeout=30.0)
    assert not poller.running
    final = poller.latest()
    assert final.seq >= 5
    assert final.fraction == values[-1]
    assert poller.latest() == final  # nothing samples after stop


def test_poller_stop_wakes_a_long_interval_and_can_restart():
    rng = random.Random(13)
    source = ScriptedPressure([rng.random()])
    with PressurePoller(source, interval_s=3600.0) as poller:
        assert poller.running and poller.latest().seq == 1
    # stop() woke the hour-long wait: the thread has ended (it was joined).
    assert not poller.running
    poller.start()
    assert poller.latest().seq == 2
    assert poller.stop(timeout=30.0) and not poller.running
    assert poller.stop() is True  # stopping twice is harmless


@pytest.mark.parametrize("interval", [0, -1.0, math.nan, math.inf, "1"])
def test_poller_rejects_a_bad_interval(interval):
    with pytest.raises(ValueError, match="interval_s"):
        PressurePoller(ScriptedPressure([0.5]), interval_s=interval)


def test_poller_rejects_a_source_without_read():
    with pytest.raises(TypeError, match="read"):
        PressurePoller(object(), interval_s=1.0)


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_real_device_sources_see_an_allocation():
    import torch

    torch_source = TorchCudaPressure(device=0)
    nvml = NvmlPressure(0)
    assert torch_source.available and nvml.available
    before_torch, before_nvml = torch_source.read(), nvml.read()
    free, total = torch.cuda.mem_get_info(0)
    block = torch.empty(int(free * 0.25), dtype=torch.uint8, device="cuda:0")
    try:
        after_torch, after_nvml = torch_source.read(), nvml.read()
        assert after_torch > before_torch + 0.2 * free / total
        assert after_nvml > before_nvml + 0.2 * free / total
        assert CompositePressure(torch_source, nvml).read() == max(after_torch, after_nvml)
    finally:
        del block
        nvml.close()


def test_pool_adjusted_counts_the_pools_free_pages_as_free():
    rng = random.Random(9)
    total = 80 << 30
    pool_cap = 40 << 30
    other = rng.randint(1 << 30, 20 << 30)  # activations, caching allocator, other processes
    pool = FakePool(used=rng.randint(0, pool_cap), capacity=pool_cap)
    fake = FakeNvml(used=pool_cap + other, total=total)  # NVML sees the whole pool as used
    nvml = NvmlPressure(nvml=fake)
    adjusted = PoolAdjustedPressure(nvml, pool)
    assert nvml.read() == pytest.approx((pool_cap + other) / total)
    assert adjusted.read() == pytest.approx((pool.used + other) / total)
    pool.used = 0
    assert adjusted.read() == pytest.approx(other / total)
    composite = CompositePressure(PoolPressure(pool), adjusted)
    pool.used = pool_cap // 2
    assert composite.read() == pytest.approx(max(0.5, (pool.used + other) / total))
    fake.fail_read = True
    assert adjusted.read() == 0.0 and not adjusted.available


def test_pool_adjusted_needs_a_byte_source():
    with pytest.raises(TypeError, match="read_bytes"):
        PoolAdjustedPressure(ScriptedPressure([0.5]), FakePool(0, 1))
