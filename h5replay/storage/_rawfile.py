"""The space of a plain h5py file that h5replay did not write: inferred from its datasets.

Pure inspection of an open group; nothing is written. Text from string dtypes, bool as
BinarySpace, numbers as unbounded BoxSpaces; a group whose only member is `data` is a bare leaf;
names starting with '_' or '.' are skipped; a dataset that can grow makes the storage unbounded.
"""

from __future__ import annotations

import h5py
import numpy as np

from h5replay.errors import SpaceMismatchError
from h5replay.spaces import DEFAULT_KEY, BinarySpace, BoxSpace, DictSpace, LeafSpace, Space, TextSpace

__all__ = ["infer_space"]


def _join_path(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def infer_space(node: h5py.Group | h5py.Dataset, path: str = "") -> tuple[int, int | None, Space]:
    """(length, capacity, space) of a group or dataset written by plain h5py.

    Raises:
        SpaceMismatchError: a scalar dataset, an unsupported dtype, an empty group, or datasets
            whose first axes differ.
    """
    if isinstance(node, h5py.Dataset):
        if node.ndim == 0:
            raise SpaceMismatchError(f"dataset '{path or node.name}' is a scalar; rows need a first axis")
        length = int(node.shape[0])
        capacity = length if node.maxshape[0] == node.shape[0] else None
        dt = node.dtype
        string_info = h5py.check_string_dtype(dt)
        leaf: LeafSpace
        if string_info is not None:
            # Variable-length strings have no stored limit: allow long texts (4096 characters).
            leaf = TextSpace(dt.itemsize if string_info.length else 4096)
        elif dt.kind == "b":
            leaf = BinarySpace(node.shape[1:])
        elif dt.kind in "fiu":
            leaf = BoxSpace(-np.inf, np.inf, node.shape[1:], dt)
        else:
            raise SpaceMismatchError(f"dataset '{path or node.name}' has unsupported dtype {dt}")
        return length, capacity, leaf
    members = [n for n in node if not n.startswith(("_", "."))]
    if DEFAULT_KEY in members and len(members) == 1:
        return infer_space(node[DEFAULT_KEY], _join_path(path, DEFAULT_KEY))
    if not members:
        raise SpaceMismatchError(f"group '{path or '/'}' holds no datasets")
    parts: dict[str, Space] = {}
    lengths: dict[str, tuple[int, int | None]] = {}
    for name in members:
        length, capacity, sub = infer_space(node[name], _join_path(path, name))
        parts[name] = sub
        lengths[name] = (length, capacity)
    first_name, first = next(iter(lengths.items()))
    for name, lc in lengths.items():
        if lc[0] != first[0]:
            raise SpaceMismatchError(
                f"'{_join_path(path, name)}' has {lc[0]} rows but '{_join_path(path, first_name)}' has {first[0]}; "
                "all datasets must share their first axis"
            )
    capacity = first[1] if all(lc[1] == first[1] for lc in lengths.values()) else None
    return first[0], capacity, DictSpace(parts)
