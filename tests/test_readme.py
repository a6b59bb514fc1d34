"""The README is a front page: short, the two set-up commands, and figures that came from a run.

Its code blocks run in tests/test_docs_snippets.py with every other page's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def test_readme_is_a_front_page_with_the_two_set_up_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "make test" in text and "make demo" in text
    assert "```python" in text and "![" in text


def test_quoted_figures_are_the_recorded_ones_with_their_machine():
    record = json.loads((ROOT / "docs" / "figures" / "demo.json").read_text())
    assert record["runs"] and record["machine"]["cores"] >= 1
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "figures.py"), "--check"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert record["machine"]["cpu"] in README.read_text()


def test_the_figures_check_fails_on_edited_text(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import figures
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    record = json.loads((ROOT / "docs" / "figures" / "demo.json").read_text())
    text = README.read_text()
    assert figures.rewrite(text, record) == text
    edited = text.replace("| whole command, wall |", "| whole command, wall | 1 s |", 1)
    assert figures.rewrite(edited, record) != edited
