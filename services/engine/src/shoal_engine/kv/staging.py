"""Reused memory for staged KV blocks on a migration's target.

Received chunks land in one long-lived arena instead of fresh allocations: fresh memory costs a
page fault per 4 KiB page on first touch, which halves what a loopback transfer can reach, while
the arena's pages stay mapped from one migration to the next. Per layer the arena is one
``[slots, bytes per layer block]`` tensor; a chunk takes a run of consecutive slots (first fit),
so it is one contiguous region per layer that a socket or a process group can write straight
into. ``torch.empty`` maps nothing up front: the arena costs memory only as far as it is used.
"""

from __future__ import annotations

import bisect
import threading

import torch


class StagingArena:
    def __init__(self, num_layers: int, bytes_per_layer_block: int, slots: int, device: torch.device) -> None:
        self.slots = slots
        self._layers = [
            torch.empty((slots, bytes_per_layer_block), dtype=torch.uint8, device=device)
            for _ in range(num_layers)
        ]
        self._lock = threading.Lock()
        # Free runs of slots, sorted by start: parallel lists of starts and lengths.
        self._starts = [0] if slots else []
        self._lengths = [slots] if slots else []

    def take(self, count: int) -> int | None:
        """The first slot of a free run of ``count`` slots, now in use; None when no run is long enough."""
        with self._lock:
            for i, length in enumerate(self._lengths):
                if length >= count:
                    start = self._starts[i]
                    if length == count:
                        del self._starts[i], self._lengths[i]
                    else:
                        self._starts[i] += count
                        self._lengths[i] -= count
                    return start
        return None

    def views(self, start: int, count: int) -> list[torch.Tensor]:
        return [layer[start : start + count] for layer in self._layers]

    def give_back(self, start: int, count: int) -> None:
        with self._lock:
            i = bisect.bisect(self._starts, start)
            self._starts.insert(i, start)
            self._lengths.insert(i, count)
            # Merge with the following run, then with the preceding one.
            if i + 1 < len(self._starts) and start + self._lengths[i] == self._starts[i + 1]:
                self._lengths[i] += self._lengths.pop(i + 1)
                del self._starts[i + 1]
            if i > 0 and self._starts[i - 1] + self._lengths[i - 1] == start:
                self._lengths[i - 1] += self._lengths.pop(i)
                del self._starts[i]

    def free_slots(self) -> int:
        with self._lock:
            return sum(self._lengths)
