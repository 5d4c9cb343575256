"""Docs true to the code: docs/architecture.md's module table names every module of the package."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_architecture_module_table_matches_the_package() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| module | owns |") :].split("\n\n", 1)[0]
    named = {
        name
        for row in table.splitlines()[2:]
        for name in re.findall(r"`([\w/.]+)`", row.split("|")[1])
    }
    package = ROOT / "tiered_kv"
    missing = []
    for path in sorted(package.rglob("*.py")):
        relative = path.relative_to(package)
        if relative.name == "__init__.py" and relative.parent != Path("."):
            continue  # a subpackage is named by its folder or its modules
        folders = {f"{parent.as_posix()}/" for parent in relative.parents if parent != Path(".")}
        if relative.as_posix() not in named and not folders & named:
            missing.append(relative.as_posix())
    assert missing == [], f"docs/architecture.md's module table lacks {missing}"
    stale = [name for name in named if name.endswith(".py") and not (package / name).exists()]
    assert stale == [], f"docs/architecture.md names modules that do not exist: {stale}"
