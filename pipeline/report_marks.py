"""Which updates end with a metric line, when several ranks must report together.

Every rank marks the same updates (the feeder marks them on the wire, the shard path agrees on them
in its per-update all-reduce), so the ranks report, and sum their intervals, at the same update with
no collective of their own. The metrics callback asks ``due(update)`` once per update.
"""

from __future__ import annotations


class ReportMarks:
    """The updates marked for a metric line; each mark answers once."""

    def __init__(self) -> None:
        self._marked: set[int] = set()

    def mark(self, update: int) -> None:
        self._marked.add(update)

    def due(self, update: int) -> bool:
        """Whether ``update`` was marked; the mark is used up, so a later question about it says no."""
        if update in self._marked:
            self._marked.discard(update)
            return True
        return False
