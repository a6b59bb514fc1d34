"""Pressure sources and the poller, with fake NVML / torch modules where the real ones can't run.

Size: over 800 lines: every pressure source against the same fake NVML / torch modules
defined here.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from types import SimpleNamespace

import pytest

from tiering.control.pressure import (
    CompositePressure,
    NvmlPressure,
    PoolAdjustedPressure,
    PoolPressure,
    PressurePoller,
    PressureReading,
    PressureSource,
    RetryPolicy,
    ScriptedPressure,
    SourceHealth,
    TorchCudaPressure,
    cache_pressure,
)

LOGGER = "tiering.control.pressure"


def _warnings(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


class FakeNvmlError(Exception):
    """Like pynvml.NVMLError: ``value`` is the NVML return code."""

    def __init__(self, message: str, value: int = 999) -> None:
        super().__init__(message)
        self.value = value


NOT_FOUND = 6


def _raw_uuid(rng: random.Random) -> str:
    h = "%032x" % rng.getrandbits(128)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class FakeGpu:
    def __init__(self, rng: random.Random, mig: bool = False) -> None:
        self.uuid = "GPU-" + _raw_uuid(rng)
        self.total = rng.randint(2**34, 2**37)
        self.used = rng.randint(2**20, self.total)
        self.mig = mig
        self.mig_uuids: list[str] = []


class FakeNvml:
    """A pynvml-like module over a list of GPUs (NVML's own order, which
    ignores CUDA_VISIBLE_DEVICES). Counts every call the source makes."""

    def __init__(self, gpus: list[FakeGpu], fail_init: bool = False) -> None:
        self.gpus = gpus
        self.fail_init = fail_init
        self.fail_read = False
        self.init_calls = 0
        self.shutdown_calls = 0
        self.memory_calls = 0
        self.by_index_calls = 0

    def nvmlInit(self) -> None:  # noqa: N802 - the pynvml spelling
        self.init_calls += 1
        if self.fail_init:
            raise FakeNvmlError("NVML Shared Library Not Found", 9)

    def nvmlShutdown(self) -> None:  # noqa: N802
        self.shutdown_calls += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:  # noqa: N802
        self.by_index_calls += 1  # the bug this source must not have
        return ("gpu", index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> object:  # noqa: N802
        for i, gpu in enumerate(self.gpus):
            if gpu.uuid == uuid:
                return ("gpu", i)
            if uuid in gpu.mig_uuids:
                return ("mig", i)
        raise FakeNvmlError("Not Found", NOT_FOUND)

    def nvmlDeviceGetIndex(self, handle) -> int:  # noqa: N802
        return handle[1]

    def nvmlDeviceGetMigMode(self, handle) -> tuple[int, int]:  # noqa: N802
        mode = int(self.gpus[handle[1]].mig)
        return mode, mode

    def nvmlDeviceGetMemoryInfo(self, handle) -> SimpleNamespace:  # noqa: N802
        self.memory_calls += 1
        if self.fail_read:
            raise FakeNvmlError("GPU is lost", 15)
        gpu = self.gpus[handle[1]]  # a MIG handle gets the whole GPU's figures here
        return SimpleNamespace(total=gpu.total, free=gpu.total - gpu.used, used=gpu.used)


class FakeTorch:
    """A torch-like module whose CUDA ordinals are ``visible`` (UUIDs as CUDA
    reports them: no prefix), as under CUDA_VISIBLE_DEVICES."""

    def __init__(self, visible: list[str], mem: list[tuple[int, int]] | None = None,
                 available: bool = True) -> None:
        self.visible = visible
        self.mem = mem or [(1, 2)] * len(visible)
        self.current = 0
        self.asked: list[object] = []
        self.error: Exception | None = None
        self.cuda = SimpleNamespace(
            is_available=lambda: available,
            current_device=lambda: self.current,
            get_device_properties=self._props,
            mem_get_info=self._mem_get_info,
        )

    def _props(self, index: int) -> SimpleNamespace:
        uuid = self.visible[index]
        return SimpleNamespace(uuid=uuid.split("-", 1)[1])  # CUDA's string has no GPU-/MIG-

    def _mem_get_info(self, device=None):
        self.asked.append(device)
        if self.error is not None:
            raise self.error
        return self.mem[device if device is not None else self.current]


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _machine(seed: int, n: int = 4):
    """n GPUs seen by NVML, and a torch whose ordinals are a permutation of them."""
    rng = random.Random(seed)
    gpus = [FakeGpu(rng) for _ in range(n)]
    perm = list(range(n))
    while perm == sorted(perm):
        rng.shuffle(perm)  # CUDA_VISIBLE_DEVICES="2,0,3,1"-like: never the identity
    torch = FakeTorch([gpus[p].uuid for p in perm])
    return rng, gpus, perm, FakeNvml(gpus), torch


def test_nvml_finds_the_device_by_uuid_under_a_cuda_visible_devices_permutation():
    _, gpus, perm, nvml, torch = _machine(1)
    for ordinal in range(len(perm)):
        for device in (ordinal, f"cuda:{ordinal}", SimpleNamespace(type="cuda", index=ordinal)):
            source = NvmlPressure(device, nvml=nvml, torch_module=torch)
            gpu = gpus[perm[ordinal]]
            assert source.available and source.mode == "nvml"
            assert source.name == f"nvml:cuda:{ordinal}"
            assert source.uuid == gpu.uuid and source.nvml_index == perm[ordinal]
            assert source.read() == pytest.approx(gpu.used / gpu.total)
            assert source.read_bytes() == (gpu.used, gpu.total)
            source.close()
    assert nvml.by_index_calls == 0  # NVML's index is never used


def test_nvml_reads_its_own_device_when_the_current_device_changes():
    _, gpus, perm, nvml, torch = _machine(2)
    torch.current = 2
    source = NvmlPressure("cuda", nvml=nvml, torch_module=torch)  # no index: current, once
    assert source.cuda_index == 2
    torch.current = 0
    gpus[perm[2]].used = gpus[perm[2]].total // 3
    assert source.read() == pytest.approx(gpus[perm[2]].used / gpus[perm[2]].total)


@pytest.mark.parametrize("by", ["mig-uuid", "mig-mode"])
def test_nvml_under_mig_reads_torch_mem_get_info_for_its_device(by):
    rng = random.Random(3)
    gpus = [FakeGpu(rng, mig=True), FakeGpu(rng)]
    if by == "mig-uuid":  # CUDA exposes the MIG instance; NVML knows it as MIG-<uuid>
        instance = "MIG-" + _raw_uuid(rng)
        gpus[0].mig_uuids.append(instance)
        visible = [gpus[1].uuid, instance]
    else:  # CUDA reports the parent GPU, which NVML says is in MIG mode
        visible = [gpus[1].uuid, gpus[0].uuid]
    total = rng.randint(2**32, 2**34)  # the instance's own slice, far below the GPU's
    free = rng.randint(0, total)
    torch = FakeTorch(visible, mem=[(1, 2), (free, total)])
    nvml = FakeNvml(gpus)
    source = NvmlPressure("cuda:1", nvml=nvml, torch_module=torch)
    assert source.available and source.mode == "mig-torch"
    assert source.read() == pytest.approx(1 - free / total)
    assert set(torch.asked) == {1} and nvml.memory_calls == 0
    # the plain GPU next to it still reads NVML
    plain = NvmlPressure(0, nvml=nvml, torch_module=torch)
    assert plain.mode == "nvml" and plain.read() == pytest.approx(gpus[1].used / gpus[1].total)


def test_nvml_unknown_uuid_is_an_outage_naming_it(caplog):
    rng, gpus, perm, nvml, torch = _machine(4)
    torch.visible[0] = "GPU-" + _raw_uuid(rng)  # a device NVML does not list
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = NvmlPressure(0, nvml=nvml, torch_module=torch)
    assert not source.available and source.read() == 0.0
    (record,) = _warnings(caplog)
    assert torch.visible[0].split("-", 1)[1] in record.getMessage()


def test_one_failed_read_is_retried_with_backoff_and_logged_once_per_outage(caplog):
    _, gpus, perm, nvml, torch = _machine(5)
    clock = Clock()
    retry = RetryPolicy(first_s=2.0, max_s=5.0, factor=2.0)
    source = NvmlPressure(1, nvml=nvml, torch_module=torch, clock=clock, retry=retry)
    gpu = gpus[perm[1]]
    assert source.read() == pytest.approx(gpu.used / gpu.total)
    nvml.fail_read = True
    calls = nvml.memory_calls
    with caplog.at_level(logging.INFO, logger=LOGGER):
        assert source.read() == 0.0  # the failed read: outage 1 starts
        assert not source.available and source.health().next_retry_at == clock.t + 2.0
        assert [source.read() for _ in range(50)] == [0.0] * 50  # no retry before the delay
        assert nvml.memory_calls == calls + 1
        clock.t += 1.999
        assert source.read() == 0.0 and nvml.memory_calls == calls + 1
        for delay in (4.0, 5.0, 5.0):  # each failed retry doubles the delay, capped at max_s
            clock.t = source.health().next_retry_at
            assert source.read() == 0.0
            assert source.health().next_retry_at == pytest.approx(clock.t + delay)
        assert nvml.memory_calls == calls + 4
        nvml.fail_read = False
        gpu.used = gpu.total // 2
        clock.t += 5.0
        assert source.read() == pytest.approx(0.5, abs=1e-9)  # recovered
        assert source.available and source.health() == SourceHealth(True, 4, 1, None, None)
        nvml.fail_read = True
        assert source.read() == 0.0  # outage 2: a fresh delay, a second warning
        assert source.health().next_retry_at == clock.t + 2.0
    warnings = _warnings(caplog)
    assert len(warnings) == 2 and all("GPU is lost" in w.getMessage() for w in warnings)
    infos = [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.INFO]
    assert len(infos) == 1 and "recovered" in infos[0].getMessage()


def test_a_composite_lets_a_source_in_an_outage_recover():
    _, gpus, perm, nvml, torch = _machine(6)
    clock = Clock()
    rng = random.Random(6)
    capacity = rng.randint(2**20, 2**30)
    pool = FakePool(rng.randint(1, capacity // 4), capacity)
    nv = NvmlPressure(0, nvml=nvml, torch_module=torch, clock=clock, retry=RetryPolicy(1, 1))
    gpu = gpus[perm[0]]
    gpu.used = gpu.total  # the whole device is full: worse than the pool
    composite = CompositePressure(PoolPressure(pool), nv)
    nvml.fail_read = True
    assert composite.read() == pytest.approx(pool.used / capacity)
    nvml.fail_read = False
    clock.t += 1.0
    assert composite.read() == 1.0  # the composite asked it again: NVML is back


def test_nvml_init_failure_is_retried_too(caplog):
    _, gpus, perm, nvml, torch = _machine(7)
    nvml.fail_init = True
    clock = Clock()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = NvmlPressure(3, nvml=nvml, torch_module=torch, clock=clock)
        assert [source.read() for _ in range(5)] == [0.0] * 5
    (record,) = _warnings(caplog)
    assert "nvml:cuda:3" in record.getMessage() and "NVML Shared Library Not Found" in record.getMessage()
    assert nvml.init_calls == 1 and nvml.shutdown_calls == 0  # never initialised: nothing to release
    nvml.fail_init = False
    clock.t += RetryPolicy().first_s
    gpu = gpus[perm[3]]
    assert source.read() == pytest.approx(gpu.used / gpu.total) and source.available


def test_nvml_inconsistent_figures_are_a_failed_read(caplog):
    _, gpus, perm, nvml, torch = _machine(8)
    gpus[perm[0]].used = gpus[perm[0]].total + 1
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = NvmlPressure(0, nvml=nvml, torch_module=torch)
        assert source.read() == 0.0
    assert not source.available
    assert "outside [0, " in _warnings(caplog)[0].getMessage()
    assert nvml.shutdown_calls == 1  # released, to be initialised again at the retry


def test_without_cuda_nvml_is_absent_for_good(caplog):
    _, gpus, perm, nvml, _ = _machine(9)
    torch = FakeTorch([g.uuid for g in gpus], available=False)
    clock = Clock()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = NvmlPressure(0, nvml=nvml, torch_module=torch, clock=clock)
        clock.t += 1e6
        assert [source.read() for _ in range(3)] == [0.0] * 3
    assert not source.available and nvml.init_calls == 0
    assert source.health().absent_reason == "torch reports no CUDA device"
    assert len(_warnings(caplog)) == 1


@pytest.mark.parametrize("device", [-1, True, 1.5, "cpu", "cuda:x", "1", SimpleNamespace(type="cpu", index=None)])
def test_device_sources_reject_a_bad_device_even_without_cuda(device):
    torch = FakeTorch([], available=False)
    with pytest.raises(ValueError, match="NvmlPressure: .*device"):
        NvmlPressure(device, nvml=FakeNvml([]), torch_module=torch)
    with pytest.raises(ValueError, match="TorchCudaPressure: .*device"):
        TorchCudaPressure(device, torch_module=torch)


def test_retry_policy_is_validated():
    for kwargs, field in (({"first_s": 0}, "first_s"), ({"max_s": 0.5}, "max_s"),
                          ({"factor": 0.5}, "factor"), ({"first_s": math.nan}, "first_s")):
        with pytest.raises(ValueError, match=f"RetryPolicy.{field}"):
            RetryPolicy(**kwargs)
    with pytest.raises(TypeError, match="retry"):
        NvmlPressure(0, nvml=FakeNvml([]), torch_module=FakeTorch([]), retry=5)


def test_real_nvml_never_crashes(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = NvmlPressure(0)
        value = source.read()
    if source.available:  # a machine with a GPU and its driver
        assert 0.0 < value <= 1.0
        source.close()
    else:
        assert value == 0.0
        assert len(_warnings(caplog)) == 1


def test_torch_cuda_reads_the_device_it_names_not_the_current_one():
    rng = random.Random(10)
    mem = []
    for _ in range(3):
        total = rng.randint(2**30, 2**37)
        mem.append((rng.randint(0, total - 1), total))
    torch = FakeTorch(["GPU-a", "GPU-b", "GPU-c"], mem=mem)
    source = TorchCudaPressure("cuda:1", torch_module=torch)
    assert source.available and source.name == "torch-cuda:1"
    for current in (0, 2, 1):
        torch.current = current
        assert source.read() == pytest.approx(1 - mem[1][0] / mem[1][1])
    assert set(torch.asked) == {1}  # never None: mem_get_info(None) is the current device
    torch.current = 2
    assert TorchCudaPressure("cuda", torch_module=torch).cuda_index == 2


@pytest.mark.parametrize(
    "available, error",
    [
        (False, None),
        (True, AssertionError("Torch not compiled with CUDA enabled")),
        (True, RuntimeError("CUDA driver initialization failed")),
    ],
)
def test_torch_cuda_unavailable_warns_once(caplog, available, error):
    torch = FakeTorch(["GPU-a"], available=available)
    torch.error = error
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = TorchCudaPressure(0, torch_module=torch)
        assert [source.read() for _ in range(3)] == [0.0] * 3
    assert not source.available
    assert len(_warnings(caplog)) == 1


def test_torch_cuda_recovers_after_a_failed_read():
    torch = FakeTorch(["GPU-a"], mem=[(1 << 30, 4 << 30)])
    clock = Clock()
    source = TorchCudaPressure(0, torch_module=torch, clock=clock)
    torch.error = RuntimeError("CUDA error: an illegal memory access")
    assert source.read() == 0.0 and not source.available
    torch.error = None
    assert source.read() == 0.0  # still inside the delay: not asked
    clock.t += RetryPolicy().first_s
    assert source.read() == 0.75 and source.available


def test_torch_cuda_on_this_machine_does_not_crash(caplog):
    import torch  # a dependency of the project: a broken import must fail, not skip

    with caplog.at_level(logging.WARNING, logger=LOGGER):
        source = TorchCudaPressure(0)
        value = source.read()
    if torch.cuda.is_available():
        assert source.available and 0.0 < value <= 1.0
    else:
        assert not source.available and value == 0.0
        assert len(_warnings(caplog)) == 1


class CudaPool:
    def __init__(self, used: int, capacity: int, index: int) -> None:
        self.used, self.device_capacity_bytes = used, capacity
        self.device = SimpleNamespace(type="cuda", index=index)

    def device_used_bytes(self) -> int:
        return self.used


def test_cache_pressure_reads_the_caches_device():
    _, gpus, perm, nvml, torch = _machine(11)
    torch.current = 0
    gpu = gpus[perm[2]]
    pool = CudaPool(used=0, capacity=gpu.total // 4, index=2)
    gpu.used = gpu.total // 2  # the pool (a quarter) plus a quarter of other use
    composite = cache_pressure(pool, nvml=nvml, torch_module=torch)
    assert [s.name for s in composite.sources] == ["pool", "pool-adjusted:nvml:cuda:2"]
    # the pool's free quarter counts as free: a quarter in use
    assert composite.read() == pytest.approx(0.25, abs=1e-6)
    assert composite.sources[1].read_bytes() == (gpu.used - pool.device_capacity_bytes, gpu.total)
    cpu = cache_pressure(FakePool(3, 10))
    assert [s.name for s in cpu.sources] == ["pool"] and cpu.read() == 0.3


def test_pool_adjusted_refuses_a_source_for_another_device():
    _, gpus, perm, nvml, torch = _machine(12)
    source, pool = NvmlPressure(0, nvml=nvml, torch_module=torch), CudaPool(0, 8, 1)
    with pytest.raises(ValueError, match="reads cuda:0 but the cache lives on"):
        PoolAdjustedPressure(source, pool)


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
    empty = PoolPressure(FakePool(0, 0))  # accepted when built: the read finds no memory
    with pytest.raises(ValueError, match="total memory"):
        empty.read()


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
    assert composite.read() == max(values)  # gone's 1.0 is left out
    assert gone.reads == 1  # asked (a device source retries inside read), not counted
    assert composite.name == "max(scripted,scripted,scripted,gone)"


def test_composite_with_failing_nvml_falls_back_to_the_pool():
    rng = random.Random(9)
    capacity = rng.randint(2**20, 2**30)
    pool = FakePool(rng.randint(1, capacity), capacity)
    _, _, _, fake, torch = _machine(13)
    fake.fail_init = True
    nvml = NvmlPressure(0, nvml=fake, torch_module=torch)
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
    assert nvml.mode in ("nvml", "mig-torch") and nvml.uuid
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
    _, gpus, perm, fake, torch = _machine(14)
    gpu = gpus[perm[0]]
    gpu.used, gpu.total = pool_cap + other, total  # NVML sees the whole pool as used
    nvml = NvmlPressure(0, nvml=fake, torch_module=torch)
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
    source, pool = ScriptedPressure([0.5]), FakePool(0, 1)
    with pytest.raises(TypeError, match="read_bytes"):
        PoolAdjustedPressure(source, pool)


@pytest.mark.cuda
@pytest.mark.skipif(not _cuda_available(), reason="needs a CUDA device")
def test_real_sources_read_the_device_they_name_not_the_current_one():
    import torch

    last = torch.cuda.device_count() - 1
    torch.cuda.set_device(0)
    nv, tc = NvmlPressure(f"cuda:{last}"), TorchCudaPressure(torch.device("cuda", last))
    try:
        props = torch.cuda.get_device_properties(last)
        assert nv.uuid is not None and nv.uuid.endswith(str(props.uuid))
        before_nv, before_tc = nv.read_bytes(), tc.read_bytes()
        free, _ = torch.cuda.mem_get_info(last)
        block = torch.empty(int(free * 0.25), dtype=torch.uint8, device=f"cuda:{last}")
        torch.cuda.synchronize(last)
        after_nv, after_tc = nv.read_bytes(), tc.read_bytes()
        assert after_tc[0] - before_tc[0] >= block.numel()
        assert after_nv[0] - before_nv[0] >= 0.9 * block.numel()
        assert torch.cuda.current_device() == 0
        del block
    finally:
        nv.close()


# -- a state machine over a device source's life: up, outage, retry, recovery -----------

from hypothesis import settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402


class _Counting(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.warnings = 0
        self.recoveries = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno == logging.WARNING:
            self.warnings += 1
        elif record.levelno == logging.INFO and "recovered" in record.getMessage():
            self.recoveries += 1


class DeviceSourceMachine(RuleBasedStateMachine):
    """Random reads, clock steps and NVML faults against a model of the source:
    while up every read asks NVML once; in an outage nothing is asked before
    the retry time; a retry that fails grows the delay up to max_s; one
    warning per outage and one INFO line per recovery."""

    def __init__(self) -> None:
        super().__init__()
        _, self.gpus, perm, self.nvml, torch = _machine(20)
        self.gpu = self.gpus[perm[1]]
        self.clock = Clock()
        self.retry = RetryPolicy(first_s=0.5, max_s=4.0, factor=2.0)
        self.log = _Counting()
        logger = logging.getLogger(LOGGER)
        self.saved_level = logger.level
        logger.setLevel(logging.INFO)  # the recovery line is INFO
        logger.addHandler(self.log)
        self.source = NvmlPressure(1, nvml=self.nvml, torch_module=torch, clock=self.clock,
                                   retry=self.retry)
        self.outages = 0 if self.source.available else 1
        self.recoveries = 0
        self.delay = self.retry.first_s

    def teardown(self) -> None:
        logger = logging.getLogger(LOGGER)
        logger.removeHandler(self.log)
        logger.setLevel(self.saved_level)

    @rule(dt=st.floats(min_value=0.0, max_value=6.0))
    def advance(self, dt):
        self.clock.t += dt

    @rule(fail=st.booleans())
    def set_read_fault(self, fail):
        self.nvml.fail_read = fail

    @rule(fail=st.booleans())
    def set_init_fault(self, fail):
        self.nvml.fail_init = fail

    @rule(used=st.integers(min_value=0, max_value=2**30))
    def set_used(self, used):
        self.gpu.used = min(used, self.gpu.total)

    @rule(via=st.sampled_from(["read", "read_bytes"]))
    def read(self, via):
        before = self.source.health()
        calls = (self.nvml.init_calls, self.nvml.memory_calls)
        if via == "read":
            value = self.source.read()
        else:
            got = self.source.read_bytes()
            assert got is None or got == (self.gpu.used, self.gpu.total)
            value = 0.0 if got is None else got[0] / got[1]
        after = self.source.health()
        if not before.up and self.clock.t < before.next_retry_at:
            assert (self.nvml.init_calls, self.nvml.memory_calls) == calls  # no early retry
            assert value == 0.0 and after == before
            return
        attempted = self.nvml.init_calls > calls[0] or self.nvml.memory_calls > calls[1]
        assert attempted
        if after.up:
            assert value == pytest.approx(self.gpu.used / self.gpu.total)
            if not before.up:
                self.recoveries += 1
            self.delay = self.retry.first_s
            return
        assert value == 0.0
        if before.up:
            self.outages += 1
            self.delay = self.retry.first_s
        else:
            self.delay = min(self.retry.max_s, self.delay * self.retry.factor)
        assert after.next_retry_at == pytest.approx(self.clock.t + self.delay)

    @invariant()
    def logs_and_counts_follow_the_outages(self):
        h = self.source.health()
        assert h.outages == self.outages == self.log.warnings
        assert self.log.recoveries == self.recoveries
        assert h.absent_reason is None and h.up == self.source.available
        assert (h.next_retry_at is None) == h.up


DeviceSourceMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                 deadline=None)
test_device_source_state_machine = DeviceSourceMachine.TestCase


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -1, True])
def test_poller_stop_with_a_bad_timeout_is_refused_and_keeps_it_running(timeout, closing):
    source = ScriptedPressure([0.25])
    poller = PressurePoller(source, interval_s=0.01)
    poller.start()
    closing.call(poller.stop, 5)
    with pytest.raises(ValueError, match="PressurePoller.stop: timeout"):
        poller.stop(timeout)
    assert poller.running
    assert poller.stop(5) is True
    assert not poller.running
