"""Mixture({Uniform(): 0.5, Recency(10_000): 0.5}): each draw picks a component by its weight
and draws from it; the probability reported is the mixture's, the sum over components of weight
times the component's probability of that row."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from h5replay.errors import ConfigError
from h5replay.samplers.base import Rows, Sampler, empty, register, sampler_from_obj

__all__ = ["Mixture"]


@register("mixture")
@dataclass(frozen=True, init=False)
class Mixture(Sampler):
    """Draws by one of several samplers at a time, each chosen with its weight. Components draw
    with replacement (not Fifo / Lifo, not another mixture); at most one is prioritized."""

    PERSISTS: ClassVar[str] = "what its components keep (a prioritized component's priorities)"
    REPLICATES: ClassVar[str] = "what its components rebuild"
    MAY_REMOVE: ClassVar[bool] = False

    components: tuple[tuple[Sampler, float], ...]

    def __init__(self, components: Mapping[Sampler, float] | Iterable[tuple[Sampler, float]]) -> None:
        pairs = list(components.items()) if isinstance(components, Mapping) else list(components)
        object.__setattr__(self, "components", tuple((s, w) for s, w in pairs))
        self.check()

    def check(self) -> None:
        if not self.components:
            raise ConfigError("a Mixture needs at least one component sampler")
        prioritized = 0
        for sampler, weight in self.components:
            if not isinstance(sampler, Sampler) or isinstance(sampler, Mixture) or sampler.IN_ORDER:
                raise ConfigError(f"a Mixture's components draw by chance (Uniform, Prioritized, Recency, ...), got "
                                  f"{str(sampler)[:80]}")
            if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) \
                    or weight <= 0:
                raise ConfigError(f"a Mixture's weights are finite numbers > 0, got {weight!r} for {sampler}")
            prioritized += sampler.prioritized_part is not None
        if prioritized > 1:
            raise ConfigError("a Mixture may have one prioritized component (its table keeps one priority per row)")

    @property
    def _weights(self) -> np.ndarray:
        w = np.array([w for _, w in self.components], dtype=np.float64)
        shares: np.ndarray = w / w.sum()
        return shares

    @property
    def prioritized_part(self) -> Any:
        return next((s.prioritized_part for s, _ in self.components if s.prioritized_part is not None), None)

    def draw(self, rows: Rows, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        empty(rows)
        pick = rng.choice(len(self.components), size=n, p=self._weights)
        ids = np.empty(n, dtype=np.int64)
        for j, (sampler, _) in enumerate(self.components):
            where = np.flatnonzero(pick == j)
            if where.size:
                ids[where] = sampler.draw(rows, int(where.size), rng)[0]
        return ids, self.probabilities(rows, ids)

    def probabilities(self, rows: Rows, ids: np.ndarray) -> np.ndarray:
        out = np.zeros(ids.shape)
        for (sampler, _), w in zip(self.components, self._weights):
            out += w * sampler.probabilities(rows, ids)
        return out

    def draw_windows(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, n: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pick = rng.choice(len(self.components), size=n, p=self._weights)
        first = np.empty(n, dtype=np.int64)
        k = np.empty(n, dtype=np.int64)
        for j, (sampler, _) in enumerate(self.components):
            where = np.flatnonzero(pick == j)
            if where.size:
                first[where], k[where], _ = sampler.draw_windows(rows, starts, windows, int(where.size), rng)
        return first, k, self.window_probabilities(rows, starts, windows, first, k)

    def window_probabilities(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, first: np.ndarray,
                             k: np.ndarray) -> np.ndarray:
        out = np.zeros(first.shape)
        for (sampler, _), w in zip(self.components, self._weights):
            out += w * sampler.window_probabilities(rows, starts, windows, first, k)
        return out

    def describe(self) -> dict[str, Any]:
        return {"kind": self.KIND, "components": [[s.describe(), w] for s, w in self.components]}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> Mixture:
        """The mixture a file records (`describe()` without its kind)."""
        parts = fields.get("components")
        if set(fields) != {"components"} or not isinstance(parts, list) \
                or not all(isinstance(p, list) and len(p) == 2 for p in parts):
            raise ConfigError(f"a mixture is {{'components': [[sampler, weight], ...]}}, got {str(fields)[:200]}")
        return cls([(sampler_from_obj(p[0]), p[1]) for p in parts])
