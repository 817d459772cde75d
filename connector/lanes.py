"""The work queue that a KV sender's lanes (posting threads) share.

The lane that finds work splits everything queued into one run per lane waiting for
work (itself included) and takes the first run; the other runs are left whole for the
other idle lanes. A burst of layers is thus written by all idle lanes at once, as
equal consecutive runs (one WRITE each), while layers that come one at a time (a model
computing layer after layer) go out one per WRITE as soon as they are queued.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class LaneQueue(Generic[T]):
    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._runs: deque[list[T]] = deque()  # split off a burst, each for one lane
        self._cond = threading.Condition()
        self._idle = 0  # lanes inside take()
        self._closed = False

    def put(self, item: T) -> bool:
        return self.put_many([item])

    def put_many(self, items: list[T]) -> bool:
        """Queue ``items`` at once (the lanes see all of them or none); False, and
        nothing queued, once closed."""
        with self._cond:
            if self._closed:
                return False
            self._items.extend(items)
            self._cond.notify()
            return True

    def close(self) -> None:
        """Lanes take what is still queued, then ``take`` answers stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def take(self, timeout: float) -> tuple[list[T], bool]:
        """Up to ``timeout`` seconds for work. Returns (this lane's share, stop): stop is
        True once the queue is closed and empty."""
        with self._cond:
            self._idle += 1
            try:
                if not self._runs and not self._items and not self._closed:
                    self._cond.wait_for(lambda: self._runs or self._items or self._closed, timeout)
                if self._runs:
                    return self._runs.popleft(), False
                if not self._items:
                    return [], self._closed
                items, self._items = list(self._items), deque()
                lanes = min(self._idle, len(items))
                size, extra = divmod(len(items), lanes)
                runs, start = [], 0
                for lane in range(lanes):
                    end = start + size + (lane < extra)
                    runs.append(items[start:end])
                    start = end
                self._runs.extend(runs[1:])
                self._cond.notify(len(runs) - 1)
                return runs[0], False
            finally:
                self._idle -= 1

    @property
    def idle_lanes(self) -> int:
        """Lanes waiting in :meth:`take` now."""
        with self._cond:
            return self._idle

    def __len__(self) -> int:
        with self._cond:
            return len(self._items) + sum(len(run) for run in self._runs)
