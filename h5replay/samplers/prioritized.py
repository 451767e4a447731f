"""Prioritized(exponent, initial_priority): probability proportional to priority ** exponent
(Schaul et al. 2016), by a sum tree of the rows' weights."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from h5replay.errors import ConfigError, NotEnoughDataError
from h5replay.samplers.base import Rows, Sampler, empty, register, without_replacement

__all__ = ["Prioritized", "MAX_WEIGHT", "over_limit", "positive_finite"]

#: The largest weight (priority ** exponent) a row may have. 2**63 rows at this weight (more than
#: an int64 row id can name) still add up to 1e299, below float64's largest (1.8e308): the sum
#: tree's total, every node in it and every sum a draw takes stay finite, whatever the buffer's
#: size, so one priority can never make a draw's probabilities inf or NaN.
MAX_WEIGHT = 1e280


def positive_finite(value: Any) -> bool:
    """A finite number > 0 (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@register("prioritized")
@dataclass(frozen=True)
class Prioritized(Sampler):
    """Probability proportional to priority ** exponent. A row without a priority of its own gets
    `initial_priority`, or (None) the largest priority seen so far, as in PER. With exponent 0
    every row is equally likely, priority 0 included (0 ** 0 is 1, as in Reverb)."""

    PERSISTS: ClassVar[str] = ("each row's priority (a dataset, checkpointed), the log of updates since, and the "
                               "running maximum priority")
    REPLICATES: ClassVar[str] = "the sum tree of weights: read once, then the priority log's new entries"
    KEEPS_PRIORITIES: ClassVar[bool] = True

    exponent: float = 0.6
    initial_priority: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.exponent, (int, float)) or not 0 <= self.exponent <= 10 or isinstance(self.exponent, bool):
            raise ConfigError(f"Prioritized exponent must be a number in [0, 10], got {self.exponent!r}")
        if self.initial_priority is not None and not positive_finite(self.initial_priority):
            raise ConfigError(f"Prioritized initial_priority must be a finite number > 0, got {self.initial_priority!r}")
        if self.initial_priority is not None and self.initial_priority > self.priority_limit:
            raise ConfigError(f"Prioritized initial_priority {self.initial_priority!r}: {over_limit(self)}")

    @property
    def priority_limit(self) -> float:
        """The largest priority a row may have: its weight priority ** exponent stays within
        MAX_WEIGHT (inf when every finite priority's does, as with exponent 0)."""
        if self.exponent == 0:
            return math.inf
        try:
            return float(MAX_WEIGHT ** (1.0 / self.exponent))
        except OverflowError:  # beyond float64: every finite priority is within the bound
            return math.inf

    @property
    def prioritized_part(self) -> Prioritized:
        return self

    def _tree(self, rows: Rows) -> Any:
        if rows.tree is None:  # a table builds one for every prioritized sampler
            raise ConfigError("a prioritized draw needs its table's sum tree")
        return rows.tree

    def draw(self, rows: Rows, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        empty(rows)
        if rows.removing:
            return without_replacement(rows, n, rng)
        tree = self._tree(rows)
        total = tree.total
        if total <= 0:
            raise NotEnoughDataError(f"every one of the {rows.end - rows.begin} rows held has priority 0")
        slots = tree.sample(rng, n)
        return rows.ids(slots), tree.get(slots) / total

    def probabilities(self, rows: Rows, ids: np.ndarray) -> np.ndarray:
        tree = self._tree(rows)
        total = tree.total
        if total <= 0:
            return np.zeros(ids.shape)
        weights: np.ndarray = tree.get(rows.slots(ids)) / total
        return weights

    def draw_windows(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, n: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Windows by the priority of their first row."""
        tree = self._tree(rows)
        sums = rows.range_sums(starts, starts + windows)
        total = float(sums.sum())
        if total <= 0:
            raise NotEnoughDataError("no window starts at a row of priority > 0")
        cum = np.cumsum(sums)
        k = np.minimum(np.searchsorted(cum, rng.random(n) * cum[-1], side="right"), len(sums) - 1)
        offset_in = rows.range_sums(np.full(n, rows.begin), starts[k]) if rows.end > rows.begin else np.zeros(n)
        slots = rows.in_order(offset_in + rng.random(n) * sums[k])
        g = np.clip(rows.ids(slots), starts[k], starts[k] + windows[k] - 1)
        return g, k, tree.get(rows.slots(g)) / total

    def window_probabilities(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, first: np.ndarray,
                             k: np.ndarray) -> np.ndarray:
        total = float(rows.range_sums(starts, starts + windows).sum())
        if total <= 0:
            return np.zeros(first.shape)
        weights: np.ndarray = self._tree(rows).get(rows.slots(first)) / total
        return weights


def over_limit(sampler: Prioritized) -> str:
    return (f"its weight priority ** exponent ({sampler.exponent:g}) would exceed {MAX_WEIGHT:g}, the bound that keeps "
            f"the sum tree's total finite; priorities may be at most {sampler.priority_limit:.6g} with this exponent "
            "(scale them down)")
