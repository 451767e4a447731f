"""Compressed leaves (compression="zstd" / "lz4"): rows stored as records in fixed slots with a
spill area (h5replay/storage/packed.py), held to a plain numpy model of the rows; the bad inputs,
a damaged record, the wire form of stored records."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
import zstandard
from compressed_helpers import IMAGE, SPACE, episode, image, mismatches
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from h5replay import codecs
from h5replay import protocol as P
from h5replay.codecs import DamagedRecordError, PackedRows
from h5replay.errors import ConfigError, ProtocolError
from h5replay.spaces import BoxSpace, DictSpace, TextSpace
from h5replay.storage import HDF5Storage, ReplayBuffer
from h5replay.storage.hdf5 import PACKED

pytestmark = pytest.mark.timeout(60)
ROW_BYTES = int(np.prod(IMAGE))


def rows(ids: list[int]) -> dict[str, Any]:
    """Rows that carry their own identity: step = id, image(id // 1000, id % 1000)."""
    return {
        "episode": np.array([i // 1000 for i in ids], np.int32),
        "step": np.array([i % 1000 for i in ids], np.int32),
        "obs": {"image": np.stack([image(i // 1000, i % 1000) for i in ids]) if ids else
                np.zeros((0, *IMAGE), np.uint8)},
    }


def create(tmp_path: Path, capacity: int = 64, codec: str = "zstd", **options: Any) -> HDF5Storage:
    return HDF5Storage.create(SPACE, capacity, tmp_path / "c.h5", compression={"obs/image": codec}, **options)


# ---------------------------------------------------------------- the rows against a model


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(codec=st.sampled_from(["zstd", "lz4"]), slot=st.sampled_from([None, 0.05, 0.5, 64]),
       writes=st.lists(st.lists(st.integers(0, 31), min_size=1, max_size=12), min_size=1, max_size=12),
       reads=st.lists(st.integers(-32, 31), min_size=1, max_size=20))
def test_rows_read_back_as_the_model_holds_them(tmp_path_factory: Any, codec: str, slot: Any,
                                                writes: list[list[int]], reads: list[int]) -> None:
    path = tmp_path_factory.mktemp("model")
    storage = HDF5Storage.create(SPACE, 32, path / "m.h5", compression={"obs/image": codec}, compression_slot=slot)
    model = np.zeros((32, *IMAGE), np.uint8)
    serial = 0
    with storage:
        for index in writes:
            ids = list(range(serial, serial + len(index)))
            serial += len(index)
            value = rows(ids)
            storage.set(np.array(index), value)
            for position, row in zip(index, value["obs"]["image"]):  # duplicates: the last one wins
                model[position] = row
            got = storage.get(np.array(reads))["obs"]["image"]
            assert np.array_equal(got, model[np.array(reads)])
        assert np.array_equal(storage.get(slice(None))["obs"]["image"], model)
        assert np.array_equal(storage.get(5)["obs"]["image"], model[5])
        live = {int(j) for j in storage._packed["obs/image"]._spill_table()[0] if j > 0}
        assert storage._packed["obs/image"].spill_slots() <= max(1, len(live)) + 16  # reused, not piled up
    with HDF5Storage.load_from(path / "m.h5", None) as reopened:
        assert np.array_equal(reopened.get(slice(None))["obs"]["image"], model)


def test_a_ring_rewritten_many_times_stays_the_same_size(tmp_path: Path) -> None:
    storage = create(tmp_path, capacity=200)
    sizes = []
    with storage:
        for lap in range(12):
            ids = list(range(lap * 1000, lap * 1000 + 200))
            storage.set(slice(0, 200), rows(ids))
            storage.flush()
            sizes.append(os.path.getsize(tmp_path / "c.h5"))
        assert mismatches(storage.get(np.arange(200))) == []
    assert sizes[-1] <= sizes[0] * 1.05, sizes
    assert sizes[0] < 200 * ROW_BYTES  # fewer bytes than the raw rows, noisy ones included


def test_a_replay_buffer_decodes_and_hands_out_stored_records(tmp_path: Path) -> None:
    with ReplayBuffer.create(SPACE, 100, tmp_path / "rb.h5", compression={"obs/image": "lz4"}) as buffer:
        for e in range(6):
            segment = buffer.open_segment_writer()
            segment.extend(episode(e, 30))
            buffer.commit_segment(segment)
        assert mismatches(buffer.sample(64)) == []
        assert mismatches(buffer.get_at(np.arange(len(buffer)))) == []
        stored = buffer.sample(16, decode=PACKED)
        assert isinstance(stored["obs/image"], PackedRows) and stored["obs/image"].shape == (16,)
        assert stored["obs/image"].blob.nbytes < 16 * ROW_BYTES
        decoded = codecs.decode_rows(stored["obs/image"], np.dtype(np.uint8), IMAGE, "obs/image")
        assert mismatches({"episode": stored["episode"], "step": stored["step"], "obs": {"image": decoded}}) == []
        windows = buffer.sample_sequences(4, 5, decode=PACKED)
        assert windows["obs/image"].shape == (4, 5)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(("options", "match"), [
    ({"compression": {"obs/image": "brotli"}}, r"compression for 'obs/image' must be one of"),
    ({"compression": {"obs/image": "zstd"}, "compression_level": {"obs/image": 30}},
     r"zstd level for 'obs/image' must be an int in 1\.\.22, got 30"),
    ({"compression": {"obs/image": "zstd"}, "compression_slot": {"obs/image": 1.5}},
     r"compression_slot for 'obs/image' must be a fraction in \(0, 1\]"),
    ({"compression": {"obs/image": "zstd"}, "compression_slot": {"obs/image": ROW_BYTES + 1}},
     rf"compression_slot for 'obs/image' must be 1\.\.{ROW_BYTES} bytes"),
    ({"compression_slot": {"obs/image": 0.5}}, r"compression_slot for 'obs/image' is set but its compression is None"),
    ({"compression": {"obs/image": "zstd"}, "chunks": {"obs/image": (4,)}}, r"chunks for 'obs/image' cannot be chosen"),
])
def test_bad_compression_options_name_the_leaf(tmp_path: Path, options: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        HDF5Storage.create(SPACE, 16, tmp_path / "x.h5", **options)
    assert not (tmp_path / "x.h5").exists()


def test_a_growing_storage_cannot_take_records(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"compression 'zstd' for 'obs/image' needs a fixed capacity"):
        HDF5Storage.create(SPACE, None, tmp_path / "x.h5", compression={"obs/image": "zstd"})


def test_text_is_never_compressed_as_records(tmp_path: Path) -> None:
    space = DictSpace({"note": TextSpace(max_length=8), "v": BoxSpace(0, 1, (), np.float32)})
    with pytest.raises(ConfigError, match=r"'note'"):
        HDF5Storage.create(space, 8, tmp_path / "x.h5", compression={"note": "zstd"})


def test_a_missing_codec_package_is_named_with_the_leaf(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with create(tmp_path) as storage:
        storage.set(slice(0, 4), rows([1, 2, 3, 4]))
    monkeypatch.setattr(codecs, "_zstd", lambda: None)
    with pytest.raises(ConfigError, match=r"compression 'zstd' of leaf 'obs/image' needs the 'zstandard' package"):
        HDF5Storage.create(SPACE, 16, tmp_path / "y.h5", compression={"obs/image": "zstd"})
    with HDF5Storage.load_from(tmp_path / "c.h5", None) as reader:  # opening needs no codec: reading does
        assert reader.read_leaves(["step"], np.array([3]))["step"].tolist() == [4]
        with pytest.raises(ConfigError, match=r"reading the zstd records of leaf 'obs/image' needs the 'zstandard'"):
            reader.get(np.array([0, 1]))
        stored = reader.read("array", np.array([0, 1]), PACKED)  # as stored, it travels without the codec
        assert isinstance(stored["obs/image"], PackedRows)


def _slot_offset(path: Path, row: int) -> int:
    """The file offset of row `row`'s slot (its record's first byte)."""
    with h5py.File(path, "r") as f:
        slots = f["obs/image/slots"]
        chunk_rows, width = slots.chunks
        info = slots.id.get_chunk_info_by_coord((row // chunk_rows * chunk_rows, 0))
        return int(info.byte_offset) + (row % chunk_rows) * width


def test_a_damaged_record_is_reported_with_its_row_and_never_returned(tmp_path: Path) -> None:
    with ReplayBuffer.create(SPACE, 50, tmp_path / "rb.h5", compression={"obs/image": "zstd"}) as buffer:
        for e in range(2):
            segment = buffer.open_segment_writer()
            segment.extend(episode(e, 20))
            buffer.commit_segment(segment)
    offset = _slot_offset(tmp_path / "rb.h5", 3)
    with open(tmp_path / "rb.h5", "r+b") as f:
        f.seek(offset + 2)
        byte = f.read(1)
        f.seek(offset + 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    with ReplayBuffer.load_from(tmp_path / "rb.h5") as buffer:
        with pytest.raises(DamagedRecordError, match=r"leaf 'obs/image' \(zstd\): the stored record of row 3 is damaged"):
            buffer.get_rows([1, 3])
        assert mismatches(buffer.get_rows([0, 1, 2, 4, 39])) == []  # the others are whole
        stored = buffer.get_rows([3], decode=PACKED)["obs/image"]
        with pytest.raises(DamagedRecordError, match=r"row 3 is damaged"):
            codecs.decode_rows(stored, np.dtype(np.uint8), IMAGE, "obs/image", [3])


def test_records_that_lie_about_their_size_are_refused(tmp_path: Path) -> None:
    with create(tmp_path) as storage:
        storage.set(slice(0, 4), rows([1, 2, 3, 4]))
    with h5py.File(tmp_path / "c.h5", "r+") as f:
        f["obs/image/meta"][2, 0] = 10**6
    with HDF5Storage.load_from(tmp_path / "c.h5", None) as storage:
        with pytest.raises(DamagedRecordError, match=r"record table entry of row 2 of the ring is damaged"):
            storage.get(np.array([1, 2]))


# ---------------------------------------------------------------- on the wire


def _reply(arrays: dict[str, Any], n: int) -> P.SampleReply:
    return P.SampleReply(7, 1, 0, 0, n, np.arange(n, dtype=np.uint64), np.zeros(n, np.uint64), np.zeros(n), arrays)


def test_stored_records_cross_the_wire_as_they_are() -> None:
    batch = rows([5, 6, 7, 1013])
    chosen = codecs.codec("zstd", 3, "obs/image")
    records = codecs.encode_rows(batch["obs"]["image"], chosen)
    blob = np.frombuffer(b"".join(bytes(r) for r, _ in records), np.uint8)
    meta = np.array([[len(r), k, codecs.crc32(r)] for r, k in records], np.int64)
    reply = _reply({"episode": batch["episode"], "step": batch["step"], "obs/image": PackedRows(blob, meta)}, 4)
    frames = P.encode(reply)
    assert sum(memoryview(f).nbytes for f in frames) < batch["obs"]["image"].nbytes
    got = P.decode([bytes(f) for f in frames], expect=P.SampleReply)
    packed = got.arrays["obs/image"]
    assert isinstance(packed, PackedRows) and np.array_equal(packed.blob, blob) and np.array_equal(packed.meta, meta)
    assert np.array_equal(codecs.decode_rows(packed, np.dtype(np.uint8), IMAGE, "obs/image"), batch["obs"]["image"])


@pytest.mark.parametrize(("change", "match"), [
    (lambda a: a.pop("/packed-meta/obs/image"), r"has records but no meta"),
    (lambda a: a.pop("/packed/obs/image"), r"has meta but no records"),
    (lambda a: a.update({"/packed-meta/obs/image": np.ones((2, 3), np.int64) * 5}), r"declare 10 bytes"),
    (lambda a: a.update({"/packed-meta/obs/image": np.ones((2, 2), np.int64)}), r"must be int64 of shape \(rows, 3\)"),
    (lambda a: a.update({"/packed/obs/image": np.ones(9, np.int16)}), r"must be 1-d uint8"),
    (lambda a: a.update({"obs/image": np.zeros((2, 1), np.uint8)}), r"comes both compressed and raw"),
])
def test_malformed_stored_records_are_refused_by_the_wire(change: Any, match: str) -> None:
    arrays: dict[str, Any] = {"step": np.arange(2, dtype=np.int32), "/packed/obs/image": np.ones(9, np.uint8),
                              "/packed-meta/obs/image": np.array([[4, 2, 0], [5, 2, 0]], np.int64)}
    change(arrays)
    frames = P.encode(_reply(arrays, 2))
    with pytest.raises(ProtocolError, match=match):
        P.decode([bytes(f) for f in frames], expect=P.SampleReply)


@pytest.mark.parametrize(("record", "kind", "match"), [
    (b"\x28\xb5\x2f\xfd" + b"junk" * 8, codecs.ZSTD, r"the record of row 41 does not decode"),
    (bytes(range(40)), codecs.LZ4, r"the record of row 41 does not decode"),
    (zstandard.ZstdCompressor().compress(b"\x00" * 10), codecs.ZSTD, r"row 41 does not decode: its frame holds 10 bytes"),
    (zstandard.ZstdCompressor(write_content_size=False).compress(b"\x00" * 4000), codecs.ZSTD,
     r"row 41 does not decode: its frame holds -1 bytes"),
    (b"\x00" * 10, codecs.RAW, r"the raw record of row 41 has 10 bytes, not 2304"),
    (b"\x00" * 10, 9, r"unknown record kind 9"),
])
def test_a_record_that_checks_but_does_not_decode_is_never_returned(record: bytes, kind: int, match: str) -> None:
    packed = PackedRows(np.frombuffer(record, np.uint8), np.array([[len(record), kind, codecs.crc32(record)]], np.int64))
    with pytest.raises(DamagedRecordError, match=match):
        codecs.decode_rows(packed, np.dtype(np.uint8), IMAGE, "obs/image", [41])
