"""`GpuPrefillTimer`: a forward's GPU time from two timing events, read without waiting."""

from __future__ import annotations

import time

import pytest
import torch

from tiered_kv.integrations.prefill_timer import MAX_PENDING, GpuPrefillTimer


def test_only_a_cuda_device_is_timed() -> None:
    with pytest.raises(ValueError, match="expected a CUDA device, got cpu"):
        GpuPrefillTimer(torch.device("cpu"))


def _work(a: torch.Tensor, times: int) -> None:
    for _ in range(times):
        a = a @ a
        a = a / a.norm()


@pytest.mark.gpu
def test_a_forward_is_timed_by_the_gpu_and_read_once_it_has_run() -> None:
    device = torch.device("cuda")
    timer = GpuPrefillTimer(device)
    a = torch.randn(4096, 4096, device=device)
    _work(a, 2)
    torch.cuda.synchronize()
    # A long forward enqueued behind a blocker: the host ends it long before the GPU does.
    torch.cuda._sleep(int(2e9 * 0.2))  # about 0.2 s of spinning on the GPU, ahead of it
    timer.begin(2048, 512)
    reference_start = torch.cuda.Event(enable_timing=True)
    reference_start.record()
    _work(a, 200)
    reference_end = torch.cuda.Event(enable_timing=True)
    reference_end.record()
    timer.end()
    assert timer.poll() == []  # still queued: nothing to report, and no wait
    assert timer.pending == 1
    torch.cuda.synchronize()
    (new, prefix, seconds), *rest = timer.poll()
    assert rest == [] and (new, prefix) == (2048, 512)
    truth = reference_start.elapsed_time(reference_end) / 1e3
    assert truth > 0.005
    assert seconds == pytest.approx(truth, rel=0.05, abs=2e-4)
    assert timer.poll() == [] and timer.pending == 0


@pytest.mark.gpu
def test_an_unbegun_forward_is_not_timed_and_the_backlog_is_bounded() -> None:
    device = torch.device("cuda")
    timer = GpuPrefillTimer(device)
    timer.end()  # nothing begun
    assert timer.pending == 0
    torch.cuda._sleep(int(2e9 * 0.05))  # the GPU is behind the host for what follows
    for index in range(MAX_PENDING + 3):
        timer.begin(index + 1, 0)
        timer.end()
    assert timer.pending == MAX_PENDING and timer.dropped == 3
    deadline = time.monotonic() + 10
    done: list[tuple[int, int, float]] = []
    while len(done) < MAX_PENDING and time.monotonic() < deadline:
        done += timer.poll()
    assert [new for new, _, _ in done] == list(range(4, MAX_PENDING + 4))  # oldest dropped
