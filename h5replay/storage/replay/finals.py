"""The final observation of each episode, in the file beside its episode record.

Layout (plain HDF5, readable with h5py alone), under `/_h5replay/replay/finals/`:
  * attribute `transition_keys`: JSON of the observation keys and the reward / end-flag leaves;
  * `has` (uint8, one per episode slot): 1 when the episode in that slot was committed with a
    final observation;
  * one dataset per observation leaf, by leaf path (`finals/obs`, `finals/obs/image`), one row per
    episode slot, in the leaf's storage dtype.
The slots are the episode table's (episode id modulo the capacity), grown in chunks as episodes
come, up to the capacity. A commit writes its episode's slot before the publish that records the
episode (the publish flushes the file first), so a final is exactly as durable as its episode; a
slot is reused only by an episode committed after every row of its earlier one was released, so a
reader that checks its rows were still held after its read (as every read does) never returns
another episode's final.
"""

from __future__ import annotations

from collections.abc import Mapping

import h5py
import numpy as np

from h5replay.errors import StorageError
from h5replay.spaces import LeafSpace, Schema, Space
from h5replay.storage._h5file import h5_dtype, h5_errors
from h5replay.storage._rowio import read_slice, read_sorted_unique_rows
from h5replay.transitions import TransitionKeys

__all__ = ["FinalsFile", "FINALS"]

FINALS = "finals"  # the group's name inside the replay group
_HAS = "has"
_ATTR_KEYS = "transition_keys"
_CHUNK = 64


class FinalsFile:
    """The finals group of one open buffer file."""

    def __init__(self, group: h5py.Group, space: Space, capacity: int | None, reader: bool) -> None:
        """Raises:
            ConfigError / StorageError: the group's keys or datasets are damaged.
        """
        self.keys = TransitionKeys.from_json(str(group.attrs.get(_ATTR_KEYS, "")), space)
        self.schema = Schema(self.keys.observation_space(space))
        self.capacity = capacity
        self._reader = reader
        self._has = group[_HAS]
        self._leaves = {path: group[path] for path, _ in self.schema.leaves}
        self._slots = int(self._has.shape[0])

    @staticmethod
    def create(replay_group: h5py.Group, keys: TransitionKeys, space: Space, capacity: int | None) -> None:
        """Add an empty finals group (a new file's `prepare` step)."""
        group = replay_group.create_group(FINALS)
        group.attrs[_ATTR_KEYS] = keys.to_json()
        chunk = _CHUNK if capacity is None else min(_CHUNK, capacity)
        flags = 4096 if capacity is None else min(4096, capacity)
        group.create_dataset(_HAS, shape=(0,), maxshape=(capacity,), chunks=(flags,), dtype=np.uint8)
        for path, leaf in Schema(keys.observation_space(space)).leaves:
            _create_leaf(group, path, leaf, capacity, chunk)

    @staticmethod
    def of(replay_group: h5py.Group, space: Space, capacity: int | None, reader: bool) -> FinalsFile | None:
        """The file's finals (None: it was made without observation keys)."""
        group = replay_group.get(FINALS)
        return None if group is None else FinalsFile(group, space, capacity, reader)

    def write(self, slot: int, final: Mapping[str, np.ndarray] | None) -> None:
        """Keep `final` (stored form, one row per leaf; None: the episode has none) in `slot`."""
        with h5_errors("writing an episode's final observation"):
            if slot >= self._slots:
                grown = max(slot + 1, 2 * self._slots, _CHUNK)
                if self.capacity is not None:
                    grown = min(grown, self.capacity)
                for ds in (self._has, *self._leaves.values()):
                    ds.resize(grown, axis=0)
                self._slots = grown
            self._has[slot] = 0 if final is None else 1
            if final is not None:
                for path, ds in self._leaves.items():
                    ds[slot] = final[path][0]

    def _refreshed(self) -> None:
        if self._reader:
            for ds in (self._has, *self._leaves.values()):
                ds.refresh()

    def has(self, slots: np.ndarray) -> np.ndarray:
        """Whether each slot holds a final (bool)."""
        with h5_errors("reading final observations"):
            self._refreshed()
            return self._gathered(self._has, slots).astype(bool)

    def rows(self, slots: np.ndarray) -> dict[str, np.ndarray]:
        """The finals in `slots` by leaf path, as stored (a slot without one: what it last held)."""
        with h5_errors("reading final observations"):
            self._refreshed()
            return {path: self._gathered(ds, slots) for path, ds in self._leaves.items()}

    def read(self, slots: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(whether each slot holds a final, the finals by leaf path: zeros where none)."""
        has, rows = self.has(slots), self.rows(slots)
        for arr in rows.values():
            arr[~has] = 0
        return has, rows

    def _gathered(self, ds: h5py.Dataset, slots: np.ndarray) -> np.ndarray:
        size = int(self._has.shape[0])
        if slots.size and int(slots.max()) >= size:
            raise StorageError(f"the finals of {self._has.file.filename!r} have {size} slots, too few for slot "
                               f"{int(slots.max())}")
        unique, inverse = np.unique(slots, return_inverse=True)
        return _gather(ds, unique)[inverse.reshape(-1)]


def _create_leaf(group: h5py.Group, path: str, leaf: LeafSpace, capacity: int | None, chunk: int) -> None:
    shape = tuple(leaf.shape or ())
    group.create_dataset(path, shape=(0, *shape), maxshape=(capacity, *shape), chunks=(chunk, *shape),
                         dtype=h5_dtype(leaf))


def _gather(ds: h5py.Dataset, unique: np.ndarray) -> np.ndarray:
    """Rows `unique` (sorted, distinct) of `ds`: one read of their span when it is short."""
    if not unique.size:
        return read_slice(ds, 0, 0)
    first, last = int(unique[0]), int(unique[-1]) + 1
    rows: np.ndarray = read_slice(ds, first, last)[unique - first] if last - first <= 4 * unique.size \
        else read_sorted_unique_rows(ds, unique)
    return rows
