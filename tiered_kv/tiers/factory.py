"""Builds the lower tiers an `EngineConfig` names: L2 from ``l2_path``, L3 from ``l3_url``.

Owns the one map from an L3 store (the ``store`` of `tiered_kv.config.L3_SCHEMES`, where every
URL scheme is listed and checked) to the constructor of its connector: a new store is a scheme
entry there and a constructor in `CONNECTORS` here. Tier and connector modules are imported
only when a config names them, so a config without L3 never loads a remote client. Must not
open anything: the storage manager opens the tiers it is given.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from tiered_kv.config import EngineConfig, L3Url, parse_l3_url
from tiered_kv.errors import ConfigError
from tiered_kv.tiers.base import LowerTier
from tiered_kv.tiers.l3_remote import RemoteTier, read_token_file
from tiered_kv.tiers.remote.connector import RemoteConnector, default_pool_size

ConnectorFactory = Callable[[EngineConfig, L3Url, "bytes | None"], RemoteConnector]


def _tkv_connector(config: EngineConfig, url: L3Url, token: bytes | None) -> RemoteConnector:
    from tiered_kv.tiers.remote.client import ClientOptions, RemoteClient, TkvConnector

    assert url.port is not None  # parse_l3_url refuses a tkv:// URL without one
    # l3_pool_size None sizes the pool from the machine (`default_pool_size`).
    options = ClientOptions(pool_size=config.l3_pool_size, timeout_s=config.l3_timeout_s)
    return TkvConnector(RemoteClient(url.host, url.port, token=token, options=options))


def _redis_connector(config: EngineConfig, url: L3Url, token: bytes | None) -> RemoteConnector:
    from tiered_kv.tiers.remote.redis import RedisConnector

    pool_size: int | None = config.l3_pool_size  # None: sized from the machine
    return RedisConnector(
        url.url,
        key_prefix=config.l3_key_prefix,
        ttl_s=config.l3_ttl_s,
        timeout_s=config.l3_timeout_s,
        password=None if token is None else token.decode("utf-8", "replace"),
        max_connections=max(default_pool_size() if pool_size is None else pool_size, 8),
    )


def _mooncake_connector(config: EngineConfig, url: L3Url, token: bytes | None) -> RemoteConnector:
    from tiered_kv.tiers.remote.mooncake_store import MooncakeConnector

    assert url.mooncake is not None  # parse_l3_url parses a mooncake:// URL's query
    pool_size: int | None = config.l3_pool_size  # None: sized from the machine
    return MooncakeConnector(
        url.mooncake,
        key_prefix=config.l3_key_prefix,
        timeout_s=config.l3_timeout_s,
        connections=max(default_pool_size() if pool_size is None else pool_size, 8),
        close_timeout_s=config.close_timeout_s,
    )


CONNECTORS: Mapping[str, ConnectorFactory] = MappingProxyType(
    {"tkv": _tkv_connector, "redis": _redis_connector, "mooncake": _mooncake_connector}
)


def remote_tier(config: EngineConfig) -> RemoteTier:
    """The L3 tier ``config.l3_url`` names, over the connector of its scheme's store."""
    if config.l3_url is None:
        raise ConfigError("l3_url: not set")
    url = parse_l3_url(config.l3_url)
    token = None if config.l3_token_file is None else read_token_file(config.l3_token_file)
    connector = CONNECTORS[url.scheme.store](config, url, token)
    return RemoteTier(connector, timeout_s=config.l3_timeout_s)


def lower_tiers(config: EngineConfig) -> list[LowerTier]:
    """The lower tiers ``config`` names, top first: L2 (``l2_path``), then L3 (``l3_url``)."""
    tiers: list[LowerTier] = []
    if config.l2_path is not None:
        from tiered_kv.tiers.l2 import DiskTier

        tiers.append(
            DiskTier(
                config.l2_path,
                config.l2_bytes,
                durability=config.l2_durability,
                sync_interval_s=config.l2_sync_interval_s,
                io_threads=config.l2_io_threads,
                eviction=config.l2_eviction,
                chunk_tokens=config.chunk_size,
            )
        )
    if config.l3_url is not None:
        tiers.append(remote_tier(config))
    return tiers
