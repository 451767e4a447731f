"""What a message may hold: the limits, and the one check of each field.

A field name means the same thing, with the same type, in every message that has it: its scalar
check (`_SCALAR_CHECKS`) or, for a message's own arrays, its dtype and shape (`_ARRAY_FIELDS`).
`Limits` bounds a message and a client; the checks across fields that messages run in their
`_validate` are here too. Pure (numpy only).
"""

from __future__ import annotations

import reprlib
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
from numpy.typing import NDArray

from h5replay.codecs import PackedRows
from h5replay.errors import ConfigError, LimitExceededError, ProtocolError
from h5replay.sampling import MAX_TABLES, check_table_name

__all__ = [
    "ROLES", "IDEMPOTENCY_KEY_BYTES", "ROWS_MESSAGE_OVERHEAD", "ID_BYTES", "SAMPLE_INFO_BYTES", "Limits", "DEFAULT_LIMITS",
    "Array", "Arrays",
]

ROLES = ("actor", "learner")

Array = NDArray[Any]
Arrays = Mapping[str, Array]

_MiB = 1 << 20


@dataclass(frozen=True)
class Limits:
    """What one message or one client may not exceed; the server sends its limits in the hello reply.

    ``decode`` enforces the first four; the server enforces the rest. Set the socket's
    ZMQ_MAXMSGSIZE (which libzmq checks per frame, by disconnecting) no lower than
    ``max_message_bytes``, so that an oversized message gets an error reply instead.
    """

    max_message_bytes: int = 32 * _MiB
    # The hello reply carries the space's JSON, whose bounds may be per-element lists.
    max_header_bytes: int = 1 * _MiB
    max_frames: int = 1024
    # Rows in one append, push_episode, get or sample reply (batch_size * length for sequences).
    max_rows_per_message: int = 65_536
    max_rows_per_segment: int = 1_000_000
    max_open_segments_per_client: int = 16
    max_clients: int = 256

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if type(value) is not int or value < 1:
                raise ConfigError(f"Limits.{f.name} must be an int >= 1, got {value!r}")

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Any) -> Limits:
        """Limits from a hello reply. Unknown names are ignored (a newer server may add limits).

        Raises:
            ProtocolError: not a map of names to ints >= 1.
        """
        if not isinstance(obj, dict):
            raise ProtocolError(f"field 'limits' must be a map, got {_show(obj)}")
        values = {}
        for f in fields(cls):
            if f.name in obj:
                value = obj[f.name]
                if type(value) is not int or value < 1:
                    raise ProtocolError(f"limit {f.name!r} must be an int >= 1, got {_show(value)}")
                values[f.name] = value
        return cls(**values)


DEFAULT_LIMITS = Limits()

#: Bytes to leave for the header when sizing a message that carries rows (append, reply to a read):
#: rows * row_bytes + ROWS_MESSAGE_OVERHEAD must stay within max_message_bytes.
ROWS_MESSAGE_OVERHEAD = 16 * 1024
#: Bytes a row id takes on the wire (get's indices and reply ids, get_rows' ids).
ID_BYTES = 8
#: Bytes a sample reply adds per sample: its row id, episode id and probability.
SAMPLE_INFO_BYTES = 24

# --------------------------------------------------------------------------------- field checks

_U64_MAX = (1 << 64) - 1
_MAX_NAME_CHARS = 256
_MAX_NDIM = 32


def _brief(value: Any) -> str:
    if isinstance(value, np.ndarray):
        return f"array({value.dtype}, {value.shape})"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k!r}: {_brief(v)}" for k, v in value.items()) + "}"
    return reprlib.repr(value)


def _show(value: Any) -> str:
    return f"{type(value).__name__} {reprlib.repr(value)}"  # reprlib: bounded, even for deep nesting


def _uint(value: Any, name: str, limits: Limits) -> int:
    if type(value) is not int or not 0 <= value <= _U64_MAX:  # `type is`: a bool is not an int here
        raise ProtocolError(f"field {name!r} must be an int >= 0, got {_show(value)}")
    return value


def _optional_uint(value: Any, name: str, limits: Limits) -> int | None:
    return None if value is None else _uint(value, name, limits)


def _check_rows_limit(num_rows: int, what: str, limits: Limits) -> None:
    if num_rows > limits.max_rows_per_message:
        raise LimitExceededError(
            f"{what} is {num_rows} rows, over the limit max_rows_per_message="
            f"{limits.max_rows_per_message}; send or ask for fewer rows per message"
        )


def _rows(value: Any, name: str, limits: Limits) -> int:
    _check_rows_limit(_uint(value, name, limits), f"field {name!r}", limits)
    return value  # type: ignore[no-any-return]


def _batch_size(value: Any, name: str, limits: Limits) -> int:
    if _rows(value, name, limits) < 1:
        raise ProtocolError(f"field {name!r} must be >= 1, got {value}")
    return value  # type: ignore[no-any-return]


def _text(value: Any, name: str, limits: Limits) -> str:
    if type(value) is not str:
        raise ProtocolError(f"field {name!r} must be a string, got {_show(value)}")
    return value


def _client_name(value: Any, name: str, limits: Limits) -> str:
    if not 1 <= len(_text(value, name, limits)) <= _MAX_NAME_CHARS:
        raise ProtocolError(f"field {name!r} must have 1 to {_MAX_NAME_CHARS} characters, got {len(value)}")
    return value  # type: ignore[no-any-return]


def _role(value: Any, name: str, limits: Limits) -> str:
    if value not in ROLES or type(value) is not str:
        raise ProtocolError(f"field {name!r} must be one of {ROLES}, got {_show(value)}")
    return value


def _is_json(obj: Any, depth: int = 0) -> bool:
    if obj is None or type(obj) in (bool, int, float, str):
        return True
    if depth >= _MAX_NDIM:
        return False
    if type(obj) is list:
        return all(_is_json(x, depth + 1) for x in obj)
    if type(obj) is dict:
        return all(type(k) is str and _is_json(v, depth + 1) for k, v in obj.items())
    return False


def _json_map(value: Any, name: str, limits: Limits) -> dict[str, Any]:
    if type(value) is not dict or not _is_json(value):
        raise ProtocolError(f"field {name!r} must be a JSON-like map, got {_show(value)}")
    return value


def _stats(value: Any, name: str, limits: Limits) -> dict[str, Any]:
    if type(value) is not dict or not all(
        type(k) is str and (v is None or type(v) in (bool, int, float, str)) for k, v in value.items()
    ):
        raise ProtocolError(f"field {name!r} must map names to scalars, got {_show(value)}")
    return value


_MAX_TIMEOUT = 86_400.0  # a day: longer is a mistake, not a wait


def _seconds(value: Any, name: str, limits: Limits) -> float:
    if type(value) not in (int, float) or not 0 <= value <= _MAX_TIMEOUT:  # NaN fails both comparisons
        raise ProtocolError(f"field {name!r} must be seconds in [0, {_MAX_TIMEOUT:g}], got {_show(value)}")
    return float(value)


def _fraction(value: Any, name: str, limits: Limits) -> float:
    if type(value) not in (int, float) or not 0 <= value <= 1:  # NaN fails both comparisons
        raise ProtocolError(f"field {name!r} must be a number in [0, 1], got {_show(value)}")
    return float(value)


IDEMPOTENCY_KEY_BYTES = 16


def _key(value: Any, name: str, limits: Limits) -> bytes | None:
    if value is not None and (type(value) is not bytes or len(value) != IDEMPOTENCY_KEY_BYTES):
        raise ProtocolError(f"field {name!r} must be {IDEMPOTENCY_KEY_BYTES} bytes (msgpack bin), got {_show(value)}")
    return value


def _limits(value: Any, name: str, limits: Limits) -> Limits:
    return Limits.from_json(value)


def _table_name(value: Any, name: str) -> str:
    try:
        return check_table_name(value)
    except ConfigError as exc:
        raise ProtocolError(f"field {name!r}: {exc}") from None


def _table(value: Any, name: str, limits: Limits) -> str | None:
    return None if value is None else _table_name(value, name)


def _tables(value: Any, name: str, limits: Limits) -> tuple[str, ...] | None:
    if value is None:
        return None
    if type(value) not in (list, tuple) or not 1 <= len(value) <= MAX_TABLES:
        raise ProtocolError(f"field {name!r} must be a list of 1 to {MAX_TABLES} table names, got {_show(value)}")
    names = tuple(_table_name(item, name) for item in value)
    if len(set(names)) != len(names):
        raise ProtocolError(f"field {name!r} names a table twice: {list(names)}")
    return names


def _bool(value: Any, name: str, limits: Limits) -> bool:
    if type(value) is not bool:
        raise ProtocolError(f"field {name!r} must be a bool, got {_show(value)}")
    return value


_SCALAR_CHECKS: dict[str, Callable[[Any, str, Limits], Any]] = {
    "client_name": _client_name, "role": _role, "segment_id": _uint, "num_rows": _rows,
    "batch_size": _batch_size, "length": _uint, "seed": _optional_uint, "first_row_id": _optional_uint,
    "episode_id": _optional_uint, "segment_length": _uint, "capacity": _optional_uint, "num_episodes": _uint,
    "server_version": _text, "protocol_version": _uint, "space": _json_map, "limits": _limits,
    "stats": _stats, "code": _text, "message": _text, "read_endpoint": _text, "replay_id": _text,
    "instance_id": _text, "min_seq": _uint, "seq": _uint, "generation": _uint, "begin": _uint, "end": _uint,
    "with_rows": _bool, "timeout": _seconds, "ignored": _uint, "sampling": _stats, "idempotency_key": _key,
    "first_episode": _optional_uint, "max_episodes": _optional_uint, "table": _table, "priority_tables": _tables,
    "n_step": _uint, "gamma": _fraction, "pad": _bool, "packed": _bool,
    "skip": _optional_uint, "local_file": _stats,
}
# Fields added within version 3, which earlier version 3 peers leave out: decoded as the message's
# default when absent. `encode` leaves one out only when it is None.
_OPTIONAL_SCALARS = frozenset({"idempotency_key", "timeout", "first_episode", "max_episodes", "table",
                               "priority_tables", "pad", "packed", "skip", "local_file"})


@dataclass(frozen=True)
class _ArrayField:
    dtype: np.dtype[Any]
    ndim: int
    columns: int | None = None  # the second axis of a 2-d field
    optional: bool = False  # left out of the message when empty (and then decoded as empty)


# A message's own arrays: one dtype and shape each, whatever message carries them.
_ARRAY_FIELDS: dict[str, _ArrayField] = {
    "indices": _ArrayField(np.dtype("<i8"), 1),
    "row_ids": _ArrayField(np.dtype("<i8"), 1),
    "episode_ids": _ArrayField(np.dtype("<u8"), 1),
    "probabilities": _ArrayField(np.dtype("<f8"), 1),
    "priorities": _ArrayField(np.dtype("<f8"), 1, optional=True),
    "table_priorities": _ArrayField(np.dtype("<f8"), 2, optional=True),  # (tables, rows)
    "has_final": _ArrayField(np.dtype("|u1"), 1, optional=True),  # per episode (transitions: per draw)
    "valid_steps": _ArrayField(np.dtype("<i8"), 1, optional=True),  # per padded window
    "episodes": _ArrayField(np.dtype("<i8"), 2, 3),
    "lengths": _ArrayField(np.dtype("<i8"), 1),
    "keys": _ArrayField(np.dtype("|u1"), 2, IDEMPOTENCY_KEY_BYTES),
    "request_ids": _ArrayField(np.dtype("<u8"), 1),
}

# ------------------------------------------------------------------------- checks across fields

_NO_PRIORITIES: Array = np.zeros(0, dtype=np.float64)
_NO_PRIORITIES.flags.writeable = False
_NO_TABLE_PRIORITIES: Array = np.zeros((0, 0), dtype=np.float64)
_NO_TABLE_PRIORITIES.flags.writeable = False
#: What an optional array left out of a message decodes as.
_NO_FLAGS: Array = np.zeros(0, dtype=np.uint8)
_NO_FLAGS.flags.writeable = False
_NO_STEPS: Array = np.zeros(0, dtype=np.int64)
_NO_STEPS.flags.writeable = False
_LEFT_OUT: dict[str, Array] = {"priorities": _NO_PRIORITIES, "table_priorities": _NO_TABLE_PRIORITIES,
                               "has_final": _NO_FLAGS, "valid_steps": _NO_STEPS}


def _check_priorities(priorities: Array, num_rows: int, tables: tuple[str, ...] | None = None,
                      by_table: Array = _NO_TABLE_PRIORITIES) -> None:
    """Priorities for every prioritized table (`priorities`) and by table (`tables`, one row of
    `by_table` each): empty (none given) or one per row."""
    if len(priorities) not in (0, num_rows):
        raise ProtocolError(f"priorities must be empty (none given) or one per row ({num_rows}), got {len(priorities)}")
    if tables is None:
        if by_table.size:
            raise ProtocolError("table_priorities needs priority_tables: the table each of its rows is for")
        return
    if by_table.shape != (len(tables), num_rows) and (num_rows or by_table.size):  # (none for no rows)
        raise ProtocolError(f"table_priorities must be (tables, rows) = ({len(tables)}, {num_rows}) for "
                            f"priority_tables {list(tables)}, got {by_table.shape}")


def _check_finals(finals: Arrays, rows: int) -> None:
    """Final observations of `rows` episodes: every leaf with `rows` rows (none: no finals)."""
    if finals:
        for name, arr in finals.items():
            if np.ndim(arr) < 1 or np.shape(arr)[0] != rows:
                raise ProtocolError(f"final observation leaf {name!r} must have {rows} rows, got shape {np.shape(arr)}")


def _check_info(row_ids: Array, episode_ids: Array, probabilities: Array) -> None:
    if not len(row_ids) == len(episode_ids) == len(probabilities):
        raise ProtocolError(f"row_ids, episode_ids and probabilities must have one entry per sample, got "
                            f"{len(row_ids)}, {len(episode_ids)} and {len(probabilities)}")


def _check_leading(arrays: Arrays, num_rows: int) -> None:
    for name, arr in arrays.items():
        shape = arr.shape if isinstance(arr, (np.ndarray, PackedRows)) else np.shape(arr)
        if not shape or shape[0] != num_rows:
            raise ProtocolError(
                f"array {name!r} has shape {shape} but the message has {num_rows} rows; "
                f"every leaf array needs a leading axis of {num_rows}"
            )


def _check_sizes(sizes: list[int], limits: Limits) -> None:
    """`sizes`: the byte size of each frame, header first."""
    if len(sizes) > limits.max_frames:
        raise LimitExceededError(f"message has {len(sizes)} frames, over the limit max_frames={limits.max_frames}")
    if sum(sizes) > limits.max_message_bytes:
        raise LimitExceededError(
            f"message has {sum(sizes)} bytes, over the limit max_message_bytes={limits.max_message_bytes}; "
            "send fewer rows per message"
        )
    if sizes[0] > limits.max_header_bytes:
        raise LimitExceededError(
            f"header frame has {sizes[0]} bytes, over the limit max_header_bytes={limits.max_header_bytes}"
        )
