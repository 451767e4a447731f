"""Padded windows, `sample_sequences(n, length, pad=True)`: every step of every complete episode,
the last `length - 1` included, starts windows at its share; steps past the episode's end are
zeros under a False mask; the same windows come from a local buffer, a server (its writer and
its reader processes, windows bigger than a message read by row id), two shards and a rate
limit's kept draws; and a pad the space cannot carry, or a lying request, is refused."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from transition_helpers import SPACE, episode

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient
from h5replay.config import ClientConfig
from h5replay.errors import ConfigError, ProtocolError, RateLimitedError
from h5replay.sampling import Prioritized, RateLimit, Table
from h5replay.spaces import BoxSpace, DictSpace
from h5replay.storage import ReplayBuffer

pytestmark = pytest.mark.timeout(120)

LENGTHS = (5, 1, 3, 8)  # episodes of these lengths, one after another: row ids 0..16
STEPS = 4


def fill(target: Any, first: int = 0) -> None:
    """The episodes of LENGTHS into a ReplayBuffer or through an ActorClient; obs id = row id."""
    for length in LENGTHS:
        rows, _ = episode(first, length, "terminated")
        if isinstance(target, ReplayBuffer):
            target.extend(rows)
            target.end_episode()
        else:
            target.push_episode(rows)
        first += length


def expected(row: int) -> tuple[list[int], int]:
    """The obs ids a padded window starting at `row` holds (0 past the episode) and its valid steps
    (the episodes of LENGTHS, filled once or more)."""
    first = row - row % sum(LENGTHS)
    for length in LENGTHS:
        if first <= row < first + length:
            valid = min(STEPS, first + length - row)
            return [row + i if i < valid else 0 for i in range(STEPS)], valid
        first += length
    raise AssertionError(f"row {row} is in no episode")


def check_windows(batch: dict[str, Any], info: Any) -> set[int]:
    """Every window equals the model: contents, zeros, mask and valid_steps; returns the starts."""
    assert set(batch) == {*SPACE.keys(), "mask"}
    assert batch["mask"].dtype == bool and batch["mask"].shape == (len(info), STEPS)
    for i, row in enumerate(info.row_ids.astype(np.int64)):
        ids, valid = expected(int(row))
        assert batch["obs"]["id"][i].tolist() == ids, (row, batch["obs"]["id"][i])
        assert batch["mask"][i].tolist() == [k < valid for k in range(STEPS)]
        assert int(info.valid_steps[i]) == valid
        assert not batch["obs"]["pos"][i][valid:].any() and not batch["terminated"][i][valid:].any()
        assert bool(batch["terminated"][i][valid - 1]) == ((ids[valid - 1] + 1) % 17 in (5, 6, 9, 0)), "the last step is the episode's"
    return set(info.row_ids.astype(np.int64).tolist())


def test_a_buffer_pads_windows_from_every_step_at_its_share(tmp_path: Any) -> None:
    with ReplayBuffer.create(SPACE, 100, tmp_path / "rb.h5") as rb:
        fill(rb)
        with pytest.raises(Exception, match="no complete episode holds 9"):
            rb.sample_sequences(10, 9)  # unpadded: no episode is that long
        batch, info = rb.sample_sequences(6800, STEPS, pad=True, with_info=True, rng=np.random.default_rng(1))
        starts = check_windows(batch, info)
        assert starts == set(range(17)), "every step starts windows, each episode's last ones included"
        counts = np.bincount(info.row_ids.astype(np.int64), minlength=17)
        assert counts.min() > 300 and counts.max() < 500, counts  # 400 each, uniform over the 17 starts
        np.testing.assert_allclose(info.probabilities, 1 / 17)
        unpadded = rb.sample_sequences(2000, STEPS, with_info=True, rng=np.random.default_rng(2))[1]
        assert set(unpadded.row_ids.astype(np.int64).tolist()) == {0, 1, 9, 10, 11, 12, 13}
        assert unpadded.valid_steps is None
        assert rb.info()["sampled"] == (6800 + 2000) * STEPS, "padding counts as sampled, as it is checked"


def test_a_prioritized_table_pads_windows_by_their_first_rows_priority(tmp_path: Any) -> None:
    tables = {"replay": Table(Prioritized(exponent=1.0))}
    with ReplayBuffer.create(SPACE, 100, tmp_path / "rb.h5", tables=tables) as rb:
        fill(rb)
        priorities = np.zeros(17)
        priorities[[4, 5, 16]] = [1.0, 2.0, 1.0]  # the last step of an episode, a 1-step episode, the very last
        rb.update_priorities(np.arange(17), priorities)
        batch, info = rb.sample_sequences(2000, STEPS, pad=True, with_info=True, rng=np.random.default_rng(3))
        assert check_windows(batch, info) == {4, 5, 16}
        assert abs(int(np.count_nonzero(info.row_ids == 5)) - 1000) < 120
        np.testing.assert_allclose(info.probabilities[info.row_ids == 5], 0.5)


def test_a_pad_the_space_cannot_carry_is_refused_before_any_draw(tmp_path: Any) -> None:
    masked_space = DictSpace({"x": BoxSpace(0, 1, (), np.float32), "mask": BoxSpace(0, 1, (), np.float32)})
    with ReplayBuffer.create(masked_space, 10, tmp_path / "a.h5") as rb:
        rb.extend({"x": np.zeros(3, np.float32), "mask": np.ones(3, np.float32)})
        rb.end_episode()
        with pytest.raises(ConfigError, match="already has one"):
            rb.sample_sequences(2, 2, pad=True)
        assert rb.info()["sampled"] == 0
    with ReplayBuffer.create(BoxSpace(0, 1, (2,), np.float32), 10, tmp_path / "b.h5") as rb:
        rb.extend(np.zeros((3, 2), np.float32))
        rb.end_episode()
        with pytest.raises(ConfigError, match="needs a Dict space"):
            rb.sample_sequences(2, 2, pad=True)
        assert rb.sample_sequences(2, 2).shape == (2, 2, 2)


@pytest.mark.parametrize("readers", [0, 2])
def test_a_learner_draws_padded_windows_as_the_buffer_does(start_server: Any, readers: int) -> None:
    server = start_server(space=SPACE, capacity=1000, num_readers=readers, multiprocessing=True)
    with ActorClient(server.endpoint, timeout=10) as actor:
        fill(actor)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        batch, info = learner.sample_sequences(600, STEPS, seed=5, with_info=True, pad=True)
        assert check_windows(batch, info) == set(range(17))
        assert learner.sample_sequences(3, STEPS, pad=True)["mask"].shape == (3, STEPS)
        assert "mask" not in learner.sample_sequences(3, STEPS)


def test_windows_bigger_than_a_message_are_padded_when_read_by_row_id(start_server: Any) -> None:
    server = start_server(space=SPACE, capacity=1000, num_readers=1, multiprocessing=True,
                          limits=P.Limits(max_rows_per_message=3))
    with ActorClient(config=ClientConfig(endpoint=server.endpoint, timeout=10, batch_rows=3)) as actor:
        fill(actor)
    with LearnerClient(server.endpoint, timeout=10) as learner:
        batch, info = learner.sample_sequences(200, STEPS, seed=6, with_info=True, pad=True)
        assert check_windows(batch, info) == set(range(17))


def test_over_two_shards_padded_windows_keep_their_mask(start_server: Any) -> None:
    servers = [start_server(name, space=SPACE, capacity=1000, limits=P.Limits(max_rows_per_message=8))
               for name in ("a.h5", "b.h5")]
    for server in servers:  # the same episodes on both: a row id means the same step on either
        with ActorClient(server.endpoint, timeout=10) as actor:
            fill(actor)
    config = ClientConfig(endpoint="tcp://127.0.0.1:1", timeout=10)
    with LearnerClient(config=config, endpoints=[s.endpoint for s in servers]) as learner:
        batch, info = learner.sample_sequences(300, STEPS, seed=7, with_info=True, pad=True)
        assert check_windows(batch, info) == set(range(17))
        assert set(info.shard_ids.tolist()) == {0, 1}
        np.testing.assert_allclose(info.probabilities, 1 / 34)
        assert set(learner.sample_sequences(5, STEPS, pad=True)) == {*SPACE.keys(), "mask"}


def test_padded_windows_a_rate_limit_kept_come_back_padded(start_server: Any) -> None:
    limited = {"replay": Table(rate_limit=RateLimit(min_size_to_sample=1, samples_per_insert=4.0, error_buffer=100.0))}
    server = start_server(space=SPACE, capacity=1000, tables=limited, limits=P.Limits(max_rows_per_message=8))
    with ActorClient(server.endpoint, timeout=10) as actor:
        fill(actor)
    config = ClientConfig(endpoint=server.endpoint, timeout=10, rate_limit_timeout=0.2)
    with LearnerClient(config=config) as learner:
        with pytest.raises(RateLimitedError):  # 17 * 4 + 100 rows may be sampled: fewer than 200 windows
            learner.sample_sequences(200, STEPS, pad=True)
        kept = learner.num_kept
        assert kept > 0
        # Unpadded windows are another kind of draw: the kept padded ones are not handed to it.
        assert "mask" not in learner.sample_sequences(1, STEPS) and learner.num_kept == kept
        batch, info = learner.sample_sequences(kept, STEPS, with_info=True, pad=True)  # all kept: no request
        check_windows(batch, info)
        assert learner.num_kept == 0


def test_a_lying_padded_request_is_refused(start_server: Any) -> None:
    from service_helpers import RawClient, error_of, header

    server = start_server(space=SPACE, capacity=100)
    with ActorClient(server.endpoint, timeout=10) as actor:
        fill(actor)
    with RawClient(server.endpoint) as raw:
        for pad, says in [("yes", "field 'pad' must be a bool"), (1, "field 'pad' must be a bool")]:
            fields = {"batch_size": 2, "length": STEPS, "seed": None, "min_seq": 0, "with_rows": True, "pad": pad}
            error = error_of(raw.request([header("sample_sequences", raw.next_id(), fields)]))
            assert isinstance(error, ProtocolError) and says in str(error), error
    with LearnerClient(server.endpoint, timeout=10) as learner:
        assert learner.info()["sampled"] == 0
        check_windows(*learner.sample_sequences(5, STEPS, with_info=True, pad=True))
