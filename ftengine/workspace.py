"""Allocate once, from a table: name -> (element count, dtype) -> one allocation -> named views."""

from __future__ import annotations

import math

import numpy as np

ALIGN = 256  # bytes; cuBLAS and vector loads want aligned starts


class Workspace:
    def __init__(self, ops, table: dict):
        """table: name -> (max element count, dtype). One buffer holds every entry."""
        self.entries = {}
        offset = 0
        for name, (count, dtype) in table.items():
            dtype = np.dtype(dtype)
            self.entries[name] = (offset, int(count), dtype)
            offset += self._aligned(count, dtype)
        self.nbytes = offset
        self.buffer = ops.empty((max(offset, ALIGN),), np.uint8)
        self._views = {}  # (name, shape) -> view: each batch asks for the same few (creating one costs microseconds)

    @staticmethod
    def _aligned(count, dtype) -> int:
        return -(-int(count) * np.dtype(dtype).itemsize // ALIGN) * ALIGN

    @classmethod
    def bytes_for(cls, table: dict) -> int:
        """The size of the one allocation `table` needs."""
        return sum(cls._aligned(count, dtype) for count, dtype in table.values())

    def size(self, name: str) -> int:
        """The element count allocated for entry `name`."""
        return self.entries[name][1]

    def view(self, name: str, shape):
        """The first prod(shape) elements of entry `name`, shaped. Refuses shapes over the entry's size."""
        key = (name, tuple(shape))
        found = self._views.get(key)
        if found is not None:
            return found
        offset, count, dtype = self.entries[name]
        n = math.prod(shape)
        if n > count:
            raise ValueError(f"workspace entry {name!r}: {shape} needs {n} elements, {count} allocated")
        view = self._views[key] = self.buffer[offset:offset + n * dtype.itemsize].view(dtype).reshape(shape)
        return view
