"""`LayerwiseStore`: a request's new chunks copied out layer by layer as the prefill makes them.

Owns the staged L1 objects of one store from `TieredKVEngine.store_layerwise` to `commit` or
`abort`: each `save_layer` orders that layer's copy after the producer's queued work (a CUDA
event on its stream) and queues it on the mover, one layer after another; `commit` waits for
every layer and only then makes the chunks visible (L1 commit, then the lower tiers' write
policies). Nothing of an aborted or failed store is ever visible. Must not touch bytes itself.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import torch

from tiered_kv.errors import EngineStateError, LayoutError, TieredKVError
from tiered_kv.gpu.base import ChunkTransfer, KVMover
from tiered_kv.keys import ChunkKey
from tiered_kv.layout import KVCacheLayout
from tiered_kv.storage import StorageManager


class LayerwiseStore:
    """Created by `TieredKVEngine.store_layerwise`. ``save_layer`` may be called from any thread
    (the model's); ``commit`` and ``abort`` belong to the engine's loop. ``new_tokens``: tokens
    that commit will store (chunks no tier held when the store began)."""

    def __init__(
        self,
        storage: StorageManager,
        mover: KVMover,
        layout: KVCacheLayout,
        block_ids: Sequence[int],
        staged: Sequence[tuple[ChunkKey, ChunkTransfer]],
        on_end: Any = None,
    ) -> None:
        self._storage = storage
        self._layout = layout
        self._block_ids = list(block_ids)
        self._staged = list(staged)
        self._transfers = [transfer for _, transfer in self._staged]
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._lock = threading.Lock()  # `_saved` is checked from the caller's thread
        self._saved: set[int] = set()
        self._save = mover.begin_gather(layout, self._block_ids, self._transfers)
        self._error: BaseException | None = None
        self._ended = False
        self._on_end = on_end
        self.new_tokens = sum(t.obj.num_tokens for t in self._transfers)
        self.stored_tokens = 0  # set by commit
        self.stored_chunks = 0

    @property
    def num_layers(self) -> int:
        return self._layout.num_layers

    def save_layer(self, layer: int, stream: Any = None) -> None:
        """Copy layer ``layer`` of the new chunks out, after the work queued so far on
        ``stream`` (default: the current stream of the caches' device), which wrote it. Returns
        at once; each layer may be saved once."""
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise LayoutError(f"save_layer: layer must be an int, got {layer!r}")
        if not 0 <= layer < self.num_layers:
            raise LayoutError(f"save_layer: layer {layer} out of range [0, {self.num_layers})")
        with self._lock:
            if self._ended:
                raise EngineStateError("save_layer: this store was committed or aborted")
            if layer in self._saved:
                raise EngineStateError(f"save_layer: layer {layer} was already saved")
            self._saved.add(layer)
        if not self._transfers:
            return
        after = None
        if self._layout.device.type == "cuda":
            after = torch.cuda.Event()  # type: ignore[no-untyped-call]
            if stream is None:
                stream = torch.cuda.current_stream(self._layout.device)
            after.record(stream)
        if threading.get_ident() == self._loop_thread:
            self._queue(layer, after)
        else:
            self._loop.call_soon_threadsafe(self._queue, layer, after)

    def _queue(self, layer: int, after: Any) -> None:
        """On the loop: hand the layer to the mover (a failure is kept for commit)."""
        if self._error is not None or not self._staged:
            return
        try:
            self._save.save(layer, after)
        except Exception as exc:
            self._error = exc

    async def _drain(self) -> None:
        # A save_layer from another thread may still be on its way to the loop: let it land.
        await asyncio.sleep(0)
        try:
            await self._save.finish()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._error = self._error or exc

    async def commit(self) -> int:
        """Wait for every layer's copy, then make the chunks visible; returns tokens newly
        stored. Raises (storing nothing) when a layer was never saved or a copy failed."""
        with self._lock:
            if self._ended:
                raise EngineStateError("commit: this store was committed or aborted")
            missing = sorted(set(range(self.num_layers)) - self._saved)
        if missing and self._transfers:
            await self.abort()
            raise EngineStateError(
                f"commit: layers {missing[:8]} were never saved; nothing was stored"
            )
        try:
            await self._drain()
        except BaseException:
            await self.abort()
            raise
        if self._error is not None:
            error = self._error
            await self.abort()
            raise TieredKVError(f"layerwise store failed: {error}") from error
        stored = 0
        with self._lock:
            self._ended = True
        try:
            for key, transfer in self._staged:
                if self._storage.commit(key, transfer.obj):
                    stored += transfer.obj.num_tokens
                    self.stored_chunks += 1
            self.stored_tokens = stored
        finally:
            self._release()
        return stored

    async def abort(self) -> None:
        """Store nothing: wait for copies already queued (they write into the staged objects),
        then free them. Safe to call more than once and after `commit`."""
        with self._lock:
            already = self._ended and not self._staged
            self._ended = True
        if already:
            return
        try:
            await self._drain()
        finally:
            self._release()

    def _release(self) -> None:
        staged, self._staged = self._staged, []
        self._transfers = []
        for _, transfer in staged:
            transfer.obj.unref()
        if self._on_end is not None:
            on_end, self._on_end = self._on_end, None
            on_end(self)
