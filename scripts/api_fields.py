"""Rewrite docs/api.md's field table from bridge/fields.py (`markdown_table()`), in place.

Run from the repository root: ``python scripts/api_fields.py``. The table is the block of lines
starting at its header row; tests/bridge/test_field_policy.py checks docs/api.md holds it.
"""

from __future__ import annotations

import pathlib

from bridge.fields import markdown_table

HEADER = "| field | /v1/completions | /v1/chat/completions | notes |"


def main() -> None:
    path = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"
    lines = path.read_text().split("\n")
    start = lines.index(HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    lines[start:end] = markdown_table().rstrip("\n").split("\n")
    path.write_text("\n".join(lines))


if __name__ == "__main__":
    main()
