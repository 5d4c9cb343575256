"""`TierWatch`: drained tier events carry their chunk's parent hash and tokens where the host
saw them, within the bound on chunks remembered; nothing is drained while nobody watches."""

from __future__ import annotations

from tiered_kv.integrations.tier_watch import TierWatch
from tiered_kv.keys import KeyScope, chunk_keys
from tiered_kv.tiers.base import TierEventLog

SCOPE = KeyScope("", "m", "", 1, 0, "layout")
CHUNK, BLOCK = 32, 16
TOKENS = list(range(100, 188))  # 88 tokens: two chunks, then 16 tokens of whole blocks and 8 more


def test_drained_events_carry_their_chunks_tokens_and_parents() -> None:
    watch = TierWatch(CHUNK)
    log = TierEventLog(16)
    watch.watch(log, remembered_chunks=8)
    keys = chunk_keys(SCOPE, TOKENS[:80], CHUNK)  # the keys cover whole blocks, as the engine's
    watch.remember(keys, TOKENS, BLOCK)
    for key in keys:
        log.emit("stored", "L1", key, 32)
    unseen = chunk_keys(SCOPE, [7] * CHUNK, CHUNK)[0]
    log.emit("removed", "L2", unseen)
    assert watch.pending()
    events = watch.drain()
    assert [event.event.key for event in events] == [*keys, unseen]
    assert [(event.parent_hash, event.token_ids) for event in events] == [
        (None, tuple(TOKENS[:32])),
        (keys[0].chunk_hash, tuple(TOKENS[32:64])),
        (keys[1].chunk_hash, tuple(TOKENS[64:80])),  # the partial last block left out
        (None, None),  # a chunk the host never saw
    ]
    assert not watch.pending() and watch.drain() == []
    assert (watch.emitted(), watch.dropped()) == (4, 0)


def test_only_the_most_recent_chunks_are_remembered() -> None:
    watch = TierWatch(CHUNK)
    log = TierEventLog(16)
    watch.watch(log, remembered_chunks=2)
    keys = chunk_keys(SCOPE, TOKENS[:64], CHUNK)
    watch.remember(keys, TOKENS[:64], BLOCK)
    fives = chunk_keys(SCOPE, [5] * CHUNK, CHUNK)
    watch.remember(fives, [5] * CHUNK, BLOCK)  # the oldest, keys[0], is forgotten
    watch.remember(keys[1:2], TOKENS[32:64], BLOCK)  # seen again: the most recent now
    sixes = chunk_keys(SCOPE, [6] * CHUNK, CHUNK)
    watch.remember(sixes, [6] * CHUNK, BLOCK)  # the oldest, fives[0], is forgotten
    for key in [*keys, *fives, *sixes]:
        log.emit("stored", "L1", key, 32)
    assert [(event.parent_hash, event.token_ids) for event in watch.drain()] == [
        (None, None),
        (keys[0].chunk_hash, tuple(TOKENS[32:64])),  # as first remembered
        (None, None),
        (None, tuple([6] * CHUNK)),
    ]


def test_nothing_is_drained_while_nobody_watches() -> None:
    watch = TierWatch(CHUNK)
    assert not watch.watching and not watch.pending()
    assert watch.drain() == []
    assert (watch.emitted(), watch.dropped()) == (0, 0)
