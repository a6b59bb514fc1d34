"""Classifying the client's exceptions: missing, already there, precondition, or transient."""

from __future__ import annotations

import re
from enum import Enum

__all__ = ["Fault", "classify", "short"]

_STATUS = re.compile(r"status code: (\d{3})")


class Fault(str, Enum):
    MISSING = "missing"  # the object is not there (404)
    EXISTS = "exists"  # create-if-absent found one (412 on If-None-Match)
    PRECONDITION = "precondition"  # ETag did not match (412 on If-Match)
    RANGE = "range"  # a ranged read the object cannot satisfy (416: it is empty)
    TRANSIENT = "transient"  # connection error, timeout, 5xx, refused credentials: retry later


def classify(exc: BaseException) -> Fault:
    try:
        from obstore.exceptions import AlreadyExistsError, PreconditionError
    except ImportError:  # pragma: no cover - the extra is required to get here
        AlreadyExistsError = PreconditionError = ()  # type: ignore[assignment]  # noqa: N806
    if isinstance(exc, AlreadyExistsError):
        return Fault.EXISTS
    if isinstance(exc, PreconditionError):
        return Fault.PRECONDITION
    if isinstance(exc, FileNotFoundError):  # obstore's NotFoundError is one
        return Fault.MISSING
    code = _STATUS.search(str(exc))
    if code and code.group(1) == "416":
        return Fault.RANGE
    return Fault.TRANSIENT


def short(exc: BaseException) -> str:
    """One line for a result's reason: the exception type, the HTTP status if the store sent
    one, and the start of its message."""
    text = str(exc).strip()
    code = _STATUS.search(text)
    status = f" (HTTP {code.group(1)})" if code else ""
    return f"{type(exc).__name__}{status}: {text.splitlines()[0][:200] if text else ''}"
