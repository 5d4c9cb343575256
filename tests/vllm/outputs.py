"""Reading a `vllm_runner` result: each request's generated tokens and cached-prefix length, in
the order the batches ran."""

from __future__ import annotations

from typing import Any


def generated(out: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for batch in out["batches"] for o in batch]


def cached_tokens(out: dict[str, Any]) -> list[int]:
    return [o["num_cached_tokens"] for batch in out["batches"] for o in batch]
