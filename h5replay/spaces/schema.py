"""The Schema of a space: its named leaves, and the one way a nested batch becomes {leaf: array} and back.

Storage, the server's checks of what arrives off the wire and both clients go through it. Pure
(numpy only).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from h5replay.errors import ConfigError, SpaceMismatchError
from h5replay.spaces.base import DictSpace, LeafSpace, Space
from h5replay.spaces.leaves import BoxSpace

__all__ = ["Schema", "DEFAULT_KEY", "named_leaves", "flatten_value", "unflatten_value"]

#: Where a space that is a single leaf keeps its values (the HDF5 dataset and the wire array name).
DEFAULT_KEY = "data"


def named_leaves(space: Space) -> list[tuple[str, LeafSpace]]:
    """(path, leaf) for every leaf in storage order; a space that is one leaf is named DEFAULT_KEY."""
    if isinstance(space, DictSpace):
        return list(space.leaves())
    if isinstance(space, LeafSpace):
        return [(DEFAULT_KEY, space)]
    raise ConfigError(f"unsupported space {space!r}; use BoxSpace, BinarySpace, TextSpace or DictSpace")


def flatten_value(space: Space, value: Any) -> dict[str, Any]:
    """{leaf path: leaf value} from a nested sample or batch, naming any missing or extra key.

    Raises:
        SpaceMismatchError: `value` is not a dict where the space has one, or its keys differ.
    """
    if not isinstance(space, DictSpace):
        return {DEFAULT_KEY: value}
    out: dict[str, Any] = {}
    _flatten_into(space, value, "", out)
    return out


def unflatten_value(space: Space, leaves: Mapping[str, Any]) -> Any:
    """A nested dict (or the bare value of a single-leaf space) from {leaf path: value}."""
    if not isinstance(space, DictSpace):
        return leaves[DEFAULT_KEY]
    out: dict[str, Any] = {}
    for path, value in leaves.items():
        node = out
        *parents, last = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _flatten_into(space: DictSpace, value: Any, prefix: str, out: dict[str, Any]) -> None:
    where = f"field '{prefix}'" if prefix else "the sample"
    if not isinstance(value, Mapping):
        raise SpaceMismatchError(f"{where} must be a dict with keys {sorted(space.spaces)}, got {type(value).__name__}")
    if value.keys() != space.spaces.keys():
        _refuse_keys(space, value, prefix, where)
    for key, sub in space.spaces.items():
        path = _join(prefix, key)
        if isinstance(sub, DictSpace):
            _flatten_into(sub, value[key], path, out)
        else:
            out[path] = value[key]


def _refuse_keys(space: DictSpace, value: Mapping[Any, Any], prefix: str, where: str) -> None:
    missing = [k for k in space.spaces if k not in value]
    extra = [k for k in value if k not in space.spaces]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(repr(_join(prefix, k)) for k in missing)}")
        if extra:
            parts.append(f"unexpected {', '.join(repr(_join(prefix, str(k))) for k in extra)}")
        raise SpaceMismatchError(f"{where} does not match the space: {'; '.join(parts)}")


def _no_exact_row(columns: Sequence[np.ndarray], row: int, sample: Any) -> bool:
    return False


def _put_exact_row(space: Space, leaves: Sequence[tuple[str, LeafSpace]]) -> Callable[[Sequence[np.ndarray], int, Any], bool]:
    """A function that copies one sample into row `row` of `columns` (one array per leaf, in the
    order of `leaves`) and returns True when the sample already is exactly what is stored: a
    plain dict with exactly the space's keys (or, for a single Box, the array itself), each an
    ndarray of exactly its leaf's dtype and shape. Otherwise it returns False and writes nothing
    (then `Schema.encode_one` says why, or converts). Bounds are not checked (see
    `Schema.check_values`). Built per space, for the per-step path of writers that check bounds
    per block of rows: a few hundred nanoseconds a leaf. Spaces with text, binary or nested
    dicts always get False."""
    if not all(isinstance(leaf, BoxSpace) and leaf.storage_dtype.kind in "biuf" for _, leaf in leaves):
        return _no_exact_row
    if isinstance(space, BoxSpace):
        dtype, shape = space.storage_dtype, space.shape

        def put_leaf(columns: Sequence[np.ndarray], row: int, sample: Any) -> bool:
            if type(sample) is np.ndarray and sample.shape == shape and (sample.dtype is dtype or sample.dtype == dtype):
                columns[0][row] = sample
                return True
            return False

        return put_leaf
    if not isinstance(space, DictSpace) or not all(isinstance(sub, BoxSpace) for sub in space.spaces.values()):
        return _no_exact_row
    plan = tuple((name, leaf.storage_dtype, leaf.shape) for name, leaf in leaves)
    size = len(plan)

    def put_dict(columns: Sequence[np.ndarray], row: int, sample: Any) -> bool:
        if type(sample) is not dict or len(sample) != size:
            return False
        values = []
        for key, dtype, shape in plan:
            value = sample.get(key)
            if type(value) is not np.ndarray or value.shape != shape or (value.dtype is not dtype and value.dtype != dtype):
                return False
            values.append(value)
        for column, value in zip(columns, values):
            column[row] = value
        return True

    return put_dict


class Schema:
    """One space's leaves, and the one way a nested sample or batch becomes {leaf name: array}.

    Leaf names are the '/'-joined dict keys ("obs/image"); a space that is a single leaf has one
    leaf named DEFAULT_KEY ("data"). The same names are the HDF5 dataset paths and the wire's
    array names. Immutable; make one per space and keep it.
    """

    def __init__(self, space: Space, *, check_bounds: bool = False) -> None:
        """`check_bounds`: also refuse Box values outside their bounds, and NaN (storage and the
        server check; clients leave it to them)."""
        self.space = space
        self.leaves: tuple[tuple[str, LeafSpace], ...] = tuple(named_leaves(space))
        self.names: tuple[str, ...] = tuple(name for name, _ in self.leaves)
        self.check_bounds = check_bounds
        self._bounded = tuple((name, leaf) for name, leaf in self.leaves
                              if check_bounds and isinstance(leaf, BoxSpace) and leaf.checks_values)
        #: Bytes of one row as stored, every leaf included.
        self.row_bytes = sum(leaf.row_bytes for _, leaf in self.leaves)
        #: put_exact_row(columns, row, sample): copy a sample that is exactly what is stored into
        #: row `row` of `columns` (one array per leaf, in leaf order) and return True; else write
        #: nothing and return False. See _put_exact_row.
        self.put_exact_row: Callable[[Sequence[np.ndarray], int, Any], bool] = _put_exact_row(space, self.leaves)

    def __repr__(self) -> str:
        return f"Schema({self.space!r})"

    def flatten(self, value: Any) -> dict[str, Any]:
        """{leaf name: leaf value} of a nested sample or batch.

        Raises:
            SpaceMismatchError: `value` is not a dict where the space has one, or its keys differ.
        """
        return flatten_value(self.space, value)

    def unflatten(self, leaves: Mapping[str, Any]) -> Any:
        """A nested dict (or the bare value of a single-leaf space) from {leaf name: value}."""
        return unflatten_value(self.space, leaves)

    def encode_batch(self, batch: Any, num_rows: int | None = None) -> tuple[dict[str, np.ndarray], int]:
        """Check a batch (a leading axis of rows on every leaf) and return ({leaf name: stored
        array}, rows). Every leaf is checked before anything is returned.

        Raises:
            SpaceMismatchError: a key, shape, dtype, row count or value does not fit; the message
                names the leaf.
        """
        flat = self.flatten(batch)
        encoded: dict[str, np.ndarray] = {}
        for name, leaf in self.leaves:
            arr = leaf.encode_batch(flat[name], num_rows, key=name)
            num_rows = arr.shape[0] if num_rows is None else num_rows
            encoded[name] = arr
        self.check_values(encoded)
        return encoded, int(num_rows or 0)

    def check_values(self, encoded: Mapping[str, np.ndarray], first_row: int = 0) -> None:
        """Check the Box bounds (and NaN) of stored rows already checked for keys, dtypes and
        shapes; a no-op without `check_bounds`. Rows are named from `first_row` in errors.

        Raises:
            SpaceMismatchError: names the leaf, the row and index of the first bad value, and the bound.
        """
        for name, leaf in self._bounded:
            leaf.check_bounds(encoded[name], name, first_row)

    def encode_one(self, sample: Any, *, check_values: bool = True) -> dict[str, np.ndarray]:
        """Check one sample; returns {leaf name: stored batch of one row}. `check_values=False`
        leaves the bounds to a later `check_values` of the stored rows.

        Raises:
            SpaceMismatchError: as `encode_batch`.
        """
        flat = self.flatten(sample)
        encoded = {name: leaf.encode_one(flat[name], key=name) for name, leaf in self.leaves}
        if check_values:
            self.check_values(encoded)
        return encoded

    def decode(self, stored: Mapping[str, np.ndarray]) -> Any:
        """Stored arrays (any leading shape) as the user sees them: nested, text as str."""
        return self.unflatten({name: leaf.decode_batch(stored[name]) for name, leaf in self.leaves})

    def decode_one(self, row: Mapping[str, Any]) -> Any:
        """One stored row (no leading axis) as the user sees it."""
        return self.unflatten({name: leaf.decode_one(row[name]) for name, leaf in self.leaves})

    def validate_stored(self, arrays: Mapping[str, np.ndarray], num_rows: int | None) -> dict[str, np.ndarray]:
        """Check arrays already in storage form (as they arrive off the wire): exactly the leaf
        names, each leaf's dtype, shape, row count and values. Returns them in leaf order.

        Raises:
            SpaceMismatchError: a leaf is missing or unexpected, or an array does not fit its leaf
                (its bounds too, with `check_bounds`).
        """
        missing = [name for name in self.names if name not in arrays]
        if missing or len(arrays) != len(self.names):
            extra = sorted(set(arrays) - set(self.names))
            raise SpaceMismatchError(
                f"arrays do not match the space: missing {missing}, unexpected {extra}; "
                f"the space's leaves are {list(self.names)}; check the actor's spaces"
            )
        checked = {name: leaf.validate_stored(arrays[name], num_rows, key=name) for name, leaf in self.leaves}
        self.check_values(checked)
        return checked
