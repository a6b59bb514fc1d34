"""Running several configurations of one trace, and writing what they give.

``Grid`` names the configurations: every policy at every watermark pair and
every host size, plus the two baselines (``recompute`` and ``no-tiering``),
which do not depend on either and run once. ``run_grid`` runs them and returns
one row per run (the metrics of ``metrics.summarize`` plus the configuration).
``write_csv`` and ``plot`` turn rows into ``sweep.csv`` and PNG figures
(``plots.plot_sweep``).
"""

from __future__ import annotations

import csv
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tiering.apps.replay.metrics import summarize
from tiering.apps.replay.policy_spec import PolicySpec
from tiering.apps.replay.presets import GiB, HardwarePreset, ModelPreset, StepCost, check_fits
from tiering.apps.replay.results import RunResult
from tiering.apps.replay.simulator import RunSpec, SimConfig, modeled_kv_factory, simulate
from tiering.apps.replay.traces import TraceRequest
from tiering.control.controller import ControllerConfig
from tiering.policies import PolicyRegistry
from tiering.policies.blocks import BlockPolicyRegistry, make_block_policy

BASELINES = ("recompute", "no-tiering")
CONFIG_COLUMNS = ("label", "mode", "policy", "block_policy", "high", "low", "host_gib")


@dataclass(frozen=True)
class Grid:
    """Block policies x policies x watermark pairs (high, low) x host sizes (bytes), plus
    the baselines.

    ``policies``: registry names or ``module:Class`` paths; ``policy_options``:
    keyword options given to every one of them. ``block_policies``: names of the
    block registry ``run_grid`` is given (empty: ``sim.block_policy`` alone); with
    two or more, each tiering run's label ends in `` | <block policy>`` and the
    baselines run once, with the first. ``device_bytes`` and ``disk_bytes``: the
    device KV and disk tier sizes of every run (None: the hardware preset's).
    """

    policies: tuple[str, ...]
    watermarks: tuple[tuple[float, float], ...]
    host_bytes: tuple[int, ...]
    baselines: bool = True
    policy_options: tuple[tuple[str, object], ...] = ()
    device_bytes: int | None = None
    disk_bytes: int | None = None
    block_policies: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("policies", "watermarks", "host_bytes", "block_policies"):
            v = getattr(self, name)
            if not isinstance(v, (tuple, list)):
                raise ValueError(f"Grid.{name} must be a tuple, got {v!r}")
            object.__setattr__(self, name, tuple(v))
        for pair in self.watermarks:
            if not isinstance(pair, (tuple, list)) or len(pair) != 2:
                raise ValueError(f"Grid.watermarks must hold (high, low) pairs, got {pair!r}")
            ControllerConfig(high=pair[0], low=pair[1])  # raises naming the bad field
        object.__setattr__(self, "watermarks", tuple(tuple(p) for p in self.watermarks))
        for b in self.block_policies:
            if not isinstance(b, str) or not b:
                raise ValueError(f"Grid.block_policies must hold block policy names, got {b!r}")
        for name in ("policies", "watermarks", "host_bytes", "block_policies"):
            v = getattr(self, name)
            if len(set(map(repr, v))) != len(v):
                raise ValueError(f"Grid.{name} holds a value twice (two runs would share "
                                 f"a name): {v!r}")
        if not self.policies or not self.watermarks or not self.host_bytes:
            raise ValueError("Grid needs at least one policy, watermark pair and host size")
        if not isinstance(self.baselines, bool):
            raise ValueError(f"Grid.baselines must be a bool, got {self.baselines!r}")
        for size in self.host_bytes:
            if isinstance(size, bool) or not isinstance(size, int) or size < 0:
                raise ValueError(f"Grid.host_bytes must hold ints >= 0, got {size!r}")
        for name in ("device_bytes", "disk_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"Grid.{name} must be None or an int >= 0, got {v!r}")
        for policy in self.policies:
            PolicySpec(policy, self.policy_options)  # raises naming a malformed option

    def points(self) -> list[tuple[str, float, float, int]]:
        return [
            (policy, high, low, host)
            for high, low in self.watermarks
            for host in self.host_bytes
            for policy in self.policies
        ]

    def blocks(self) -> tuple[str | None, ...]:
        """The block policy of each pass over ``points`` (None: ``sim.block_policy``)."""
        return self.block_policies or (None,)

    def label(self, policy: str, block: str | None) -> str:
        """A tiering run's label: the policy's, and its block policy when there are several."""
        label = PolicySpec(policy, self.policy_options).label
        return f"{label} | {block}" if len(self.block_policies) > 1 else label

    def runs(self) -> int:
        return len(self.points()) * len(self.blocks()) + (len(BASELINES) if self.baselines else 0)

    def labels(self) -> list[str]:
        """The label of every run, in the order ``run_grid`` runs them."""
        base = list(BASELINES) if self.baselines else []
        return base + [self.label(p, b) for b in self.blocks() for p, *_ in self.points()]


def run_grid(
    trace: Sequence[TraceRequest],
    model: ModelPreset,
    hardware: HardwarePreset,
    grid: Grid,
    sim: SimConfig = SimConfig(),  # noqa: B008 - frozen
    *,
    time_scale: float = 1.0,
    on_finish: Callable[[int], None] | None = None,
    on_run: Callable[[dict], None] | None = None,
    on_start: Callable[[int, str], None] | None = None,
    on_result: Callable[[dict, RunResult], None] | None = None,
    registry: PolicyRegistry | None = None,
    block_registry: BlockPolicyRegistry | None = None,
    only: Sequence[int] | None = None,
) -> list[dict]:
    """Run every configuration of ``grid``; one row per run, baselines first.

    ``only``: the indexes of the runs to run (their rows in grid order), the others
    skipped (a process pool runs each one apart; ``on_start`` is told the run's own
    index).

    ``registry``: where policy names are looked up (default: the built-ins);
    ``block_registry``: where block policy names are (default: the built-ins).
    ``on_start(i, label)`` is told before run ``i`` starts; ``on_finish`` is
    passed to ``simulate`` (requests done); ``on_run(row)`` and
    ``on_result(row, result)`` are told after each run. The baselines get no
    host or disk tier (they never move KV off the device), so their rows say so.
    """
    _check_run_grid_args(trace, model, hardware, grid, sim, registry, block_registry,
                         on_finish=on_finish, on_run=on_run, on_start=on_start,
                         on_result=on_result)
    rows: list[dict] = []
    hw = hardware.with_sizes(grid.device_bytes, None, grid.disk_bytes)
    check_fits(model, hw)

    wanted = None if only is None else set(only)
    if wanted is not None and not all(
            isinstance(i, int) and 0 <= i < grid.runs() for i in wanted):
        raise ValueError(f"run_grid: only must hold run indexes in [0, {grid.runs()}), "
                         f"got {list(only)!r}")
    seen = [0]  # runs passed so far, run or skipped

    blocks = grid.blocks()
    for b in blocks:  # each one is known before any run starts
        if b is not None:
            make_block_policy(b, block_registry, capacity=16)

    def one(spec: RunSpec, hw: HardwarePreset, host: int | None, block: str | None) -> None:
        label = grid.label(spec.label, block) if spec.mode == "tiering" else spec.label
        i = seen[0]
        seen[0] += 1
        if wanted is not None and i not in wanted:
            return
        if on_start is not None:
            on_start(i, label)
        cost = StepCost(model, hw)
        run_sim = sim if block is None else dataclasses.replace(sim, block_policy=block)
        result = simulate(trace, cost, spec, run_sim, time_scale=time_scale,
                          kv_factory=modeled_kv_factory(model, hw, run_sim),
                          on_finish=on_finish, registry=registry, block_registry=block_registry)
        row = {
            "label": label,
            "mode": spec.mode,
            "policy": label if spec.mode == "tiering" else "",
            "block_policy": run_sim.block_policy if run_sim.prefix_reuse else "",
            "high": spec.controller.high if spec.mode == "tiering" else "",
            "low": spec.controller.low if spec.mode == "tiering" else "",
            "host_gib": host / GiB if host is not None else "",
        }
        row.update(summarize(result))
        row["label"] = label  # the run's own label, its block policy's included
        rows.append(row)
        if on_run is not None:
            on_run(row)
        if on_result is not None:
            on_result(row, result)

    if grid.baselines:
        for mode in BASELINES:
            one(RunSpec(mode=mode), hw.with_sizes(None, 0, 0), None, blocks[0])
    for block in blocks:
        for policy, high, low, host in grid.points():
            spec = RunSpec("tiering", policy, ControllerConfig(high=high, low=low),
                           grid.policy_options)
            one(spec, hw.with_host_bytes(host), host, block)
    return rows


def _check_run_grid_args(trace, model, hardware, grid, sim, registry, block_registry,
                         **callbacks) -> None:
    """TypeError naming the argument of ``run_grid`` that is of the wrong kind."""
    for name, value, kind in (("model", model, ModelPreset), ("hardware", hardware, HardwarePreset),
                              ("grid", grid, Grid), ("sim", sim, SimConfig)):
        if not isinstance(value, kind):
            raise TypeError(f"run_grid: {name} must be a {kind.__name__}, got {value!r}")
    if registry is not None and not isinstance(registry, PolicyRegistry):
        raise TypeError(f"run_grid: registry must be a PolicyRegistry or None, got {registry!r}")
    if block_registry is not None and not isinstance(block_registry, BlockPolicyRegistry):
        raise TypeError("run_grid: block_registry must be a BlockPolicyRegistry or None, "
                        f"got {block_registry!r}")
    for name, fn in callbacks.items():
        if fn is not None and not callable(fn):
            raise TypeError(f"run_grid: {name} must be callable or None, got {fn!r}")
    if isinstance(trace, (str, bytes)) or not isinstance(trace, Sequence):
        raise TypeError(f"run_grid: trace must be a sequence of TraceRequest, got {trace!r}")
    bad = next((t for t in trace if not isinstance(t, TraceRequest)), None)
    if bad is not None:
        raise TypeError(f"run_grid: trace must hold TraceRequest records, got {bad!r}")


def write_csv(rows: Sequence[dict], path: str | Path) -> None:
    """One line per run: the configuration columns first, then every metric."""
    if not rows:
        raise ValueError("write_csv: no rows")
    names = list(CONFIG_COLUMNS)
    for row in rows:
        names.extend(k for k in row if k not in names)
    with Path(path).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k, "")) for k in names})


def _cell(value: object) -> object:
    return f"{value:.6g}" if isinstance(value, float) else value


def plot(rows: Sequence[dict], out_dir: str | Path, title: str = "") -> list[Path]:
    """Token hit rate and p99 TTFT against host size (see ``plots.plot_sweep``)."""
    from tiering.apps.replay.plots import plot_sweep

    return plot_sweep(rows, out_dir, title)
