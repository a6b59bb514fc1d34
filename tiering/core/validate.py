"""One set of checks for configuration fields (the look-alike ``__post_init__`` checks).

Each raises ValueError naming the record and the field (``"StagingConfig.pages must be
an int >= 1, got 0"``) and changes nothing. A bool is never taken for a number, and NaN
never passes a bound.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Collection, Mapping, Sequence

#: the longest wait the platform takes (``threading.TIMEOUT_MAX``: about 292 years on Linux);
#: a longer one raises OverflowError inside the wait, so no duration that is waited exceeds it
MAX_WAIT_S = float(threading.TIMEOUT_MAX)

#: the most worker threads one pool may be asked for: each is a thread of its own, started
#: at once, so a count in the millions would exhaust the process before any copy ran
MAX_WORKER_THREADS = 64


def check_threads(what: str, value: int) -> None:
    """An int >= 1 already checked is at most ``MAX_WORKER_THREADS``; else ValueError
    naming ``what``."""
    if value > MAX_WORKER_THREADS:
        raise ValueError(f"{what} {value!r} is more worker threads than one pool may start "
                         f"(at most {MAX_WORKER_THREADS})")


_ID_SEQUENCES = (list, tuple)  # the controller's own: no ABC check on the step path


def check_rids(what: str, rids: object) -> None:
    """``rids`` is a collection of request ids (a list, tuple, array...), not one str or
    bytes, whose characters would be taken for ids; TypeError naming ``what`` otherwise."""
    if type(rids) in _ID_SEQUENCES:
        return
    if isinstance(rids, (str, bytes)) or not isinstance(rids, Collection):
        raise TypeError(f"{what}: rids must be a collection of request ids (a list or "
                        f"tuple), got {rids!r:.80}")


def is_int(value: object) -> bool:
    """An ``int`` that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_integral(value: object) -> bool:
    """An integer, Python's or numpy's (slots and counts may come from index arrays),
    never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a bool (NaN and infinities included)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(owner: str, name: str, value: object, minimum: int) -> None:
    """``value`` (the field ``owner.name``) is an int >= ``minimum``."""
    if not is_int(value) or value < minimum:
        raise ValueError(f"{owner}.{name} must be an int >= {minimum}, got {value!r}")


def check_number(owner: str, name: str, value: object, *, zero_ok: bool = False,
                 maximum: float = math.inf) -> None:
    """``value`` (the field ``owner.name``) is a number > 0 (>= 0 with ``zero_ok``), at most
    ``maximum`` when one is given."""
    low_ok = is_number(value) and (value >= 0 if zero_ok else value > 0)
    if not (low_ok and value <= maximum):
        bound = ">= 0" if zero_ok else "> 0"
        top = "" if maximum == math.inf else f" and <= {maximum}"
        raise ValueError(f"{owner}.{name} must be a number {bound}{top}, got {value!r}")


def check_fields(
    record: object,
    *,
    ints: Mapping[str, int] | None = None,
    numbers: Sequence[str] = (),
    zero_ok: Sequence[str] = (),
) -> None:
    """Check fields of ``record`` (named after its type): ``ints`` maps an int field to its
    minimum; ``numbers`` must be > 0, ``zero_ok`` >= 0. The first bad field raises."""
    owner = type(record).__name__
    for name, minimum in (ints or {}).items():
        check_int(owner, name, getattr(record, name), minimum)
    for name in numbers:
        check_number(owner, name, getattr(record, name))
    for name in zero_ok:
        check_number(owner, name, getattr(record, name), zero_ok=True)


def check_clock(what: str, clock: object, error: type[Exception] = TypeError) -> None:
    """``clock`` is a callable whose reading is a finite real number of seconds (read once,
    here): a clock such as ``datetime.now`` or one that returns None or NaN would otherwise
    fail later, inside a step, after part of a registration or a move was made. ``error``
    (TypeError by default) names ``what``'s clock."""
    if not callable(clock):
        raise error(f"{what}: clock must be callable, got {clock!r}")
    reading = clock()
    if (isinstance(reading, bool) or not isinstance(reading, numbers.Real)
            or not math.isfinite(reading)):
        raise error(f"{what}: clock must return a finite number of seconds, "
                    f"got {reading!r} from {clock!r}")


def check_timeout(what: str, timeout: object) -> float:
    """``timeout`` as a finite number of seconds >= 0 (every wait is bounded: an infinite or
    NaN one is refused, as is a bool); else ValueError naming ``what``. Called before
    anything changes, so a refused call changes nothing."""
    if not is_number(timeout) or not math.isfinite(timeout) or timeout < 0:
        raise ValueError(
            f"{what}: timeout must be a finite number of seconds >= 0, got {timeout!r}")
    check_waitable(f"{what}: timeout", timeout)
    return float(timeout)


def check_waitable(what: str, seconds: float) -> None:
    """A finite duration that some thread will wait is at most ``MAX_WAIT_S``; else
    ValueError naming ``what`` (the wait itself would raise OverflowError, later)."""
    if seconds > MAX_WAIT_S:
        raise ValueError(f"{what} {seconds!r} s is longer than the longest wait the platform "
                         f"takes ({MAX_WAIT_S:.0f} s, threading.TIMEOUT_MAX)")


def check_budget(what: str, timeout: object) -> float:
    """A wait's time budget in seconds: a finite real number (not a bool; None, infinity and
    NaN bound nothing); a negative one is an expired budget, returned as 0.0 (answer at
    once). Else ValueError ``"<what> must be a finite number of seconds, got ..."``.
    ``check_timeout`` is the stricter twin for waits where a negative timeout is a mistake."""
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real) \
            or not math.isfinite(timeout):
        raise ValueError(f"{what} must be a finite number of seconds, got {timeout!r}")
    check_waitable(what, timeout)
    return max(0.0, float(timeout))
