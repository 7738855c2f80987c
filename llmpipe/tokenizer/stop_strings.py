"""Stop strings over streamed text: hold back whatever could still turn into one."""

from __future__ import annotations

from collections.abc import Sequence


class StopStringMatcher:
    """Feed text pieces in order; get back the part that can be emitted now.

    Text is held back from the earliest position whose remainder could begin a stop string, so a
    stop string split across pieces never reaches the output. The held-back text is at most one
    stop string long, which keeps each push O(piece + stop strings).
    """

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self.stops = tuple(stop for stop in stops if stop)
        self.include_stop = include_stop
        self.matched: str | None = None
        self._held = ""

    def push(self, piece: str) -> str:
        """Append `piece`; return the text now safe to emit ("" once a stop string has matched)."""
        if self.matched is not None:
            return ""
        text = self._held + piece
        start, stop = self._first_match(text)
        if stop is not None:
            self.matched, self._held = stop, ""
            return text[: start + len(stop)] if self.include_stop else text[:start]
        keep = self._longest_open_prefix(text)
        self._held = text[len(text) - keep :]
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held-back text, when no more pieces will come."""
        held, self._held = self._held, ""
        return held

    def _first_match(self, text: str) -> tuple[int, str | None]:
        """Earliest-starting stop string in `text` (the first listed wins a tie)."""
        best: tuple[int, str | None] = (len(text), None)
        for stop in self.stops:
            start = text.find(stop, 0, best[0] + len(stop))
            if start != -1 and start < best[0]:
                best = (start, stop)
        return best

    def _longest_open_prefix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
