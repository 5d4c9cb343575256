"""`LayerGroups`: which groups a lookup spans and where a sliding-window group's reads start."""

from __future__ import annotations

from tiered_kv import EngineConfig, TieredKVEngine
from tiered_kv.integrations.layer_groups import LayerGroup, LayerGroups, window_start


def test_a_lookup_spans_every_group_registered_each_once() -> None:
    groups = LayerGroups(TieredKVEngine(EngineConfig(chunk_size=32)))
    assert groups.current() == [LayerGroup("")] and groups.index_of(None) == 0
    groups.register("full", None, 16)
    groups.register("window", 64, 16)
    assert groups.current() == [LayerGroup("full"), LayerGroup("window", 64)]
    assert (groups.index_of("full"), groups.index_of("window")) == (0, 1)
    assert groups.index_of(None) == 1  # the last registered
    assert groups.index_of("other") is None
    groups.register("full", None, 16)  # registered again: one group, now the last
    assert groups.current() == [LayerGroup("window", 64), LayerGroup("full")]
    assert groups.block_size == 16


def test_a_window_starts_at_the_block_holding_its_first_token() -> None:
    # 128 tokens, a 32-token window: tokens 97.. are read, in the block starting at 96.
    assert window_start(128, 32, 16) == 96
    assert window_start(96, 32, 16) == 64  # token 65 is in the block starting at 64
    assert window_start(20, 32, 16) == 0  # the window reaches back past the start
