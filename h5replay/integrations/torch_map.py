"""PyTorch: `H5ReplayMapDataset`, a map-style dataset of the rows (or n-step transitions) of a
local replay file, for offline RL with the DataLoader's own batching and shuffling:

    dataset = H5ReplayMapDataset("replay.h5")
    loader = dataset.loader(256, shuffle=True, num_workers=0)  # a DataLoader of whole batches
    loader = DataLoader(dataset, batch_size=256, shuffle=True)  # the same rows, collated row by row

Index i is the i-th row held when the dataset was made (0 the oldest), so `shuffle=True` is one
pass over every step in a random order, and `len()` stays what it was, whatever is written
after. The dataset holds only the path and those row ids: each process opens the file read-only
(SWMR, so a live server's file can be read) the first time it reads. A batch is one read of
all its indices either way; `loader()` also skips the DataLoader's collation (it indexes the
dataset with each batch's list of indices: `dataset[[3, 1, 4]]` is those rows, batched), which
splits each batch into rows and stacks them again, at several times the cost of the read.

Needs PyTorch (`pip install 'h5replay[torch]'`).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, SequentialSampler

from h5replay.errors import ConfigError
from h5replay.integrations._tensors import to_tensors
from h5replay.transitions import check_n_step

__all__ = ["H5ReplayMapDataset"]


class H5ReplayMapDataset(Dataset[Any]):  # type: ignore[misc,unused-ignore]  # Any without torch installed
    """The rows held in a replay file, by index, as dicts of tensors nested like the space.

    Args:
        path: the replay file (a file a server writes is read through SWMR).
        transitions: items are n-step transitions starting at each row (`ReplayBuffer.
            get_transitions`: the step's leaves, `next`, `discount`, the summed `reward`);
            needs a file created with observation keys. `n_step`, `gamma`: theirs.
        with_info: each item is (row, row id) (a batch: (rows, ids as an int64 tensor)).

    Raises:
        ConfigError: the file holds no rows, or `transitions` of a file without observation
            keys; a bad n_step or gamma.
        EvictedError: (when read) a row was evicted since the dataset was made: a ring a writer
            keeps appending to has overwritten it.
    """

    def __init__(self, path: str | os.PathLike[str], *, transitions: bool = False, n_step: int = 1,
                 gamma: float = 0.99, with_info: bool = False) -> None:
        from h5replay.storage import ReplayBuffer

        self.path = os.fspath(path)
        self.transitions = bool(transitions)
        self.n_step, self.gamma = check_n_step(n_step, gamma)
        self.with_info = bool(with_info)
        with ReplayBuffer.load_from(self.path) as rb:
            view = rb.view
            if self.transitions and rb.transition_keys is None:
                raise ConfigError(f"{self.path} keeps no final observations (created without observation_keys=): "
                                  "it has no transitions; read its rows (transitions=False)")
            if not view.length:
                raise ConfigError(f"{self.path} holds no rows")
        self.first, self.length = int(view.begin), int(view.length)
        self._rb: Any = None
        self._pid = -1

    def __len__(self) -> int:
        return self.length

    def __getstate__(self) -> dict[str, Any]:
        """Settings only: each worker process opens the file itself."""
        return {key: value for key, value in self.__dict__.items() if key != "_rb"} | {"_rb": None, "_pid": -1}

    def _buffer(self) -> Any:
        """This process's read-only view of the file (a forked worker opens its own)."""
        if self._rb is None or self._pid != os.getpid():
            from h5replay.storage import ReplayBuffer

            self._rb = ReplayBuffer.load_from(self.path)
            self._pid = os.getpid()
        return self._rb

    def _row_ids(self, indices: Any) -> np.ndarray:
        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        bad = (index < -self.length) | (index >= self.length)
        if bad.any():
            raise IndexError(f"index {int(index[bad][0])} is out of range for a dataset of {self.length} rows")
        return self.first + np.where(index < 0, index + self.length, index)

    def _read(self, ids: np.ndarray) -> Any:
        rb = self._buffer()
        if self.transitions:
            return rb.get_transitions(ids, n_step=self.n_step, gamma=self.gamma)
        return rb.get_rows(ids)

    def __getitem__(self, index: Any) -> Any:
        """Row `index` (negative from the end); a sequence of indices gives those rows batched
        (leaves with a leading axis; with_info: and their ids as an int64 tensor)."""
        if np.ndim(index) == 0:
            ids = self._row_ids([index])
            row = _row(to_tensors(self._read(ids)), 0)
            return (row, int(ids[0])) if self.with_info else row
        ids = self._row_ids(index)
        batch = to_tensors(self._read(ids))
        return (batch, torch.from_numpy(ids)) if self.with_info else batch

    def __getitems__(self, indices: list[int]) -> list[Any]:
        """The DataLoader's batch of indices in one read, as the rows its collate stacks again."""
        ids = self._row_ids(indices)
        batch = self._read(ids)
        rows = [_row(batch, i) for i in range(ids.size)]
        return list(zip(rows, ids.tolist(), strict=True)) if self.with_info else rows

    def loader(self, batch_size: int, *, shuffle: bool = False, drop_last: bool = False, **kwargs: Any) -> Any:
        """A DataLoader of whole batches of `batch_size` rows (the last one shorter unless
        `drop_last`), each one read of the file and no collation; `shuffle`: a random order each
        pass. Other DataLoader arguments (num_workers, pin_memory, generator...) go through."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ConfigError(f"batch_size must be an int >= 1, got {batch_size!r}")
        order = RandomSampler(self, generator=kwargs.pop("generator", None)) if shuffle else SequentialSampler(self)
        return DataLoader(self, batch_size=None, sampler=BatchSampler(order, batch_size, drop_last), **kwargs)

    def close(self) -> None:
        """Close this process's handle of the file (reopened on the next read)."""
        if self._rb is not None:
            self._rb.close()
            self._rb = None


def _row(batch: Any, i: int) -> Any:
    """Row i of a batch nested in dicts: a view of each array (text: its str)."""
    if isinstance(batch, dict):
        return {key: _row(value, i) for key, value in batch.items()}
    return batch[i]

