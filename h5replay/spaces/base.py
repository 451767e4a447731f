"""What a space is: the Space and LeafSpace contracts, DictSpace, and the bounds every space keeps.

A leaf is stored as one dataset; a DictSpace nests named spaces. Pure (numpy only).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from h5replay.errors import ConfigError, SpaceMismatchError

__all__ = ["Space", "LeafSpace", "DictSpace", "MAX_ROW_BYTES", "MAX_DEPTH"]

#: The most bytes one row of one leaf may take (1 GiB), and how deeply dict spaces may nest.
#: A description read from a file or a peer is checked against them before anything is
#: allocated for it: a crafted (10**6, 10**6) Box would otherwise ask for a TiB for its bounds.
MAX_ROW_BYTES = 1 << 30
MAX_DEPTH = 32
_MAX_DIMS = 31  # a leaf's dataset adds the row axis: HDF5 allows 32 dimensions in all


def _where(key: str) -> str:
    return f"field '{key}'" if key else "the value"


def _shape_tuple(shape: Any, what: str) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        out = tuple(int(d) for d in shape)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be a tuple of ints, got {shape!r}") from exc
    if any(d < 0 for d in out):
        raise ConfigError(f"{what} must not have negative dimensions, got {out}")
    if len(out) > _MAX_DIMS:
        raise ConfigError(f"{what} has {len(out)} dimensions; a row may have at most {_MAX_DIMS}")
    return out


def _check_row_bytes(shape: tuple[int, ...], itemsize: int, what: str) -> None:
    """Refuse a leaf whose row would take more than MAX_ROW_BYTES (Python ints: no overflow)."""
    size = itemsize
    for d in shape:
        size *= d
    if size > MAX_ROW_BYTES:
        raise ConfigError(f"{what} would take {size} bytes a row, over the limit of {MAX_ROW_BYTES} (1 GiB)")


class Space(ABC):
    """A set of values one row may hold. Subclasses are immutable after construction."""

    shape: tuple[int, ...] | None
    dtype: np.dtype[Any] | None

    @abstractmethod
    def contains(self, value: Any) -> bool:
        """True when `value` is one valid sample of this space."""

    @abstractmethod
    def sample(self, rng: np.random.Generator | None = None) -> Any:
        """One random sample of this space."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable description that `space_from_json` turns back into an equal space."""

    @abstractmethod
    def leaves(self, prefix: str = "") -> Iterator[tuple[str, LeafSpace]]:
        """(path, leaf) for every leaf, in storage order; paths join dict keys with '/'."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Space) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(repr(self.to_json()))


class LeafSpace(Space):
    """A space stored as one HDF5 dataset: rows of `shape`, written as `storage_dtype`."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    @abstractmethod
    def storage_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the stored rows."""

    @abstractmethod
    def encode_batch(self, value: Any, num_rows: int | None = None, key: str = "") -> np.ndarray:
        """Check a batch and return it as a C-contiguous array of `storage_dtype`.

        Raises:
            SpaceMismatchError: the batch does not fit; the message names `key`.
        """

    def decode_batch(self, stored: np.ndarray) -> np.ndarray:
        """Stored rows as the user sees them (identity except for text)."""
        return stored

    def validate_stored(self, arr: np.ndarray, num_rows: int | None = None, key: str = "") -> np.ndarray:
        """Check a batch that is already in `storage_dtype` (as it arrives off the wire).

        Raises:
            SpaceMismatchError: wrong dtype, shape or row count, or bytes the dtype cannot hold.
        """
        if arr.dtype != self.storage_dtype:
            raise SpaceMismatchError(
                f"{_where(key)} arrived as {arr.dtype} but the space stores {self.storage_dtype}"
            )
        self._check_rows(arr, num_rows, key)
        self._check_stored_values(arr, key)
        return arr

    def _check_stored_values(self, arr: np.ndarray, key: str) -> None:
        """Subclasses reject byte patterns their dtype admits but the space does not."""

    def encode_one(self, value: Any, key: str = "") -> np.ndarray:
        """One sample as a stored batch of one row (a view of `value` when it already fits exactly)."""
        # The per-step hot path of actors: an array of exactly the stored dtype and shape needs no checks.
        if type(value) is np.ndarray and value.dtype.kind in "biuf" and value.dtype == self.storage_dtype:
            if value.shape == self.shape:
                return value[None]
        return self.encode_batch(self._as_batch_of_one(value), 1, key)

    def decode_one(self, stored_row: Any) -> Any:
        """One stored row (no leading axis) as the user sees it."""
        return stored_row

    def _as_batch_of_one(self, value: Any) -> Any:
        return np.asarray(value)[None]

    def leaves(self, prefix: str = "") -> Iterator[tuple[str, LeafSpace]]:
        yield prefix, self

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.storage_dtype.itemsize

    def _check_rows(self, arr: np.ndarray, num_rows: int | None, key: str) -> None:
        if arr.ndim != 1 + len(self.shape) or arr.shape[1:] != self.shape:
            raise SpaceMismatchError(
                f"{_where(key)} has shape {arr.shape[1:] if arr.ndim else arr.shape} per row "
                f"(batch shape {arr.shape}) but the space expects {self.shape}; check the actor's spaces"
            )
        if num_rows is not None and arr.shape[0] != num_rows:
            raise SpaceMismatchError(
                f"{_where(key)} has {arr.shape[0]} rows but the other fields have {num_rows}"
            )


class DictSpace(Space):
    """A mapping of names to spaces (nested dicts become nested DictSpaces). Keys are kept sorted."""

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"DictSpace takes a mapping of names to spaces, got {type(mapping).__name__}")
        spaces: dict[str, Space] = {}
        for key in mapping:  # check before sorting: sorted() raises TypeError on mixed key types
            if not isinstance(key, str) or not key or "/" in key or key in (".", ".."):
                raise ConfigError(f"DictSpace key {key!r} must be a non-empty string without '/'")
        for key in sorted(mapping):
            sub = mapping[key]
            if isinstance(sub, Mapping):
                sub = DictSpace(sub)
            if not isinstance(sub, Space):
                raise ConfigError(f"DictSpace value for {key!r} must be a space, got {type(sub).__name__}")
            spaces[key] = sub
        self.spaces: Mapping[str, Space] = spaces
        self.shape = None
        self.dtype = None

    def __getitem__(self, key: str) -> Space:
        return self.spaces[key]

    def keys(self) -> Any:
        return self.spaces.keys()

    def contains(self, value: Any) -> bool:
        if not isinstance(value, Mapping) or set(value) != set(self.spaces):
            return False
        return all(space.contains(value[k]) for k, space in self.spaces.items())

    def sample(self, rng: np.random.Generator | None = None) -> dict[str, Any]:
        rng = rng or np.random.default_rng()
        return {k: space.sample(rng) for k, space in self.spaces.items()}

    def leaves(self, prefix: str = "") -> Iterator[tuple[str, LeafSpace]]:
        for key, space in self.spaces.items():
            yield from space.leaves(f"{prefix}/{key}" if prefix else key)

    def to_json(self) -> dict[str, Any]:
        return {"type": "dict", "spaces": {k: s.to_json() for k, s in self.spaces.items()}}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {s!r}" for k, s in self.spaces.items())
        return f"DictSpace({{{inner}}})"
