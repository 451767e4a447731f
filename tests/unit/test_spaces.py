"""Spaces: attributes, contains, sample, equality and JSON, leaf encode/decode and every error."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from h5replay import protocol as P
from h5replay.errors import ConfigError, SpaceMismatchError
from h5replay.integrations.gym import space_from_gymnasium
from h5replay.spaces import (
    BinarySpace,
    BoxSpace,
    DictSpace,
    LeafSpace,
    Schema,
    Space,
    TextSpace,
    space_from_json,
)

INF = float("inf")


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def assert_same_value(a: Any, b: Any) -> None:
    """Deep equality for samples: dicts, arrays (dtype and shape too) and str."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for k in a:
            assert_same_value(a[k], b[k])
    elif isinstance(a, str):
        assert a == b
    else:
        a, b = np.asarray(a), np.asarray(b)
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)


def json_round_trip(space: Space) -> Space:
    return space_from_json(json.loads(json.dumps(space.to_json())))


NESTED = DictSpace(
    {
        "obs": {
            "v": BoxSpace(-1.0, 1.0, (3,)),
            "img": BoxSpace(0, 255, (4, 4, 3), np.uint8),
            "flags": BinarySpace((2,)),
        },
        "reward": BoxSpace(-INF, INF, ()),
        "instruction": TextSpace(8, min_length=1),
    }
)


# ---------------------------------------------------------------- attributes


def test_box_attributes() -> None:
    box = BoxSpace(-1, 1, (2, 3))
    assert box.shape == (2, 3)
    assert box.dtype == np.float32
    assert box.storage_dtype == np.float32
    assert box.low.shape == box.high.shape == (2, 3)
    assert box.low.dtype == box.high.dtype == np.float32
    assert box.row_bytes == 24
    assert isinstance(box, LeafSpace)


def test_box_bounds_are_read_only() -> None:
    box = BoxSpace(0, 1, (2,))
    with pytest.raises(ValueError):
        box.low[0] = -5


def test_box_shape_from_bounds_and_int_shape() -> None:
    assert BoxSpace([0, 0, 0], 1).shape == (3,)
    assert BoxSpace(0, np.ones((2, 2))).shape == (2, 2)
    assert BoxSpace(0, 1).shape == ()
    assert BoxSpace(0, 1, 4).shape == (4,)
    assert BoxSpace(0, 1, np.int64(4)).shape == (4,)


def test_box_integer_dtype_attributes() -> None:
    box = BoxSpace(0, 10, (2,), np.int16)
    assert box.dtype == np.int16 and box.low.dtype == np.int16 and box.row_bytes == 4


def test_binary_attributes() -> None:
    assert BinarySpace().shape == ()
    assert BinarySpace(3).shape == (3,)
    b = BinarySpace((2, 5))
    assert b.shape == (2, 5) and b.dtype == np.bool_ and b.storage_dtype == np.bool_ and b.row_bytes == 10


def test_text_attributes() -> None:
    t = TextSpace(5, min_length=2)
    assert t.shape == () and t.dtype == np.dtype(object)
    assert (t.max_length, t.min_length) == (5, 2)
    # 4 bytes per character: the longest UTF-8 encoding of one code point.
    assert t.storage_dtype == np.dtype("S20") and t.row_bytes == 20


def test_dict_attributes_and_leaves() -> None:
    assert NESTED.shape is None and NESTED.dtype is None
    assert list(NESTED.keys()) == ["instruction", "obs", "reward"]  # sorted
    assert isinstance(NESTED["obs"], DictSpace)  # nested plain dicts become DictSpaces
    assert [p for p, _ in NESTED.leaves()] == ["instruction", "obs/flags", "obs/img", "obs/v", "reward"]
    assert all(isinstance(leaf, LeafSpace) for _, leaf in NESTED.leaves())
    assert list(BoxSpace(0, 1).leaves()) == [("", BoxSpace(0, 1))]
    assert list(BoxSpace(0, 1).leaves("x")) == [("x", BoxSpace(0, 1))]


def test_dict_keys_are_sorted_regardless_of_insertion_order() -> None:
    a = DictSpace({"b": BinarySpace(), "a": BinarySpace()})
    b = DictSpace({"a": BinarySpace(), "b": BinarySpace()})
    assert list(a.keys()) == ["a", "b"] and a == b and a.to_json() == b.to_json()


# ---------------------------------------------------------------- contains


@pytest.mark.parametrize(
    "space",
    [
        BoxSpace(-1, 1, (3,)),
        BoxSpace(0, 255, (2, 2), np.uint8),
        BoxSpace(-INF, INF, ()),
        BinarySpace((4,)),
        TextSpace(6),
        NESTED,
    ],
    ids=repr,
)
def test_contains_own_samples(space: Space) -> None:
    r = rng(1)
    assert all(space.contains(space.sample(r)) for _ in range(20))


@pytest.mark.parametrize(
    "value, expected",
    [
        (np.zeros(3, np.float32), True),
        (np.array([-1, 0, 1], np.float32), True),  # bounds are inclusive
        (np.zeros(3, np.float64), True),  # float64 -> float32 is same_kind
        (np.zeros(3, np.int64), True),  # int -> float is allowed
        ([0.5, 0.5, 0.5], True),  # a list is fine
        (np.zeros(4, np.float32), False),  # wrong shape
        (np.zeros((1, 3), np.float32), False),  # extra axis
        (np.float32(0), False),  # scalar for a (3,) space
        (np.array([0, 0, 1.5], np.float32), False),  # above high
        (np.array([-2, 0, 0], np.float32), False),  # below low
        (np.array([0, np.nan, 0], np.float32), False),
        (np.zeros(3, np.complex64), False),
        (np.array(["a", "b", "c"]), False),
        (np.array([None, None, None], dtype=object), False),
        ([[0.0], [0.0, 0.0]], False),  # ragged
        ("abc", False),
        (None, False),
    ],
)
def test_box_contains(value: Any, expected: bool) -> None:
    assert BoxSpace(-1, 1, (3,)).contains(value) is expected


def test_box_contains_refuses_float64_that_overflows_float32() -> None:
    box = BoxSpace(-INF, INF, (1,))
    assert box.contains(np.array([1e30]))
    assert not box.contains(np.array([1e40]))  # would become inf: encode refuses it, so must contains
    assert box.contains(np.array([np.inf]))  # a genuine inf within [-inf, inf] is fine


def test_box_contains_integer_rules() -> None:
    box = BoxSpace(-5, 5, (2,), np.int8)
    assert box.contains(np.array([1, -5], np.int64))
    assert not box.contains(np.array([1, 6], np.int64))  # above high
    assert not box.contains(np.array([1, 300], np.int64))  # outside int8 altogether
    assert not box.contains(np.array([1.0, 2.0]))  # float -> int changes kind


def test_box_contains_per_element_bounds() -> None:
    box = BoxSpace([0, -INF], [1, 0], None)
    assert box.contains(np.array([0.5, -1e20]))
    assert not box.contains(np.array([0.5, 0.5]))
    assert not box.contains(np.array([1.5, -1.0]))


@pytest.mark.parametrize(
    "value, expected",
    [
        (np.array([True, False]), True),
        (np.array([1, 0]), True),  # ints of 0 / 1 are accepted
        (np.array([1, 0], np.uint8), True),
        ([True, True], True),
        (np.array([1, 2]), False),
        (np.array([-1, 0]), False),
        (np.array([1.0, 0.0]), False),  # floats are not binary
        (np.array([True, False, True]), False),  # wrong shape
        (np.array(True), False),
        ("ab", False),
    ],
)
def test_binary_contains(value: Any, expected: bool) -> None:
    assert BinarySpace(2).contains(value) is expected


def test_binary_scalar_contains() -> None:
    b = BinarySpace()
    assert b.contains(True) and b.contains(np.bool_(False)) and b.contains(1) and b.contains(0)
    assert not b.contains(2) and not b.contains(0.0) and not b.contains([True])


@pytest.mark.parametrize(
    "value, expected",
    [
        ("ab", True),
        ("abcde", True),
        ("ééééé", True),  # 5 characters, 10 bytes: the limit counts characters
        ("🙂🙂🙂🙂🙂", True),  # 5 characters, 20 bytes
        ("a", False),  # shorter than min_length
        ("", False),
        ("abcdef", False),  # longer than max_length
        ("a\x00b", False),  # NUL cannot be stored in a fixed-length field
        (b"ab", False),  # bytes are not text
        (np.array(["ab"]), False),
        (5, False),
        (None, False),
    ],
)
def test_text_contains(value: Any, expected: bool) -> None:
    assert TextSpace(5, min_length=2).contains(value) is expected


def test_dict_contains() -> None:
    space = DictSpace({"a": BoxSpace(0, 1, (2,)), "b": {"c": BinarySpace()}})
    good = {"a": np.array([0.5, 0.5], np.float32), "b": {"c": True}}
    assert space.contains(good)
    assert not space.contains({"a": good["a"]})  # missing key
    assert not space.contains({**good, "z": 1})  # extra key
    assert not space.contains({"a": good["a"], "b": {"c": 2}})  # bad nested leaf
    assert not space.contains({"a": np.array([2.0, 0.0]), "b": {"c": True}})  # out of bounds
    assert not space.contains({"a": good["a"], "b": True})  # a leaf where a dict belongs
    assert not space.contains([good["a"], {"c": True}])  # not a mapping
    assert not space.contains(None)
    assert DictSpace({}).contains({}) and not DictSpace({}).contains({"a": 1})


# ---------------------------------------------------------------- sample


@pytest.mark.parametrize(
    "space",
    [
        BoxSpace(-1, 1, (3,)),
        BoxSpace(-INF, INF, (2,)),
        BoxSpace([0, -INF, -INF, 2], [INF, 0, INF, 2], None, np.float64),  # half-open, open, point
        BoxSpace(-3, 3, (5,), np.int32),
        BoxSpace(-INF, INF, (5,), np.int64),  # whole int64 range
        BoxSpace(0, INF, (5,), np.uint64),
        BoxSpace(0, 1, (2,), np.float16),
        BinarySpace((3, 2)),
        TextSpace(10, min_length=3),
        NESTED,
    ],
    ids=repr,
)
def test_sample_is_deterministic_and_contained(space: Space) -> None:
    a = [space.sample(rng(7)) for _ in range(3)]
    b = [space.sample(rng(7)) for _ in range(3)]
    for x, y in zip(a, b):
        assert_same_value(x, y)
        assert space.contains(x)
    r = rng(3)
    assert all(space.contains(space.sample(r)) for _ in range(25))


def test_sample_without_rng() -> None:
    assert NESTED.contains(NESTED.sample())


def test_box_sample_is_an_ndarray_of_the_space_dtype_and_shape() -> None:
    for space in (BoxSpace(0, 1, ()), BoxSpace(0, 5, (), np.int64), BoxSpace(0, 1, (2, 3), np.float64)):
        s = space.sample(rng())
        assert isinstance(s, np.ndarray) and s.shape == space.shape and s.dtype == space.dtype


def test_binary_and_text_sample_types() -> None:
    b = BinarySpace((3,)).sample(rng())
    assert isinstance(b, np.ndarray) and b.dtype == np.bool_ and b.shape == (3,)
    t = TextSpace(4, min_length=4).sample(rng())
    assert isinstance(t, str) and len(t) == 4


def test_dict_sample_has_the_same_nested_keys() -> None:
    s = NESTED.sample(rng())
    assert set(s) == {"instruction", "obs", "reward"} and set(s["obs"]) == {"flags", "img", "v"}


def test_different_seeds_give_different_samples() -> None:
    box = BoxSpace(0, 1, (16,))
    assert not np.array_equal(box.sample(rng(1)), box.sample(rng(2)))


# ---------------------------------------------------------------- equality and JSON


ROUND_TRIP_SPACES = [
    BoxSpace(-1, 1, (3,)),
    BoxSpace(-INF, INF, (2, 2)),
    BoxSpace(0, INF, ()),
    BoxSpace([0, -INF, 1], [INF, 0, 2], None),  # per-element bounds mixing inf and numbers
    BoxSpace([[0.5, 0.25], [1.0, 2.0]], 3.0, None, np.float64),
    BoxSpace(0.1, 0.3, (2,), np.float16),
    BoxSpace(0, 255, (84, 84, 3), np.uint8),
    BoxSpace(-INF, INF, (2,), np.int64),  # clipped to the whole int64 range
    BoxSpace(0, 2**64 - 1, (), np.uint64),
    BoxSpace(-(2**62) - 1, 2**62 + 1, (), np.int64),  # beyond float64's exact integers
    BoxSpace([1, 2, 3], [4, 5, 6], None, np.int16),
    BoxSpace(0, 1, (0,)),  # empty rows: the bounds have no elements
    BoxSpace(0, 1, (0, 3)),
    BoxSpace([[0, 1, 2]], 5, (0, 3), np.int8),
    BoxSpace(0, 1, (3,), ">f4"),  # explicit byte order survives
    BinarySpace(),
    BinarySpace((2, 3)),
    TextSpace(1),
    TextSpace(16, min_length=4),
    DictSpace({}),
    NESTED,
    DictSpace({"a": {"b": {"c": {"d": TextSpace(3)}}}, "e": BinarySpace()}),
]


@pytest.mark.parametrize("space", ROUND_TRIP_SPACES, ids=repr)
def test_json_round_trip(space: Space) -> None:
    back = json_round_trip(space)
    assert back == space and type(back) is type(space)
    assert back.to_json() == space.to_json()
    assert hash(back) == hash(space)
    if isinstance(space, BoxSpace):
        assert isinstance(back, BoxSpace)
        assert back.dtype == space.dtype and back.shape == space.shape
        np.testing.assert_array_equal(back.low, space.low)
        np.testing.assert_array_equal(back.high, space.high)


def test_json_form_is_strict_json() -> None:
    """inf travels as a string: json.dumps(allow_nan=False) must accept every space."""
    for space in ROUND_TRIP_SPACES:
        json.dumps(space.to_json(), allow_nan=False)


def test_json_examples() -> None:
    assert BoxSpace(-INF, INF, (2,)).to_json() == {
        "type": "box", "shape": [2], "dtype": "float32", "low": "-inf", "high": "inf"
    }
    assert BoxSpace([0, -INF], [1, 2], None).to_json()["low"] == [0.0, "-inf"]
    assert BinarySpace(3).to_json() == {"type": "binary", "shape": [3]}
    assert TextSpace(4, 1).to_json() == {"type": "text", "max_length": 4, "min_length": 1}
    assert DictSpace({"a": BinarySpace()}).to_json() == {
        "type": "dict", "spaces": {"a": {"type": "binary", "shape": []}}
    }


def test_int_box_bounds_are_exact_and_clipped_to_the_dtype() -> None:
    big = BoxSpace(-INF, INF, (), np.int64)
    assert int(big.low) == np.iinfo(np.int64).min and int(big.high) == np.iinfo(np.int64).max
    assert int(BoxSpace(0, INF, (), np.uint64).high) == 2**64 - 1
    assert int(BoxSpace(0, 2**62 + 1, (), np.int64).high) == 2**62 + 1
    small = BoxSpace(-1000, 1000, (), np.int8)
    assert (int(small.low), int(small.high)) == (-128, 127)


def test_text_min_length_defaults_to_zero_in_json() -> None:
    assert space_from_json({"type": "text", "max_length": 3}) == TextSpace(3)


@pytest.mark.parametrize(
    "a, b",
    [
        (BoxSpace(0, 1, (3,)), BoxSpace(0, 2, (3,))),
        (BoxSpace(0, 1, (3,)), BoxSpace(0, 1, (4,))),
        (BoxSpace(0, 1, (3,)), BoxSpace(0, 1, (3,), np.float64)),
        (BoxSpace(0, 1, (3,), np.int32), BoxSpace(0, 1, (3,), np.int64)),
        (BoxSpace([0, 0], 1), BoxSpace([0, -1], 1)),
        (BoxSpace(0, 1, (1,)), BinarySpace((1,))),
        (BinarySpace(2), BinarySpace(3)),
        (TextSpace(4), TextSpace(5)),
        (TextSpace(4), TextSpace(4, 1)),
        (DictSpace({"a": BinarySpace()}), DictSpace({"b": BinarySpace()})),
        (DictSpace({"a": BinarySpace()}), DictSpace({"a": BinarySpace(), "b": BinarySpace()})),
        (DictSpace({"a": {"b": TextSpace(3)}}), DictSpace({"a": {"b": TextSpace(4)}})),
    ],
)
def test_inequality(a: Space, b: Space) -> None:
    assert a != b and b != a


def test_equality_basics() -> None:
    assert BoxSpace(0, 1, (3,)) == BoxSpace([0, 0, 0], [1, 1, 1])
    assert BoxSpace(0, 1, (2,)) == BoxSpace(np.zeros(2), np.ones(2), (2,), "float32")
    assert DictSpace({"a": {"b": BinarySpace()}}) == DictSpace({"a": DictSpace({"b": BinarySpace()})})
    assert BoxSpace(0, 1) != "BoxSpace"
    assert BinarySpace() != 0 and BinarySpace().__eq__(None) is False
    assert len({BinarySpace(2), BinarySpace(2), BinarySpace(3)}) == 2


# ---------------------------------------------------------------- random nested spaces

_FLOAT_DTYPES = ["float16", "float32", "float64"]
_INT_DTYPES = ["int8", "uint8", "int16", "int32", "int64", "uint64"]


@st.composite
def box_spaces(draw: st.DrawFn) -> BoxSpace:
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    dtype = np.dtype(draw(st.sampled_from(_FLOAT_DTYPES + _INT_DTYPES)))
    if dtype.kind == "f":
        number = st.floats(-1e4, 1e4, allow_nan=False)
        low_s = st.one_of(number, st.just(-INF))
        high_s = st.one_of(number, st.just(INF))
    else:
        info = np.iinfo(dtype)
        number = st.integers(int(info.min), int(info.max))
        low_s = st.one_of(number, st.just(-INF))
        high_s = st.one_of(number, st.just(INF))
    pair = st.tuples(low_s, high_s).map(lambda p: tuple(sorted(p)))  # -inf <= x <= inf already
    n = int(np.prod(shape, dtype=np.int64))
    if n and draw(st.booleans()):  # per-element bounds, as nested lists (ints stay exact)
        pairs = draw(st.lists(pair, min_size=n, max_size=n))
        low = np.array([p[0] for p in pairs], dtype=object).reshape(shape).tolist()
        high = np.array([p[1] for p in pairs], dtype=object).reshape(shape).tolist()
    else:
        low, high = draw(pair)
    return BoxSpace(low, high, shape, dtype)


@st.composite
def text_spaces(draw: st.DrawFn) -> TextSpace:
    max_length = draw(st.integers(1, 12))
    return TextSpace(max_length, draw(st.integers(0, max_length)))


leaf_spaces = st.one_of(
    box_spaces(),
    st.lists(st.integers(0, 3), max_size=3).map(lambda s: BinarySpace(tuple(s))),
    text_spaces(),
)
_keys = st.text(alphabet="abcxyz_0", min_size=1, max_size=4)
spaces = st.recursive(
    leaf_spaces,
    lambda children: st.dictionaries(_keys, children, max_size=3).map(DictSpace),
    max_leaves=8,
)


@given(spaces)
def test_random_spaces_round_trip_through_json(space: Space) -> None:
    back = json_round_trip(space)
    assert back == space and back.to_json() == space.to_json()


@given(spaces, st.integers(0, 2**32 - 1))
def test_random_spaces_sample_deterministically_inside_themselves(space: Space, seed: int) -> None:
    a, b = space.sample(rng(seed)), space.sample(rng(seed))
    assert_same_value(a, b)
    assert space.contains(a)


@given(spaces, st.integers(0, 2**32 - 1), st.integers(0, 4))
def test_random_leaves_encode_validate_decode_round_trip(space: Space, seed: int, n: int) -> None:
    r = rng(seed)
    for path, leaf in space.leaves():
        rows = [leaf.sample(r) for _ in range(n)]
        if isinstance(leaf, TextSpace):
            batch: Any = rows
        else:
            batch = np.stack(rows) if rows else np.zeros((0, *leaf.shape), leaf.storage_dtype)
        stored = leaf.encode_batch(batch, n, key=path)
        assert stored.dtype == leaf.storage_dtype and stored.shape == (n, *leaf.shape)
        assert stored.flags.c_contiguous
        assert leaf.validate_stored(stored, n, key=path) is stored
        decoded = leaf.decode_batch(stored)
        assert decoded.shape == (n, *leaf.shape)
        for i, row in enumerate(rows):
            assert_same_value(decoded[i], row)
            assert_same_value(leaf.decode_one(stored[i]), row)


# ---------------------------------------------------------------- Box encode / decode


def test_box_encode_batch_returns_contiguous_storage_dtype() -> None:
    box = BoxSpace(0, 1, (3,))
    src = np.zeros((3, 4), np.float32)[:, :3]  # a non-contiguous view
    assert not src.flags.c_contiguous
    out = box.encode_batch(src, 3, key="obs/v")
    assert out.flags.c_contiguous and out.dtype == np.float32 and out.shape == (3, 3)
    assert box.encode_batch([[0, 0, 0]], 1).dtype == np.float32  # lists are converted
    assert box.decode_batch(out) is out


def test_box_encode_one_adds_and_decode_one_keeps_the_row() -> None:
    box = BoxSpace(0, 1, (2,))
    one = box.encode_one(np.array([0.5, 1.0]), key="obs/v")
    assert one.shape == (1, 2) and one.dtype == np.float32
    row = one[0]
    assert box.decode_one(row) is row
    scalar = BoxSpace(0, 1, ())
    assert scalar.encode_one(0.5).shape == (1,)


@pytest.mark.parametrize(
    "src_dtype, dst_dtype, values",
    [
        (np.int32, np.float32, [1, 2]),  # int -> float
        (np.int64, np.float64, [2**40, -3]),
        (np.uint8, np.float16, [0, 255]),
        (np.bool_, np.float32, [True, False]),
        (np.float64, np.float32, [1e30, -1e-30]),  # narrowing float, no overflow
        (np.float64, np.float16, [65504.0, -1.0]),  # float16's max fits
        (np.float64, np.float32, [np.inf, -np.inf]),  # inf stays inf (not an overflow)
        (np.float64, np.float32, [np.nan, 0.0]),  # NaN is not refused by encode
        (np.int64, np.int8, [-128, 127]),  # narrowing int, values fit
        (np.uint8, np.int8, [0, 127]),
        (np.uint16, np.int64, [0, 65535]),
        (np.float32, np.float64, [0.5, 0.25]),
    ],
)
def test_box_same_kind_casts_accepted(src_dtype: Any, dst_dtype: Any, values: list[Any]) -> None:
    box = BoxSpace(-INF, INF, (2,), dst_dtype)
    src = np.array([values], dtype=src_dtype)
    out = box.encode_batch(src, 1, key="obs/v")
    assert out.dtype == dst_dtype
    np.testing.assert_array_equal(out, src.astype(dst_dtype))


@pytest.mark.parametrize(
    "src, dst_dtype, match",
    [
        (np.array([[1e40, 0.0]]), np.float32, r"field 'obs/v' has values that overflow float32"),
        (np.array([[-1e40, 0.0]]), np.float32, r"obs/v.*overflow"),
        (np.array([[70000.0, 0.0]]), np.float16, r"obs/v.*overflow float16"),
        (np.array([[100000, 0]], np.int64), np.float16, r"obs/v.*overflow float16"),
        (np.array([[1.0, 2.0]]), np.int32, r"field 'obs/v' has dtype float64, which cannot be cast to the space's int32"),
        (np.array([[1.0, 2.0]], np.float32), np.int64, r"obs/v.*cannot be cast"),
        (np.array([[1, 2]], np.int64), np.uint8, r"obs/v.*cannot be cast"),  # signed -> unsigned
        (np.array([[128, 0]], np.int64), np.int8, r"field 'obs/v' has values outside the range of int8"),
        (np.array([[-129, 0]], np.int64), np.int8, r"obs/v.*outside the range of int8"),
        (np.array([[256, 0]], np.uint16), np.uint8, r"obs/v.*outside the range of uint8"),
        (np.array([[1 + 1j, 0]]), np.float32, r"field 'obs/v' has dtype complex128 but the space expects float32"),
        (np.array([["a", "b"]]), np.float32, r"obs/v.*has dtype <U1"),
        (np.array([[None, None]], dtype=object), np.float32, r"obs/v.*dtype object"),
    ],
)
def test_box_casts_refused(src: np.ndarray, dst_dtype: Any, match: str) -> None:
    box = BoxSpace(-INF, INF, (2,), dst_dtype)
    with pytest.raises(SpaceMismatchError, match=match):
        box.encode_batch(src, 1, key="obs/v")


def test_box_encode_shape_errors_name_key_and_expectation() -> None:
    box = BoxSpace(0, 1, (2,))
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/v' has shape \(3,\) per row .* expects \(2,\)"):
        box.encode_batch(np.zeros((4, 3)), 4, key="obs/v")
    with pytest.raises(SpaceMismatchError, match=r"obs/v.*expects \(2,\)"):
        box.encode_batch(np.zeros(2), key="obs/v")  # a row where a batch belongs
    with pytest.raises(SpaceMismatchError, match=r"obs/v.*expects \(2,\)"):
        box.encode_batch(np.float32(0), key="obs/v")  # 0-d
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/v' has 4 rows but the other fields have 3"):
        box.encode_batch(np.zeros((4, 2)), 3, key="obs/v")
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/v' is not an array of numbers"):
        box.encode_batch([[0.0, 1.0], [0.0]], key="obs/v")
    with pytest.raises(SpaceMismatchError, match=r"expects \(2,\)"):
        box.encode_one(np.zeros(3), key="obs/v")


def test_error_without_key_says_the_value() -> None:
    with pytest.raises(SpaceMismatchError, match=r"^the value has shape"):
        BoxSpace(0, 1, (2,)).encode_batch(np.zeros((1, 3)))


def test_space_mismatch_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        BinarySpace().encode_one(5)


def test_box_encode_does_not_check_bounds() -> None:
    """Bounds belong to contains(); encode only checks shape and dtype (documented choice)."""
    out = BoxSpace(0, 1, (1,)).encode_batch(np.array([[5.0]]))
    assert out[0, 0] == 5.0


def test_box_validate_stored() -> None:
    box = BoxSpace(0, 1, (2,))
    arr = np.zeros((3, 2), np.float32)
    assert box.validate_stored(arr, 3, key="obs/v") is arr
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/v' arrived as float64 but the space stores float32"):
        box.validate_stored(np.zeros((3, 2)), 3, key="obs/v")
    with pytest.raises(SpaceMismatchError, match=r"obs/v.*expects \(2,\)"):
        box.validate_stored(np.zeros((3, 3), np.float32), 3, key="obs/v")
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/v' has 3 rows but the other fields have 2"):
        box.validate_stored(arr, 2, key="obs/v")


# ---------------------------------------------------------------- Binary encode / decode


def test_binary_encode() -> None:
    b = BinarySpace((2,))
    out = b.encode_batch(np.array([[1, 0], [0, 1]], np.int64), 2, key="obs/f")
    assert out.dtype == np.bool_ and out.tolist() == [[True, False], [False, True]]
    assert b.encode_batch([[True, True]]).dtype == np.bool_
    assert b.encode_one([1, 0]).tolist() == [[True, False]]
    assert BinarySpace().encode_one(True).shape == (1,)


@pytest.mark.parametrize(
    "value, match",
    [
        (np.array([[1, 2]]), r"field 'obs/f' is binary but holds values other than 0 and 1"),
        (np.array([[-1, 0]]), r"obs/f.*other than 0 and 1"),
        (np.array([[1.0, 0.0]]), r"field 'obs/f' has dtype float64 but the space expects bool"),
        (np.array([["1", "0"]]), r"obs/f.*expects bool"),
        (np.array([[True, False, True]]), r"field 'obs/f' has shape \(3,\) per row"),
        ([[True], [True, False]], r"field 'obs/f' is not a boolean array"),
    ],
)
def test_binary_encode_errors(value: Any, match: str) -> None:
    with pytest.raises(SpaceMismatchError, match=match):
        BinarySpace(2).encode_batch(value, key="obs/f")


def test_binary_validate_stored() -> None:
    b = BinarySpace((2,))
    ok = np.array([[True, False]])
    assert b.validate_stored(ok, 1, key="obs/f") is ok
    raw = np.array([[1, 2]], np.uint8).view(np.bool_)  # a byte the bool dtype admits but isn't 0/1
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/f' holds bytes other than 0 and 1"):
        b.validate_stored(raw, 1, key="obs/f")
    with pytest.raises(SpaceMismatchError, match=r"obs/f.*arrived as uint8 but the space stores bool"):
        b.validate_stored(np.array([[1, 0]], np.uint8), 1, key="obs/f")


# ---------------------------------------------------------------- Text encode / decode


def test_text_counts_characters_not_bytes() -> None:
    t = TextSpace(5)
    stored = t.encode_one("ééééé", key="obs/t")
    assert stored.dtype == np.dtype("S20") and stored.shape == (1,)
    assert stored[0] == "ééééé".encode()  # 10 bytes in a 20-byte field
    assert t.decode_one(stored[0]) == "ééééé"


@pytest.mark.parametrize(
    "text", ["", "a", "héllo", "中文字符串", "🙂🙃🙂🙃🙂", "a🙂é中", "👩‍👩‍👧"[:5], "\u00a0\t\n"]
)
def test_text_round_trips_multibyte(text: str) -> None:
    t = TextSpace(5)
    stored = t.encode_batch([text, "x"], 2, key="obs/t")
    assert t.validate_stored(stored, 2, key="obs/t") is stored
    decoded = t.decode_batch(stored)
    assert decoded.dtype == np.dtype(object) and decoded.shape == (2,)
    assert decoded.tolist() == [text, "x"] and all(type(s) is str for s in decoded)
    assert t.decode_one(stored[0]) == text and type(t.decode_one(stored[0])) is str


@pytest.mark.parametrize(
    "batch",
    [
        ["ab", "cd"],
        ("ab", "cd"),
        np.array(["ab", "cd"]),  # numpy unicode array
        np.array(["ab", "cd"], dtype=object),
    ],
    ids=["list", "tuple", "unicode-array", "object-array"],
)
def test_text_batch_containers(batch: Any) -> None:
    t = TextSpace(3)
    out = t.encode_batch(batch, 2, key="obs/t")
    assert out.tolist() == [b"ab", b"cd"]
    assert t.decode_batch(out).tolist() == ["ab", "cd"]


def test_text_decode_batch_keeps_the_batch_shape() -> None:
    t = TextSpace(3)
    stored = np.array([[b"a", b"b"], [b"c", "é".encode()]], dtype=t.storage_dtype)
    out = t.decode_batch(stored)
    assert out.shape == (2, 2) and out.dtype == np.dtype(object) and out[1, 1] == "é"


@pytest.mark.parametrize(
    "value, match",
    [
        ("abc", r"field 'obs/t' is a single string; a batch needs a sequence of strings"),
        (b"abc", r"obs/t.*single string"),
        (["ab", b"cd"], r"field 'obs/t'\[1\] is bytes, expected str"),
        (["ab", 5], r"field 'obs/t'\[1\] is int, expected str"),
        (["ab", None], r"obs/t'\[1\] is NoneType, expected str"),
        (["abcdef"], r"field 'obs/t'\[0\] has 6 characters but the space allows 1 to 5"),
        (["ab", ""], r"field 'obs/t'\[1\] has 0 characters but the space allows 1 to 5"),
        (["a\x00b"], r"field 'obs/t'\[0\] contains a NUL character"),
        (["abc\x00"], r"obs/t'\[0\] contains a NUL"),  # a trailing NUL would be silently lost
        ([["a", "b"]], r"field 'obs/t'\[0\] is list, expected str"),
        (np.array([["a", "b"]]), r"field 'obs/t' has batch shape \(1, 2\); text rows are scalars"),
        (np.array([["a"], ["b"]]), r"obs/t.*batch shape \(2, 1\)"),
        (5, r"obs/t.*batch shape \(\)"),
    ],
)
def test_text_encode_errors(value: Any, match: str) -> None:
    with pytest.raises(SpaceMismatchError, match=match):
        TextSpace(5, min_length=1).encode_batch(value, key="obs/t")


def test_text_encode_row_count_and_encode_one_errors() -> None:
    t = TextSpace(5)
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/t' has 2 rows but the other fields have 3"):
        t.encode_batch(["a", "b"], 3, key="obs/t")
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/t'\[0\] has 6 characters"):
        t.encode_one("abcdef", key="obs/t")
    with pytest.raises(SpaceMismatchError, match=r"obs/t'\[0\] is bytes"):
        t.encode_one(b"abc", key="obs/t")
    assert t.encode_batch([], 0).shape == (0,)


def test_text_validate_stored() -> None:
    t = TextSpace(5)
    good = t.encode_batch(["ab", "🙂🙂🙂🙂🙂"])
    assert t.validate_stored(good, 2, key="obs/t") is good
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/t' arrived as \|S5 but the space stores \|S20"):
        t.validate_stored(np.array([b"ab"], dtype="S5"), 1, key="obs/t")
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/t'\[1\] is not valid UTF-8"):
        t.validate_stored(np.array([b"ok", b"\xff\xfe"], dtype="S20"), 2, key="obs/t")
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/t'\[0\] has 6 characters"):
        t.validate_stored(np.array([b"abcdef"], dtype="S20"), 1, key="obs/t")
    with pytest.raises(SpaceMismatchError, match=r"field 'obs/t'\[0\] contains a NUL"):
        t.validate_stored(np.array([b"a\x00b"], dtype="S20"), 1, key="obs/t")
    with pytest.raises(SpaceMismatchError, match=r"obs/t.*1 rows but the other fields have 2"):
        t.validate_stored(np.array([b"a"], dtype="S20"), 2, key="obs/t")
    with pytest.raises(SpaceMismatchError, match=r"obs/t.*expects \(\)"):
        t.validate_stored(np.array([[b"a"]], dtype="S20"), 1, key="obs/t")
    mn = TextSpace(5, min_length=2)
    with pytest.raises(SpaceMismatchError, match=r"obs/t'\[0\] has 1 characters but the space allows 2 to 5"):
        mn.validate_stored(np.array([b"a"], dtype="S20"), 1, key="obs/t")


# ---------------------------------------------------------------- constructor errors


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: BoxSpace(0, 1, (2,), bool), r"real float or integer type, got bool"),
        (lambda: BoxSpace(0, 1, (2,), np.complex64), r"real float or integer type, got complex64"),
        (lambda: BoxSpace(0, 1, (2,), object), r"real float or integer type, got object"),
        (lambda: BoxSpace(0, 1, (2,), "U4"), r"real float or integer type"),
        (lambda: BoxSpace(0, 1, (2,), "not-a-dtype"), r"is not a numpy dtype"),
        (lambda: BoxSpace(0, 1, (2,), 3.5), r"is not a numpy dtype"),
        (lambda: BoxSpace(1, 0), r"low must be <= high everywhere"),
        (lambda: BoxSpace([0, 2], [1, 1]), r"low must be <= high everywhere"),
        (lambda: BoxSpace(np.nan, 1), r"must not be NaN"),
        (lambda: BoxSpace(0, [1, np.nan]), r"must not be NaN"),
        (lambda: BoxSpace(np.zeros(2), np.ones(3)), r"do not broadcast"),
        (lambda: BoxSpace(np.zeros(2), 1, (3,)), r"do not broadcast to shape \(3,\)"),
        (lambda: BoxSpace("abc", 1), r"low must be numbers"),
        (lambda: BoxSpace(0, {"a": 1}), r"high must be numbers"),
        (lambda: BoxSpace(0, 1, (-1,)), r"must not have negative dimensions"),
        (lambda: BoxSpace(0, 1, "ab"), r"shape must be a tuple of ints"),
        (lambda: BoxSpace(0, 1, object()), r"shape must be a tuple of ints"),
        (lambda: BinarySpace(-2), r"BinarySpace shape must not have negative dimensions"),
        (lambda: BinarySpace((2, None)), r"BinarySpace shape must be a tuple of ints"),
        (lambda: BinarySpace("x"), r"BinarySpace shape must be a tuple of ints"),
        (lambda: TextSpace(0), r"max_length must be an int >= 1, got 0"),
        (lambda: TextSpace(-3), r"max_length must be an int >= 1"),
        (lambda: TextSpace(2.5), r"max_length must be an int >= 1"),  # type: ignore[arg-type]
        (lambda: TextSpace(True), r"max_length must be an int >= 1"),
        (lambda: TextSpace("8"), r"max_length must be an int >= 1"),  # type: ignore[arg-type]
        (lambda: TextSpace(3, min_length=4), r"min_length must be an int in \[0, 3\], got 4"),
        (lambda: TextSpace(3, min_length=-1), r"min_length must be an int in \[0, 3\]"),
        (lambda: TextSpace(3, min_length=1.0), r"min_length must be an int"),  # type: ignore[arg-type]
        (lambda: DictSpace({"a/b": BinarySpace()}), r"DictSpace key 'a/b' must be a non-empty string without '/'"),
        (lambda: DictSpace({"": BinarySpace()}), r"DictSpace key '' must be a non-empty string"),
        (lambda: DictSpace({"..": BinarySpace()}), r"DictSpace key '\.\.'"),
        (lambda: DictSpace({1: BinarySpace()}), r"DictSpace key 1 must be a non-empty string"),  # type: ignore[dict-item]
        (lambda: DictSpace({1: BinarySpace(), "a": BinarySpace()}), r"DictSpace key 1"),  # type: ignore[dict-item]
        (lambda: DictSpace({("a",): BinarySpace()}), r"DictSpace key \('a',\)"),  # type: ignore[dict-item]
        (lambda: DictSpace({"a": 5}), r"DictSpace value for 'a' must be a space, got int"),
        (lambda: DictSpace({"a": None}), r"value for 'a' must be a space, got NoneType"),
        (lambda: DictSpace({"a": {"b": "box"}}), r"value for 'b' must be a space, got str"),
        (lambda: DictSpace({"a": {"b/c": BinarySpace()}}), r"key 'b/c'"),
        (lambda: DictSpace([("a", BinarySpace())]), r"takes a mapping of names to spaces, got list"),  # type: ignore[arg-type]
    ],
)
def test_constructor_errors(make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        make()


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        TextSpace(0)


def test_numpy_integer_lengths_are_accepted() -> None:
    assert TextSpace(np.int64(4), np.int32(1)) == TextSpace(4, 1)


def test_float_bounds_beyond_the_dtype_become_infinite() -> None:
    box = BoxSpace(-1e40, 1e40, (), np.float32)
    assert box.low == -INF and box.high == INF


# ---------------------------------------------------------------- space_from_json errors


@pytest.mark.parametrize(
    "obj, match",
    [
        (None, r"must be a mapping with a 'type'"),
        ("box", r"must be a mapping with a 'type'"),
        ([{"type": "box"}], r"must be a mapping"),
        ({}, r"must be a mapping with a 'type'"),
        ({"kind": "box"}, r"must be a mapping with a 'type'"),
        ({"type": "tuple"}, r"unknown space type 'tuple'; expected box, binary, text or dict"),
        ({"type": 3}, r"unknown space type 3"),
        ({"type": "box"}, r"invalid 'box' space description"),
        ({"type": "box", "shape": [2], "dtype": "float32", "low": 0}, r"invalid 'box' space description.*high"),
        ({"type": "box", "shape": 2, "dtype": "float32", "low": 0, "high": 1}, r"invalid 'box'"),
        ({"type": "box", "shape": [2], "dtype": "bool", "low": 0, "high": 1}, r"real float or integer"),
        ({"type": "box", "shape": [2], "dtype": "nope", "low": 0, "high": 1}, r"not a numpy dtype"),
        ({"type": "box", "shape": [2], "dtype": "float32", "low": "abc", "high": 1}, r"invalid 'box'|must be numbers"),
        ({"type": "box", "shape": [2], "dtype": "float32", "low": {"x": 1}, "high": 1}, r"must be numbers|invalid"),
        ({"type": "box", "shape": [2], "dtype": "float32", "low": [0, 0, 0], "high": 1}, r"do not broadcast"),
        ({"type": "box", "shape": [2], "dtype": "float32", "low": 2, "high": 1}, r"low must be <= high"),
        ({"type": "box", "shape": [2], "dtype": "float32", "low": "nan", "high": 1}, r"NaN"),
        ({"type": "box", "shape": ["a"], "dtype": "float32", "low": 0, "high": 1}, r"shape must be a tuple of ints"),
        ({"type": "binary"}, r"invalid 'binary' space description"),
        ({"type": "binary", "shape": None}, r"invalid 'binary'"),
        ({"type": "binary", "shape": [-1]}, r"negative dimensions"),
        ({"type": "text"}, r"invalid 'text' space description"),
        ({"type": "text", "max_length": "5"}, r"max_length must be an int"),
        ({"type": "text", "max_length": 0}, r"max_length must be an int >= 1"),
        ({"type": "text", "max_length": 2, "min_length": 3}, r"min_length"),
        ({"type": "dict"}, r"invalid 'dict' space description"),
        ({"type": "dict", "spaces": [1, 2]}, r"'spaces' must be a mapping"),
        ({"type": "dict", "spaces": {"a": 5}}, r"must be a mapping with a 'type'"),
        ({"type": "dict", "spaces": {"a": {"type": "dict", "spaces": {"b": {"type": "?"}}}}}, r"unknown space type '\?'"),
        ({"type": "dict", "spaces": {"a/b": {"type": "binary", "shape": []}}}, r"key 'a/b'"),
    ],
)
def test_space_from_json_errors(obj: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        space_from_json(obj)


# ---------------------------------------------------------------- gymnasium conversion
# Stand-ins with the attributes gymnasium's spaces have: the converter reads attributes only.


class Box:
    def __init__(self, low: Any, high: Any, shape: Any = None, dtype: Any = np.float32) -> None:
        self.dtype = np.dtype(dtype)
        self.shape = tuple(shape) if shape is not None else np.broadcast_shapes(np.shape(low), np.shape(high))
        self.low = np.broadcast_to(np.asarray(low), self.shape).astype(self.dtype)
        self.high = np.broadcast_to(np.asarray(high), self.shape).astype(self.dtype)


class MultiBinary:
    def __init__(self, n: Any) -> None:
        self.n = n
        self.shape = tuple(int(x) for x in np.atleast_1d(n))
        self.dtype = np.dtype(np.int8)


class Text:
    def __init__(self, max_length: int, *, min_length: int = 1) -> None:
        self.max_length, self.min_length = max_length, min_length


class Discrete:
    def __init__(self, n: int, start: int = 0) -> None:
        self.n, self.start = np.int64(n), np.int64(start)
        self.shape, self.dtype = (), np.dtype(np.int64)


class Dict:
    def __init__(self, spaces: dict[Any, Any]) -> None:
        self.spaces = dict(spaces)


class Tuple:
    def __init__(self, spaces: tuple[Any, ...]) -> None:
        self.spaces = spaces


def test_from_gymnasium_box() -> None:
    space = space_from_gymnasium(Box(-1.0, [1.0, 2.0], dtype=np.float64))
    assert space == BoxSpace(-1, [1, 2], (2,), np.float64)
    inf = space_from_gymnasium(Box(-np.inf, np.inf, (3,)))
    assert inf == BoxSpace(-INF, INF, (3,))


def test_from_gymnasium_int_box_with_full_range() -> None:
    """gymnasium's default int64 bounds are iinfo(int64).min / max: they must survive exactly."""
    info = np.iinfo(np.int64)
    space = space_from_gymnasium(Box(info.min, info.max, (2,), np.int64))
    assert isinstance(space, BoxSpace)
    assert space.low.tolist() == [info.min] * 2 and space.high.tolist() == [info.max] * 2
    assert space.contains(np.array([info.min, info.max]))


def test_from_gymnasium_multibinary() -> None:
    assert space_from_gymnasium(MultiBinary(4)) == BinarySpace((4,))
    assert space_from_gymnasium(MultiBinary([2, 3])) == BinarySpace((2, 3))
    assert space_from_gymnasium(MultiBinary(np.array([2, 3]))) == BinarySpace((2, 3))
    assert space_from_gymnasium(MultiBinary(np.int64(5))) == BinarySpace((5,))


def test_from_gymnasium_text_and_discrete() -> None:
    assert space_from_gymnasium(Text(10, min_length=2)) == TextSpace(10, 2)
    d = space_from_gymnasium(Discrete(5, start=-2))
    assert d == BoxSpace(-2, 2, (), np.int64)
    assert d.contains(np.int64(-2)) and d.contains(np.int64(2)) and not d.contains(np.int64(3))


def test_from_gymnasium_nested_dict() -> None:
    gym = Dict({"obs": Dict({"pos": Box(-1, 1, (3,)), "touch": MultiBinary(2)}), "goal": Text(8), 7: Discrete(3)})
    space = space_from_gymnasium(gym)
    assert space == DictSpace(
        {
            "obs": {"pos": BoxSpace(-1, 1, (3,)), "touch": BinarySpace(2)},
            "goal": TextSpace(8, 1),
            "7": BoxSpace(0, 2, (), np.int64),  # keys become str
        }
    )


def test_from_gymnasium_unsupported() -> None:
    with pytest.raises(ConfigError, match=r"cannot convert the empty gymnasium Tuple at the space\['a'\]"):
        space_from_gymnasium(Dict({"a": Tuple(())}))
    with pytest.raises(ConfigError, match=r"real float or integer"):
        space_from_gymnasium(Box(0, 1, (2,), bool))


def test_from_real_gymnasium() -> None:
    gym = pytest.importorskip("gymnasium")
    g = gym.spaces
    gspace = g.Dict(
        {
            "pos": g.Box(-1.0, 1.0, (3,), np.float32),
            "count": g.Box(0, 10, (2,), np.int64),
            "wide": g.Box(low=np.iinfo(np.int64).min, high=np.iinfo(np.int64).max, shape=(2,), dtype=np.int64),
            "touch": g.MultiBinary(4),
            "grid": g.MultiBinary([2, 2]),
            "goal": g.Text(8, min_length=1),
            "action": g.Discrete(5, start=1),
            "inner": g.Dict({"x": g.Box(-np.inf, np.inf, (2,))}),
        }
    )
    space = space_from_gymnasium(gspace)
    assert isinstance(space, DictSpace)
    assert space["pos"] == BoxSpace(-1, 1, (3,))
    assert space["touch"] == BinarySpace(4) and space["grid"] == BinarySpace((2, 2))
    assert space["goal"] == TextSpace(8, 1)
    assert space["action"] == BoxSpace(1, 5, (), np.int64)
    assert json_round_trip(space) == space
    gspace.seed(0)
    for _ in range(20):
        assert space.contains(gspace.sample())


# ------------------------------------------------------------------ Schema.validate_stored (wire rows)

WIRE_SPACE = DictSpace({
    "obs": {"vec": BoxSpace(-1, 1, (3,), np.float32)},
    "done": BinarySpace(),
    "note": TextSpace(max_length=4),
})


def good_rows(n: int = 2) -> dict[str, np.ndarray]:
    return {
        "obs/vec": np.zeros((n, 3), np.float32),
        "done": np.zeros(n, bool),
        "note": np.array([b"abcd"] * n, dtype="S16"),
    }


def test_validate_stored_accepts_and_orders_like_the_space() -> None:
    rows = good_rows()
    out = Schema(WIRE_SPACE).validate_stored(dict(reversed(list(rows.items()))), 2)
    assert list(out) == list(Schema(WIRE_SPACE).names) == ["done", "note", "obs/vec"]


def test_validate_stored_single_leaf_is_data() -> None:
    space = BoxSpace(0, 1, (2,), np.float32)
    assert list(Schema(space).names) == ["data"]
    assert list(Schema(space).validate_stored({"data": np.zeros((1, 2), np.float32)}, 1)) == ["data"]
    with pytest.raises(SpaceMismatchError, match=r"missing \['data'\]"):
        Schema(space).validate_stored({"": np.zeros((1, 2), np.float32)}, 1)


def test_validate_stored_missing_and_extra_keys() -> None:
    rows = good_rows()
    del rows["done"]
    rows["obs/extra"] = np.zeros(2)
    with pytest.raises(SpaceMismatchError, match=r"missing \['done'\], unexpected \['obs/extra'\]"):
        Schema(WIRE_SPACE).validate_stored(rows, 2)


@pytest.mark.parametrize(
    ("path", "value", "words"),
    [
        ("obs/vec", np.zeros((2, 3), np.float64), "arrived as float64 but the space stores float32"),
        ("obs/vec", np.zeros((2, 4), np.float32), "expects (3,)"),
        ("obs/vec", np.zeros((3, 3), np.float32), "has 3 rows"),
        ("note", np.array([b"abcde", b"a"], dtype="S16"), "has 5 characters"),
        ("note", np.array([b"\xff\xfe", b"a"], dtype="S16"), "not valid UTF-8"),
        ("done", np.array([1, 2], np.uint8).view(bool), "bytes other than 0 and 1"),
    ],
)
def test_validate_stored_refusals(path: str, value: np.ndarray, words: str) -> None:
    rows = {**good_rows(), path: value}
    with pytest.raises(SpaceMismatchError) as info:
        Schema(WIRE_SPACE).validate_stored(rows, 2)
    assert words in str(info.value) and path in str(info.value)


def test_validate_stored_after_the_wire() -> None:
    """What an actor encodes with the space's own encode_batch passes the server's check."""
    arrays = {path: leaf.encode_batch([leaf.sample() for _ in range(3)], 3, path) for path, leaf in Schema(WIRE_SPACE).leaves}
    out = P.decode(P.encode(P.Append(1, 0, 3, arrays)), expect=P.Request)
    assert isinstance(out, P.Append)
    Schema(WIRE_SPACE).validate_stored(out.arrays, out.num_rows)


# ------------------------------------------------------------------------------------ bounds


def _bounded_schema() -> Schema:
    return Schema(DictSpace({
        "obs": BoxSpace(np.array([-1.0, -2.0, 0.0]), np.array([1.0, 2.0, np.inf]), dtype=np.float32),
        "free": BoxSpace(-np.inf, np.inf, (2,), np.float64),
        "action": BoxSpace(0, 3, (), np.int64),
        "pixels": BoxSpace(0, 255, (2, 2), np.uint8),  # the dtype's whole range: nothing to check
    }), check_bounds=True)


def _rows(n: int = 4) -> dict[str, np.ndarray]:
    return {"obs": np.zeros((n, 3), np.float32), "free": np.full((n, 2), np.inf), "action": np.arange(n) % 4,
            "pixels": np.full((n, 2, 2), 255, np.uint8)}


@pytest.mark.parametrize(("leaf", "row", "index", "value", "expected"), [
    ("obs", 2, (1,), 2.5, r"field 'obs', row 2 index \(1,\) is 2\.5, outside the space's bounds \[-2\.0, 2\.0\]"),
    ("obs", 0, (0,), -1.5, r"field 'obs', row 0 index \(0,\) is -1\.5, outside the space's bounds \[-1\.0, 1\.0\]"),
    ("obs", 3, (2,), -0.1, r"row 3 index \(2,\) is -0\.1\d*, outside the space's bounds \[0\.0, inf\]"),
    ("obs", 1, (2,), np.nan, r"field 'obs', row 1 index \(2,\) is NaN"),
    ("free", 3, (1,), np.nan, r"field 'free', row 3 index \(1,\) is NaN"),  # NaN even with infinite bounds
    ("action", 1, (), 4, r"field 'action', row 1 is 4, outside the space's bounds \[0, 3\]"),
])
def test_values_outside_a_box_or_nan_are_refused_naming_field_row_index_and_bound(
        leaf: str, row: int, index: tuple[int, ...], value: float, expected: str) -> None:
    schema = _bounded_schema()
    rows = _rows()
    rows[leaf][(row, *index)] = value
    with pytest.raises(SpaceMismatchError, match=expected):
        schema.encode_batch(rows)
    with pytest.raises(SpaceMismatchError, match=expected):
        schema.validate_stored(rows, 4)
    with pytest.raises(SpaceMismatchError, match=expected):
        schema.encode_one({k: v[row] for k, v in rows.items()}) if row == 0 else schema.encode_batch(rows)
    assert Schema(schema.space).encode_batch(rows)[1] == 4  # a schema that does not check bounds stores it


def test_values_on_the_bounds_and_infinities_within_infinite_bounds_are_accepted() -> None:
    schema = _bounded_schema()
    rows = _rows()
    rows["obs"][:] = [[-1.0, 2.0, np.inf]]
    rows["free"][:] = -np.inf
    rows["action"][:] = 3
    schema.validate_stored(rows, 4)
    schema.encode_one({k: v[0] for k, v in rows.items()})
    assert schema.encode_batch({k: v[:0] for k, v in rows.items()})[1] == 0  # an empty batch has no bad value


def test_only_bounded_leaves_and_floats_are_checked() -> None:
    space = DictSpace({"a": BoxSpace(0, 255, (3,), np.uint8), "b": BoxSpace(-np.inf, np.inf, (), np.int32),
                       "c": BoxSpace(-np.inf, np.inf, (), np.float32), "d": BoxSpace(0, 1, (), np.int8)})
    assert [name for name, _ in Schema(space, check_bounds=True)._bounded] == ["c", "d"]
    assert Schema(space)._bounded == ()


def test_a_storage_checks_bounds_unless_told_not_to(tmp_path: Any) -> None:
    from h5replay.storage import ReplayBuffer

    space = BoxSpace(-1.0, 1.0, (2,), np.float32)
    with ReplayBuffer.create(space, 10, tmp_path / "a.h5") as buffer:
        with pytest.raises(SpaceMismatchError, match=r"field 'data', row 1 index \(0,\) is 3\.0, outside the space's bounds \[-1\.0, 1\.0\]"):
            buffer.extend(np.array([[0, 0], [3, 0]], np.float32))
        with pytest.raises(SpaceMismatchError, match="is NaN"):
            buffer.append(np.array([np.nan, 0], np.float32))
        writer = buffer.open_segment_writer()
        with pytest.raises(SpaceMismatchError):
            writer.extend(np.full((2, 2), 5, np.float32))
        writer.abort()
        assert len(buffer) == 0  # nothing of a refused batch was written
        buffer.storage.check_bounds = False
        buffer.append(np.array([np.nan, 7], np.float32))
        assert len(buffer) == 1
    with ReplayBuffer.load_from(tmp_path / "a.h5", read_only=False, check_bounds=False) as buffer:
        buffer.append(np.array([9, 9], np.float32))
        assert len(buffer) == 2
