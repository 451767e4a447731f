"""Padded windows of `sample_sequences(n, length, pad=True)`: a window may start at any step of
its episode, the last `length - 1` included; the steps past the episode's end hold zeros (empty
text), and the batch's `mask` says which steps are the episode's (TorchRL's
`strict_length=False`). Pure numpy: the buffer, the server's reply and the clients share it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from h5replay.errors import ConfigError
from h5replay.spaces import DictSpace, Space

__all__ = ["MASK", "check_pad_space", "window_rows", "step_mask", "masked", "unmasked"]

MASK = "mask"  # the key of a padded batch's (n, length) bool mask of valid steps


def check_pad_space(space: Space) -> None:
    """Raises ConfigError when a padded batch cannot carry its mask beside the space's keys."""
    if not isinstance(space, DictSpace):
        raise ConfigError(f"sample_sequences(pad=True) returns a {MASK!r} key beside the space's keys: it needs a "
                          f"Dict space, got {space!r}")
    if MASK in space.keys():
        raise ConfigError(f"sample_sequences(pad=True) adds a {MASK!r} key, and the space already has one: "
                          "rename that leaf to sample padded windows")


def step_mask(valid: np.ndarray, steps: int) -> np.ndarray:
    """(n, steps) bool: True at the first `valid[i]` steps of window i."""
    mask: np.ndarray = np.arange(steps, dtype=np.int64)[None, :] < np.asarray(valid, np.int64)[:, None]
    return mask


def window_rows(first: np.ndarray, valid: np.ndarray, steps: int) -> np.ndarray:
    """(n, steps) row ids of windows starting at `first` with `valid` steps each: a step past the
    episode's end reads the episode's last row again (then zeroed by `masked`), so no id beyond
    the episode is read."""
    offsets = np.minimum(np.arange(steps, dtype=np.int64)[None, :], np.asarray(valid, np.int64)[:, None] - 1)
    rows: np.ndarray = np.asarray(first, np.int64)[:, None] + offsets
    return rows


def masked(batch: Mapping[str, Any], valid: np.ndarray, steps: int) -> dict[str, Any]:
    """`batch` (leaves shaped (n, steps, ...)) with every step past `valid` zeroed and the mask
    added under MASK."""
    mask = step_mask(valid, steps)
    out = _zeroed(batch, mask)
    out[MASK] = mask
    return out


def unmasked(batch: Mapping[str, Any]) -> dict[str, Any]:
    """A padded batch without its mask (the mask is rebuilt from `SampleInfo.valid_steps`)."""
    return {key: value for key, value in batch.items() if key != MASK}


def _zeroed(tree: Mapping[str, Any], mask: np.ndarray) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out[key] = _zeroed(value, mask)
            continue
        if mask.all():
            out[key] = value
            continue
        arr = np.array(value, copy=True)
        arr[~mask] = "" if arr.dtype == object else 0
        out[key] = arr
    return out
