"""Fifo() and Lifo(): the oldest (newest) rows that may still be sampled, in order, no row twice
in a batch. With max_times_sampled=1 a table of either is a queue (a stack)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from h5replay.errors import NotEnoughDataError
from h5replay.samplers.base import Rows, Sampler, empty, register

__all__ = ["Fifo", "Lifo"]


@dataclass(frozen=True)
class _Ordered(Sampler):
    IN_ORDER: ClassVar[bool] = True
    REPLICATES: ClassVar[str] = ("nothing, as long as rows are not removed (a table that removes rows is sampled by "
                                 "its writer alone)")
    _OLDEST_FIRST: ClassVar[bool] = True

    def draw(self, rows: Rows, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        empty(rows)
        count = rows.sampleable
        if n > count:
            raise NotEnoughDataError(f"{type(self).__name__} sampling of {n} rows without replacement needs {n} rows "
                                     f"that may be sampled; the buffer has {count}")
        k = np.arange(n, dtype=np.int64) if self._OLDEST_FIRST else np.arange(count - 1, count - 1 - n, -1,
                                                                               dtype=np.int64)
        if rows.tree is None:
            return rows.begin + k, np.ones(n)
        return rows.ids(rows.in_order(k + 0.5)), np.ones(n)  # the k-th row not removed, by weights of 1


@register("fifo")
@dataclass(frozen=True)
class Fifo(_Ordered):
    """The oldest rows that may still be sampled, no row twice in a batch."""


@register("lifo")
@dataclass(frozen=True)
class Lifo(_Ordered):
    """The newest rows that may still be sampled, no row twice in a batch."""

    _OLDEST_FIRST: ClassVar[bool] = False
