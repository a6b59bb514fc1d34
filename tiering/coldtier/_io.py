"""Classifying the client's exceptions: missing, already there, precondition, or transient."""

from __future__ import annotations

from enum import Enum

__all__ = ["Fault", "classify"]


class Fault(str, Enum):
    MISSING = "missing"  # the object is not there (404)
    EXISTS = "exists"  # create-if-absent found one (412 on If-None-Match)
    PRECONDITION = "precondition"  # ETag did not match (412 on If-Match)
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
    return Fault.TRANSIENT


def short(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200] if text else ''}"
