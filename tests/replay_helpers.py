"""Constants the replay tests share: the bundled trace and a small worker."""

from __future__ import annotations

from pathlib import Path

from tiering.apps.replay.presets import StepCost, get_hardware, get_model
from tiering.apps.replay.simulator import SimConfig

ROOT = Path(__file__).resolve().parent.parent
MOONCAKE = ROOT / "benchmarks" / "traces" / "mooncake" / "conversation_trace.jsonl"
MODEL = get_model("llama-3.1-8b")
SMALL = get_hardware("small")
COST = StepCost(MODEL, SMALL)
SIM = SimConfig(max_batch=16, max_step_tokens=1024, page_tokens=16, block_tokens=64)
