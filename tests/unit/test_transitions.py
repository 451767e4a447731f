"""Final observations and n-step transitions, against a plain-Python model of random episodes
(terminated, truncated with a final, cut without one) committed by every local path, through
the ring's eviction, a reopen and an SWMR reader; and every bad input refused before a write."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transition_helpers import SPACE, Model, check_every_held, check_sample, episode

from h5replay.errors import ConfigError, NotEnoughDataError, SpaceMismatchError
from h5replay.sampling import Prioritized, Table
from h5replay.spaces import BoxSpace, DictSpace
from h5replay.storage import ReplayBuffer

pytestmark = pytest.mark.timeout(120)

def commit_all(rb: ReplayBuffer, plan: list[tuple[int, str, str]], model: Model) -> None:
    """Commit episodes of (length, kind, path) by their path: extend + end_episode, a segment
    writer, or several in one commit_episodes."""
    batch: list[tuple[dict[str, Any], dict[str, Any] | None, int]] = []
    for length, kind, path in plan:
        first = rb.view.end + sum(n for _, _, n in batch)
        rows, final = episode(first, length, kind)
        model.episodes.append((first, rows, final))
        if path == "several":
            batch.append((rows, final, length))
            continue
        flush(rb, batch)
        batch = []
        if path == "extend":
            rb.extend(rows)
            rb.end_episode(final=final)
        else:
            writer = rb.open_segment_writer()
            writer.extend(rows)
            rb.commit_segment(writer, final=final)
    flush(rb, batch)


def flush(rb: ReplayBuffer, batch: list[tuple[dict[str, Any], dict[str, Any] | None, int]]) -> None:
    if not batch:
        return
    writer = rb.open_segment_writer()
    for rows, _, _ in batch:
        writer.extend(rows)
    rb.commit_episodes(writer, [n for _, _, n in batch], finals=[f for _, f, _ in batch])


plans = st.lists(st.tuples(st.integers(1, 8), st.sampled_from(["terminated", "truncated", "cut"]),
                           st.sampled_from(["extend", "segment", "several"])), min_size=1, max_size=12)


@settings(max_examples=25, deadline=None)
@given(plan=plans, more=plans, n=st.sampled_from([1, 3, 5]), gamma=st.sampled_from([0.0, 0.5, 0.99, 1.0]))
def test_every_transition_drawn_or_read_is_the_models_through_eviction_and_a_reopen(tmp_path_factory: Any, plan: Any, more: Any,
                                                                       n: int, gamma: float) -> None:
    path = tmp_path_factory.mktemp("t") / "rb.h5"
    model = Model()
    with ReplayBuffer.create(SPACE, 40, path, observation_keys=("obs",)) as rb:
        commit_all(rb, plan, model)
        check_sample(rb, model, n, gamma)
        commit_all(rb, more, model)  # may wrap the ring: evicted episodes leave with their finals
        check_sample(rb, model, n, gamma)
        check_every_held(rb, model, n, gamma)
    with ReplayBuffer.load_from(path) as rb:
        check_sample(rb, model, n, gamma)
        check_every_held(rb, model, n, gamma)


def test_every_step_is_drawn_at_its_share_the_last_and_terminal_ones_too(tmp_path: Path) -> None:
    model = Model()
    with ReplayBuffer.create(SPACE, 100, tmp_path / "rb.h5", observation_keys=("obs",)) as rb:
        commit_all(rb, [(3, "terminated", "extend"), (5, "truncated", "segment"), (2, "cut", "several")], model)
        drawn = check_sample(rb, model, 3, 0.9, size=10_000)
    counts = np.bincount(drawn, minlength=10)
    assert counts.min() > 10_000 / 10 * 0.85 and counts.max() < 10_000 / 10 * 1.15, counts
    assert counts[2] > 0 and counts[7] > 0, "the terminal and the last steps are drawn"


def test_a_prioritized_transition_is_drawn_by_its_first_steps_priority(tmp_path: Path) -> None:
    with ReplayBuffer.create(SPACE, 100, tmp_path / "rb.h5", observation_keys=("obs",),
                             tables={"replay": Table(Prioritized(1.0))}) as rb:
        rows, final = episode(0, 4, "terminated")
        rb.extend(rows, priorities=[0.0, 0.0, 0.0, 1.0])
        rb.end_episode(final=final)
        batch, info = rb.sample_transitions(50, n_step=2, with_info=True)
        assert set(info.row_ids.tolist()) == {3} and np.all(batch["terminated"]) and np.all(batch["next"]["obs"]["id"] == 10**6)


def test_a_reader_process_view_and_plain_h5py_see_the_finals(tmp_path: Path) -> None:
    path = tmp_path / "rb.h5"
    model = Model()
    with ReplayBuffer.create(SPACE, 50, path, observation_keys=("obs",), multiprocessing=True) as rb:
        commit_all(rb, [(4, "terminated", "extend")], model)
        rb.flush()  # (extend + end_episode publish at the next flush)
        with ReplayBuffer.load_from(path, multiprocessing=True) as reader:
            check_sample(reader, model, 2, 0.5)
            commit_all(rb, [(3, "truncated", "segment"), (2, "cut", "extend")], model)
            rb.flush()
            check_sample(reader, model, 2, 0.5)
    with h5py.File(path, "r") as f:
        finals = f["_h5replay/replay/finals"]
        assert finals["has"][:3].tolist() == [1, 1, 0] and finals["obs/id"][:2].tolist() == [10**6, 10**6 + 4]
    with ReplayBuffer.load_from(path) as rb:
        assert len(rb) == 9, "len() counts steps, not finals"


def test_an_open_episode_and_a_file_without_finals(tmp_path: Path) -> None:
    with ReplayBuffer.create(SPACE, 50, tmp_path / "rb.h5", observation_keys=("obs",)) as rb:
        rows, _ = episode(0, 3, "terminated")
        rb.extend(rows)  # not ended: its last step has nothing to bootstrap from yet
        batch, info = rb.sample_transitions(100, n_step=1, with_info=True)
        last = info.row_ids == 2
        assert np.all(batch["discount"][last] == 0) and not info.has_final.any()
        assert np.all(batch["discount"][~last] == np.float32(0.99))
    with ReplayBuffer.create(SPACE, 50, tmp_path / "plain.h5") as rb:
        rb.extend(episode(0, 3, "cut")[0])
        rb.end_episode()
        with pytest.raises(ConfigError, match="observation_keys="):
            rb.sample_transitions(4)
        with pytest.raises(ConfigError, match="observation_keys="):
            rb.get_transitions([0])
        with pytest.raises(ConfigError, match="keeps no final observations"):
            rb.end_episode(final={"pos": np.zeros(2, np.float32), "id": 0})


@pytest.mark.parametrize(("make", "says"), [
    (lambda p: ReplayBuffer.create(SPACE, 10, p, observation_keys=("nope",)), "observation key 'nope' is not a key"),
    (lambda p: ReplayBuffer.create(SPACE, 10, p, observation_keys="obs"), "non-empty sequence"),
    (lambda p: ReplayBuffer.create(SPACE, 10, p, observation_keys=("obs", "obs")), "names a key twice"),
    (lambda p: ReplayBuffer.create(BoxSpace(0, 1, (2,)), 10, p, observation_keys=("obs",)), "needs a Dict space"),
    (lambda p: ReplayBuffer.create(DictSpace({"obs": BoxSpace(0, 1), "next": BoxSpace(0, 1)}), 10, p,
                                   observation_keys=("obs",)), "may not have a key 'next'"),
    (lambda p: ReplayBuffer.create(SPACE, 10, p, reward_key="r"), "give observation_keys= too"),
])
def test_bad_observation_keys_are_refused_and_create_nothing(tmp_path: Path, make: Any, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        make(tmp_path / "rb.h5")
    assert not (tmp_path / "rb.h5").exists()


@pytest.mark.parametrize(("call", "error", "says"), [
    (lambda rb: rb.sample_transitions(4, n_step=0), ConfigError, "n_step must be an integer >= 1, got 0"),
    (lambda rb: rb.sample_transitions(4, n_step=2.5), ConfigError, "n_step must be an integer"),
    (lambda rb: rb.sample_transitions(4, gamma=1.5), ConfigError, r"gamma must be a number in \[0, 1\], got 1.5"),
    (lambda rb: rb.sample_transitions(4, gamma=float("nan")), ConfigError, "gamma must be"),
    (lambda rb: rb.end_episode(final={"pos": np.zeros(3, np.float32), "id": 0}), SpaceMismatchError, "pos"),
    (lambda rb: rb.end_episode(final={"pos": np.zeros(2, np.float32)}), SpaceMismatchError, "id"),
    (lambda rb: rb.commit_segment(_writer(rb), final={"bad": 1}), SpaceMismatchError, "bad"),
    (lambda rb: rb.commit_episodes(_writer(rb), [2], finals=[None, None]), ConfigError, "2 finals for 1 episodes"),
    (lambda rb: rb.get_transitions([0, 99]), IndexError, "99"),
    (lambda rb: rb.get_transitions([-1]), IndexError, "-1"),
    (lambda rb: rb.get_transitions([]), ConfigError, "at least one row id"),
    (lambda rb: rb.get_transitions([0.5]), TypeError, "integer"),
    (lambda rb: rb.get_transitions([0], n_step=0), ConfigError, "n_step"),
])
def test_bad_transition_input_is_refused_naming_it_and_writes_nothing(tmp_path: Path, call: Any, error: Any,
                                                                      says: str) -> None:
    with ReplayBuffer.create(SPACE, 50, tmp_path / "rb.h5", observation_keys=("obs",)) as rb:
        rows, final = episode(0, 3, "truncated")
        rb.extend(rows)
        rb.end_episode(final=final)
        rb.extend(episode(3, 2, "cut")[0])  # an open episode a bad final must leave open
        with pytest.raises(error, match=says):
            call(rb)
        assert rb.num_episodes == 1 and len(rb) == 5
        rb.end_episode()
        assert rb.num_episodes == 2


def test_a_space_without_the_reward_leaves_is_told_which(tmp_path: Path) -> None:
    space = DictSpace({"obs": BoxSpace(0, 1, (2,)), "r": BoxSpace(0, 1)})
    with ReplayBuffer.create(space, 10, tmp_path / "rb.h5", observation_keys=("obs",)) as rb:
        rb.extend({"obs": np.zeros((2, 2), np.float32), "r": np.zeros(2, np.float32)})
        rb.end_episode(final=np.zeros(2, np.float32))
        with pytest.raises(ConfigError, match="needs the reward leaf 'reward'.*reward_key="):
            rb.sample_transitions(2)


def _writer(rb: ReplayBuffer) -> Any:
    writer = rb.open_segment_writer()
    writer.extend(episode(9, 2, "cut")[0])
    return writer


@pytest.mark.parametrize("how", ["export", "compact", "unbounded"])
def test_finals_go_with_their_episodes_through_export_and_compaction(tmp_path: Path, how: str) -> None:
    from h5replay.storage import compact_file, export_file

    path, out = tmp_path / "rb.h5", tmp_path / "out.h5"
    model = Model()
    with ReplayBuffer.create(SPACE, 40, path, observation_keys=("obs",)) as rb:
        commit_all(rb, [(7, "terminated", "extend"), (9, "cut", "segment"), (8, "truncated", "several"),
                        (6, "terminated", "several"), (9, "truncated", "segment")], model)  # wraps the ring
        held = rb.episodes()
    if how == "compact":
        compact_file(path)
        out = path
    else:
            export_file(path, out, capacity=40 if how == "export" else None)
    with ReplayBuffer.load_from(out) as copy:
        assert copy.transition_keys is not None and copy.transition_keys.observation == ("obs",)
        for ep in copy.episodes():
            first, _, final = next(e for e in model.episodes if e[0] == ep.first_row_id)
            got = copy.final_observation(ep.episode_id)
            assert (got is None) == (final is None) and (final is None or got["id"] == final["id"])
        assert {e.episode_id for e in copy.episodes()} <= {e.episode_id for e in held}
        check_sample(copy, model, 3, 0.9)
        with pytest.raises(IndexError, match="never committed"):
            copy.final_observation(999)


def test_a_final_may_be_given_as_the_observation_or_as_a_dict_of_the_one_observation_key(tmp_path: Path) -> None:
    """Regression: `final={"obs": value}` with one observation key was taken as the value itself
    and refused as "dtype object"; both forms now store the same final."""
    with ReplayBuffer.create(SPACE, 50, tmp_path / "rb.h5", observation_keys=("obs",)) as rb:
        rows, final = episode(0, 3, "terminated")
        rb.extend(rows)
        rb.end_episode(final=final)
        rb.extend(episode(3, 2, "terminated")[0])
        rb.end_episode(final={"obs": final})
        got = rb.sample_transitions(200, rng=np.random.default_rng(0))
        ends = got["terminated"].astype(bool)
        assert ends.any() and (got["next"]["obs"]["id"][ends] == 10**6).all(), "both episodes carry the same final"


def test_an_in_order_draw_passes_over_the_rows_a_split_batch_drew_before(tmp_path: Path) -> None:
    from h5replay.sampling import Fifo, Lifo, Table

    tables = {"old": Table(Fifo()), "new": Table(Lifo()), "any": Table()}
    with ReplayBuffer.create(SPACE, 100, tmp_path / "rb.h5", observation_keys=("obs",), tables=tables) as rb:
        rows, final = episode(0, 30, "terminated")
        rb.extend(rows)
        rb.end_episode(final=final)
        _, info = rb.sample(10, with_info=True, table="old", skip=12)
        assert info.row_ids.tolist() == list(range(12, 22))
        _, info = rb.sample_transitions(5, with_info=True, table="new", skip=3)
        assert info.row_ids.tolist() == [26, 25, 24, 23, 22]
        _, info = rb.sample(10, with_info=True, table="any", skip=10**9)  # random draws: nothing to pass over
        assert len(info.row_ids) == 10
        with pytest.raises(NotEnoughDataError, match="needs 31 rows"):
            rb.sample(1, table="old", skip=30)
