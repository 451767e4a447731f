"""A served compressed ring (serve --compression obs/image=zstd): the file stays bounded while the
ring wraps ten times, and every row a learner gets is bit-exact, through reader processes and
the writer, as stored records the client decodes and as raw rows the server decodes; where it
meets tables (prioritized, queues, rate limits), padded windows, shards, restarts and asyncio."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import h5py
import msgpack
import numpy as np
import pytest
from compressed_helpers import SPACE, episode, mismatches
from service_helpers import RawClient, running_server, server_config

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.client.aio import AsyncLearnerClient
from h5replay.codecs import DamagedRecordError
from h5replay.config import ClientConfig
from h5replay.errors import ConfigError, StorageError
from h5replay.sampling import Fifo, Prioritized, RateLimit, Table
from h5replay.server.writer import open_buffer
from h5replay.storage import ReplayBuffer

pytestmark = pytest.mark.timeout(180)

ZSTD = {"compression": {"obs/image": "zstd"}}
LENGTH = 25


def _raw(endpoint: str) -> LearnerClient:
    return LearnerClient(config=ClientConfig(endpoint=endpoint, timeout=10, raw_rows=True))


def _checked(batch: dict[str, Any]) -> dict[str, Any]:
    flat = {"episode": batch["episode"].reshape(-1), "step": batch["step"].reshape(-1),
            "obs": {"image": batch["obs"]["image"].reshape(-1, *batch["obs"]["image"].shape[-3:])}}
    assert mismatches(flat) == []
    return batch


@pytest.mark.parametrize("codec", ["zstd", "lz4"])
def test_a_served_ring_wraps_ten_times_within_a_quarter_more_file_and_every_row_is_exact(
        tmp_path: Path, codec: str) -> None:
    capacity = 1000
    config = server_config(tmp_path / "rb.h5", space=SPACE, capacity=capacity, num_readers=1,
                           storage_kwargs={"compression": {"obs/image": codec}})
    with running_server(config) as server:
        pusher = ActorClient(server.endpoint, timeout=10)
        streamer = ActorClient(server.endpoint, timeout=10)
        learner = LearnerClient(server.endpoint, timeout=10)
        raw = _raw(server.endpoint)
        after_first_pass = None
        e = 0
        while e * LENGTH < 11 * capacity:
            rows = episode(e, LENGTH)
            if e % 2:
                pusher.push_episode(rows)
            else:
                with streamer.segment() as segment:
                    segment.extend(rows)
            e += 1
            if after_first_pass is None and e * LENGTH >= capacity:
                after_first_pass = os.path.getsize(tmp_path / "rb.h5")
            if e % 40 == 0:  # learners read while the ring wraps
                _checked(learner.sample(64))
                _checked(raw.sample(16))
        final = os.path.getsize(tmp_path / "rb.h5")
        _checked(learner.sample(256))
        _checked(learner.sample_sequences(8, 5))
        padded = learner.sample_sequences(8, 5, pad=True)
        mask = padded.pop("mask")
        _checked({"episode": padded["episode"][mask], "step": padded["step"][mask],
                  "obs": {"image": padded["obs"]["image"][mask]}})
        last = learner.episodes()[-1]
        rows = learner.get_rows(np.arange(last.first_row_id, last.first_row_id + last.length))
        assert _checked(rows)["step"].tolist() == list(range(LENGTH))
        assert _checked(learner.get(np.arange(0, len(learner), 7)))["step"].size
        for client in (pusher, streamer, learner, raw):
            client.close()
    assert after_first_pass is not None
    assert final <= 1.25 * after_first_pass, (final, after_first_pass)
    raw_bytes = capacity * int(np.prod(SPACE.spaces["obs"].spaces["image"].shape))
    assert final < raw_bytes  # fewer bytes than the raw images, staging and noisy rows included


def test_compressed_rows_meet_prioritized_tables_queues_and_rate_limits(tmp_path: Path) -> None:
    tables = {"replay": Table(Prioritized(1.0)), "queue": Table(Fifo(), max_times_sampled=1),
              "limited": Table(rate_limit=RateLimit(1, 4.0, 1000.0))}
    config = server_config(tmp_path / "rb.h5", space=SPACE, capacity=400, num_readers=1, tables=tables,
                           storage_kwargs=ZSTD)
    with running_server(config) as server, ActorClient(server.endpoint, timeout=10) as actor, \
            LearnerClient(server.endpoint, timeout=10) as learner:
        for e in range(8):
            actor.push_episode(episode(e, LENGTH), priorities=np.full(LENGTH, 1.0 + e))
        queued, info = learner.sample(8 * LENGTH, with_info=True, table="queue")  # each row once, in order
        assert info.row_ids.tolist() == list(range(8 * LENGTH))
        _checked(queued)
        batch, info = learner.sample(128, with_info=True, table="replay")
        _checked(batch)
        learner.update_priorities(info.row_ids, np.full(128, 7.0), table="replay")
        _checked(learner.sample(64, table="replay"))
        _checked(learner.sample(32, table="limited"))  # through the writer: rate limits sample there
        _checked(learner.sample_sequences(4, 6, table="replay"))


def test_a_restarted_server_keeps_its_compression_and_refuses_another(tmp_path: Path) -> None:
    config = server_config(tmp_path / "rb.h5", space=SPACE, capacity=300, storage_kwargs=ZSTD)
    with running_server(config) as server, ActorClient(server.endpoint, timeout=10) as actor:
        for e in range(20):  # wraps
            actor.push_episode(episode(e, LENGTH))
    with running_server(config.replace(space=None, capacity=None, storage_kwargs={})) as server:
        with LearnerClient(server.endpoint, timeout=10) as learner:
            _checked(learner.sample(128))
    with ReplayBuffer.load_from(tmp_path / "rb.h5") as buffer:
        assert buffer.file_storage.compressed_leaves == {"obs/image": "zstd"}
    lz4 = config.replace(storage_kwargs={"compression": {"obs/image": "lz4"}})
    with pytest.raises(ConfigError, match=r"compressed leaves \{'obs/image': 'zstd'\}, not the \{'obs/image': 'lz4'\}"):
        open_buffer(lz4)  # what the server runs first: it refuses to start


def test_shards_and_asyncio_learners_decode_compressed_rows(tmp_path: Path) -> None:
    configs = [server_config(tmp_path / f"s{k}.h5", space=SPACE, capacity=500, num_readers=1, storage_kwargs=ZSTD)
               for k in range(2)]
    with running_server(configs[0]) as a, running_server(configs[1]) as b:
        endpoints = [a.endpoint, b.endpoint]
        with ActorClient(endpoints=endpoints, timeout=10) as actor, ActorClient(a.endpoint, timeout=10) as to_a:
            for e in range(12):
                actor.push_episode(episode(e, LENGTH))
                to_a.push_episode(episode(100 + e, LENGTH))
        with LearnerClient(endpoints=endpoints, timeout=10) as learner:
            _checked(learner.sample(200))

        async def main() -> None:
            async with AsyncLearnerClient(a.endpoint, timeout=10) as one, \
                    AsyncLearnerClient(endpoints=endpoints, timeout=10) as both:
                _checked(await one.sample(64))
                _checked(await both.sample(64))
                _checked(await both.sample_sequences(4, 5))

        asyncio.run(main())


def test_a_learner_without_the_codec_asks_for_raw_rows(tmp_path: Path) -> None:
    config = server_config(tmp_path / "rb.h5", space=SPACE, capacity=200, num_readers=1, storage_kwargs=ZSTD)
    with running_server(config) as server, ActorClient(server.endpoint, timeout=10) as actor:
        for e in range(4):
            actor.push_episode(episode(e, LENGTH))
        with _raw(server.endpoint) as raw:
            _checked(raw.sample(50))
            _checked(raw.get(np.arange(10)))
            _checked(raw.sample_sequences(3, 4))


def _flip_a_byte_of_the_record(path: Path, row: int) -> None:
    """Damage row `row`'s record on disk (under a live server: an SWMR reader finds where it is)."""
    with h5py.File(path, "r", libver="latest", swmr=True, locking=False) as f:
        slots = f["obs/image/slots"]
        chunk_rows, width = slots.chunks
        info = slots.id.get_chunk_info_by_coord((row // chunk_rows * chunk_rows, 0))
        offset = int(info.byte_offset) + (row % chunk_rows) * width + 3
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x5A]))


def test_a_damaged_record_is_an_error_naming_its_row_and_the_server_keeps_serving(tmp_path: Path) -> None:
    config = server_config(tmp_path / "rb.h5", space=SPACE, capacity=200, num_readers=1, storage_kwargs=ZSTD)
    with running_server(config) as server, ActorClient(server.endpoint, timeout=10) as actor:
        for e in range(4):
            actor.push_episode(episode(e, LENGTH))
        _flip_a_byte_of_the_record(tmp_path / "rb.h5", 30)
        with LearnerClient(server.endpoint, timeout=10) as learner, _raw(server.endpoint) as raw:
            with pytest.raises(DamagedRecordError, match=r"leaf 'obs/image' \(zstd\): the stored record of row 30 is damaged"):
                learner.get_rows([29, 30])  # decoded here, from the records the reader sent as stored
            with pytest.raises(StorageError, match=r"row 30 is damaged"):
                raw.get_rows([30])  # decoded by the server, which says so and serves on
            _checked(learner.get_rows([0, 29, 31, 99]))
            _checked(raw.get_rows([0, 29, 31, 99]))
            actor.push_episode(episode(9, LENGTH))
            assert len(learner) == 5 * LENGTH


def test_an_actor_that_sends_records_or_a_learner_that_lies_about_packed_is_refused(tmp_path: Path) -> None:
    config = server_config(tmp_path / "rb.h5", space=SPACE, capacity=200, storage_kwargs=ZSTD)
    with running_server(config) as server, ActorClient(server.endpoint, timeout=10) as actor:
        receipt = actor.push_episode(episode(0, LENGTH))
        rows = episode(1, 3)
        forged = {"episode": rows["episode"], "step": rows["step"], "/packed/obs/image": np.zeros(6, np.uint8),
                  "/packed-meta/obs/image": np.array([[2, 2, 0]] * 3, np.int64)}
        with RawClient(server.endpoint, timeout=5) as raw:
            assert isinstance(raw.call(lambda rid: P.Hello(rid, "raw", "actor")), P.HelloReply)
            reply = raw.call(lambda rid: P.PushEpisode(rid, 3, forged))  # records are what the server stores, not takes
            assert isinstance(reply, P.ErrorReply) and "obs/image" in reply.message, reply
            frames = P.encode(P.Sample(raw.next_id(), 4))
            head = msgpack.unpackb(frames[0])
            head["fields"]["packed"] = "yes"
            reply = raw.request([msgpack.packb(head), *frames[1:]])
            assert isinstance(reply, P.ErrorReply) and "packed" in reply.message, reply
        with LearnerClient(server.endpoint, timeout=10) as learner:  # served on, nothing else stored
            assert len(learner) == receipt.length
            _checked(learner.sample(32))
