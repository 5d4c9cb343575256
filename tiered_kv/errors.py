"""The exception hierarchy. Misses and capacity pressure are return values, never these."""

from __future__ import annotations


class TieredKVError(Exception):
    """Root of every error tiered_kv raises on purpose."""


class ConfigError(TieredKVError, ValueError):
    """A configuration value is malformed or out of range."""


class LayoutError(TieredKVError, ValueError):
    """KV tensors whose format cannot be detected, or arguments that do not fit the layout."""


class CodecError(TieredKVError, ValueError):
    """A chunk frame is malformed, truncated, over a limit, or fails its checksum."""


class KernelCompileError(TieredKVError):
    """NVRTC refused a kernel; the compiler log is attached as ``log``."""

    def __init__(self, message: str, log: str = "") -> None:
        super().__init__(f"{message}\n{log}" if log else message)
        self.log = log


class EngineStateError(TieredKVError, RuntimeError):
    """The engine was used before it was opened, after it was closed, or before registration."""


class L2DirectoryInUseError(TieredKVError, RuntimeError):
    """Another process holds the lock on this L2 directory."""


class RemoteError(TieredKVError):
    """A remote cache (``tkv://`` server or Redis/Valkey) failed a request.

    The L3 tier turns these into misses and skipped stores; they reach callers only of the
    connector and client APIs themselves.
    """


class RemoteUnavailable(RemoteError, ConnectionError):
    """The remote cache cannot be reached (refused, reset, or backing off after failures)."""


class RemoteDown(RemoteUnavailable):
    """Refused without a request: the store is known to be down (its circuit is open) until a
    background probe finds it answering again."""


class RemoteTimeout(RemoteError, TimeoutError):
    """A remote request did not complete within its timeout."""


class RemoteAuthError(RemoteError):
    """The remote cache refused our credentials (wrong or missing token)."""


class ProtocolError(RemoteError, ValueError):
    """A frame of the remote protocol is malformed, over a limit, or of another version."""
