"""The pure parts of a learner's reads: arguments checked, requests built a message's worth at a
time, and what a reply says (the published state it came from, the info of what it drew).

No sockets: LearnerClient (learner.py) and the shard router (h5replay.client._shards) use these.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from h5replay import protocol as P
from h5replay.errors import ConfigError
from h5replay.records import SampleInfo
from h5replay.sampling import Prioritized, Sampler, described_tables, rows_at_once, table_description

__all__ = ["View", "sample_info"]

_WILDCARD_HOSTS = ("0.0.0.0", "*", "::", "[::]")
_INT64_MAX = np.iinfo(np.int64).max


class View(NamedTuple):
    """The published state a reply came from: publish counter, clear counter, row ids held."""

    seq: int
    generation: int
    begin: int
    end: int

    @property
    def length(self) -> int:
        return self.end - self.begin


def _reachable(advertised: str, dialed: str) -> str:
    """The read endpoint to dial: a wildcard host (a server bound on 0.0.0.0) becomes the host this
    client reached the writer on."""
    if advertised.startswith("tcp://") and dialed.startswith("tcp://"):
        host, _, port = advertised[len("tcp://"):].rpartition(":")
        if host in _WILDCARD_HOSTS:
            return f"tcp://{dialed[len('tcp://'):].rpartition(':')[0]}:{port}"
    return advertised


def _integer_array(values: Any, what: str) -> np.ndarray:
    """`values` as a flat int64 array, refusing what is not an integer index (bools, floats)."""
    arr = values if isinstance(values, np.ndarray) else np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got an array of {arr.dtype}"
                        + ("; a boolean mask selects rows locally only: pass np.flatnonzero(mask)"
                           if arr.dtype.kind == "b" else ""))
    flat = arr.reshape(-1)
    if arr.dtype.kind == "u" and int(flat.max()) > _INT64_MAX:
        raise IndexError(f"{what[:-1]} {int(flat.max())} is out of range")
    return flat.astype(np.int64, copy=False)


def _positive(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ConfigError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _chunks(n: int, per: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + per)) for lo in range(0, n, per)]


def _request(cls: Callable[..., P.Request], *fields: Any) -> Callable[[int], P.Request]:
    """A request factory for Connection.send (which picks the request id)."""
    return lambda request_id: cls(request_id, *fields)


def _seed(seed: int | None, part: int) -> int | None:
    return None if seed is None else seed + part


def sample_info(replies: list[Any]) -> SampleInfo:
    """The SampleInfo of the replies of one draw, in order."""
    infos = [SampleInfo(r.row_ids.astype(np.uint64), r.episode_ids, r.probabilities,
                        has_final=r.has_final.astype(bool) if hasattr(r, "has_final") else None,
                        valid_steps=r.valid_steps if len(getattr(r, "valid_steps", ())) else None) for r in replies]
    info = infos[0]
    for more in infos[1:]:
        info = info.concatenate(more)
    return info


@dataclass(frozen=True)
class TableDraws:
    """How a learner draws from one table of a server, as its hello describes the table."""

    asked: str | None  # the name the caller gave (None: the server's only table), sent as is
    name: str  # the table's name ('' from a server that names no tables)
    samples: Any  # the target its samples go to ("writer" when they change the buffer, else "reads")
    consuming: bool  # its draws change the server's state (a rate limit, removals): none is dropped
    removes: bool  # max_times_sampled is set: rows drawn leave the table
    sampler: Sampler | None  # the priorities' sampler (their bound is checked here too), or None
    keeps_priorities: bool | None  # whether the table is prioritized (None: the server does not say)
    rows_per_sample: int  # rows one sample request asks for: within a message and the rate limit

    @property
    def kind(self) -> tuple[str, ...]:
        """The part of a kept draw's kind that names the table (kept rows never cross tables)."""
        return (self.name,) if self.name else ()


def table_draws(described: dict[str, Any], table: str | None, writer: Any, reads: Any,
                rows_per_message: int) -> TableDraws:
    """A table's `TableDraws` from a server's hello `sampling`.

    Raises:
        ConfigError: no such table, or none named where the server has several.
    """
    figures = table_description(described, table)
    names = described_tables(described)
    name = table if table is not None else (names[0] if names else "")
    consuming = bool(figures.get("writer_samples"))
    sampler: Sampler | None = None
    if figures.get("priority_exponent") is not None:
        try:
            sampler = Prioritized(figures.get("priority_exponent"))  # type: ignore[arg-type]
        except ConfigError:
            sampler = None  # a description that is no sampler: the server checks alone
    rows = min(rows_per_message, rows_at_once(figures, sampling=True) or rows_per_message)
    keeps = None if "sampler" not in figures else figures.get("priority_exponent") is not None
    return TableDraws(table, name, writer if consuming else reads, consuming, bool(figures.get("max_times_sampled")),
                      sampler, keeps, rows)
