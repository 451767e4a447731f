"""The leaf spaces: Box (bounded numbers), Binary (booleans), Text (UTF-8 of bounded length).

Each one checks and encodes batches for storage, decodes them back, samples, and describes itself
as JSON. Pure (numpy only).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from h5replay.errors import ConfigError, SpaceMismatchError
from h5replay.spaces.base import LeafSpace, _check_row_bytes, _shape_tuple, _where

__all__ = ["BoxSpace", "BinarySpace", "TextSpace"]

_UTF8_MAX_BYTES_PER_CHAR = 4
_SAMPLE_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 éüß中文🙂"


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
