"""What every sampler is: its settings (a frozen dataclass, recorded in the file as JSON), how it
draws rows and windows from the rows a table holds, and the probability of each draw.

A sampler never keeps state of its own. The table it belongs to (`storage/replay/table.py`)
holds the rows' weights in a sum tree when the sampler needs them (`KEEPS_PRIORITIES`) or when
the table removes rows, and shows them to the sampler as `Rows`. Each subclass states, in
`PERSISTS` and `REPLICATES`, what its table keeps in the file and what a reader process
rebuilds to draw as the writer does. A new sampler is one module: a subclass registered with
`@register("kind")`. Pure numpy: clients and the CLI import it too.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Protocol, TypeVar

import numpy as np

from h5replay.errors import ConfigError, NotEnoughDataError
from h5replay.samplers.sumtree import SumTree

__all__ = ["Sampler", "Rows", "register", "sampler_from_json", "sampler_to_json", "sampler_from_obj", "kinds",
           "without_replacement"]

_KINDS: dict[str, type[Sampler]] = {}
_S = TypeVar("_S", bound="type[Sampler]")


class Rows(Protocol):
    """The rows a table holds, as its sampler sees them for one draw."""

    begin: int  # the oldest row id held
    end: int  # the next row id
    sampleable: int  # rows that may still be sampled (held, not removed)
    removing: bool  # the table removes rows: draws are without replacement, by the tree's weights
    #: Per-slot weights (priority ** exponent; 1 or 0 when rows are removed; 0 for a slot not
    #: held). None: every row held weighs 1.
    tree: SumTree | None

    def ids(self, slots: np.ndarray) -> np.ndarray: ...
    def slots(self, ids: np.ndarray) -> np.ndarray: ...
    def in_order(self, targets: np.ndarray) -> np.ndarray: ...  # slots at cumulative weights from `begin`
    def range_sums(self, first: np.ndarray, stop: np.ndarray) -> np.ndarray: ...  # weights of ids [first, stop)


@dataclass(frozen=True)
class Sampler:
    """The base of every sampler: how a table draws rows."""

    #: The name the file, the wire and the CLI give it.
    KIND: ClassVar[str] = ""
    #: What its table keeps in the file for it (besides the rows).
    PERSISTS: ClassVar[str] = "nothing: it draws from the rows held alone"
    #: What a reader process rebuilds from the file to draw as the writer does.
    REPLICATES: ClassVar[str] = "nothing: the rows held are the published state's"
    #: Its table keeps a priority per row (a sum tree, a priorities dataset and its log).
    KEEPS_PRIORITIES: ClassVar[bool] = False
    #: It hands rows out in an order (never twice in a batch), not by chance.
    IN_ORDER: ClassVar[bool] = False
    #: Its table may remove rows (max_times_sampled): its draws then go by the tree's weights.
    MAY_REMOVE: ClassVar[bool] = True

    def draw(self, rows: Rows, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """(row ids, the probability each was drawn with) of `n` rows drawn from `rows` (held).

        Raises:
            NotEnoughDataError: nothing to draw from, or too few rows for a draw without replacement.
        """
        raise NotImplementedError

    def probabilities(self, rows: Rows, ids: np.ndarray) -> np.ndarray:
        """The probability that one draw from `rows` gives each of `ids` (held)."""
        raise NotImplementedError

    def draw_windows(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, n: int,
                     rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first row ids, episode index, probabilities) of `n` windows: window starts
        [starts[k], starts[k] + windows[k]) of episode k (`windows[k]` may be 0).

        Raises:
            NotEnoughDataError: no window can be drawn.
        """
        raise ConfigError(f"{type(self).__name__}() cannot draw windows: use sample(), or commit each unroll as an "
                          "episode")

    def window_probabilities(self, rows: Rows, starts: np.ndarray, windows: np.ndarray, first: np.ndarray,
                             k: np.ndarray) -> np.ndarray:
        """The probability that one window draw gives the window starting at `first` (in episode `k`)."""
        raise ConfigError(f"{type(self).__name__}() cannot draw windows")

    @property
    def prioritized_part(self) -> Any:
        """The `Prioritized` sampler whose priorities this one draws by (itself, a mixture's
        component), or None."""
        return None

    def check(self) -> None:
        """Raises ConfigError for settings it cannot work with (called by its constructor)."""

    def describe(self) -> dict[str, Any]:
        """Its settings as JSON-able values (`kind` first)."""
        return {"kind": self.KIND, **asdict(self)}


def register(kind: str) -> Any:
    """Class decorator: the sampler is known by `kind` in files, on the wire and in the CLI."""

    def add(cls: _S) -> _S:
        if kind in _KINDS:
            raise ValueError(f"a sampler kind {kind!r} is registered already")
        cls.KIND = kind
        _KINDS[kind] = cls
        return cls

    return add


def kinds() -> dict[str, type[Sampler]]:
    """Every sampler known, by kind."""
    return dict(_KINDS)


def sampler_to_json(sampler: Sampler) -> str:
    return json.dumps(sampler.describe())


def sampler_from_obj(obj: Any) -> Sampler:
    """The sampler a JSON object describes (`Sampler.describe()`).

    Raises:
        ConfigError: not a sampler this version knows, or settings it refuses.
    """
    if not isinstance(obj, dict) or not isinstance(obj.get("kind"), str):
        raise ConfigError(f"a sampler is a JSON object with a 'kind', got {str(obj)[:200]!r}")
    fields = dict(obj)
    kind = fields.pop("kind")
    cls = _KINDS.get(kind)
    if cls is None:
        raise ConfigError(f"unknown sampler kind {kind!r}: this version knows {', '.join(sorted(_KINDS))}")
    try:
        return cls.from_fields(fields) if hasattr(cls, "from_fields") else cls(**fields)
    except TypeError as exc:
        raise ConfigError(f"sampler {kind!r}: {exc}") from exc


def sampler_from_json(text: str) -> Sampler:
    """The sampler a file records.

    Raises:
        ConfigError: not a sampler this version knows.
    """
    try:
        return sampler_from_obj(json.loads(text))
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"unknown sampler description {text[:200]!r}: {exc}") from exc


def without_replacement(rows: Rows, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n distinct rows by the tree's weights, as if drawn one at a time with each pick leaving
    the draw (a table that removes rows).

    Draws a round with replacement and keeps each row's first appearance, in order (the first
    appearances of an i.i.d. weighted sequence are distributed exactly as sequential draws
    without replacement), takes them out of the tree, and draws again for the rest. The k-th
    row's probability is its weight over the weight left after the k - 1 before it. The rows go
    back in the tree afterwards, with the weights they had.

    Raises:
        NotEnoughDataError: fewer than n rows have weight.
    """
    tree = rows.tree
    if tree is None:
        raise NotEnoughDataError("this table keeps no weights to draw without replacement by")
    chosen: list[tuple[np.ndarray, np.ndarray]] = []
    start_total = tree.total
    have = 0
    try:
        for _ in range(n):  # every round adds at least one row while any weight is left
            if tree.total <= 0:
                break
            slots = tree.sample(rng, n - have)
            slots = slots[np.sort(np.unique(slots, return_index=True)[1])]
            chosen.append((slots, tree.get(slots)))
            tree.set(slots, 0.0)
            have += int(slots.size)
            if have == n:
                break
    finally:
        for slots, weights in chosen:
            tree.set(slots, weights)
    if have < n:
        raise NotEnoughDataError(f"sampling {n} rows without replacement needs {n} rows that may be sampled; "
                                 f"the buffer has {rows.sampleable}")
    slots = np.concatenate([c[0] for c in chosen])
    weights = np.concatenate([c[1] for c in chosen])
    # The weight left before each pick is at least its own: rounding (a tiny weight after a
    # huge one cancels to 0) must not make a probability above 1, inf or NaN.
    left = np.maximum(start_total - (np.cumsum(weights) - weights), weights)
    return rows.ids(slots), weights / left


def empty(rows: Rows) -> None:
    """Raises NotEnoughDataError when `rows` holds nothing."""
    if rows.end <= rows.begin:
        raise NotEnoughDataError("cannot sample from an empty replay buffer")
