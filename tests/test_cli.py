"""The conventions every ``tiering`` command shares: ``--version``, ``-v``/``-q``, and one
progress style (a bar on a terminal, a few plain lines anywhere else)."""

from __future__ import annotations

import io
import logging
import sys
import types

import pytest

from tiering.apps import cli
from tiering.apps.console import Progress, log_level, version


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_version_is_printed_by_the_command_and_by_each_subcommand(capsys):
    import tiering

    assert version() == tiering.__version__
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tiering {tiering.__version__}"
    for sub in ("demo", "replay", "stress"):
        try:
            code = cli.main([sub, "--version"])
        except SystemExit as stop:
            code = stop.code
        assert code == 0, sub
        assert capsys.readouterr().out.strip() == f"tiering {tiering.__version__}", sub


def test_verbosity_before_the_command_reaches_it(monkeypatch):
    seen: list[list[str]] = []
    fake = types.ModuleType("fake_tiering_command")
    fake.main = lambda argv: seen.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "fake_tiering_command", fake)
    monkeypatch.setitem(cli.SUBCOMMANDS, "fake", ("fake_tiering_command", "a test command"))
    assert cli.main(["-q", "fake", "x", "--y"]) == 0
    assert cli.main(["-v", "-v", "fake"]) == 0
    assert cli.main(["fake", "-q"]) == 0
    assert seen == [["x", "--y", "-q"], ["-v", "-v"], ["-q"]]


def test_progress_off_a_terminal_is_a_few_plain_lines():
    stream, clock = io.StringIO(), _Clock()
    bar = Progress(5000, desc="work", unit="tok", stream=stream, tty=False, clock=clock)
    for _ in range(5000):
        clock.t += 0.01
        bar.update(1)
    bar.close()
    bar.close()  # idempotent: no second last line
    text = stream.getvalue()
    lines = text.splitlines()
    assert "\r" not in text
    assert 9 <= len(lines) <= 11, lines
    assert lines[0].startswith("work:  10% (500/5,000 tok")
    assert lines[-1].startswith("work: 100% (5,000/5,000 tok, 50.0 s) done")


def test_progress_on_a_terminal_is_a_bar_and_quiet_is_nothing():
    """The negative control of the plain lines: a bar redraws with carriage returns."""
    pytest.importorskip("tqdm")
    bar_stream = io.StringIO()
    bar = Progress(100, desc="work", unit="tok", stream=bar_stream, tty=True)
    for _ in range(100):
        bar.update(1)
    bar.close()
    assert "\r" in bar_stream.getvalue()
    quiet_stream = io.StringIO()
    quiet = Progress(100, desc="work", unit="tok", stream=quiet_stream, tty=True, quiet=True)
    for _ in range(100):
        quiet.update(1)
    quiet.close()
    assert quiet_stream.getvalue() == ""


def test_progress_refuses_an_empty_total():
    with pytest.raises(ValueError, match="total"):
        Progress(0, desc="work", unit="tok", stream=io.StringIO(), tty=False)


def test_log_level_shows_what_it_names_and_restores_the_logger():
    logger = logging.getLogger("tiering")
    before = (logger.level, list(logger.handlers))
    stream = io.StringIO()
    with log_level(1, stream):
        logging.getLogger("tiering.somewhere").info("an info line")
        logging.getLogger("tiering.somewhere").debug("a debug line")
    assert "an info line" in stream.getvalue() and "debug" not in stream.getvalue()
    assert (logger.level, list(logger.handlers)) == before
    with log_level(-1):
        assert not logging.getLogger("tiering.x").isEnabledFor(logging.WARNING)
        assert logging.getLogger("tiering.x").isEnabledFor(logging.ERROR)
    assert (logger.level, list(logger.handlers)) == before


def test_the_demos_progress_writes_no_carriage_returns_into_a_log(capsys):
    """Off a terminal each run is a few lines (the demo's bars wrote hundreds of
    carriage-return updates into a log)."""
    from tiering.apps.demo import _Progress

    progress = _Progress(600)
    for _ in range(600):
        progress.pressured()
    for _ in range(600):
        progress.reference()
    progress.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert 2 <= len(lines) <= 24, lines
    assert any(line.startswith("demo under pressure: 100%") for line in lines)
    assert any(line.startswith("demo reference: 100%") for line in lines)


def test_the_demo_quiet_shows_no_progress(capsys):
    from tiering.apps.demo import _Progress

    progress = _Progress(50, quiet=True)
    for _ in range(50):
        progress.pressured()
    progress.close()
    assert capsys.readouterr().err == ""


class _Counts:
    def __init__(self) -> None:
        self.steps = 0
        self.operations = 0
        self.data_errors = 0


class _Harness:
    def __init__(self) -> None:
        self.counts = _Counts()
        self.lost: list[str] = []

    def live_requests(self) -> int:
        return 3


def test_stress_prints_progress_while_it_runs_off_a_terminal(capsys):
    """A log of a stress run shows it moving (it printed nothing until the report)."""
    from tiering.apps.stress.cli import _progress

    bar, on_step = _progress(200, "steps", False)
    h = _Harness()
    printed_before_the_end = 0
    for _ in range(200):
        h.counts.steps += 1
        h.counts.operations += 7
        on_step(h)
        if h.counts.steps == 150:
            printed_before_the_end = len(capsys.readouterr().err.splitlines())
    bar.close()
    assert printed_before_the_end >= 5
    assert "\r" not in capsys.readouterr().err
