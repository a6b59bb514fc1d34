"""The first run on a GPU machine, in one command: set-up, CUDA tests, probes, benchmarks, demo.

    bash benchmarks/gpu_check.sh OUTDIR [WHEELS_DIR]           # on the GPU machine
    bash benchmarks/gpu_check.sh --dry-run OUTDIR [WHEELS_DIR] # anywhere: no step runs

Standard library only: it must start on a machine that has CUDA torch but none
of the project's other dependencies and no network. It finds what the
interpreter lacks, installs it from WHEELS_DIR (a folder filled by
``scripts/gpu_wheels.sh``; ``pip --no-index``, into a virtual environment under
OUTDIR that still sees the machine's torch), says what is still missing, then
runs each step under its own time limit, all within ``--budget-s`` (default 460
s, under 8 minutes), and writes every figure as JSON into OUTDIR:

    OUTDIR/gpu_check.json      the summary: set-up, every step's status, rc, time, files
    OUTDIR/setup.json          interpreter, torch / CUDA / cupy, what was missing and installed
    OUTDIR/pytest_cuda.json    pytest -m cuda: counts and failing test ids (+ junit xml)
    OUTDIR/race.json           race probes (reload into freed slots, offload while writing): exact bytes or not
    OUTDIR/probe.json          exact-size pinning; NVML against torch pressure readings
    OUTDIR/transfer.json       transfer benchmark: pages 2 MiB / 128 KiB / 8 KiB, each way,
                               both ways at once, and under a matmul on another stream
    OUTDIR/layerwise.json      layer 0 ready/computed against a whole reload; a streamed step
    OUTDIR/demo/summary.json   tiering demo --device cuda
    OUTDIR/logs/STEP.log       each step's output

``--dry-run`` checks the arguments, discovers wheels and missing modules and
writes the same JSON layout with every step marked ``dry-run`` (what CI runs).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parent.parent
SCHEMA = 1

#: (import name, distribution): what the steps need beyond torch and numpy.
#: ``GPU_CHECK_REQUIRE="mod=dist,..."`` replaces the list (the tests' seam).
REQUIRED: tuple[tuple[str, str], ...] = (
    ("zarr", "zarr"),
    ("numcodecs", "numcodecs"),
    ("donfig", "donfig"),
    ("google_crc32c", "google-crc32c"),
    ("pynvml", "nvidia-ml-py"),
    ("psutil", "psutil"),
    ("tqdm", "tqdm"),
    ("matplotlib", "matplotlib"),
    ("pytest", "pytest"),
    ("hypothesis", "hypothesis"),
)
#: Never installed from wheels: the machine's own CUDA builds must be used.
MACHINE_OWN = ("torch", "numpy")


class Step(NamedTuple):
    name: str
    argv: tuple[str, ...]
    budget_s: float
    json_file: str  # relative to OUTDIR


def steps(py: str, out: Path) -> list[Step]:
    """The steps, most important first; each gets min(its budget, what is left)."""
    return [
        Step("pytest_cuda", (py, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:xdist",
                             "-p", "no:cacheprovider", f"--junitxml={out / 'pytest_cuda.xml'}",
                             "tests"), 140, "pytest_cuda.json"),
        Step("race", (py, "benchmarks/gpu_race.py", "--out", str(out / "race.json")),
             50, "race.json"),
        Step("probe", (py, "benchmarks/gpu_probe.py", "--out", str(out / "probe.json")),
             30, "probe.json"),
        Step("transfer", (py, "benchmarks/transfer.py", "--out", str(out / "transfer.json"),
                          "--gib", "0.25", "--reps", "3", "--page-kib", "2048,128,8",
                          "--both-ways", "--under-matmul"), 95, "transfer.json"),
        Step("layerwise", (py, "benchmarks/layerwise.py", "--device", "cuda", "--quick",
                           "--out", str(out / "layerwise.json")), 25, "layerwise.json"),
        Step("demo", (py, "-m", "tiering.apps.cli", "demo", "--device", "cuda",
                      "--out", str(out / "demo")), 80, "demo/summary.json"),
    ]


# -- wheels -------------------------------------------------------------------------


def normalize(dist: str) -> str:
    """A distribution name as wheel files spell it: lower case, runs of -_. as _."""
    return re.sub(r"[-_.]+", "_", dist).lower()


class Wheel(NamedTuple):
    dist: str  # normalized
    version: str
    python_tag: str
    abi_tag: str
    platform_tag: str
    file: str


def parse_wheel(name: str) -> Wheel | None:
    """``dist-ver[-build]-py-abi-plat.whl`` -> Wheel; None for anything else."""
    if not name.endswith(".whl"):
        return None
    parts = name[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    dist, version = parts[0], parts[1]
    py, abi, plat = parts[-3:]
    return Wheel(normalize(dist), version, py, abi, plat, name)


def wheel_fits(w: Wheel, py_version: tuple[int, int], machine: str = "x86_64") -> bool:
    """Whether pip could install ``w`` on CPython ``py_version`` on linux ``machine``."""
    major, minor = py_version
    ours = f"cp{major}{minor}"
    py_ok = False
    for tag in w.python_tag.split("."):
        if tag in (f"py{major}", f"py{major}{minor}", ours):
            py_ok = True
        elif (w.abi_tag == "abi3" and tag.startswith(f"cp{major}") and tag[3:].isdigit()
              and int(tag[3:]) <= minor):
            py_ok = True  # a stable-ABI wheel built for this or an older CPython
    plat_ok = any(p == "any" or (p.startswith(("manylinux", "linux_")) and p.endswith(machine))
                  for p in w.platform_tag.split("."))
    return py_ok and plat_ok


def find_wheels(wheels_dir: Path | None, py_version: tuple[int, int]) -> list[Wheel]:
    if wheels_dir is None:
        return []
    found = [parse_wheel(p.name) for p in sorted(wheels_dir.iterdir()) if p.is_file()]
    return [w for w in found if w is not None and wheel_fits(w, py_version)]


# -- the target interpreter ---------------------------------------------------------

_INSPECT = r"""
import importlib.metadata as md, importlib.util, json, sys
mods, dists = json.loads(sys.argv[1]), json.loads(sys.argv[2])
def has(m):
    try:
        return importlib.util.find_spec(m) is not None
    except Exception:
        return False
def version(d):
    try:
        return md.version(d)
    except Exception:
        return None
print(json.dumps({"python": list(sys.version_info[:2]), "executable": sys.executable,
                  "modules": {m: has(m) for m in mods},
                  "dists": {d: version(d) for d in dists}}))
"""

_TORCH = r"""
import json
out = {}
try:
    import torch
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["cuda_available"] = bool(torch.cuda.is_available())
    if out["cuda_available"]:
        p = torch.cuda.get_device_properties(0)
        out["device_name"] = p.name
        out["device_count"] = torch.cuda.device_count()
        out["device_total_bytes"] = int(p.total_memory)
        out["device_uuid"] = str(getattr(p, "uuid", ""))
except Exception as e:
    out["torch_error"] = f"{type(e).__name__}: {e}"
try:
    import cupy
    out["cupy"] = cupy.__version__
except Exception as e:
    out["cupy_error"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


_SITE_DIRS = r"""
import sys
print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))
"""


def inspect(py: str, modules: list[str], dists: list[str], env: dict) -> dict:
    got = subprocess.run([py, "-c", _INSPECT, json.dumps(modules), json.dumps(dists)],
                         capture_output=True, text=True, timeout=60, env=env, check=True)
    return json.loads(got.stdout)


def required() -> list[tuple[str, str]]:
    spec = os.environ.get("GPU_CHECK_REQUIRE")
    if spec is None:
        return list(REQUIRED)
    pairs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        mod, sep, dist = item.partition("=")
        if not sep or not mod or not dist:
            raise SystemExit(f"gpu_check: GPU_CHECK_REQUIRE item {item!r} is not MODULE=DIST")
        pairs.append((mod, dist))
    return pairs


# -- running steps ------------------------------------------------------------------


def run_step(step: Step, env: dict, out: Path, limit_s: float) -> dict:
    log = out / "logs" / f"{step.name}.log"
    record = {"name": step.name, "cmd": list(step.argv), "limit_s": round(limit_s, 1),
              "json": step.json_file, "log": str(log.relative_to(out))}
    if limit_s < 5:
        return {**record, "status": "skipped", "reason": "time budget spent", "rc": None,
                "seconds": 0.0}
    t0 = time.monotonic()
    with open(log, "w") as fh:
        proc = subprocess.Popen(step.argv, cwd=REPO, env=env, stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait(timeout=30)
            status = "timeout"
    record.update(status=status, rc=rc, seconds=round(time.monotonic() - t0, 2))
    if step.name != "pytest_cuda" and not (out / step.json_file).is_file():  # pytest's: from xml
        record["json_missing"] = True
        if status == "ok":
            record["status"] = "failed"
    return record


def junit_summary(xml_path: Path, rc: int | None) -> dict:
    """pytest's junit xml -> counts and the ids of failing tests."""
    summary: dict = {"rc": rc, "xml": xml_path.name}
    if not xml_path.is_file():
        return {**summary, "error": "no junit xml (pytest did not get to write it)"}
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    for key in ("tests", "failures", "errors", "skipped"):
        summary[key] = sum(int(s.get(key, 0)) for s in suites)
    failed, skipped = [], []
    for case in root.iter("testcase"):
        cid = f"{case.get('classname')}::{case.get('name')}"
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(cid)
        elif case.find("skipped") is not None:
            skipped.append({"id": cid, "reason": case.find("skipped").get("message", "")})
    summary["failed"] = failed
    summary["skipped_tests"] = skipped
    summary["passed"] = summary["tests"] - summary["failures"] - summary["errors"] - summary["skipped"]
    return summary


def install(py: str, missing_dists: list[str], wheels_dir: Path, wheels: list[Wheel],
            out: Path, env: dict, present_dists: dict) -> tuple[str, dict, dict]:
    """Install ``missing_dists`` from ``wheels_dir``; returns (python to use, env, report)."""
    report: dict = {"method": None, "ok": False}
    venv = out / "_venv"
    made = subprocess.run([py, "-m", "venv", "--system-site-packages", str(venv)],
                          capture_output=True, text=True, timeout=120)
    if made.returncode == 0 and (venv / "bin" / "python").exists():
        vpy = str(venv / "bin" / "python")
        # --system-site-packages sees the base interpreter's packages only; when
        # the machine's python is itself a virtual environment its torch would be
        # hidden, so its site folders are added behind the venv's own (.pth).
        paths = subprocess.run([py, "-c", _SITE_DIRS], capture_output=True, text=True,
                               timeout=60, env=env, check=True).stdout.split("\n")
        purelib = subprocess.run([vpy, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                 capture_output=True, text=True, timeout=60, check=True).stdout.strip()
        Path(purelib, "_gpu_check_parent.pth").write_text(
            "".join(f"{p}\n" for p in paths if p.strip()))
        got = subprocess.run([vpy, "-m", "pip", "install", "--no-index", "--find-links",
                              str(wheels_dir), "-q", *missing_dists],
                             capture_output=True, text=True, timeout=240, env=env)
        report.update(method="venv", rc=got.returncode, output=got.stdout[-2000:] + got.stderr[-4000:])
        if got.returncode == 0:
            report["ok"] = True
            return vpy, env, report
    else:
        report["venv_error"] = (made.stderr or made.stdout)[-2000:]
    # No venv (no ensurepip): every wheel whose distribution the machine lacks,
    # unpacked into a folder put first on PYTHONPATH, without dependency resolution
    # (which would pull numpy over the machine's own).
    target = out / "_site"
    files = [str(wheels_dir / w.file) for w in wheels
             if w.dist not in {normalize(d) for d in MACHINE_OWN}
             and present_dists.get(w.dist) is None]
    got = subprocess.run([py, "-m", "pip", "install", "--no-index", "--no-deps", "-q",
                          "--target", str(target), *files],
                         capture_output=True, text=True, timeout=240, env=env)
    report.update(method="target", rc=got.returncode, output=got.stdout[-2000:] + got.stderr[-4000:])
    report["ok"] = got.returncode == 0
    env = {**env, "PYTHONPATH": f"{target}{os.pathsep}{env['PYTHONPATH']}"}
    return py, env, report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__.splitlines()[0])
    ap.add_argument("outdir", help="folder for every JSON figure (created)")
    ap.add_argument("wheels_dir", nargs="?", help="folder of wheels to install what is missing")
    ap.add_argument("--dry-run", action="store_true", help="check and write the layout; run nothing")
    ap.add_argument("--python", default=sys.executable, help="the interpreter the steps use")
    ap.add_argument("--budget-s", type=float, default=460.0, help="all steps together (s)")
    ap.add_argument("--only", default=None,
                    help="comma-separated steps to run (default: all of "
                         "pytest_cuda,race,probe,transfer,layerwise,demo)")
    ap.add_argument("--setup-only", action="store_true",
                    help="install what is missing, write setup.json, run no step")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    if not (0 < a.budget_s <= 480):
        ap.error(f"--budget-s must be in (0, 480] (under 8 minutes), got {a.budget_s}")
    out = Path(a.outdir).resolve()
    if out.exists() and not out.is_dir():
        ap.error(f"OUTDIR {a.outdir!r} exists and is not a directory")
    wheels_dir = Path(a.wheels_dir).resolve() if a.wheels_dir else None
    if wheels_dir is not None and not wheels_dir.is_dir():
        ap.error(f"WHEELS_DIR {a.wheels_dir!r} is not a directory")
    if shutil.which(a.python) is None and not Path(a.python).is_file():
        ap.error(f"--python {a.python!r} not found")
    all_steps = steps(a.python, out)
    if a.only is not None:
        chosen = [n for n in a.only.split(",") if n]
        unknown = sorted(set(chosen) - {st.name for st in all_steps})
        if unknown or not chosen:
            ap.error(f"--only: unknown step(s) {unknown or a.only!r}; "
                     f"choose from {','.join(st.name for st in all_steps)}")
    need = required()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "MPLBACKEND": "Agg",
           "PYTHONDONTWRITEBYTECODE": "1"}

    mods = [m for m, _ in need]
    dists = sorted({d for _, d in need} | set(MACHINE_OWN))
    seen = inspect(a.python, mods, dists, env)
    py_version = tuple(seen["python"])
    wheels = find_wheels(wheels_dir, py_version)
    wheel_dists = {w.dist for w in wheels}
    missing = [(m, d) for m, d in need if not seen["modules"][m]]
    setup: dict = {
        "python": a.python, "python_version": ".".join(map(str, py_version)),
        "executable": seen["executable"], "platform": platform.platform(),
        "wheels_dir": str(wheels_dir) if wheels_dir else None,
        "wheels_usable": [w.file for w in wheels],
        "missing": [d for _, d in missing],
        "missing_with_wheel": [d for _, d in missing if normalize(d) in wheel_dists],
        "missing_without_wheel": [d for _, d in missing if normalize(d) not in wheel_dists],
        "machine_own": {d: seen["dists"].get(d) for d in MACHINE_OWN},
        "installed": [], "install": None, "still_missing": [d for _, d in missing],
    }
    py = a.python
    if missing and not a.dry_run:
        if wheels_dir is None:
            print(f"gpu_check: missing {setup['missing']} and no WHEELS_DIR given", file=sys.stderr)
        elif setup["missing_with_wheel"]:
            try:
                py, env, report = install(a.python, setup["missing_with_wheel"], wheels_dir,
                                          wheels, out, env,
                                          {normalize(k): v for k, v in seen["dists"].items()})
            except (OSError, subprocess.SubprocessError) as err:  # reported, never a crash
                report = {"method": None, "ok": False, "error": f"{type(err).__name__}: {err}"}
            setup["install"] = report
            again = inspect(py, mods, dists, env)
            setup["still_missing"] = [d for m, d in need if not again["modules"][m]]
            setup["installed"] = [d for _, d in missing if d not in setup["still_missing"]]
    if not a.dry_run:
        got = subprocess.run([py, "-c", _TORCH], capture_output=True, text=True,
                             timeout=120, env=env)
        setup.update(json.loads(got.stdout) if got.returncode == 0 else
                     {"torch_error": got.stderr[-2000:]})
        smi = shutil.which("nvidia-smi")
        if smi:
            for key, args in (("nvidia_smi_L", ["-L"]),
                              ("nvidia_smi_mig", ["--query-gpu=index,uuid,mig.mode.current,memory.total",
                                                  "--format=csv,noheader"])):
                try:
                    r = subprocess.run([smi, *args], capture_output=True, text=True, timeout=20)
                    setup[key] = r.stdout.strip().splitlines()
                except (OSError, subprocess.TimeoutExpired) as err:
                    setup[key] = f"failed: {err}"
    if setup["missing"]:
        print(f"gpu_check: missing: {', '.join(setup['missing'])}", file=sys.stderr)
    if setup["still_missing"]:
        print(f"gpu_check: still missing: {', '.join(setup['still_missing'])}", file=sys.stderr)
    if not a.dry_run and not setup.get("cuda_available"):
        print(f"gpu_check: no CUDA torch in {py}: {setup.get('torch_error', 'no CUDA device')}",
              file=sys.stderr)
    (out / "setup.json").write_text(json.dumps(setup, indent=2, sort_keys=True) + "\n")

    records = []
    deadline = t_start + a.budget_s
    chosen_steps = [st for st in steps(py, out) if a.only is None or st.name in a.only.split(",")]
    for step in [] if a.setup_only else chosen_steps:
        if a.dry_run:
            records.append({"name": step.name, "cmd": list(step.argv), "status": "dry-run",
                            "rc": None, "seconds": 0.0, "limit_s": step.budget_s,
                            "json": step.json_file, "log": f"logs/{step.name}.log"})
            continue
        limit = min(step.budget_s, deadline - time.monotonic())
        rec = run_step(step, env, out, limit)
        if step.name == "pytest_cuda":
            summary = junit_summary(out / "pytest_cuda.xml", rec["rc"])
            (out / step.json_file).write_text(json.dumps(summary, indent=2) + "\n")
            rec["passed"], rec["failed_tests"] = summary.get("passed"), summary.get("failed")
            if ("tests" in summary and summary["tests"] == summary["skipped"]
                    and rec["status"] != "timeout"):
                rec["status"] = "failed"  # nothing ran: every cuda test skipped
                rec["reason"] = "every cuda test was skipped"
        records.append(rec)
        print(f"gpu_check: {step.name:12s} {rec['status']:8s} rc={rec['rc']} "
              f"{rec['seconds']:.1f}s", flush=True)
    result = {
        "schema": SCHEMA, "dry_run": a.dry_run, "outdir": str(out),
        "budget_s": a.budget_s, "elapsed_s": round(time.monotonic() - t_start, 2),
        "setup": "setup.json", "setup_only": a.setup_only, "python_used": py,
        "still_missing": setup["still_missing"], "steps": records,
        "cuda_available": bool(setup.get("cuda_available")),
        "ok": (not a.dry_run and not setup["still_missing"]
               and (a.setup_only or bool(setup.get("cuda_available")))
               and all(r["status"] == "ok" for r in records)),
    }
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"gpu_check: wrote {out / 'gpu_check.json'} (ok: {str(result['ok']).lower()})")
    return 0 if (a.dry_run or result["ok"]) else 1


if __name__ == "__main__":
    sys.exit(main())
