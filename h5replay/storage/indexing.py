"""The design document's index helpers.

Telling a fancy index apart (``is_fancy_index``), turning any integer index into sorted distinct
rows plus the map back (``fancy_indexing_to_supported_indexing`` for reads,
``fancy_indexing_to_supported_set_indexing`` for writes, where the last duplicate wins as in
numpy), and splitting a sorted index into slices (``io_reduced_indexing``). Pure numpy.

The row functions the design names (``read_sorted_unique_rows``, ``write_rows``,
``write_sorted_unique_rows``) live in the private engine ``_rowio`` and are re-exported here.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from h5replay.storage._rowio import (
    CHUNK_TARGET_BYTES,
    read_slice,
    read_sorted_unique_rows,
    write_rows,
    write_sorted_unique_rows,
)

__all__ = [
    "CHUNK_TARGET_BYTES",
    "is_fancy_index",
    "fancy_indexing_to_supported_indexing",
    "fancy_indexing_to_supported_set_indexing",
    "io_reduced_indexing",
    "read_sorted_unique_rows",
    "read_slice",
    "write_rows",
    "write_sorted_unique_rows",
]



def is_fancy_index(index: Any) -> bool:
    """Tell whether ``index`` selects rows by an integer array.

    Args:
        index: Anything used to index a storage.

    Returns:
        True for a numpy array of a signed or unsigned integer dtype with at least one axis
        (shape ``(1,)`` included, unlike the reference); False for 0-d arrays, Python or numpy
        integers, slices, lists and bool arrays.
    """
    return isinstance(index, np.ndarray) and index.dtype.kind in "iu" and index.ndim >= 1


def fancy_indexing_to_supported_indexing(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split an integer index into sorted distinct rows and the map back to request order.

    Args:
        index: An integer array of any shape.

    Returns:
        ``(unique_sorted, inverse)`` with ``unique_sorted[inverse] == index``; ``inverse`` has the
        shape of ``index`` (numpy 1 and 2 alike). Negative values are kept as they are.
    """
    index = np.asarray(index)
    unique_sorted, inverse = np.unique(index, return_inverse=True)
    return unique_sorted, inverse.reshape(index.shape)


def fancy_indexing_to_supported_set_indexing(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split an integer index for a write: sorted distinct rows and which value each one takes.

    For a row named several times the value used is its *last* occurrence, as with numpy's
    ``array[index] = value``. (The reference kept the first occurrence; this is a deliberate
    deviation.)

    Args:
        index: An integer array of any shape; positions refer to its flattened form.

    Returns:
        ``(unique_sorted, positions)``: ``value.reshape(-1, *row)[positions]`` are the rows to
        write at ``unique_sorted``.
    """
    flat = np.asarray(index).reshape(-1)
    # np.unique reports the first occurrence, so look at the index back to front.
    unique_sorted, first_from_end = np.unique(flat[::-1], return_index=True)
    positions = (flat.size - 1) - first_from_end
    return unique_sorted, positions.astype(np.intp, copy=False)


def io_reduced_indexing(
    original_index: np.ndarray, max_gap_size: int = 8
) -> list[slice | np.ndarray | int]:
    """Cover a sorted, duplicate-free index with slices where it forms progressions.

    Scanning from the left, every maximal arithmetic progression of at least two elements whose
    step is at most ``max_gap_size`` becomes ``slice(first, last + step, step)``. Elements left in
    between become a Python ``int`` when alone, or one array of the input dtype when adjacent.
    For example ``[0, 2, 4, 5, 6, 20, 40, 41, 100]`` gives
    ``[slice(0, 6, 2), slice(5, 7, 1), 20, slice(40, 42, 1), 100]``.

    Args:
        original_index: A 1-D, strictly increasing integer array.
        max_gap_size: The largest step a slice may have.

    Returns:
        The pieces in order; ``[]`` for an empty index.

    Raises:
        ValueError: The index is not 1-D, or not strictly increasing.
    """
    original_index = np.asarray(original_index)
    if original_index.ndim != 1:
        raise ValueError(f"io_reduced_indexing needs a 1-D index, got shape {original_index.shape}")
    values = [int(v) for v in original_index.tolist()]
    for pos in range(len(values) - 1):
        if values[pos + 1] <= values[pos]:
            raise ValueError(
                "io_reduced_indexing needs a strictly increasing index: "
                f"index[{pos}]={values[pos]} is followed by {values[pos + 1]}"
            )
    pieces: list[slice | np.ndarray | int] = []
    loose: list[int] = []

    def flush_loose() -> None:
        if len(loose) == 1:
            pieces.append(loose[0])
        elif loose:
            pieces.append(np.array(loose, dtype=original_index.dtype))
        loose.clear()

    pos, n = 0, len(values)
    while pos < n:
        step = values[pos + 1] - values[pos] if pos + 1 < n else 0
        if not 1 <= step <= max_gap_size:
            loose.append(values[pos])
            pos += 1
            continue
        end = pos + 1
        while end + 1 < n and values[end + 1] - values[end] == step:
            end += 1
        flush_loose()
        pieces.append(slice(values[pos], values[end] + step, step))
        pos = end + 1
    flush_loose()
    return pieces
