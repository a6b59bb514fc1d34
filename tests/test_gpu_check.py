"""The GPU first-run kit: gpu_check.sh's CPU half (arguments, wheel discovery, the
JSON layout, installing from a wheel folder), the race-probe verdicts, the
transfer benchmark's new options, the cuda extra choice and the wheel list;
and, on a GPU, the race probes and exact pinning themselves."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks import gpu_check, gpu_race, transfer  # noqa: E402

CHECK = REPO / "benchmarks" / "gpu_check.sh"


def _run_check(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, **(env or {})}
    return subprocess.run(["bash", str(CHECK), *args], capture_output=True, text=True,
                          timeout=timeout, env=full, cwd=REPO)


def _touch_wheels(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for n in names:
        (folder / n).write_bytes(b"not a real wheel")


PY = f"cp{sys.version_info[0]}{sys.version_info[1]}"


def test_dry_run_writes_the_layout_and_says_what_is_missing(tmp_path):
    rng = random.Random(1)
    fake = f"tierfake_{rng.getrandbits(32):08x}"
    nowheel = f"tiernone_{rng.getrandbits(32):08x}"
    wheels = tmp_path / "wheels"
    _touch_wheels(wheels, [
        f"{fake}-1.0-py3-none-any.whl",
        f"{fake}-1.0-cp39-cp39-win_amd64.whl",  # never usable here
        f"other-2.0-{PY}-{PY}-musllinux_1_2_x86_64.whl",  # not manylinux
        "README.txt",
    ])
    out = tmp_path / "out"
    env = {"GPU_CHECK_REQUIRE": f"json=json,{fake}={fake.replace('_', '-')},{nowheel}={nowheel}"}
    got = _run_check("--dry-run", str(out), str(wheels), env=env)
    assert got.returncode == 0, got.stderr
    assert f"still missing: {fake.replace('_', '-')}, {nowheel}" in got.stderr
    summary = json.loads((out / "gpu_check.json").read_text())
    setup = json.loads((out / "setup.json").read_text())
    assert summary["dry_run"] is True and summary["ok"] is False and summary["schema"] == 1
    assert [s["name"] for s in summary["steps"]] == ["pytest_cuda", "race", "probe", "transfer", "layerwise", "demo"]
    assert {s["status"] for s in summary["steps"]} == {"dry-run"}
    assert sum(s["limit_s"] for s in summary["steps"]) <= 480 - 60  # room for set-up: < 8 min
    by_name = {s["name"]: s for s in summary["steps"]}
    assert "cuda" in by_name["pytest_cuda"]["cmd"] and "-m" in by_name["pytest_cuda"]["cmd"]
    assert by_name["transfer"]["cmd"][-4:] == ["--page-kib", "2048,128,8", "--both-ways",
                                               "--under-matmul"]
    assert ["--device", "cuda"] == by_name["demo"]["cmd"][4:6]
    assert setup["missing"] == [fake.replace("_", "-"), nowheel]
    assert setup["missing_with_wheel"] == [fake.replace("_", "-")]
    assert setup["missing_without_wheel"] == [nowheel]
    assert setup["wheels_usable"] == [f"{fake}-1.0-py3-none-any.whl"]
    assert setup["installed"] == [] and setup["install"] is None  # dry run: nothing installed
    assert not (out / "_venv").exists()


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "the following arguments are required: outdir"),
        (["OUT", "/nonexistent/wheels"], "WHEELS_DIR '/nonexistent/wheels' is not a directory"),
        (["--budget-s", "600", "OUT"], "--budget-s must be in (0, 480]"),
        (["FILE"], "exists and is not a directory"),
    ],
)
def test_bad_arguments_are_refused_with_a_message_and_write_nothing(tmp_path, args, message):
    (tmp_path / "FILE").write_text("x")
    args = [str(tmp_path / a) if a in ("OUT", "FILE") else a for a in args]
    got = _run_check("--dry-run", *args)
    assert got.returncode == 2 and message in got.stderr
    assert not (tmp_path / "OUT").exists()


def test_a_malformed_requirement_list_is_named(monkeypatch):
    monkeypatch.setenv("GPU_CHECK_REQUIRE", "json=json,zarr")
    with pytest.raises(SystemExit, match="'zarr' is not MODULE=DIST"):
        gpu_check.required()


def test_no_python_is_refused(tmp_path):
    got = _run_check("--dry-run", str(tmp_path / "o"), env={"PYTHON": "/nonexistent/python9"})
    assert got.returncode == 2 and "no interpreter '/nonexistent/python9'" in got.stderr


@pytest.mark.parametrize(
    "name, fits",
    [
        ("zarr-3.4.2-py3-none-any.whl", True),
        (f"crc32c-2.9-{PY}-{PY}-manylinux_2_17_x86_64.manylinux2014_x86_64.whl", True),
        ("google_crc32c-1.9.0-cp39-abi3-manylinux_2_17_x86_64.whl", True),  # stable ABI, older
        ("psutil-7.0-cp36-abi3-manylinux_2_12_x86_64.manylinux2010_x86_64.whl", True),
        ("x-1.0-cp399-cp399-manylinux_2_17_x86_64.whl", False),
        ("x-1.0-cp39-cp39-manylinux_2_17_x86_64.whl", False),  # another CPython's ABI
        ("x-1.0-py3-none-manylinux_2_17_aarch64.whl", False),
        ("x-1.0-py3-none-macosx_11_0_x86_64.whl", False),
        ("x-1.0-py2-none-any.whl", False),
    ],
)
def test_wheel_compatibility(name, fits):
    w = gpu_check.parse_wheel(name)
    assert w is not None
    assert gpu_check.wheel_fits(w, sys.version_info[:2]) is fits


def test_wheel_names_parse_and_normalize():
    w = gpu_check.parse_wheel("Google.CRC32C-1.9.0-1-cp311-cp311-manylinux_2_17_x86_64.whl")
    assert (w.dist, w.version, w.python_tag, w.platform_tag) == (
        "google_crc32c", "1.9.0", "cp311", "manylinux_2_17_x86_64")
    assert gpu_check.parse_wheel("notawheel.tar.gz") is None
    assert gpu_check.parse_wheel("too-few.whl") is None


def _make_wheel(folder: Path, dist: str, value: int) -> Path:
    """A minimal, real, pure-Python wheel whose module holds ``VALUE = value``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist}-0.1-py3-none-any.whl"
    info = f"{dist}-0.1.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}/__init__.py", f"VALUE = {value}\n")
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", f"{dist}/__init__.py,,\n{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def test_setup_installs_what_is_missing_from_the_wheel_folder_without_network(tmp_path):
    rng = random.Random(2)
    dist = f"tierwheel_{rng.getrandbits(32):08x}"
    value = rng.getrandbits(30)
    _make_wheel(tmp_path / "wheels", dist, value)
    out = tmp_path / "out"
    env = {"GPU_CHECK_REQUIRE": f"json=json,{dist}={dist}", "PIP_NO_INDEX": "1"}
    got = _run_check("--setup-only", str(out), str(tmp_path / "wheels"), env=env, timeout=400)
    assert got.returncode == 0, got.stderr + got.stdout
    setup = json.loads((out / "setup.json").read_text())
    summary = json.loads((out / "gpu_check.json").read_text())
    assert setup["missing"] == [dist] and setup["installed"] == [dist]
    assert setup["still_missing"] == [] and setup["install"]["ok"] is True
    assert summary["ok"] is True and summary["steps"] == []
    used = summary["python_used"]
    extra = {"PYTHONPATH": str(out / "_site")} if setup["install"]["method"] == "target" else {}
    probe = subprocess.run([used, "-c", f"import {dist}, torch; print({dist}.VALUE)"],
                           capture_output=True, text=True, timeout=120, env={**os.environ, **extra})
    assert probe.stdout.strip() == str(value), probe.stderr  # and the machine's torch still imports


def test_setup_without_a_wheel_folder_reports_the_missing_and_is_not_ok(tmp_path):
    dist = f"tiernone_{random.Random(3).getrandbits(32):08x}"
    got = _run_check("--setup-only", str(tmp_path / "o"), env={"GPU_CHECK_REQUIRE": f"{dist}={dist}"})
    assert got.returncode == 1
    assert f"missing ['{dist}'] and no WHEELS_DIR given" in got.stderr
    assert json.loads((tmp_path / "o" / "gpu_check.json").read_text())["still_missing"] == [dist]


def test_junit_summary_counts_and_names_failures(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="1" skipped="1">'
        '<testcase classname="tests.test_cuda" name="test_a"/>'
        '<testcase classname="tests.test_cuda" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_c"><error message="y"/></testcase>'
        '<testcase classname="tests.test_gpu" name="test_d"><skipped message="no gpu"/></testcase>'
        "</testsuite></testsuites>")
    s = gpu_check.junit_summary(xml, 1)
    assert (s["tests"], s["failures"], s["errors"], s["skipped"], s["passed"]) == (4, 1, 1, 1, 1)
    assert s["failed"] == ["tests.test_cuda::test_b", "tests.test_gpu::test_c"]
    assert s["skipped_tests"] == [{"id": "tests.test_gpu::test_d", "reason": "no gpu"}]
    assert "error" in gpu_check.junit_summary(tmp_path / "none.xml", 4)


# -- race probes: the verdict, and the probes themselves on a GPU ----------------------

T = gpu_race.Trial


def test_race_verdict_passes_only_exact_conclusive_trials_with_a_control_that_saw_the_race():
    good = [T(True, 0, True, 32)] * 3
    caught = [T(False, 4096, True, 32)]
    assert gpu_race.verdict(good, caught)["status"] == "pass"
    assert gpu_race.verdict(good + [T(False, 1, True, 32)], caught)["status"] == "fail"
    # the kernel had finished before the move: proves nothing
    assert gpu_race.verdict(good + [T(True, 0, False, 32)], caught)["status"] == "inconclusive"
    # the reload did not land in the old owner's pages
    assert gpu_race.verdict(good + [T(True, 0, True, 0)], caught)["status"] == "inconclusive"
    # the control did not see the race: the probe cannot tell
    v = gpu_race.verdict(good, [T(True, 0, True, 32)])
    assert v["status"] == "inconclusive" and v["control_detected_race"] is False
    assert gpu_race.verdict([T(True, 0, True, None)], caught)["status"] == "pass"  # item 11
    assert gpu_race.verdict([], caught)["status"] == "inconclusive"


def test_race_and_probe_scripts_say_skipped_without_cuda(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the cuda tests below run the probes")
    from benchmarks import gpu_probe

    r = gpu_race.main(["--out", str(tmp_path / "r.json")])
    p = gpu_probe.main(["--out", str(tmp_path / "p.json")])
    assert r["status"] == p["status"] == "skipped"
    assert json.loads((tmp_path / "r.json").read_text())["reason"] == "needs a CUDA device"
    assert json.loads((tmp_path / "p.json").read_text())["status"] == "skipped"


@pytest.mark.cuda
def test_race_probes_give_exact_bytes_on_the_gpu(tmp_path):
    res = gpu_race.main(["--out", str(tmp_path / "r.json"), "--trials", "3", "--controls", "1"])
    assert sorted(res["probes"]) == ["offload_while_writing", "reload_into_freed_slots"], res
    for name, probe in res["probes"].items():
        assert probe["status"] == "pass", (name, probe)
    assert res["compute_stream_supported"] is True


@pytest.mark.cuda
def test_host_slab_pinning_is_exact_on_the_gpu(tmp_path):
    from benchmarks import gpu_probe

    res = gpu_probe.main(["--out", str(tmp_path / "p.json")])
    assert res["status"] == "ok", res
    assert res["pinning"]["exact"] is True, res["pinning"]
    assert res["pressure"]["devices"], "the probe measured no device"
    for dev in res["pressure"]["devices"]:
        assert dev["nvml_uuid"] and dev["torch_delta"] >= dev["allocated_bytes"] * 0.9


# -- transfer benchmark ----------------------------------------------------------------


@pytest.mark.parametrize("kib", [2048, 128, 8, 64, 4])
def test_transfer_geometry_has_exactly_the_page_size(kib):
    assert transfer.geometry_for(kib).page_bytes == kib * 1024


@pytest.mark.parametrize("text", ["", "2048,x", "6", "0", "-8"])
def test_transfer_page_list_is_validated(text):
    with pytest.raises(SystemExit):
        transfer.main(["--out", "/dev/null", "--page-kib", text])


def test_transfer_default_keeps_its_output_and_options_add_sections(tmp_path, capsys):
    base = transfer.main(["--out", str(tmp_path / "a.json"), "--gib", "0.01", "--reps", "1",
                          "--device", "cpu"])
    printed = capsys.readouterr().out
    assert "offload (device->host)" in printed and "KiB" not in printed.split("\n")[2]
    assert set(base) == {"bytes", "pages", "page_bytes", "scattered_runs", "offload_gbps",
                         "reload_gbps", "raw_gbps", "raw_d2h_gbps", "raw_h2d_gbps",
                         "offload_ratio", "reload_ratio", "device"}
    assert base["page_bytes"] == 2 << 20 and base["scattered_runs"] == base["pages"]
    more = transfer.main(["--out", str(tmp_path / "b.json"), "--gib", "0.01", "--reps", "1",
                          "--device", "cpu", "--page-kib", "128,8", "--both-ways", "--under-matmul"])
    saved = json.loads((tmp_path / "b.json").read_text())
    assert [r["page_kib"] for r in saved["by_page_kib"]] == [128, 8]
    assert len(more["by_page_kib"]) == 2
    for r in more["by_page_kib"]:
        assert r["page_bytes"] == r["page_kib"] * 1024
        assert r["both_ways_gbps"] > 0 and r["raw_both_ways_gbps"] > 0
        assert r["both_ways_ratio"] == pytest.approx(r["both_ways_gbps"] / r["raw_both_ways_gbps"])
        assert r["under_matmul"] == {"skipped": "needs a CUDA device"}
    assert "both ways at once 8 KiB" in capsys.readouterr().out


# -- the cuda extra and the wheel list -----------------------------------------------------


@pytest.mark.parametrize(
    "cuda, extra",
    [("12.8", "cuda12"), ("12.1", "cuda12"), ("13.0", "cuda13"), ("", ""), ("11.8", "")],
)
def test_cuda_extra_follows_torch_version_cuda(tmp_path, cuda, extra):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\necho '{cuda}'\n")
    fake.chmod(0o755)
    got = subprocess.run(["sh", str(REPO / "scripts" / "install_torch.sh"), "--cuda-extra", str(fake)],
                         capture_output=True, text=True, timeout=30)
    assert got.returncode == 0 and got.stdout.strip() == extra
    if cuda == "11.8":
        assert "no cupy extra for torch's CUDA 11.8" in got.stderr
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    if extra:
        assert extras[extra] == [f"cupy-{extra}x>=" + extras[extra][0].split(">=")[1]]
    assert "cuda" not in extras  # one extra for every CUDA build was the mismatch


def test_cuda_extra_of_this_interpreter_matches_its_torch():
    got = subprocess.run(["sh", str(REPO / "scripts" / "install_torch.sh"), "--cuda-extra", sys.executable],
                         capture_output=True, text=True, timeout=60)
    major = (torch.version.cuda or "").split(".")[0]
    assert got.stdout.strip() == ({"12": "cuda12", "13": "cuda13"}.get(major, ""))


def _name(req: str) -> str:
    for sep in "<>=!~[; ":
        req = req.split(sep)[0]
    return gpu_check.normalize(req)


def test_gpu_wheels_downloads_every_dependency_beyond_torch_and_numpy_for_both_pythons():
    got = subprocess.run(["bash", str(REPO / "scripts" / "gpu_wheels.sh"), "--print", "/tmp/w"],
                         capture_output=True, text=True, timeout=30)
    assert got.returncode == 0, got.stderr
    lines = got.stdout.strip().splitlines()
    assert len(lines) == 2 and "--python-version 3.11" in lines[0] and "3.12" in lines[1]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["test"]}
    wanted -= {"torch", "numpy"}
    for line in lines:
        listed = {_name(tok.replace("\\", "")) for tok in line.split() if not tok.startswith("-")}
        assert wanted <= listed, wanted - listed
        assert {"torch", "numpy"}.isdisjoint(listed)
        assert "--only-binary=:all:" in line and "x86_64" in line
    needed = {gpu_check.normalize(d) for _, d in gpu_check.REQUIRED}
    assert needed <= {_name(tok.replace("\\", "")) for tok in lines[0].split()}


def test_a_real_run_records_each_step_and_is_not_ok_without_cuda(tmp_path):
    out = tmp_path / "out"
    got = _run_check(str(out), "--only", "race,probe", env={"GPU_CHECK_REQUIRE": "json=json"},
                     timeout=300)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["race", "probe"]
    for s in summary["steps"]:
        assert s["rc"] is not None and s["seconds"] > 0 and (out / s["log"]).is_file()
        assert (out / s["json"]).is_file()
    if torch.cuda.is_available():
        assert summary["cuda_available"] is True
    else:  # each probe says skipped; the run as a whole is not a GPU check: not ok
        assert {s["status"] for s in summary["steps"]} == {"ok"}
        assert json.loads((out / "race.json").read_text())["status"] == "skipped"
        assert summary["ok"] is False and summary["cuda_available"] is False
        assert got.returncode == 1 and "no CUDA torch" in got.stderr


def test_a_spent_budget_skips_the_steps_it_cannot_start(tmp_path):
    out = tmp_path / "out"
    _run_check(str(out), "--only", "race", "--budget-s", "0.5", env={"GPU_CHECK_REQUIRE": "json=json"})
    (step,) = json.loads((out / "gpu_check.json").read_text())["steps"]
    assert step["status"] == "skipped" and step["reason"] == "time budget spent"


def test_only_names_an_unknown_step():
    got = _run_check("--dry-run", "/tmp/x", "--only", "race,bogus")
    assert got.returncode == 2 and "unknown step(s) ['bogus']" in got.stderr
