"""Opening an object store from ``s3://bucket/prefix`` plus ``storage_options``.

obstore is the client. ``storage_options`` accepts the names a user knows from fsspec/s3fs
(``endpoint_url``, ``key``, ``secret``, ``token``, ``client_kwargs={"endpoint_url", "region_name"}``)
and obstore's own (``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``,
``session_token``); anything not given falls back to the ``AWS_*`` environment variables, as
obstore reads them. An ``http://`` endpoint enables plain HTTP. A name we do not know raises
``ValueError`` naming it.

``open_s3_store`` probes the store once (one small list request, bounded by ``timeout_s``) and
raises :class:`ColdTierUnavailable` when it cannot be reached or refuses the credentials, so a
wrong endpoint fails at start-up with the tier's own exception, not at the first offload.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from types import MappingProxyType
from typing import Any, NamedTuple
from urllib.parse import urlsplit

from tiering.core.validate import check_waitable

from .errors import ColdTierUnavailable

__all__ = ["S3Location", "check_storage_options", "open_s3_store", "open_zarr_store", "parse_s3_url",
           "probe"]

# storage_options name -> obstore S3Config name
_ALIASES = MappingProxyType({
    "endpoint": "endpoint",
    "endpoint_url": "endpoint",
    "region": "region",
    "region_name": "region",
    "key": "access_key_id",
    "access_key_id": "access_key_id",
    "aws_access_key_id": "access_key_id",
    "secret": "secret_access_key",
    "secret_access_key": "secret_access_key",
    "aws_secret_access_key": "secret_access_key",
    "token": "session_token",
    "session_token": "session_token",
    "aws_session_token": "session_token",
    "virtual_hosted_style_request": "virtual_hosted_style_request",
    "skip_signature": "skip_signature",
    "anon": "skip_signature",
})
_CLIENT_KWARGS = MappingProxyType({"endpoint_url": "endpoint", "region_name": "region"})
_OURS = frozenset({"timeout_s", "connect_timeout_s", "allow_http", "max_retries"})
# the S3 settings that are text: an endpoint, a region, credentials
_TEXT = frozenset({"endpoint", "region", "access_key_id", "secret_access_key", "session_token"})


class S3Location(NamedTuple):
    bucket: str
    prefix: str  # no leading or trailing slash; "" for the bucket root


def parse_s3_url(url: str) -> S3Location:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix"). Raises ValueError naming the URL."""
    if not isinstance(url, str):
        raise ValueError(f"cold tier URL must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    if parts.scheme not in ("s3", "s3a"):
        raise ValueError(f"cold tier URL {url!r}: scheme must be s3:// (got {parts.scheme!r})")
    if not parts.netloc:
        raise ValueError(f"cold tier URL {url!r}: no bucket name")
    if parts.query or parts.fragment:
        raise ValueError(f"cold tier URL {url!r}: query and fragment are not allowed")
    prefix = parts.path.strip("/")
    if "//" in prefix or any(seg in (".", "..") for seg in prefix.split("/") if prefix):
        raise ValueError(f"cold tier URL {url!r}: prefix has an empty or relative segment")
    return S3Location(parts.netloc, prefix)


def _check_timeout(what: str, value: object) -> None:
    """A client timeout: a finite number > 0 (not a bool; an infinite one bounds nothing)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not (0 < value < float("inf")):
        raise ValueError(f"{what} must be a positive number, got {value!r}")
    check_waitable(what, value)  # the client's durations overflow well before a float does


def _check_text(what: str, value: object) -> None:
    """An endpoint, region or credential: a non-empty str (obstore takes nothing else)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty str, got {value!r}")


#: the most retries a request may be given (the retry budget is timeout x (retries + 1))
MAX_RETRIES = 1000


def _check_retries(what: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RETRIES:
        raise ValueError(f"{what} must be an int from 0 to {MAX_RETRIES}, got {value!r}")


def _config(storage_options: Mapping[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split storage_options into (obstore S3Config, our own knobs); ValueError on unknown names."""
    config: dict[str, Any] = {}
    ours: dict[str, Any] = {}
    for name, value in dict(storage_options or {}).items():
        if name == "client_kwargs":
            if not isinstance(value, Mapping):
                raise ValueError("storage_options['client_kwargs'] must be a mapping")
            for k, v in value.items():
                if k not in _CLIENT_KWARGS:
                    raise ValueError(f"storage_options['client_kwargs'][{k!r}] is not supported "
                                     f"(known: {sorted(_CLIENT_KWARGS)})")
                _check_text(f"storage_options['client_kwargs'][{k!r}]", v)
                config[_CLIENT_KWARGS[k]] = v
        elif name in _ALIASES:
            if _ALIASES[name] in _TEXT:
                _check_text(f"storage_options[{name!r}]", value)
            config[_ALIASES[name]] = value
        elif name in _OURS:
            ours[name] = value
        else:
            known = sorted(set(_ALIASES) | _OURS | {"client_kwargs"})
            raise ValueError(f"storage_options[{name!r}] is not a known option (known: {known})")
    for num in ("timeout_s", "connect_timeout_s"):
        if num in ours:
            _check_timeout(f"storage_options[{num!r}]", ours[num])
    if "max_retries" in ours:
        _check_retries("storage_options['max_retries']", ours["max_retries"])
    if "allow_http" in ours and not isinstance(ours["allow_http"], bool):
        raise ValueError(f"storage_options['allow_http'] must be a bool, got {ours['allow_http']!r}")
    return config, ours


def check_storage_options(storage_options: Mapping[str, Any] | None) -> None:
    """Raise ValueError naming the first unknown or bad option; no I/O, no client needed."""
    _config(storage_options)


def open_s3_store(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    *,
    timeout_s: float = 10.0,
    connect_timeout_s: float = 2.0,
    max_retries: int = 1,
    check: bool = True,
):
    """An ``obstore.store.S3Store`` rooted at the URL's bucket and prefix.

    Every request is bounded by ``timeout_s`` (``connect_timeout_s`` for the connect phase) with
    at most ``max_retries`` retries; ``storage_options`` may override the three. With ``check``
    the store is probed once; a store that cannot be reached, refuses the credentials or lacks
    the bucket raises :class:`ColdTierUnavailable` with the endpoint and the cause.
    Bad options raise ``ValueError`` naming the option.
    """
    loc = parse_s3_url(url)
    config, ours = _config(storage_options)
    _check_timeout("open_s3_store: timeout_s", timeout_s)
    _check_timeout("open_s3_store: connect_timeout_s", connect_timeout_s)
    _check_retries("open_s3_store: max_retries", max_retries)
    timeout_s = float(ours.get("timeout_s", timeout_s))
    connect_timeout_s = float(ours.get("connect_timeout_s", connect_timeout_s))
    max_retries = int(ours.get("max_retries", max_retries))
    endpoint = str(config.get("endpoint", ""))
    allow_http = bool(ours.get("allow_http", endpoint.startswith("http://")))
    try:
        from obstore.store import S3Store
    except ImportError as exc:  # the extra is not installed
        raise ColdTierUnavailable(
            "the cold tier needs obstore: pip install 'tiering[coldtier]'") from exc
    client_options = {
        "allow_http": allow_http,
        "timeout": timedelta(seconds=timeout_s),
        "connect_timeout": timedelta(seconds=connect_timeout_s),
    }
    retry = {
        "max_retries": max_retries,
        "retry_timeout": timedelta(seconds=timeout_s * (max_retries + 1)),
        "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=1),
                    "base": 2},
    }
    try:
        store = S3Store(loc.bucket, prefix=loc.prefix or None, client_options=client_options,
                        retry_config=retry, **config)
    except Exception as exc:  # obstore raises its own config errors
        raise ColdTierUnavailable(f"cannot configure the cold tier at {url!r}: {exc}") from exc
    if check:
        probe(store, where=f"{url} (endpoint {endpoint or 'from environment'})")
    return store


def probe(store, *, where: str = "the cold tier") -> None:
    """One small list request; ColdTierUnavailable if the store does not answer it."""
    import obstore

    try:
        stream = obstore.list(store, prefix=None, chunk_size=1)
        next(iter(stream), None)
    except Exception as exc:
        raise ColdTierUnavailable(
            f"cannot reach {where}: {type(exc).__name__}: {_first_line(exc)}") from exc


def open_zarr_store(url: str, storage_options: Mapping[str, Any] | None = None, **kwargs):
    """A zarr store over the same location: ``zarr.storage.ObjectStore`` on obstore for s3://,
    ``zarr.storage.FsspecStore`` for any other fsspec URL (fsspec URLs keep working)."""
    import zarr.storage

    if urlsplit(url).scheme in ("s3", "s3a") and kwargs.pop("client", "obstore") == "obstore":
        return zarr.storage.ObjectStore(open_s3_store(url, storage_options, **kwargs))
    try:
        return zarr.storage.FsspecStore.from_url(url, storage_options=dict(storage_options or {}))
    except Exception as exc:
        raise ColdTierUnavailable(f"cannot open {url!r} through fsspec: {exc}") from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""
