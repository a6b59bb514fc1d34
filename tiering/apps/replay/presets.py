"""Model and hardware presets, and the step-time model built from them.

A model preset gives the KV geometry (so the bytes of one token of KV) and the
parameter count; a hardware preset gives the capacity of each tier, the
bandwidth of each link, and the compute and memory throughput of the
accelerator. ``StepCost`` combines the two into a roofline step time:

    compute  = (prefill tokens + decoding requests) * prefill_s_per_token
    memory   = (weight bytes + KV bytes of the decoding requests) / hbm_bps
    step     = step_overhead_s + max(compute, memory)

so ``prefill_s_per_token`` is ``2 * params / flops`` and the cost of a decode
step with an empty context (``decode_s_per_step``) is the weight read plus the
fixed overhead. The figures are effective rates (what a serving engine reaches,
not the datasheet peak), chosen to be plausible, not measured.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

GiB = 1 << 30
TiB = 1 << 40


def _positive(owner: str, name: str, value: object, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{name} must be a finite number {bound}, got {value!r}")


@dataclass(frozen=True)
class ModelPreset:
    """KV geometry and size of a model. ``params_b``: parameters, in billions.
    ``kv_bytes``: the KV bytes of one token when given (another model's figure, with
    ``--kv-bytes-per-token``); 0: from the geometry."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int
    params_b: float
    kv_bytes: int = 0

    def __post_init__(self) -> None:
        for f in ("num_layers", "num_kv_heads", "head_dim", "dtype_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModelPreset.{f} must be an int >= 1, got {v!r}")
        _positive("ModelPreset", "params_b", self.params_b)
        if isinstance(self.kv_bytes, bool) or not isinstance(self.kv_bytes, int) or (
                self.kv_bytes < 0):
            raise ValueError(f"ModelPreset.kv_bytes must be an int >= 0, got {self.kv_bytes!r}")

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token (``kv_bytes`` when given)."""
        if self.kv_bytes:
            return self.kv_bytes
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def describe(self) -> str:
        """One line for ``--help``."""
        return (f"{self.num_layers} layers, {self.num_kv_heads} KV heads of {self.head_dim}, "
                f"{self.kv_bytes_per_token // 1024} KiB of KV a token, {self.params_b:g}B "
                "parameters")

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.dtype_bytes


@dataclass(frozen=True)
class HardwarePreset:
    """One serving worker: tier sizes (bytes), link and compute rates.

    ``device_kv_bytes``: device memory left for the KV cache. ``host_bytes`` and
    ``disk_bytes``: the host and disk tiers (0 means no such tier). Link rates
    in bytes per second: ``d2h_bps``, ``h2d_bps``, ``disk_write_bps``,
    ``disk_read_bps``. ``flops``: effective dense FLOP/s in prefill;
    ``hbm_bps``: effective device-memory bandwidth; ``step_overhead_s``: fixed
    cost of one engine step. Latencies (seconds, the fixed part of one copy on
    a link): ``d2h_latency_s``, ``h2d_latency_s``, ``disk_write_latency_s``,
    ``disk_read_latency_s``. ``device_mem_bytes``: the accelerator memory the
    model's weights and the KV cache share (0: not checked).
    """

    name: str
    device_kv_bytes: int
    host_bytes: int
    disk_bytes: int
    d2h_bps: float
    h2d_bps: float
    disk_write_bps: float
    disk_read_bps: float
    flops: float
    hbm_bps: float
    step_overhead_s: float
    d2h_latency_s: float = 10e-6
    h2d_latency_s: float = 10e-6
    disk_write_latency_s: float = 100e-6
    disk_read_latency_s: float = 100e-6
    device_mem_bytes: int = 0

    def __post_init__(self) -> None:
        for f in ("device_kv_bytes", "host_bytes", "disk_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"HardwarePreset.{f} must be an int, got {v!r}")
            _positive("HardwarePreset", f, v, allow_zero=f != "device_kv_bytes")
        for f in ("d2h_bps", "h2d_bps", "disk_write_bps", "disk_read_bps", "flops", "hbm_bps"):
            _positive("HardwarePreset", f, getattr(self, f))
        for f in ("step_overhead_s", "d2h_latency_s", "h2d_latency_s", "disk_write_latency_s",
                  "disk_read_latency_s"):
            _positive("HardwarePreset", f, getattr(self, f), allow_zero=True)
        if isinstance(self.device_mem_bytes, bool) or not isinstance(self.device_mem_bytes, int):
            raise ValueError(
                f"HardwarePreset.device_mem_bytes must be an int, got {self.device_mem_bytes!r}")
        _positive("HardwarePreset", "device_mem_bytes", self.device_mem_bytes, allow_zero=True)

    def describe(self) -> str:
        """One line for ``--help``."""
        return (f"{_gib_text(self.device_kv_bytes)} device KV, {_gib_text(self.host_bytes)} "
                f"host, {_gib_text(self.disk_bytes)} disk, {self.h2d_bps / 1e9:g} GB/s to the "
                "device")

    def with_host_bytes(self, host_bytes: int) -> HardwarePreset:
        """The same worker with a host tier of ``host_bytes`` (an int, checked)."""
        return dataclasses.replace(self, host_bytes=host_bytes)

    def with_sizes(self, device_kv_bytes: int | None = None, host_bytes: int | None = None,
                   disk_bytes: int | None = None) -> HardwarePreset:
        """The same worker with the given tier sizes (ints, checked; None: the preset's)."""
        return dataclasses.replace(
            self,
            device_kv_bytes=self.device_kv_bytes if device_kv_bytes is None else device_kv_bytes,
            host_bytes=self.host_bytes if host_bytes is None else host_bytes,
            disk_bytes=self.disk_bytes if disk_bytes is None else disk_bytes,
        )


def _gib_text(nbytes: int) -> str:
    return f"{nbytes / TiB:g} TiB" if nbytes >= TiB else f"{nbytes / GiB:g} GiB"


_DTYPE_BYTES = {"float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
                "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1}


_REQUIRED = object()


def _hf_count(data: dict, key: str, default: object = _REQUIRED) -> Any:
    """``data[key]`` of a Hugging Face config: an int >= 1 (a bool, a str, 0 or a negative
    is refused naming ``key``: one would divide by zero or size the model silently wrong);
    ``default`` when the key is absent or null (KeyError when there is none)."""
    value = data.get(key)
    if value is None:
        if default is _REQUIRED:
            raise KeyError(key)
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be an int >= 1, got {value!r}")
    return value


def model_from_file(path: str) -> ModelPreset:
    """A model from a JSON file: either this class's fields (``name``, ``num_layers``,
    ``num_kv_heads``, ``head_dim``, ``dtype_bytes``, ``params_b``), or a Hugging Face
    ``config.json`` (``num_hidden_layers``, ``num_key_value_heads``, ``head_dim`` or
    ``hidden_size / num_attention_heads``, ``torch_dtype``; the parameter count is estimated
    from ``hidden_size``, ``intermediate_size`` and ``vocab_size`` unless ``params_b`` is
    given). ValueError naming the file and the missing or bad field."""
    import json
    from pathlib import Path

    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--model-config {path}: cannot be read as JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"--model-config {path}: expected a JSON object")
    name = str(data.get("name") or data.get("_name_or_path") or Path(path).stem)
    try:
        if "num_layers" in data:
            return ModelPreset(name, data["num_layers"], data["num_kv_heads"], data["head_dim"],
                               data.get("dtype_bytes", 2), data["params_b"])
        layers = _hf_count(data, "num_hidden_layers")
        heads = _hf_count(data, "num_attention_heads")
        kv_heads = _hf_count(data, "num_key_value_heads", heads)
        hidden = _hf_count(data, "hidden_size")
        head_dim = _hf_count(data, "head_dim", None) or hidden // heads
        dtype = str(data.get("torch_dtype", "bfloat16")).replace("torch.", "")
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"torch_dtype {dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
        params_b = data.get("params_b")
        if params_b is None:
            inter = _hf_count(data, "intermediate_size")
            vocab = _hf_count(data, "vocab_size")
            attn = hidden * (heads * head_dim) * 2 + hidden * (kv_heads * head_dim) * 2
            mlp = 3 * hidden * inter
            embed = vocab * hidden * (1 if data.get("tie_word_embeddings") else 2)
            params_b = (layers * (attn + mlp) + embed) / 1e9
        return ModelPreset(name, layers, kv_heads, head_dim, _DTYPE_BYTES[dtype], params_b)
    except KeyError as err:
        raise ValueError(f"--model-config {path}: missing field {err.args[0]!r}") from None
    except (ValueError, TypeError) as err:
        raise ValueError(f"--model-config {path}: {err}") from None


def check_fits(model: ModelPreset, hardware: HardwarePreset) -> None:
    """ValueError naming both presets unless the model's weights and the device KV budget
    fit in the accelerator's memory (when the preset states it)."""
    mem = hardware.device_mem_bytes
    if not mem:
        return
    need = model.weight_bytes + hardware.device_kv_bytes
    if need > mem:
        raise ValueError(
            f"{model.name} weights ({model.weight_bytes / GiB:.1f} GiB) plus "
            f"{hardware.device_kv_bytes / GiB:.1f} GiB of device KV do not fit in the "
            f"{mem / GiB:.1f} GiB of {hardware.name!r}; choose a larger --hardware or a "
            f"smaller --device-gib"
        )


def reload_seconds(hardware: HardwarePreset, nbytes: float, tier: str) -> float:
    """Seconds to copy ``nbytes`` of KV from ``tier`` ("host" or "disk") to the device on an
    idle link: latency plus bytes over the narrowest link on the way."""
    if tier == "host":
        return hardware.h2d_latency_s + nbytes / hardware.h2d_bps
    if tier == "disk":
        rate = min(hardware.disk_read_bps, hardware.h2d_bps)
        return hardware.disk_read_latency_s + hardware.h2d_latency_s + nbytes / rate
    raise ValueError(f"reload_seconds: tier must be 'host' or 'disk', got {tier!r}")


@dataclass(frozen=True)
class StepCost:
    """Step time of ``model`` on ``hardware`` (see the module docstring)."""

    model: ModelPreset
    hardware: HardwarePreset

    @property
    def prefill_s_per_token(self) -> float:
        return 2.0 * self.model.params_b * 1e9 / self.hardware.flops

    @property
    def kv_read_s_per_token(self) -> float:
        """Seconds to read one token of KV in a decode step."""
        return self.model.kv_bytes_per_token / self.hardware.hbm_bps

    @property
    def decode_s_per_step(self) -> float:
        """A decode step with no context: overhead plus one read of the weights."""
        return self.hardware.step_overhead_s + self.model.weight_bytes / self.hardware.hbm_bps

    def step_s(self, prefill_tokens: int, decoding: int, context_tokens: int) -> float:
        """One step: ``prefill_tokens`` prefilled, ``decoding`` requests each producing a
        token while reading ``context_tokens`` tokens of KV in all."""
        hw = self.hardware
        compute = (prefill_tokens + decoding) * self.prefill_s_per_token
        memory = (self.model.weight_bytes + context_tokens * self.model.kv_bytes_per_token)
        return hw.step_overhead_s + max(compute, memory / hw.hbm_bps)


MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset("llama-3.1-8b", 32, 8, 128, 2, 8.0),
        ModelPreset("llama-3.1-70b", 80, 8, 128, 2, 70.6),
    )
}

HARDWARE: dict[str, HardwarePreset] = {
    h.name: h
    for h in (
        # one H100 SXM serving an 8B model: 80 GB minus weights and activations
        HardwarePreset("h100-80g", 56 * GiB, 256 * GiB, 2 * TiB, 25e9, 25e9, 3e9, 6e9,
                       400e12, 2.6e12, 2e-3, device_mem_bytes=80 * 10**9),
        # eight H100s in tensor parallel, sized for a 70B model
        HardwarePreset("8xh100-80g", 400 * GiB, 1536 * GiB, 8 * TiB, 200e9, 200e9, 12e9,
                       24e9, 3.2e15, 20.8e12, 4e-3, device_mem_bytes=640 * 10**9),
        # one A10 (PCIe 4) serving an 8B model: little room left for KV
        HardwarePreset("a10-24g", 5 * GiB, 64 * GiB, 512 * GiB, 12e9, 12e9, 1.5e9, 3e9,
                       60e12, 0.5e12, 3e-3, device_mem_bytes=24 * 10**9),
        # a deliberately tight worker for quick experiments and tests
        HardwarePreset("small", 2 * GiB, 4 * GiB, 16 * GiB, 10e9, 10e9, 2e9, 2e9,
                       100e12, 1e12, 1e-3, device_mem_bytes=24 * GiB),
    )
}


def get_model(name: str) -> ModelPreset:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(MODELS)}") from None


def get_hardware(name: str) -> HardwarePreset:
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware preset {name!r}; known: {', '.join(HARDWARE)}"
        ) from None
