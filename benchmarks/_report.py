"""Shared output for benchmarks: a printed table and a JSON file."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import torch


def machine() -> dict:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.is_available(),
        "device_name": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch_threads": torch.get_num_threads(),
    }


def table(rows: list[tuple], headers: tuple[str, ...]) -> str:
    cells = [tuple(str(c) for c in headers)] + [tuple(_fmt(c) for c in r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(c) -> str:
    return f"{c:.3f}" if isinstance(c, float) else str(c)


def write_json(path: str | Path, payload: dict) -> None:
    payload = {**payload, "machine": machine()}
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
