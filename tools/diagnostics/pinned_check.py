"""Registered (cudaHostRegister) arena vs torch pinned tensor: H2D/D2H GB/s, same run (GPU)."""

from __future__ import annotations

import torch

from tiered_kv.memory import HostArena


def _rate(src: torch.Tensor, dst: torch.Tensor, reps: int = 10) -> float:
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return reps * src.numel() / (start.elapsed_time(end) / 1e3) / 1e9


def main() -> None:
    n = 1 << 30
    arena = HostArena(n + (1 << 20), pin=True)
    ours = arena.view(0, n)
    ref = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    print(f"{'buffer':<28}{'H2D GB/s':>10}{'D2H GB/s':>10}")
    for name, host in (("torch pin_memory", ref), ("arena (cudaHostRegister)", ours)):
        print(f"{name:<28}{_rate(host, dev):>10.1f}{_rate(dev, host):>10.1f}")
    del ours
    arena.close()


if __name__ == "__main__":
    main()
