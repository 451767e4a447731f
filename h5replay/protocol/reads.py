"""The messages of reads: get, get_rows, sample, sample_sequences, episodes; their replies name the view."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from h5replay.errors import LimitExceededError, ProtocolError
from h5replay.protocol.base import Kind, Reply, Request
from h5replay.protocol.checks import _NO_STEPS, Array, Arrays, Limits, _check_info, _check_leading, _check_rows_limit

__all__ = [
    "Get", "GetRows", "Sample", "SampleSequences", "Episodes",
    "ReadReply", "GetReply", "GetRowsReply", "SampleReply", "SampleSequencesReply", "SampleTransitions", "SampleTransitionsReply", "EpisodesReply",
]


@dataclass(frozen=True, eq=False, repr=False)
class Get(Request):
    KIND = Kind.GET
    READS = True
    min_seq: int
    indices: Array
    packed: bool | None = None  # True: compressed leaves may come as stored (PackedRows); the client decodes

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.indices), "indices", limits)


@dataclass(frozen=True, eq=False, repr=False)
class GetRows(Request):
    KIND = Kind.GET_ROWS
    READS = True
    min_seq: int
    row_ids: Array
    packed: bool | None = None

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.row_ids), "row_ids", limits)
        if len(self.row_ids) and int(np.min(self.row_ids)) < 0:
            raise ProtocolError(f"row ids must be >= 0, got {int(np.min(self.row_ids))}")


@dataclass(frozen=True, eq=False, repr=False)
class Sample(Request):
    KIND = Kind.SAMPLE
    READS = True
    DRAWS = True
    batch_size: int
    seed: int | None = None
    min_seq: int = 0
    timeout: float = 0.0  # seconds the rate limit may hold the sample back (writer-side sampling)
    table: str | None = None  # the table to draw from (None: the server's only table)
    packed: bool | None = None
    # A later part of one batch split over several requests: an in-order sampler (fifo, lifo)
    # passes over the first `skip` rows of its order, so no row comes twice in the batch.
    skip: int | None = None

    @property
    def num_drawn(self) -> int:
        """Rows the draw hands out (what a rate limit counts)."""
        return self.batch_size


@dataclass(frozen=True, eq=False, repr=False)
class SampleSequences(Request):
    KIND = Kind.SAMPLE_SEQUENCES
    READS = True
    DRAWS = True
    batch_size: int
    length: int
    seed: int | None = None
    min_seq: int = 0
    with_rows: bool = True  # False: only the windows' ids (the learner then fetches rows by id)
    timeout: float = 0.0
    table: str | None = None
    pad: bool | None = None  # True: windows may start in an episode's last length - 1 steps, padded
    packed: bool | None = None

    @property
    def num_drawn(self) -> int:
        """Rows the draw hands out (what a rate limit counts): every row of every window."""
        return self.batch_size * self.length

    def _validate(self, limits: Limits) -> None:
        if self.length < 1:
            raise ProtocolError(f"field 'length' must be >= 1, got {self.length}")
        if self.length > limits.max_rows_per_segment:  # no episode the server takes is longer
            raise LimitExceededError(f"field 'length' is {self.length} rows, over the limit max_rows_per_segment="
                                     f"{limits.max_rows_per_segment}: no episode holds such a window")
        if self.with_rows:
            _check_rows_limit(self.batch_size * self.length, "batch_size * length", limits)


@dataclass(frozen=True, eq=False, repr=False)
class SampleTransitions(Request):
    """n-step transitions (see h5replay/transitions.py) from a file with
    observation keys: the step's leaves, `next/<observation leaf>` and `discount`."""

    KIND = Kind.SAMPLE_TRANSITIONS
    READS = True
    DRAWS = True
    batch_size: int
    n_step: int = 1
    gamma: float = 0.99
    seed: int | None = None
    min_seq: int = 0
    timeout: float = 0.0
    table: str | None = None
    skip: int | None = None  # as Sample's

    @property
    def num_drawn(self) -> int:
        """Rows the draw hands out (what a rate limit counts): one per transition."""
        return self.batch_size

    def _validate(self, limits: Limits) -> None:
        if self.n_step < 1:
            raise ProtocolError(f"field 'n_step' must be >= 1, got {self.n_step}")
        if self.n_step > limits.max_rows_per_segment:
            raise LimitExceededError(f"field 'n_step' is {self.n_step}, over the limit max_rows_per_segment="
                                     f"{limits.max_rows_per_segment}: no episode is that long")


@dataclass(frozen=True, eq=False, repr=False)
class Episodes(Request):
    """The complete episodes held, oldest first; with `first_episode` / `max_episodes`, at most
    that many from that episode id on (a list too long for one message is read in pages)."""

    KIND = Kind.EPISODES
    READS = True
    min_seq: int = 0
    first_episode: int | None = None
    max_episodes: int | None = None


@dataclass(frozen=True, eq=False, repr=False)
class ReadReply(Reply):
    """Base of the replies to reads: the published state ("view") that answered."""

    seq: int
    generation: int
    begin: int  # id of the oldest row held
    end: int  # id the next committed row gets


@dataclass(frozen=True, eq=False, repr=False)
class GetReply(ReadReply):
    KIND = Kind.GET
    row_ids: Array
    arrays: Arrays

    def _validate(self, limits: Limits) -> None:
        _check_rows_limit(len(self.row_ids), "row_ids", limits)
        _check_leading(self.arrays, len(self.row_ids))


@dataclass(frozen=True, eq=False, repr=False)
class GetRowsReply(ReadReply):
    KIND = Kind.GET_ROWS
    num_rows: int
    arrays: Arrays

    def _validate(self, limits: Limits) -> None:
        _check_leading(self.arrays, self.num_rows)


@dataclass(frozen=True, eq=False, repr=False)
class SampleReply(ReadReply):
    KIND = Kind.SAMPLE
    DRAWN = True
    row_ids: Array
    episode_ids: Array
    probabilities: Array
    arrays: Arrays

    def _validate(self, limits: Limits) -> None:
        _check_drawn(self.row_ids, self.episode_ids, self.probabilities, self.arrays, limits)


def _check_drawn(row_ids: Array, episode_ids: Array, probabilities: Array, arrays: Arrays, limits: Limits) -> None:
    """What a reply of drawn rows must hold: one id, episode and probability per row, leaves of as many rows."""
    _check_rows_limit(len(row_ids), "row_ids", limits)
    _check_info(row_ids, episode_ids, probabilities)
    _check_leading(arrays, len(row_ids))


@dataclass(frozen=True, eq=False, repr=False)
class SampleTransitionsReply(ReadReply):
    """A sample reply with each transition's `has_final`."""

    KIND = Kind.SAMPLE_TRANSITIONS
    DRAWN = True
    row_ids: Array  # of each transition's first step
    episode_ids: Array
    probabilities: Array
    has_final: Array  # uint8: whether the step's episode has its final observation
    arrays: Arrays  # the step's leaves, next/<observation leaf>, discount

    def _validate(self, limits: Limits) -> None:
        if len(self.has_final) != len(self.row_ids):
            raise ProtocolError(f"has_final must have one entry per transition, got {len(self.has_final)} for "
                                f"{len(self.row_ids)}")
        _check_drawn(self.row_ids, self.episode_ids, self.probabilities, self.arrays, limits)


@dataclass(frozen=True, eq=False, repr=False)
class SampleSequencesReply(ReadReply):
    KIND = Kind.SAMPLE_SEQUENCES
    DRAWN = True
    row_ids: Array  # of each window's first row
    episode_ids: Array
    probabilities: Array
    arrays: Arrays  # each (batch, length, ...), padded with zeros; none when the request asked for ids only
    # Padded windows: how many steps of each are its episode's (empty when not padded).
    valid_steps: Array = field(default_factory=lambda: _NO_STEPS)

    def _validate(self, limits: Limits) -> None:
        _check_info(self.row_ids, self.episode_ids, self.probabilities)
        if len(self.valid_steps) not in (0, len(self.row_ids)):
            raise ProtocolError(f"valid_steps must be empty or one per window ({len(self.row_ids)}), got "
                                f"{len(self.valid_steps)}")
        if len(self.valid_steps) and int(self.valid_steps.min()) < 1:
            raise ProtocolError(f"valid_steps must be >= 1, got {int(self.valid_steps.min())}")
        _check_leading(self.arrays, len(self.row_ids))
        lengths = {np.shape(a)[1] if np.ndim(a) >= 2 else -1 for a in self.arrays.values()}
        if len(lengths) > 1 or -1 in lengths:
            shapes = {name: np.shape(a) for name, a in self.arrays.items()}
            raise ProtocolError(f"sequence arrays must all be (batch, length, ...), got shapes {shapes}")
        if len(self.valid_steps) and lengths and int(self.valid_steps.max()) > max(lengths):
            raise ProtocolError(f"valid_steps must be at most the windows' length {max(lengths)}, got "
                                f"{int(self.valid_steps.max())}")
        _check_rows_limit(len(self.row_ids) * max(lengths, default=0), "batch_size * length", limits)


@dataclass(frozen=True, eq=False, repr=False)
class EpisodesReply(ReadReply):
    KIND = Kind.EPISODES
    episodes: Array  # int64 (n, 3): (episode_id, first_row_id, length) per complete episode, oldest first
