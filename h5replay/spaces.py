"""Box / Binary / Text / Dict spaces, and the Schema of one space: what a sample looks like, how
it is checked, how a nested batch becomes one array per leaf and back, its JSON form.

Pure code (numpy only): no files, no sockets, no h5py, so clients import it cheaply. The storage,
the server's checks of what arrives off the wire and both clients go through `Schema`, the one
implementation of flatten / validate / encode / decode. A leaf's own contract has two halves:

* ``encode_batch(value, num_rows, key)`` checks a user batch (leading axis ``num_rows``) and returns
  the array that is written to HDF5 (``storage_dtype``), or raises ``SpaceMismatchError`` naming the
  key and what was expected. Nothing is written before every leaf has been encoded.
* ``decode_batch(stored)`` turns stored rows back into what the user sees (``str`` for text).

Text is stored as fixed-length UTF-8 byte fields sized for ``max_length`` characters (4 bytes each),
because variable-length strings cannot be written under HDF5's SWMR mode.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from h5replay.errors import ConfigError, SpaceMismatchError

__all__ = [
    "Space",
    "LeafSpace",
    "BoxSpace",
    "BinarySpace",
    "TextSpace",
    "DictSpace",
    "space_from_json",
    "Schema",
    "DEFAULT_KEY",
    "named_leaves",
    "flatten_value",
    "unflatten_value",
    "MAX_ROW_BYTES",
    "MAX_DEPTH",
]

#: Where a space that is a single leaf keeps its values (the HDF5 dataset and the wire array name).
DEFAULT_KEY = "data"

#: The most bytes one row of one leaf may take (1 GiB), and how deeply dict spaces may nest.
#: A description read from a file or a peer is checked against them before anything is
#: allocated for it: a crafted (10**6, 10**6) Box would otherwise ask for a TiB for its bounds.
MAX_ROW_BYTES = 1 << 30
MAX_DEPTH = 32
_MAX_DIMS = 31  # a leaf's dataset adds the row axis: HDF5 allows 32 dimensions in all
_UTF8_MAX_BYTES_PER_CHAR = 4
_SAMPLE_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 éüß中文🙂"


def _where(key: str) -> str:
    return f"field '{key}'" if key else "the value"


def _shape_tuple(shape: Any, what: str) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    try:
        out = tuple(int(d) for d in shape)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{what} must be a tuple of ints, got {shape!r}") from exc
    if any(d < 0 for d in out):
        raise ConfigError(f"{what} must not have negative dimensions, got {out}")
    if len(out) > _MAX_DIMS:
        raise ConfigError(f"{what} has {len(out)} dimensions; a row may have at most {_MAX_DIMS}")
    return out


def _check_row_bytes(shape: tuple[int, ...], itemsize: int, what: str) -> None:
    """Refuse a leaf whose row would take more than MAX_ROW_BYTES (Python ints: no overflow)."""
    size = itemsize
    for d in shape:
        size *= d
    if size > MAX_ROW_BYTES:
        raise ConfigError(f"{what} would take {size} bytes a row, over the limit of {MAX_ROW_BYTES} (1 GiB)")


def _bound_array(bound: Any, what: str) -> np.ndarray:
    """A bound as an array: integer input stays exact (int64 / uint64), anything else is float64."""
    try:
        arr = np.asarray(bound)
        return arr if arr.dtype.kind in "iu" else arr.astype(np.float64)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"BoxSpace {what} must be numbers, got {bound!r:.200}") from exc


def _float_to_json(x: float) -> float | str:
    if math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def _bound_to_json(bound: np.ndarray) -> Any:
    """A bound array as JSON: one number when uniform, else nested lists; inf as a string."""
    flat = bound.reshape(-1)
    if not flat.size:  # nested lists would lose an empty shape such as (0, 3); any number broadcasts
        return 0.0 if bound.dtype.kind == "f" else 0
    if np.all(flat == flat[0]):
        return _float_to_json(float(flat[0])) if bound.dtype.kind == "f" else int(flat[0])
    if bound.dtype.kind == "f":
        return np.vectorize(_float_to_json, otypes=[object])(bound).tolist()
    return bound.tolist()


def _bound_to_check(bound: np.ndarray, unbounded: Any) -> Any:
    """None when `bound` admits every value of its dtype (all +-inf or the integer limit), a
    scalar when it is uniform, else the array."""
    flat = bound.reshape(-1)
    if not flat.size or bool(np.all(flat == unbounded)):
        return None
    return flat[0].item() if bool(np.all(flat == flat[0])) else bound


def _bound_from_json(obj: Any, depth: int = 0) -> Any:
    if isinstance(obj, str):
        return float(obj)
    if isinstance(obj, list):
        if depth >= _MAX_DIMS:
            raise ConfigError(f"a BoxSpace bound is nested more than {_MAX_DIMS} lists deep")
        return [_bound_from_json(x, depth + 1) for x in obj]
    return obj


class Space(ABC):
    """A set of values one row may hold. Subclasses are immutable after construction."""

    shape: tuple[int, ...] | None
    dtype: np.dtype[Any] | None

    @abstractmethod
    def contains(self, value: Any) -> bool:
        """True when `value` is one valid sample of this space."""

    @abstractmethod
    def sample(self, rng: np.random.Generator | None = None) -> Any:
        """One random sample of this space."""

    @abstractmethod
    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable description that `space_from_json` turns back into an equal space."""

    @abstractmethod
    def leaves(self, prefix: str = "") -> Iterator[tuple[str, LeafSpace]]:
        """(path, leaf) for every leaf, in storage order; paths join dict keys with '/'."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Space) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(repr(self.to_json()))


class LeafSpace(Space):
    """A space stored as one HDF5 dataset: rows of `shape`, written as `storage_dtype`."""

    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    @abstractmethod
    def storage_dtype(self) -> np.dtype[Any]:
        """The numpy dtype of the stored rows."""

    @abstractmethod
    def encode_batch(self, value: Any, num_rows: int | None = None, key: str = "") -> np.ndarray:
        """Check a batch and return it as a C-contiguous array of `storage_dtype`.

        Raises:
            SpaceMismatchError: the batch does not fit; the message names `key`.
        """

    def decode_batch(self, stored: np.ndarray) -> np.ndarray:
        """Stored rows as the user sees them (identity except for text)."""
        return stored

    def validate_stored(self, arr: np.ndarray, num_rows: int | None = None, key: str = "") -> np.ndarray:
        """Check a batch that is already in `storage_dtype` (as it arrives off the wire).

        Raises:
            SpaceMismatchError: wrong dtype, shape or row count, or bytes the dtype cannot hold.
        """
        if arr.dtype != self.storage_dtype:
            raise SpaceMismatchError(
                f"{_where(key)} arrived as {arr.dtype} but the space stores {self.storage_dtype}"
            )
        self._check_rows(arr, num_rows, key)
        self._check_stored_values(arr, key)
        return arr

    def _check_stored_values(self, arr: np.ndarray, key: str) -> None:
        """Subclasses reject byte patterns their dtype admits but the space does not."""

    def encode_one(self, value: Any, key: str = "") -> np.ndarray:
        """One sample as a stored batch of one row (a view of `value` when it already fits exactly)."""
        # The per-step hot path of actors: an array of exactly the stored dtype and shape needs no checks.
        if type(value) is np.ndarray and value.dtype.kind in "biuf" and value.dtype == self.storage_dtype:
            if value.shape == self.shape:
                return value[None]
        return self.encode_batch(self._as_batch_of_one(value), 1, key)

    def decode_one(self, stored_row: Any) -> Any:
        """One stored row (no leading axis) as the user sees it."""
        return stored_row

    def _as_batch_of_one(self, value: Any) -> Any:
        return np.asarray(value)[None]

    def leaves(self, prefix: str = "") -> Iterator[tuple[str, LeafSpace]]:
        yield prefix, self

    @property
    def row_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.storage_dtype.itemsize

    def _check_rows(self, arr: np.ndarray, num_rows: int | None, key: str) -> None:
        if arr.ndim != 1 + len(self.shape) or arr.shape[1:] != self.shape:
            raise SpaceMismatchError(
                f"{_where(key)} has shape {arr.shape[1:] if arr.ndim else arr.shape} per row "
                f"(batch shape {arr.shape}) but the space expects {self.shape}; check the actor's spaces"
            )
        if num_rows is not None and arr.shape[0] != num_rows:
            raise SpaceMismatchError(
                f"{_where(key)} has {arr.shape[0]} rows but the other fields have {num_rows}"
            )


class BoxSpace(LeafSpace):
    """Real or integer arrays of a fixed shape, with elementwise bounds [low, high]."""

    def __init__(self, low: Any, high: Any, shape: Any = None, dtype: Any = np.float32) -> None:
        try:
            self.dtype = np.dtype(dtype)
        except TypeError as exc:
            raise ConfigError(f"BoxSpace dtype {dtype!r} is not a numpy dtype") from exc
        if self.dtype.kind not in "fiu":
            raise ConfigError(f"BoxSpace dtype must be a real float or integer type, got {self.dtype}")
        low_arr, high_arr = _bound_array(low, "low"), _bound_array(high, "high")
        if shape is None:
            try:
                shape = np.broadcast_shapes(low_arr.shape, high_arr.shape)
            except ValueError as exc:
                raise ConfigError(
                    f"BoxSpace low {low_arr.shape} and high {high_arr.shape} do not broadcast together"
                ) from exc
        self.shape = _shape_tuple(shape, "BoxSpace shape")
        _check_row_bytes(self.shape, self.dtype.itemsize, f"BoxSpace of shape {self.shape} {self.dtype}")
        try:
            low_arr = np.broadcast_to(low_arr, self.shape)
            high_arr = np.broadcast_to(high_arr, self.shape)
        except ValueError as exc:
            raise ConfigError(f"BoxSpace bounds do not broadcast to shape {self.shape}") from exc
        if np.any(np.isnan(low_arr)) or np.any(np.isnan(high_arr)):
            raise ConfigError("BoxSpace bounds must not be NaN")
        if np.any(low_arr > high_arr):
            raise ConfigError("BoxSpace low must be <= high everywhere")
        if self.dtype.kind in "iu":
            # Clip as Python numbers: float64 cannot hold int64's max (it rounds up to 2**63 and
            # the cast wraps), so +-inf bounds on an int64 box used to collapse to one value.
            info = np.iinfo(self.dtype)
            low_arr = np.asarray(np.clip(low_arr.astype(object), info.min, info.max), dtype=self.dtype)
            high_arr = np.asarray(np.clip(high_arr.astype(object), info.min, info.max), dtype=self.dtype)
        else:
            with np.errstate(over="ignore"):  # bounds beyond a float16/32's range become +-inf
                low_arr, high_arr = low_arr.astype(self.dtype), high_arr.astype(self.dtype)
        self.low: np.ndarray = np.array(low_arr)
        self.high: np.ndarray = np.array(high_arr)
        self.low.flags.writeable = False
        self.high.flags.writeable = False
        # What `check_bounds` compares with: None for a side that admits every value of the dtype,
        # a scalar when the bound is uniform (min / max then suffice), else the bound array.
        lowest, highest = ((-np.inf, np.inf) if self.dtype.kind == "f"
                           else (np.iinfo(self.dtype).min, np.iinfo(self.dtype).max))
        self._low_check = _bound_to_check(self.low, lowest)
        self._high_check = _bound_to_check(self.high, highest)
        self._uniform_low, self._uniform_high = np.ndim(self._low_check) == 0, np.ndim(self._high_check) == 0
        #: Whether `check_bounds` has anything to check: a finite bound, or a float (NaN).
        self.checks_values = self._low_check is not None or self._high_check is not None or self.dtype.kind == "f"

    @property
    def storage_dtype(self) -> np.dtype[Any]:
        return self.dtype

    def check_bounds(self, arr: np.ndarray, key: str = "", first_row: int = 0) -> None:
        """Refuse a stored batch with a value outside [low, high], or NaN (which no bound admits,
        as gymnasium's `contains` says), as gymnasium's `Box.contains` would. Vectorised, once per
        batch; a leaf with neither a finite bound nor floats costs nothing.

        Raises:
            SpaceMismatchError: names the leaf, the row (counted from `first_row`) and index of the
                first bad value, and the bound.
        """
        low, high = self._low_check, self._high_check
        if arr.size <= 1:  # one value (a row of a scalar leaf): plain Python, no reductions
            if not arr.size:
                return
            v = arr.item()
            if v == v and (low is None or v >= low) and (high is None or v <= high):  # v != v: NaN
                return
        elif low is None and high is None:
            top = arr.max().item()
            if self.dtype.kind != "f" or top == top:  # the max is NaN when any value is
                return
        elif (
            (low is None or (arr.min().item() >= low if self._uniform_low else bool(np.all(arr >= low))))
            and (high is None or (arr.max().item() <= high if self._uniform_high else bool(np.all(arr <= high))))
        ):
            return  # a NaN fails every comparison (min and max are NaN then), so it is caught here
        self._refuse(arr, key, first_row)

    def _refuse(self, arr: np.ndarray, key: str, first_row: int = 0) -> None:
        bad = ~((arr >= self.low) & (arr <= self.high))
        where = np.unravel_index(int(np.argmax(bad)), arr.shape)
        row, index = first_row + int(where[0]), tuple(int(i) for i in where[1:])
        value = arr[where].item()
        at = f"{_where(key)}, row {row}" + (f" index {index}" if index else "")
        remedy = "or turn bounds checking off (serve --no-check-bounds; check_bounds=False on a local buffer)"
        if value != value:  # NaN
            error = SpaceMismatchError(f"{at} is NaN, which the space's bounds do not admit; replace it, {remedy}")
        else:
            low, high = self.low[index].item(), self.high[index].item()
            error = SpaceMismatchError(
                f"{at} is {value!r}, outside the space's bounds [{low!r}, {high!r}]; clip it, widen the space's "
                f"bounds, {remedy}"
            )
        error.row = row
        raise error

    def contains(self, value: Any) -> bool:
        try:
            arr = np.asarray(value)
            self.encode_one(arr)  # shape, kind, same_kind cast, int range, float overflow
        except (TypeError, ValueError):  # SpaceMismatchError is a ValueError
            return False
        return bool(np.all(arr >= self.low) and np.all(arr <= self.high))

    def sample(self, rng: np.random.Generator | None = None) -> np.ndarray:
        rng = rng or np.random.default_rng()
        if self.dtype.kind in "iu":
            # np.asarray: for shape () numpy hands back a scalar, and a Box sample is an ndarray.
            return np.asarray(rng.integers(self.low, self.high, endpoint=True, dtype=self.dtype))
        low, high = self.low.astype(np.float64), self.high.astype(np.float64)
        lo_fin, hi_fin = np.isfinite(low), np.isfinite(high)
        out = rng.normal(size=self.shape)
        both = lo_fin & hi_fin
        out = np.where(both, rng.uniform(np.where(both, low, 0), np.where(both, high, 1), self.shape), out)
        out = np.where(lo_fin & ~hi_fin, np.where(lo_fin, low, 0) + rng.exponential(size=self.shape), out)
        out = np.where(~lo_fin & hi_fin, np.where(hi_fin, high, 0) - rng.exponential(size=self.shape), out)
        return np.asarray(np.clip(out, low, high), dtype=self.dtype)

    def encode_batch(self, value: Any, num_rows: int | None = None, key: str = "") -> np.ndarray:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise SpaceMismatchError(f"{_where(key)} is not an array of numbers: {exc}") from exc
        if arr.dtype.kind not in "biuf":
            raise SpaceMismatchError(
                f"{_where(key)} has dtype {arr.dtype} but the space expects {self.dtype}"
            )
        self._check_rows(arr, num_rows, key)
        if arr.dtype == self.dtype:
            return np.ascontiguousarray(arr)
        if not np.can_cast(arr.dtype, self.dtype, "same_kind"):
            raise SpaceMismatchError(
                f"{_where(key)} has dtype {arr.dtype}, which cannot be cast to the space's "
                f"{self.dtype} without changing kind; convert it first"
            )
        if arr.dtype.kind in "iu" and self.dtype.kind in "iu":
            info = np.iinfo(self.dtype)
            if arr.size and (arr.min() < info.min or arr.max() > info.max):
                raise SpaceMismatchError(f"{_where(key)} has values outside the range of {self.dtype}")
        with np.errstate(over="ignore"):  # overflow is reported below, as a SpaceMismatchError
            out = np.ascontiguousarray(arr, dtype=self.dtype)
        might_overflow = self.dtype.kind == "f" and not np.can_cast(arr.dtype, self.dtype, "safe")
        if might_overflow and not np.array_equal(np.isfinite(arr), np.isfinite(out)):
            raise SpaceMismatchError(f"{_where(key)} has values that overflow {self.dtype}")
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "type": "box",
            "shape": list(self.shape),
            # A native order is spelled by name whether it came as "<f4" (h5py) or "float32" (numpy).
            "dtype": self.dtype.name if self.dtype.isnative else self.dtype.str,
            "low": _bound_to_json(self.low),
            "high": _bound_to_json(self.high),
        }

    def __repr__(self) -> str:
        return f"BoxSpace(shape={self.shape}, dtype={self.dtype})"


class BinarySpace(LeafSpace):
    """Boolean arrays of a fixed shape. Integer arrays holding only 0 and 1 are accepted too."""

    def __init__(self, shape: Any = ()) -> None:
        self.shape = _shape_tuple(shape, "BinarySpace shape")
        _check_row_bytes(self.shape, 1, f"BinarySpace of shape {self.shape}")
        self.dtype = np.dtype(bool)

    @property
    def storage_dtype(self) -> np.dtype[Any]:
        return np.dtype(bool)

    def contains(self, value: Any) -> bool:
        try:
            self.encode_one(value)
        except SpaceMismatchError:
            return False
        return True

    def sample(self, rng: np.random.Generator | None = None) -> np.ndarray:
        rng = rng or np.random.default_rng()
        return rng.integers(0, 2, size=self.shape).astype(bool)

    def encode_batch(self, value: Any, num_rows: int | None = None, key: str = "") -> np.ndarray:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as exc:
            raise SpaceMismatchError(f"{_where(key)} is not a boolean array: {exc}") from exc
        if arr.dtype.kind not in "biu":
            raise SpaceMismatchError(f"{_where(key)} has dtype {arr.dtype} but the space expects bool")
        self._check_rows(arr, num_rows, key)
        if arr.dtype.kind != "b":
            if arr.size and not np.all((arr == 0) | (arr == 1)):
                raise SpaceMismatchError(f"{_where(key)} is binary but holds values other than 0 and 1")
            arr = arr.astype(bool)
        return np.ascontiguousarray(arr)

    def _check_stored_values(self, arr: np.ndarray, key: str) -> None:
        if arr.size and np.any(arr.view(np.uint8) > 1):
            raise SpaceMismatchError(f"{_where(key)} holds bytes other than 0 and 1 in a boolean field")

    def to_json(self) -> dict[str, Any]:
        return {"type": "binary", "shape": list(self.shape)}

    def __repr__(self) -> str:
        return f"BinarySpace(shape={self.shape})"


class TextSpace(LeafSpace):
    """Unicode strings of min_length..max_length characters, without NUL characters."""

    def __init__(self, max_length: int, min_length: int = 0) -> None:
        if isinstance(max_length, bool) or not isinstance(max_length, (int, np.integer)) or max_length < 1:
            raise ConfigError(f"TextSpace max_length must be an int >= 1, got {max_length!r}")
        if isinstance(min_length, bool) or not isinstance(min_length, (int, np.integer)) or not 0 <= min_length <= max_length:
            raise ConfigError(f"TextSpace min_length must be an int in [0, {max_length}], got {min_length!r}")
        _check_row_bytes((int(max_length),), _UTF8_MAX_BYTES_PER_CHAR, f"TextSpace of max_length {max_length}")
        self.max_length, self.min_length = int(max_length), int(min_length)
        self.shape = ()
        self.dtype = np.dtype(object)

    @property
    def storage_dtype(self) -> np.dtype[Any]:
        return np.dtype(f"S{self.max_length * _UTF8_MAX_BYTES_PER_CHAR}")

    def contains(self, value: Any) -> bool:
        return isinstance(value, str) and self._problem(value) is None

    def _problem(self, text: str) -> str | None:
        if not self.min_length <= len(text) <= self.max_length:
            return f"has {len(text)} characters but the space allows {self.min_length} to {self.max_length}"
        if "\x00" in text:
            return "contains a NUL character, which text fields cannot hold"
        return None

    def sample(self, rng: np.random.Generator | None = None) -> str:
        rng = rng or np.random.default_rng()
        n = int(rng.integers(self.min_length, self.max_length, endpoint=True))
        idx = rng.integers(0, len(_SAMPLE_ALPHABET), size=n)
        return "".join(_SAMPLE_ALPHABET[i] for i in idx)

    def _as_batch_of_one(self, value: Any) -> Any:
        return [value]

    def encode_batch(self, value: Any, num_rows: int | None = None, key: str = "") -> np.ndarray:
        if isinstance(value, (str, bytes)):
            raise SpaceMismatchError(f"{_where(key)} is a single string; a batch needs a sequence of strings")
        try:
            items = list(np.asarray(value, dtype=object).reshape(-1)) if not isinstance(value, list) else value
            shape = np.shape(value) if not isinstance(value, list) else (len(value),)
        except (TypeError, ValueError) as exc:
            raise SpaceMismatchError(f"{_where(key)} is not a sequence of strings: {exc}") from exc
        if len(shape) != 1:
            raise SpaceMismatchError(f"{_where(key)} has batch shape {shape}; text rows are scalars, expected (n,)")
        if num_rows is not None and len(items) != num_rows:
            raise SpaceMismatchError(f"{_where(key)} has {len(items)} rows but the other fields have {num_rows}")
        out = np.empty(len(items), dtype=self.storage_dtype)
        for i, item in enumerate(items):
            if not isinstance(item, str):
                raise SpaceMismatchError(f"{_where(key)}[{i}] is {type(item).__name__}, expected str")
            problem = self._problem(item)
            if problem is not None:
                raise SpaceMismatchError(f"{_where(key)}[{i}] {problem}")
            out[i] = item.encode("utf-8")
        return out

    def decode_batch(self, stored: np.ndarray) -> np.ndarray:
        out = np.empty(stored.shape, dtype=object)
        flat_in, flat_out = stored.reshape(-1), out.reshape(-1)
        for i, raw in enumerate(flat_in):
            flat_out[i] = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        return out

    def decode_one(self, stored_row: Any) -> Any:
        return stored_row.decode("utf-8") if isinstance(stored_row, bytes) else str(stored_row)

    def _check_stored_values(self, arr: np.ndarray, key: str) -> None:
        for i, raw in enumerate(arr.reshape(-1)):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise SpaceMismatchError(f"{_where(key)}[{i}] is not valid UTF-8: {exc}") from exc
            problem = self._problem(text)
            if problem is not None:
                raise SpaceMismatchError(f"{_where(key)}[{i}] {problem}")

    def to_json(self) -> dict[str, Any]:
        return {"type": "text", "max_length": self.max_length, "min_length": self.min_length}

    def __repr__(self) -> str:
        return f"TextSpace(max_length={self.max_length}, min_length={self.min_length})"


class DictSpace(Space):
    """A mapping of names to spaces (nested dicts become nested DictSpaces). Keys are kept sorted."""

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"DictSpace takes a mapping of names to spaces, got {type(mapping).__name__}")
        spaces: dict[str, Space] = {}
        for key in mapping:  # check before sorting: sorted() raises TypeError on mixed key types
            if not isinstance(key, str) or not key or "/" in key or key in (".", ".."):
                raise ConfigError(f"DictSpace key {key!r} must be a non-empty string without '/'")
        for key in sorted(mapping):
            sub = mapping[key]
            if isinstance(sub, Mapping):
                sub = DictSpace(sub)
            if not isinstance(sub, Space):
                raise ConfigError(f"DictSpace value for {key!r} must be a space, got {type(sub).__name__}")
            spaces[key] = sub
        self.spaces: Mapping[str, Space] = spaces
        self.shape = None
        self.dtype = None

    def __getitem__(self, key: str) -> Space:
        return self.spaces[key]

    def keys(self) -> Any:
        return self.spaces.keys()

    def contains(self, value: Any) -> bool:
        if not isinstance(value, Mapping) or set(value) != set(self.spaces):
            return False
        return all(space.contains(value[k]) for k, space in self.spaces.items())

    def sample(self, rng: np.random.Generator | None = None) -> dict[str, Any]:
        rng = rng or np.random.default_rng()
        return {k: space.sample(rng) for k, space in self.spaces.items()}

    def leaves(self, prefix: str = "") -> Iterator[tuple[str, LeafSpace]]:
        for key, space in self.spaces.items():
            yield from space.leaves(f"{prefix}/{key}" if prefix else key)

    def to_json(self) -> dict[str, Any]:
        return {"type": "dict", "spaces": {k: s.to_json() for k, s in self.spaces.items()}}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {s!r}" for k, s in self.spaces.items())
        return f"DictSpace({{{inner}}})"


def named_leaves(space: Space) -> list[tuple[str, LeafSpace]]:
    """(path, leaf) for every leaf in storage order; a space that is one leaf is named DEFAULT_KEY."""
    if isinstance(space, DictSpace):
        return list(space.leaves())
    if isinstance(space, LeafSpace):
        return [(DEFAULT_KEY, space)]
    raise ConfigError(f"unsupported space {space!r}; use BoxSpace, BinarySpace, TextSpace or DictSpace")


def flatten_value(space: Space, value: Any) -> dict[str, Any]:
    """{leaf path: leaf value} from a nested sample or batch, naming any missing or extra key.

    Raises:
        SpaceMismatchError: `value` is not a dict where the space has one, or its keys differ.
    """
    if not isinstance(space, DictSpace):
        return {DEFAULT_KEY: value}
    out: dict[str, Any] = {}
    _flatten_into(space, value, "", out)
    return out


def unflatten_value(space: Space, leaves: Mapping[str, Any]) -> Any:
    """A nested dict (or the bare value of a single-leaf space) from {leaf path: value}."""
    if not isinstance(space, DictSpace):
        return leaves[DEFAULT_KEY]
    out: dict[str, Any] = {}
    for path, value in leaves.items():
        node = out
        *parents, last = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return out


def _join(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def _flatten_into(space: DictSpace, value: Any, prefix: str, out: dict[str, Any]) -> None:
    where = f"field '{prefix}'" if prefix else "the sample"
    if not isinstance(value, Mapping):
        raise SpaceMismatchError(f"{where} must be a dict with keys {sorted(space.spaces)}, got {type(value).__name__}")
    if value.keys() != space.spaces.keys():
        _refuse_keys(space, value, prefix, where)
    for key, sub in space.spaces.items():
        path = _join(prefix, key)
        if isinstance(sub, DictSpace):
            _flatten_into(sub, value[key], path, out)
        else:
            out[path] = value[key]


def _refuse_keys(space: DictSpace, value: Mapping[Any, Any], prefix: str, where: str) -> None:
    missing = [k for k in space.spaces if k not in value]
    extra = [k for k in value if k not in space.spaces]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(repr(_join(prefix, k)) for k in missing)}")
        if extra:
            parts.append(f"unexpected {', '.join(repr(_join(prefix, str(k))) for k in extra)}")
        raise SpaceMismatchError(f"{where} does not match the space: {'; '.join(parts)}")


def _no_exact_row(columns: Sequence[np.ndarray], row: int, sample: Any) -> bool:
    return False


def _put_exact_row(space: Space, leaves: Sequence[tuple[str, LeafSpace]]) -> Callable[[Sequence[np.ndarray], int, Any], bool]:
    """A function that copies one sample into row `row` of `columns` (one array per leaf, in the
    order of `leaves`) and returns True when the sample already is exactly what is stored: a
    plain dict with exactly the space's keys (or, for a single Box, the array itself), each an
    ndarray of exactly its leaf's dtype and shape. Otherwise it returns False and writes nothing
    (then `Schema.encode_one` says why, or converts). Bounds are not checked (see
    `Schema.check_values`). Built per space, for the per-step path of writers that check bounds
    per block of rows: a few hundred nanoseconds a leaf. Spaces with text, binary or nested
    dicts always get False."""
    if not all(isinstance(leaf, BoxSpace) and leaf.storage_dtype.kind in "biuf" for _, leaf in leaves):
        return _no_exact_row
    if isinstance(space, BoxSpace):
        dtype, shape = space.storage_dtype, space.shape

        def put_leaf(columns: Sequence[np.ndarray], row: int, sample: Any) -> bool:
            if type(sample) is np.ndarray and sample.shape == shape and (sample.dtype is dtype or sample.dtype == dtype):
                columns[0][row] = sample
                return True
            return False

        return put_leaf
    if not isinstance(space, DictSpace) or not all(isinstance(sub, BoxSpace) for sub in space.spaces.values()):
        return _no_exact_row
    plan = tuple((name, leaf.storage_dtype, leaf.shape) for name, leaf in leaves)
    size = len(plan)

    def put_dict(columns: Sequence[np.ndarray], row: int, sample: Any) -> bool:
        if type(sample) is not dict or len(sample) != size:
            return False
        values = []
        for key, dtype, shape in plan:
            value = sample.get(key)
            if type(value) is not np.ndarray or value.shape != shape or (value.dtype is not dtype and value.dtype != dtype):
                return False
            values.append(value)
        for column, value in zip(columns, values):
            column[row] = value
        return True

    return put_dict


def space_from_json(obj: Any) -> Space:
    """Rebuild a space from `Space.to_json()` output (dict spaces nested at most MAX_DEPTH deep).

    Raises:
        ConfigError: `obj` is not a space description this version understands.
    """
    return _space_from_json(obj, 0)


def _space_from_json(obj: Any, depth: int) -> Space:
    if not isinstance(obj, Mapping) or "type" not in obj:
        raise ConfigError(f"a space description must be a mapping with a 'type', got {obj!r:.200}")
    kind = obj["type"]
    try:
        if kind == "box":
            return BoxSpace(
                _bound_from_json(obj["low"]), _bound_from_json(obj["high"]), tuple(obj["shape"]), obj["dtype"]
            )
        if kind == "binary":
            return BinarySpace(tuple(obj["shape"]))
        if kind == "text":
            return TextSpace(obj["max_length"], obj.get("min_length", 0))
        if kind == "dict":
            spaces = obj["spaces"]
            if not isinstance(spaces, Mapping):
                raise ConfigError("a dict space's 'spaces' must be a mapping")
            if depth >= MAX_DEPTH:
                raise ConfigError(f"dict spaces are nested more than {MAX_DEPTH} deep")
            return DictSpace({k: _space_from_json(v, depth + 1) for k, v in spaces.items()})
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"invalid {kind!r} space description: {exc!r}") from exc
    raise ConfigError(f"unknown space type {kind!r}; expected box, binary, text or dict")


class Schema:
    """One space's leaves, and the one way a nested sample or batch becomes {leaf name: array}.

    Leaf names are the '/'-joined dict keys ("obs/image"); a space that is a single leaf has one
    leaf named DEFAULT_KEY ("data"). The same names are the HDF5 dataset paths and the wire's
    array names. Immutable; make one per space and keep it.
    """

    def __init__(self, space: Space, *, check_bounds: bool = False) -> None:
        """`check_bounds`: also refuse Box values outside their bounds, and NaN (storage and the
        server check; clients leave it to them)."""
        self.space = space
        self.leaves: tuple[tuple[str, LeafSpace], ...] = tuple(named_leaves(space))
        self.names: tuple[str, ...] = tuple(name for name, _ in self.leaves)
        self.check_bounds = check_bounds
        self._bounded = tuple((name, leaf) for name, leaf in self.leaves
                              if check_bounds and isinstance(leaf, BoxSpace) and leaf.checks_values)
        #: Bytes of one row as stored, every leaf included.
        self.row_bytes = sum(leaf.row_bytes for _, leaf in self.leaves)
        #: put_exact_row(columns, row, sample): copy a sample that is exactly what is stored into
        #: row `row` of `columns` (one array per leaf, in leaf order) and return True; else write
        #: nothing and return False. See _put_exact_row.
        self.put_exact_row: Callable[[Sequence[np.ndarray], int, Any], bool] = _put_exact_row(space, self.leaves)

    def __repr__(self) -> str:
        return f"Schema({self.space!r})"

    def flatten(self, value: Any) -> dict[str, Any]:
        """{leaf name: leaf value} of a nested sample or batch.

        Raises:
            SpaceMismatchError: `value` is not a dict where the space has one, or its keys differ.
        """
        return flatten_value(self.space, value)

    def unflatten(self, leaves: Mapping[str, Any]) -> Any:
        """A nested dict (or the bare value of a single-leaf space) from {leaf name: value}."""
        return unflatten_value(self.space, leaves)

    def encode_batch(self, batch: Any, num_rows: int | None = None) -> tuple[dict[str, np.ndarray], int]:
        """Check a batch (a leading axis of rows on every leaf) and return ({leaf name: stored
        array}, rows). Every leaf is checked before anything is returned.

        Raises:
            SpaceMismatchError: a key, shape, dtype, row count or value does not fit; the message
                names the leaf.
        """
        flat = self.flatten(batch)
        encoded: dict[str, np.ndarray] = {}
        for name, leaf in self.leaves:
            arr = leaf.encode_batch(flat[name], num_rows, key=name)
            num_rows = arr.shape[0] if num_rows is None else num_rows
            encoded[name] = arr
        self.check_values(encoded)
        return encoded, int(num_rows or 0)

    def check_values(self, encoded: Mapping[str, np.ndarray], first_row: int = 0) -> None:
        """Check the Box bounds (and NaN) of stored rows already checked for keys, dtypes and
        shapes; a no-op without `check_bounds`. Rows are named from `first_row` in errors.

        Raises:
            SpaceMismatchError: names the leaf, the row and index of the first bad value, and the bound.
        """
        for name, leaf in self._bounded:
            leaf.check_bounds(encoded[name], name, first_row)

    def encode_one(self, sample: Any, *, check_values: bool = True) -> dict[str, np.ndarray]:
        """Check one sample; returns {leaf name: stored batch of one row}. `check_values=False`
        leaves the bounds to a later `check_values` of the stored rows.

        Raises:
            SpaceMismatchError: as `encode_batch`.
        """
        flat = self.flatten(sample)
        encoded = {name: leaf.encode_one(flat[name], key=name) for name, leaf in self.leaves}
        if check_values:
            self.check_values(encoded)
        return encoded

    def decode(self, stored: Mapping[str, np.ndarray]) -> Any:
        """Stored arrays (any leading shape) as the user sees them: nested, text as str."""
        return self.unflatten({name: leaf.decode_batch(stored[name]) for name, leaf in self.leaves})

    def decode_one(self, row: Mapping[str, Any]) -> Any:
        """One stored row (no leading axis) as the user sees it."""
        return self.unflatten({name: leaf.decode_one(row[name]) for name, leaf in self.leaves})

    def validate_stored(self, arrays: Mapping[str, np.ndarray], num_rows: int | None) -> dict[str, np.ndarray]:
        """Check arrays already in storage form (as they arrive off the wire): exactly the leaf
        names, each leaf's dtype, shape, row count and values. Returns them in leaf order.

        Raises:
            SpaceMismatchError: a leaf is missing or unexpected, or an array does not fit its leaf
                (its bounds too, with `check_bounds`).
        """
        missing = [name for name in self.names if name not in arrays]
        if missing or len(arrays) != len(self.names):
            extra = sorted(set(arrays) - set(self.names))
            raise SpaceMismatchError(
                f"arrays do not match the space: missing {missing}, unexpected {extra}; "
                f"the space's leaves are {list(self.names)}; check the actor's spaces"
            )
        checked = {name: leaf.validate_stored(arrays[name], num_rows, key=name) for name, leaf in self.leaves}
        self.check_values(checked)
        return checked
