"""A bounded set of recently seen ids (cancelled requests). Pure."""

from __future__ import annotations

from collections import OrderedDict


class RecentIds:
    """Remembers the last `capacity` ids added; older ones are forgotten first."""

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity!r} must be >= 1")
        self.capacity = capacity
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, item: str) -> None:
        self._ids[item] = None
        self._ids.move_to_end(item)
        while len(self._ids) > self.capacity:
            self._ids.popitem(last=False)

    def __contains__(self, item: str) -> bool:
        return item in self._ids

    def __len__(self) -> int:
        return len(self._ids)
