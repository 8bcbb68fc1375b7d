"""Helpers for the bridge tests: parse SSE bodies."""

from __future__ import annotations

import json

# The model name the test apps are created with.
MODEL_NAME = "test-model"


def parse_sse(body: str) -> list[tuple[str | None, str]]:
    """(event name or None, data) of every SSE event in a response body."""
    events = []
    for block in body.split("\n\n"):
        if not block.strip() or all(line.startswith(":") for line in block.split("\n")):
            continue                        # empty, or comments only (keep-alives)
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[len("event:"):].strip()
            elif line.startswith("data:"):
                data.append(line[len("data:"):].strip())
        events.append((name, "\n".join(data)))
    return events


def data_events(body: str) -> list[dict]:
    """Every `data:` event as JSON, with the final [DONE] checked and dropped."""
    events = parse_sse(body)
    assert events[-1] == (None, "[DONE]"), f"stream must end with [DONE]: {events[-1]}"
    assert all(name is None for name, _ in events)
    return [json.loads(data) for _, data in events[:-1]]
