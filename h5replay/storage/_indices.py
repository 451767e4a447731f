"""Row indices as users write them (int, slice, list, int array, bool mask) made into one of three
plain forms, range-checked. Pure numpy: the storage and the replay buffer share it."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["normalize_index"]

_INT64_MAX = np.iinfo(np.int64).max


def _normalize_int(i: Any, length: int) -> int:
    j = int(i)
    if j < 0:
        j += length
    if not 0 <= j < length:
        raise IndexError(f"index {int(i)} is out of range for {length} rows")
    return j


def normalize_index(index: Any, length: int) -> tuple[str, Any]:
    """Classify a row index: ('int', i), ('slice', (start, stop)) or ('array', int64 ndarray).

    Negative values count from the end; every row is range-checked (unsigned values too: a uint64
    never wraps to a negative one). Stepped slices and boolean masks become arrays.

    Raises:
        IndexError: an index is out of range, or a mask does not have one entry per row.
        TypeError: `index` is not a row index.
    """
    if isinstance(index, (bool, np.bool_)):
        raise TypeError("a boolean is not a row index; use a boolean mask array")
    if isinstance(index, (int, np.integer)):
        return "int", _normalize_int(index, length)
    if index is Ellipsis:
        return "slice", (0, length)
    if isinstance(index, slice):
        start, stop, step = index.indices(length)
        if step == 1:
            return "slice", (start, max(start, stop))
        return "array", np.arange(start, stop, step, dtype=np.int64)
    if isinstance(index, (list, tuple)):
        index = np.asarray(index) if len(index) else np.zeros(0, dtype=np.int64)
    if isinstance(index, np.ndarray):
        if index.dtype.kind == "b":
            if index.shape != (length,):
                raise IndexError(f"boolean mask has shape {index.shape} but the storage has {length} rows")
            return "array", np.flatnonzero(index).astype(np.int64)
        if index.dtype.kind not in "iu":
            raise TypeError(f"row indices must be integers, got an array of {index.dtype}")
        if index.ndim == 0:
            return "int", _normalize_int(index[()], length)
        if index.dtype.kind == "u" and index.size and int(index.max()) > _INT64_MAX:
            raise IndexError(f"index {int(index.max())} is out of range for {length} rows")
        idx = index.astype(np.int64, copy=True)
        if idx.size:
            neg = idx < 0
            if neg.any():
                idx[neg] += length
            lo, hi = int(idx.min()), int(idx.max())
            if lo < 0 or hi >= length:
                flat = idx.reshape(-1)
                bad = int(index.reshape(-1)[np.argmax((flat < 0) | (flat >= length))])
                raise IndexError(f"index {bad} is out of range for {length} rows")
        return "array", idx
    raise TypeError(f"unsupported row index of type {type(index).__name__}: use an int, slice, list, int array or mask")
