"""How a learner over shards splits a call and puts the shards' answers back together.

Pure functions over arrays and figures, no client and no I/O: the blocking router and the
asyncio one (h5replay.client._shards.learner, h5replay.client.aio._shards) share them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from h5replay.errors import NotEnoughDataError, RateLimitedError, ServerUnavailableError
from h5replay.records import Episode, SampleInfo, pack_ids, unpack_ids
from h5replay.spaces import Space, flatten_value, unflatten_value
from h5replay.windows import unmasked

__all__ = ["add_up_info", "merge_draws", "packed_episodes", "qualified", "scatter", "shares", "shortfall",
           "without_mask"]

# Figures of `info()` that do not add up across shards (they stay per shard, under "shards").
_NOT_ADDITIVE = frozenset({
    "seq", "generation", "oldest_row_id", "uptime", "replay_id", "instance_id", "server_version",
    "protocol_version", "capacity",
})


def qualified(row_ids: Any, num_shards: int) -> tuple[np.ndarray, np.ndarray]:
    """(shard, local id) arrays from packed ids (1-D) or (shard, id) pairs (shape (n, 2)).

    Raises:
        TypeError: not integers.
        IndexError: a negative id or pair, or a shard this learner does not have.
    """
    arr = row_ids if isinstance(row_ids, np.ndarray) else np.asarray(row_ids)
    if arr.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"row ids must be integers (packed ids, or (shard, row_id) pairs), got an array of {arr.dtype}")
    if arr.ndim == 2 and arr.shape[1] == 2:
        if int(arr.min()) < 0:
            raise IndexError(f"(shard, row_id) pairs cannot be negative, got {int(arr.min())}")
        shards, local = arr[:, 0].astype(np.int64), arr[:, 1].astype(np.int64)
    elif arr.ndim == 1:
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise IndexError(f"packed row id {int(arr.min())} is negative")
        shards, ids = unpack_ids(arr)
        local = ids.astype(np.int64)
    else:
        raise TypeError(f"row ids must be packed ids (shape (n,)) or (shard, row_id) pairs (shape (n, 2)), "
                        f"got shape {arr.shape}")
    if int(shards.max()) >= num_shards:
        raise IndexError(f"shard {int(shards.max())} does not exist: this learner has {num_shards} shard(s)")
    return shards, local


def add_up_info(results: Mapping[int, dict[str, Any]], num_shards: int, skipped: Sequence[int]) -> dict[str, Any]:
    """The shards' figures added up (rows, episodes, rows in and out, commits, ...), with
    "shards": each shard's own (None for a shard that did not answer), "num_shards",
    "live_shards" and "skipped" (calls that skipped each shard)."""
    per_shard = [results.get(index) for index in range(num_shards)]
    answered = [r for r in per_shard if r is not None]
    total: dict[str, Any] = {}
    for key in answered[0]:
        values = [r.get(key) for r in answered]
        if key not in _NOT_ADDITIVE and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            total[key] = sum(values)
    capacities = [r.get("capacity") for r in answered]
    total["capacity"] = None if None in capacities else sum(capacities)
    total.update(num_shards=num_shards, live_shards=sorted(results), skipped=list(skipped), shards=per_shard)
    return total


def packed_episodes(results: Mapping[int, Sequence[Episode]]) -> list[Episode]:
    """Every shard's episodes, shard by shard, with packed ids:
    Episode(pack_ids(shard, episode_id), pack_ids(shard, first_row_id), length)."""
    out: list[Episode] = []
    for index in sorted(results):
        eps = results[index]
        if not eps:
            continue
        table = np.asarray(eps, dtype=np.uint64).reshape(-1, 3)
        ids, firsts = pack_ids(index, table[:, 0]), pack_ids(index, table[:, 1])
        out.extend(Episode(int(e), int(f), int(n)) for e, f, n in zip(ids, firsts, table[:, 2]))
    return out


def shares(n: int, lengths: np.ndarray, weights: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """How many of `n` rows to ask of each shard when its draws remove what they take: a
    multinomial draw by `weights`, no shard asked for more than it holds (`lengths`, as last
    seen) while others have room; only what all of them together lack is asked beyond that (it
    waits for rows, as a sample from one queue does)."""
    counts = np.minimum(rng.multinomial(n, weights), np.maximum(lengths, 0))
    room = np.maximum(lengths, 0) - counts
    excess = n - int(counts.sum())
    while excess > 0 and room.sum() > 0:
        extra = np.minimum(rng.multinomial(min(excess, int(room.sum())), room / room.sum()), room)
        counts, room, excess = counts + extra, room - extra, excess - int(extra.sum())
    if excess > 0:
        counts = counts + rng.multinomial(excess, weights)
    out: np.ndarray = counts.astype(np.int64)
    return out


def shortfall(failed: Mapping[int, BaseException], what: str, num_shards: int) -> BaseException:
    """Why a draw over shards came up short: the shards' own refusal, the most telling first."""
    for cls in (RateLimitedError, NotEnoughDataError, ServerUnavailableError):
        for exc in failed.values():
            if isinstance(exc, cls):
                return exc
    for exc in failed.values():
        return exc
    return NotEnoughDataError(f"cannot sample {what}: no live shard of {num_shards} has any left")


def scatter(parts: Mapping[int, Mapping[str, Any]], masks: Mapping[int, np.ndarray], size: int) -> dict[str, Any]:
    """One flat batch of `size` rows from each shard's part, placed where its mask is true."""
    first = next(iter(parts.values()))
    out: dict[str, Any] = {}
    for path, arr in first.items():
        arr = np.asarray(arr)
        if len(parts) == 1:
            out[path] = arr
            continue
        # Text decodes to str arrays whose width is each part's longest: take the widest.
        dtype = np.result_type(*(np.asarray(part[path]).dtype for part in parts.values()))
        merged = np.empty((size, *arr.shape[1:]), dtype)
        for index, part in parts.items():
            merged[masks[index]] = part[path]
        out[path] = merged
    return out


def merge_draws(space: Space, live: Sequence[int], assign: np.ndarray, weights: np.ndarray,
                drawn: Mapping[int, tuple[Any, SampleInfo]], with_info: bool) -> Any:
    """The shards' draws (of `space`) put back in the order of `assign` (batch position -> index
    into `live`); each row's probability is its shard's times that shard's share `weights`."""
    masks = {index: assign == k for k, index in enumerate(live) if index in drawn}
    parts = {index: flatten_value(space, drawn[index][0]) for index in masks}
    batch = unflatten_value(space, scatter(parts, masks, assign.shape[0]))
    if not with_info:
        return batch
    infos = {index: dataclasses.replace(drawn[index][1], probabilities=drawn[index][1].probabilities * weights[k],
                                        shard_ids=np.full(len(drawn[index][1]), index, np.int64))
             for k, index in enumerate(live) if index in masks}
    merged: dict[str, np.ndarray] = {}
    for f in dataclasses.fields(SampleInfo):  # each field every shard's info has, scattered back
        values = {index: getattr(info, f.name) for index, info in infos.items()}
        if any(v is None for v in values.values()):
            continue
        out = np.empty(assign.shape[0], next(iter(values.values())).dtype)
        for index, value in values.items():
            out[masks[index]] = value
        merged[f.name] = out
    return batch, SampleInfo(**merged)


def without_mask(drawn: tuple[Any, SampleInfo]) -> tuple[Any, SampleInfo]:
    """A shard's padded draw without its mask: rebuilt from the merged `valid_steps`."""
    batch, info = drawn
    return unmasked(batch), info
