"""What `CudaMover` keeps per device, and the options it is built from.

Owns `MoverOptions` and `DeviceState`: one device's kernels, its store and load `Direction`s
(streams, staging rings, clocks), the copy plan of each registered layout, the mapped device
address of each pinned arena, and the pool of free `CallBuffers`. Enqueues nothing. Made and
read on the loop thread; the model's thread reads it while it pulls a layerwise load, under the
mover's lock.
"""

from __future__ import annotations

import dataclasses

import torch

from tiered_kv.errors import TieredKVError
from tiered_kv.gpu.events import CallBuffers
from tiered_kv.gpu.kernels import DeviceKernels, check_driver
from tiered_kv.gpu.plan import LayoutPlan, PathChoice, choose_path, group_plan, path_choice
from tiered_kv.gpu.staging import Direction
from tiered_kv.layout import KVCacheLayout
from tiered_kv.memory import HostArena


@dataclasses.dataclass(frozen=True, slots=True)
class MoverOptions:
    """``path``: ``auto`` or one of `PATHS`. Staging uses ``staging_slots`` GPU buffers of
    ``staging_slot_bytes`` per direction (grown to one layer's slab when that is larger) and
    ``staging_ctas`` thread blocks per launch; ``mapped_ctas`` (0: two per SM) for the mapped
    path, which needs many loads in flight to cover PCIe latency. A staging layerwise load of
    small layers launches its first ``mapped_front_layers`` layers (at most all but one) as
    mapped kernels before it returns (0: staging fills only; docs/layerwise.md). Under ``auto``,
    a whole call of at most ``small_call_bytes`` (0: none) on a staging layout whose objects are
    pinned runs as mapped kernels of ``small_call_ctas`` CTAs: one launch, no staging fill,
    and too few CTAs to slow the model (docs/decisions/small-gpu-calls.md)."""

    path: PathChoice = "auto"
    staging_slot_bytes: int = 32 << 20
    staging_slots: int = 3
    staging_ctas: int = 32
    mapped_ctas: int = 0
    mapped_front_layers: int = 4
    small_call_bytes: int = 2 << 20
    small_call_ctas: int = 32

    def __post_init__(self) -> None:
        path_choice(self.path)  # a string from outside the type checker: refused clearly
        if self.staging_slots < 2:
            raise ValueError(f"MoverOptions.staging_slots must be >= 2, got {self.staging_slots}")
        if self.staging_slot_bytes < 4096:
            raise ValueError(
                f"MoverOptions.staging_slot_bytes must be >= 4096, got {self.staging_slot_bytes}"
            )
        if self.staging_ctas < 1 or self.mapped_ctas < 0 or self.mapped_front_layers < 0:
            raise ValueError(
                f"MoverOptions: staging_ctas must be >= 1, mapped_ctas and mapped_front_layers "
                f">= 0, got {self.staging_ctas}, {self.mapped_ctas}, {self.mapped_front_layers}"
            )
        if self.small_call_bytes < 0 or self.small_call_ctas < 1:
            raise ValueError(
                f"MoverOptions: small_call_bytes must be >= 0 and small_call_ctas >= 1, got "
                f"{self.small_call_bytes}, {self.small_call_ctas}"
            )


_STREAMS_KEPT = 64  # caller streams whose torch object `DeviceState.current_stream` keeps
# torch's (stream id, device, type) of the current stream; absent from builds without CUDA.
_GET_CURRENT_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)


class DeviceState:
    """One device's share of a mover: kernels, both directions, plans, buffers."""

    def __init__(self, device: torch.device, kernels: DeviceKernels, options: MoverOptions) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.kernels = kernels
        self.options = options
        _, high = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        self.store = Direction(device, 0, options.staging_slots)
        self.load = Direction(device, high, options.staging_slots)
        self.sm_count = torch.cuda.get_device_properties(device).multi_processor_count
        self.host_delta: dict[int, int] = {}  # arena base → device address minus host address
        self.plans: dict[int, LayoutPlan] = {}
        self.buffers: list[CallBuffers] = []  # free ones
        self._streams: dict[tuple[int, int, int], torch.cuda.Stream] = {}

    def current_stream(self) -> torch.cuda.Stream:
        """The calling thread's current stream on this device; torch's object for it is made once
        per stream (`torch.cuda.current_stream` builds a new one per call)."""
        if _GET_CURRENT_STREAM is None:
            return torch.cuda.current_stream(self.device)
        raw: tuple[int, int, int] = _GET_CURRENT_STREAM(self.index)
        stream = self._streams.get(raw)
        if stream is None:
            if len(self._streams) >= _STREAMS_KEPT:
                self._streams.clear()
            stream = torch.cuda.Stream(stream_id=raw[0], device_index=raw[1], device_type=raw[2])  # type: ignore[no-untyped-call]
            self._streams[raw] = stream
        return stream

    def take_buffers(self) -> CallBuffers:
        return self.buffers.pop() if self.buffers else CallBuffers(self.device)

    def plan(self, layout: KVCacheLayout) -> LayoutPlan:
        """``layout``'s copy plan, made on first use (and again if the layout was replaced)."""
        plan = self.plans.get(id(layout))
        if plan is not None and plan.layout is layout:
            return plan
        groups = tuple(group_plan(group, self.device) for group in layout.groups)
        plan = LayoutPlan(layout, groups, choose_path(layout, self.options.path))
        self.plans[id(layout)] = plan
        return plan

    def forget(self, layout: KVCacheLayout) -> None:
        """Drop ``layout``'s plan (which holds the layout and so its KV tensors)."""
        plan = self.plans.get(id(layout))
        if plan is not None and plan.layout is layout:
            del self.plans[id(layout)]

    def ensure_slots(self, side: Direction, plan: LayoutPlan) -> None:
        """Staging slots on ``side`` that hold the configured bytes and one layer of ``plan``."""
        side.ensure_slots(max(self.options.staging_slot_bytes, plan.largest_layer))

    def device_address(self, arena: HostArena) -> int:
        """Mapped device address of the arena's first byte (equal to it under UVA)."""
        delta = self.host_delta.get(arena.base_ptr)
        if delta is None:
            if not arena.pinned:
                raise TieredKVError(
                    "CudaMover: the mapped path needs a pinned host arena (EngineConfig.pin_memory)"
                )
            from cuda.bindings import driver

            dptr = check_driver(
                driver.cuMemHostGetDevicePointer(arena.base_ptr, 0), "cuMemHostGetDevicePointer"
            )
            delta = int(dptr) - arena.base_ptr
            self.host_delta[arena.base_ptr] = delta
        return arena.base_ptr + delta
