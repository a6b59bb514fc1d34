"""Who may write what a worker loads: the deployment secret and the MAC it keys.

Every object the shared tier holds (and every chunk of an ``s3://`` disk tier) carries a keyed
BLAKE2b tag over its root, geometry, key, length and payload. Only holders of the deployment
secret can make a tag that verifies, so write access to the bucket alone is not enough to put
KV in front of a worker.

:class:`TrustConfig` is the one option set (frozen, checked on construction, secrets never in
its ``repr``):

- ``secret``: the current deployment secret (``bytes`` or ``str``, at least 16 bytes). Left out,
  it is read from the environment variable named by ``secret_env``
  (``TIERING_COLDTIER_SECRET`` by default) when the tier is opened.
- ``previous_secret``: the secret before a rotation, accepted on read, never used to write
  (environment: ``previous_env``, ``TIERING_COLDTIER_SECRET_PREVIOUS`` by default).
- ``trust``: ``"authenticated"`` (the default: opening without a secret is refused) or
  ``"unauthenticated"``, which must be said in so many words and turns the MAC off (objects are
  then checked by crc32c only, which proves nothing about who wrote them).

:meth:`TrustConfig.keys` resolves it into :class:`MacKeys` (or None when unauthenticated).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["KEY_ID_BYTES", "MAC_BYTES", "MIN_SECRET_BYTES", "PREVIOUS_SECRET_ENV", "SECRET_ENV",
           "TRUST_MODES", "MacKeys", "TrustConfig", "resolve_keys"]

SECRET_ENV = "TIERING_COLDTIER_SECRET"
PREVIOUS_SECRET_ENV = "TIERING_COLDTIER_SECRET_PREVIOUS"
TRUST_MODES = ("authenticated", "unauthenticated")
MIN_SECRET_BYTES = 16
MAC_BYTES = 32
KEY_ID_BYTES = 8
NO_KEY = bytes(KEY_ID_BYTES)  # the key id of an object written without a MAC
_DERIVE = b"tiering/mac-key"  # BLAKE2b personalisation: at most 16 bytes
_NAME = b"tiering/key-id"


def _secret_bytes(what: str, value: object) -> bytes | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = value.encode("utf-8")
    if not isinstance(value, (bytes, bytearray)):
        raise ValueError(f"{what} must be bytes or str, got {type(value).__name__}")
    if len(value) < MIN_SECRET_BYTES:
        raise ValueError(f"{what} is {len(value)} bytes; a deployment secret needs at least"
                         f" {MIN_SECRET_BYTES}")
    return bytes(value)


class MacKeys:
    """The keys one worker tags and verifies with: the current one, and the previous one."""

    __slots__ = ("_current", "_current_id", "_previous", "_named")

    def __init__(self, current: bytes, previous: bytes | None = None) -> None:
        cur = _secret_bytes("MacKeys current secret", current)
        prev = _secret_bytes("MacKeys previous secret", previous)
        assert cur is not None
        self._current = self._derive(cur)
        self._current_id = self._key_id(self._current)
        self._previous = None if prev is None else self._derive(prev)
        # (key id, key) of the keys a tag may name, the current one first
        self._named = tuple((self._key_id(k), k) for k in (self._current, self._previous) if k is not None)

    @staticmethod
    def _derive(secret: bytes) -> bytes:
        return hashlib.blake2b(secret, digest_size=32, person=_DERIVE).digest()

    @staticmethod
    def _key_id(key: bytes) -> bytes:
        return hashlib.blake2b(key, digest_size=KEY_ID_BYTES, person=_NAME).digest()

    @property
    def key_id(self) -> bytes:
        """The id written beside a tag so a reader picks the key without trying each."""
        return self._current_id

    def tag(self, *parts) -> bytes:
        """The MAC of the concatenated ``parts`` (bytes-like) under the current key."""
        return self._mac(self._current, parts)

    def verify(self, key_id: bytes, tag: bytes, *parts) -> bool:
        """Whether ``tag`` is the MAC of ``parts`` under the key named ``key_id`` (current or
        previous); constant-time comparison."""
        for kid, key in self._named:
            if hmac.compare_digest(kid, bytes(key_id)):
                return hmac.compare_digest(self._mac(key, parts), bytes(tag))
        return False

    def knows(self, key_id: bytes) -> bool:
        return any(hmac.compare_digest(kid, bytes(key_id)) for kid, _ in self._named)

    @staticmethod
    def _mac(key: bytes, parts) -> bytes:
        h = hashlib.blake2b(key=key, digest_size=MAC_BYTES)
        for p in parts:
            h.update(p)
        return h.digest()

    def __repr__(self) -> str:
        return f"MacKeys(key_id={self._current_id.hex()}, previous={self._previous is not None})"


@dataclass(frozen=True)
class TrustConfig:
    """The deployment secret and trust mode of a shared tier (see the module docstring)."""

    secret: bytes | str | None = field(default=None, repr=False)
    previous_secret: bytes | str | None = field(default=None, repr=False)
    trust: str = "authenticated"
    secret_env: str = SECRET_ENV
    previous_env: str = PREVIOUS_SECRET_ENV

    def __post_init__(self) -> None:
        if self.trust not in TRUST_MODES:
            raise ValueError(f"TrustConfig.trust must be one of {TRUST_MODES}, got {self.trust!r}")
        for name in ("secret_env", "previous_env"):
            v = getattr(self, name)
            if not isinstance(v, str) or not v or "=" in v:
                raise ValueError(f"TrustConfig.{name} must name an environment variable, got {v!r}")
        object.__setattr__(self, "secret", _secret_bytes("TrustConfig.secret", self.secret))
        object.__setattr__(self, "previous_secret",
                           _secret_bytes("TrustConfig.previous_secret", self.previous_secret))
        if self.trust == "unauthenticated" and (self.secret or self.previous_secret):
            raise ValueError("TrustConfig: trust='unauthenticated' takes no secret (give one and"
                             " leave trust at 'authenticated' to use it)")
        if self.previous_secret is not None and self.secret is None:
            raise ValueError("TrustConfig.previous_secret needs a current secret as well")

    def keys(self, environ: Mapping[str, str] | None = None) -> MacKeys | None:
        """The keys to tag and verify with; None when unauthenticated. Without a secret given
        here or in ``environ`` (``os.environ`` by default), ValueError saying how to give one."""
        if self.trust == "unauthenticated":
            return None
        env = os.environ if environ is None else environ
        current = self.secret
        previous = self.previous_secret
        if current is None:
            current = _secret_bytes(f"environment variable {self.secret_env}",
                                    env.get(self.secret_env) or None)
            previous = _secret_bytes(f"environment variable {self.previous_env}",
                                     env.get(self.previous_env) or None)
        if current is None:
            raise ValueError(
                f"the shared tier needs a deployment secret: set TrustConfig(secret=...) or the"
                f" environment variable {self.secret_env}, or pass trust='unauthenticated' to"
                " accept blocks that anyone with write access to the bucket can forge")
        return MacKeys(current, previous)


def resolve_keys(trust: TrustConfig | MacKeys | str | None, what: str,
                 environ: Mapping[str, str] | None = None) -> MacKeys | None:
    """``trust`` as keys: a TrustConfig is resolved, MacKeys is used as it is, None (or
    ``"authenticated"``) reads the secret from the environment and refuses without one, and
    only the words ``"unauthenticated"`` turn the MAC off. Anything else: ValueError naming
    ``what``."""
    if isinstance(trust, MacKeys):
        return trust
    if isinstance(trust, TrustConfig):
        return trust.keys(environ)
    if trust is None or isinstance(trust, str) and trust in TRUST_MODES:
        return TrustConfig(trust=trust or "authenticated").keys(environ)
    raise ValueError(f"{what}: trust must be a TrustConfig, MacKeys or one of {TRUST_MODES},"
                     f" got {trust!r:.60}")
