"""The README's examples run as written (with their disk paths moved to a temp dir)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _block(opening: str) -> str:
    text = README.read_text()
    start = text.index("```python\n" + opening)
    return text[start + len("```python\n") : text.index("```", start + 10)]


def _run(body: str, tmp_path) -> None:
    for path in ('"/tmp/kv-disk"', '"/tmp/kv-tier"'):
        body = body.replace(path, repr(str(tmp_path / path.strip('"').rsplit("/", 1)[1])))
    exec(compile(body, str(README), "exec"), {"__name__": "readme_example"})


def test_readme_kv_cache_example_runs(tmp_path):
    body = _block("import torch")
    assert "kv.reload" in body and "torch.equal" in body
    _run(body, tmp_path)


def test_readme_front_door_example_runs(tmp_path):
    body = _block("from tiering import ControllerConfig")
    assert "TieredKV(" in body and "after_step" in body
    _run(body, tmp_path)
