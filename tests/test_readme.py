"""The README's KV cache example runs as written (with its disk path moved to a temp dir)."""

from __future__ import annotations

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_kv_cache_example_runs(tmp_path):
    text = README.read_text()
    start = text.index("```python\nimport torch")
    body = text[start + len("```python\n") : text.index("```", start + 10)]
    assert "kv.reload" in body and "torch.equal" in body
    code = body.replace('"/tmp/kv-disk"', repr(str(tmp_path / "disk")))
    exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
