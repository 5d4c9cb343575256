"""Frozen statistics snapshots: how a component turns its live counters into its stats dataclass.

Owns two helpers every component's ``stats()`` uses, so that a counter is declared once (as a
field of the frozen stats dataclass) and copied by name: `snapshot` (attributes of the same
names) and `counter_fields` (the names a component keeps as a counting dict). Stdlib only; no
state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

_S = TypeVar("_S")


def snapshot(stats_type: type[_S], source: object, **measured: Any) -> _S:
    """A ``stats_type`` whose fields are ``measured`` where given, else ``source``'s attributes
    of the same names (an `AttributeError` names a field the source does not keep)."""
    values = {
        field.name: getattr(source, field.name)
        for field in dataclasses.fields(stats_type)  # type: ignore[arg-type]
        if field.name not in measured
    }
    return stats_type(**measured, **values)


def counter_fields(stats_type: type[Any], *, measured: tuple[str, ...]) -> tuple[str, ...]:
    """The fields of ``stats_type`` that count events: every field but those ``measured`` when
    asked (occupancy, latencies, nested stats)."""
    return tuple(f.name for f in dataclasses.fields(stats_type) if f.name not in measured)
