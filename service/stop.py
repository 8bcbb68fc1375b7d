"""Stop strings matched on detokenized text across token boundaries."""

from __future__ import annotations

from dataclasses import dataclass

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64


@dataclass(frozen=True, slots=True)
class StopCheck:
    """What one new piece of text releases.

    Attributes:
        text: text safe to stream now (never part of a possible stop string).
        matched: the stop string that matched, or None; when set, generation ends and `text`
            is everything before it.
    """

    text: str
    matched: str | None = None


class StopMatcher:
    """Holds back text that could still become a stop string.

    The stop string itself is not emitted (unless `include_stop`). A match can start only inside held-back text:
    anything already streamed had, when it was released, no suffix that was a prefix of a stop
    string. So the concatenation of streamed pieces equals the non-streamed completion.

    Args:
        stops: up to 4 non-empty strings.
        include_stop: a match releases the stop string too (vLLM's `include_stop_str_in_output`).
    """

    def __init__(self, stops: list[str] | tuple[str, ...], include_stop: bool = False) -> None:
        self.stops = tuple(stops)
        self.include_stop = include_stop
        self._held = ""

    def push(self, piece: str) -> StopCheck:
        """Add newly detokenized text; return what may be streamed and whether a stop matched."""
        if not self.stops:
            return StopCheck(piece)
        text = self._held + piece
        hits = [(text.find(s), s) for s in self.stops if s in text]
        if hits:
            at, stop = min(hits)
            self._held = ""
            return StopCheck(text[:at + len(stop)] if self.include_stop else text[:at], stop)
        hold = self._longest_partial(text)
        self._held = text[len(text) - hold:] if hold else ""
        return StopCheck(text[:len(text) - hold])

    def flush(self) -> str:
        """Release held text at the end of generation (no stop string can complete now)."""
        text, self._held = self._held, ""
        return text

    def _longest_partial(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), best, -1):
                if text.endswith(stop[:k]):
                    best = k
                    break
        return best
