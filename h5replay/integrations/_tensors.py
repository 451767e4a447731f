"""Sampled batches as PyTorch tensors, for the PyTorch datasets (torch.py, torch_map.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["to_tensors"]


def to_tensors(value: Any) -> Any:
    """A sampled batch as tensors: dicts stay dicts, numeric arrays become tensors (copied: the
    client's arrays are read-only views of the received message), text stays lists of str."""
    if isinstance(value, dict):
        return {key: to_tensors(sub) for key, sub in value.items()}
    arr = np.asarray(value)
    if arr.dtype == object:
        return arr.tolist()
    return torch.from_numpy(np.array(arr, copy=True))
