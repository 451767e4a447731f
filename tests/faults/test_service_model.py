"""A model-based test of the whole service: a seeded random walk drives two real shards (server
processes on loopback, their files in a temporary directory) and the clients of a distributed job
through random interleavings of pushes, waited and unwaited commits, consuming and non-consuming samples,
requests split over several messages, priority updates, restarts, SIGKILLs and compactions, and
after every step checks what docs/guarantees.md promises against a plain Python model:

* every acknowledged episode is held exactly once over the shards, whole and in order; an episode
  whose commit raised is held at most once; nothing else is held;
* from a queue (max_times_sampled=1), every row is returned at most once, and none is lost: rows
  committed = rows returned + rows the learner keeps + rows still to draw;
* under a rate limit, every sample the servers counted reached the learner (or is kept by it);
* a learner's view never goes back: every reply comes from a publish no older than the one its
  request named, across restarts, kills and compactions;
* the probability of every row drawn from a prioritized shard is its priority in the model over
  the sum of the priorities that shard holds (priorities given at commit, updates acknowledged).

The worlds: a fifo queue under a rate limit, a lifo queue, a uniform buffer under a
samples-per-insert limit, and a prioritized buffer. Messages carry at most 32 rows, so most
samples and reads are split. Each walk is one test, named by its seed (which also picks its world):
a failure says the seed and the steps that led to it, and `pytest -k "walk and 17"` replays it.
Profiles (H5REPLAY_MODEL_PROFILE): "short" (default, `make test`: one walk of 25 steps per world)
and "long" (`.ci/run`: 40 walks of 60 steps, 2,400 steps). Why a seeded walk rather than
hypothesis' stateful testing: every step costs real processes and round trips, so the walks are
few, and hypothesis spends a handful of examples on its simplest ones (one rule again and again);
weighted random steps reach every rule in every walk.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from service_helpers import episode_problems, episode_rows
from shard_helpers import Shards

from h5replay import protocol as P
from h5replay.client import ActorClient, LearnerClient, PendingCommit
from h5replay.client._connection import Connection
from h5replay.client._shards import home_shard
from h5replay.config import ClientConfig
from h5replay.errors import H5ReplayError, NotEnoughDataError, RateLimitedError, ServerUnavailableError
from h5replay.sampling import Fifo, Lifo, Prioritized, RateLimit, SamplingConfig, Uniform
from h5replay.storage import compact_file

PROFILES = {"short": (4, 25), "long": (40, 60)}  # (walks, steps each)
PROFILE = os.environ.get("H5REPLAY_MODEL_PROFILE", "short")
WORLDS: dict[str, SamplingConfig] = {
    "fifo queue, rate-limited": SamplingConfig(Fifo(), RateLimit(1, 1.0, 400.0), 1),
    "lifo queue": SamplingConfig(Lifo(), max_times_sampled=1),
    "uniform, samples per insert": SamplingConfig(Uniform(), RateLimit(1, 2.0, 300.0)),
    "prioritized": SamplingConfig(Prioritized(exponent=1.0)),
}
LIMITS = P.Limits(max_rows_per_message=32)
SHARDED, DIRECT = 1, 2  # the "actor" field of the rows each actor writes

Tag = tuple[int, int]  # (actor, episode): which episode a row belongs to
RowTag = tuple[int, int, int]  # (actor, episode, step)

# Replies that came from a publish older than the one their request named (see `_floors`).
_regressions: list[str] = []
_floor_of: dict[tuple[int, int], int] = {}


def _checked_send(original: Any) -> Any:
    def send(self: Connection, factory: Any, timeout: float | None = None) -> int:
        floors: dict[int, int] = {}

        def make(request_id: int) -> P.Request:
            request = factory(request_id)
            if isinstance(getattr(request, "min_seq", None), int):
                floors[request_id] = request.min_seq  # type: ignore[attr-defined]
            return request  # type: ignore[no-any-return]

        request_id: int = original(self, make, timeout)
        if request_id in floors:
            _floor_of[(id(self), request_id)] = floors[request_id]
        return request_id

    return send


def _checked_wait(original: Any) -> Any:
    def wait(self: Connection, request_id: int, timeout: float | None = None) -> P.Reply:
        floor = _floor_of.pop((id(self), request_id), None)
        reply: P.Reply = original(self, request_id, timeout)
        if floor is not None and isinstance(reply, P.ReadReply) and reply.seq < floor:
            _regressions.append(f"{self.endpoint}: a {type(reply).__name__} from publish {reply.seq}, older than "
                                f"publish {floor} its request named")
        return reply

    return wait


class ServiceModel:
    """Two shards, a sharded actor homed on one, a direct actor on shard 1 (commits in flight), a
    sharded learner, and one single-server learner per shard (checks, batches loops), with the
    model of what they were promised."""

    def __init__(self, world: str, home: int, seed: int) -> None:
        self.world, self.sampling = world, WORLDS[world]
        self.consuming = self.sampling.writer_only is not None
        self.removes = self.sampling.removes
        self.prioritized = self.sampling.prioritized
        self.dir = Path(tempfile.mkdtemp(prefix="h5r-model-"))
        self.shards = Shards(self.dir, 2, capacity=100_000, sampling=self.sampling, limits=LIMITS,
                             heartbeat_interval=0.2)
        eps = self.shards.endpoints
        name = next(f"actor-{k}" for k in range(1000) if home_shard(f"actor-{k}", 2) == home)
        short = {"timeout": 2.0, "rate_limit_timeout": 0.3, "shard_retry_interval": 0.2}
        self.actor = ActorClient(config=ClientConfig(name=name, **short), endpoints=eps)
        self.direct = ActorClient(config=ClientConfig(endpoint=eps[1], name="direct", **short))
        self.learner = LearnerClient(config=ClientConfig(name="sharded-learner", **short), endpoints=eps)
        self.singles = [LearnerClient(config=ClientConfig(endpoint=e, name=f"learner-{i}", **short))
                        for i, e in enumerate(eps)]
        self.next_episode = 0
        self.acked: dict[Tag, int] = {}  # acknowledged episodes: length
        self.doubt: dict[Tag, int] = {}  # commits that raised: held at most once
        self.refused: set[Tag] = set()  # refused by the rate limit: never held
        self.pending: list[tuple[PendingCommit, Tag, int]] = []
        self.delivered: list[RowTag] = []  # rows returned by consuming draws
        self.priority: dict[RowTag, float] = {}
        self.quiet = 0  # steps since the last restart, kill or compaction
        self.tally: Counter[str] = Counter()  # what this world did (H5REPLAY_MODEL_VERBOSE=1 prints it)
        self.rng = np.random.default_rng(seed)

    def summary(self) -> str:
        return (f"{self.world}: {dict(self.tally)}; {len(self.acked)} acknowledged, {len(self.doubt)} in doubt, "
                f"{len(self.refused)} refused, {len(self.delivered)} rows drawn")

    def close(self) -> None:
        for client in [self.actor, self.direct, self.learner, *self.singles]:
            with contextlib.suppress(Exception):
                client.close()
        self.shards.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ------------------------------------------------------------------ writes

    def _rows(self, actor: int, n: int) -> tuple[Tag, dict[str, np.ndarray], np.ndarray | None]:
        tag = (actor, self.next_episode)
        self.next_episode += 1
        rows = episode_rows(actor, tag[1], n)
        priorities = None
        if self.prioritized:
            priorities = self.rng.choice([0.5, 1.0, 2.0, 4.0], size=n)
            for step in range(n):
                self.priority[(actor, tag[1], step)] = float(priorities[step])
        return tag, rows, priorities

    def _settled(self, tag: Tag, n: int, outcome: Any) -> None:
        if isinstance(outcome, RateLimitedError):
            self.refused.add(tag)  # refused at once or after its wait: nothing was written
        elif isinstance(outcome, BaseException):
            self.doubt[tag] = n
        else:
            assert outcome.length == n, f"episode {tag}: receipt {outcome} for {n} rows"
            self.acked[tag] = n

    def _try(self, call: Any) -> Any:
        try:
            return call()
        except (ServerUnavailableError, RateLimitedError, NotEnoughDataError) as exc:
            return exc

    def push(self, n: int) -> None:
        self.tally["push"] += 1
        tag, rows, priorities = self._rows(SHARDED, n)
        self._settled(tag, n, self._try(lambda: self.actor.push_episode(rows, priorities)))

    def push_many(self, lengths: list[int]) -> None:
        self.tally["push_many"] += 1
        episodes = [self._rows(SHARDED, n) for n in lengths]
        outcome = self._try(lambda: self.actor.push_episodes([r for _, r, _ in episodes],
                                                             [p for _, _, p in episodes]))
        for (tag, _, _), n, k in zip(episodes, lengths, range(len(lengths))):
            if isinstance(outcome, list):
                self._settled(tag, n, outcome[k])
            else:  # the episodes before the one that failed may be committed: none is known either way
                self.doubt[tag] = n

    def stream(self, n: int, wait: bool) -> None:
        """Steps appended one by one on shard 1, committed waited or in flight."""
        self.tally["stream"] += 1
        tag, rows, priorities = self._rows(DIRECT, n)
        try:
            seg = self.direct.segment()
            for step in range(n):
                seg.append({k: v[step] for k, v in rows.items()}, None if priorities is None else priorities[step])
            outcome = seg.commit(wait=wait)
        except (ServerUnavailableError, RateLimitedError) as exc:
            with contextlib.suppress(H5ReplayError):
                seg.abort()  # a held-back commit leaves the segment open: it is given up
            self._settled(tag, n, exc)
            return
        if isinstance(outcome, PendingCommit):
            self.pending.append((outcome, tag, n))
        else:
            self._settled(tag, n, outcome)

    def push_in_flight(self, n: int) -> None:
        self.tally["push_in_flight"] += 1
        tag, rows, priorities = self._rows(DIRECT, n)
        outcome = self._try(lambda: self.direct.push_episode(rows, priorities, wait=False))
        if isinstance(outcome, PendingCommit):
            self.pending.append((outcome, tag, n))
        else:
            self._settled(tag, n, outcome)

    def _flush(self) -> None:
        with contextlib.suppress(H5ReplayError):
            self.direct.flush()
        for pending, tag, n in self.pending:
            try:
                self._settled(tag, n, pending.result())
            except H5ReplayError as exc:
                self._settled(tag, n, exc)
        self.pending = []

    def flush(self) -> None:
        self.tally["flush"] += 1
        self._flush()

    # ------------------------------------------------------------------ reads

    def _take(self, batch: dict[str, np.ndarray]) -> list[RowTag]:
        return list(zip(batch["actor"].reshape(-1).tolist(), batch["episode"].reshape(-1).tolist(),
                        batch["step"].reshape(-1).tolist()))

    def sample(self, n: int) -> None:
        self.tally["sample"] += 1
        outcome = self._try(lambda: self.learner.sample(n, with_info=True))
        if isinstance(outcome, tuple):
            batch, info = outcome
            assert len(info) == n
            if self.consuming:
                self.delivered += self._take(batch)

    def sample_windows(self, n: int, length: int) -> None:
        self.tally["sample_windows"] += 1
        outcome = self._try(lambda: self.learner.sample_sequences(n, length))
        if isinstance(outcome, dict):
            assert outcome["step"].shape == (n, length)
            rows = self._take(outcome)
            for w in range(n):  # each window lies in one episode, in order
                window = rows[w * length:(w + 1) * length]
                assert len({r[:2] for r in window}) == 1 and [r[2] for r in window] == list(
                    range(window[0][2], window[0][2] + length)), window
            if self.consuming:
                self.delivered += rows

    def loop(self, shard: int, batches: int, size: int) -> None:
        """A few batches of a `batches` loop on one shard, then the loop is left."""
        self.tally["loop"] += 1
        loop = self.singles[shard].batches(size, prefetch=3)
        try:
            for _ in range(batches):
                batch = next(loop)
                if self.consuming:
                    self.delivered += self._take(batch)
        except (ServerUnavailableError, RateLimitedError, NotEnoughDataError):
            pass
        finally:
            loop.close()

    def update(self, k: int, value: float) -> None:
        self.tally["update"] += 1
        outcome = self._try(lambda: self.learner.sample(k, with_info=True))
        if not isinstance(outcome, tuple):
            return
        batch, info = outcome
        deadline = time.monotonic() + 20
        while True:  # waited: once it returns, the model may count on it; a shard down is waited out
            try:
                self.learner.update_priorities(info.packed_row_ids, np.full(k, value))
                break
            except ServerUnavailableError:
                assert time.monotonic() < deadline, "a shard never came back for a priority update"
                time.sleep(0.2)
        for tag in self._take(batch):
            self.priority[tag] = value

    # ------------------------------------------------------------------ the servers

    def maintain(self, shard: int, how: str) -> None:
        self.tally[f"maintain {how}"] += 1
        if how == "sigkill":
            self.shards.kill(shard)
        else:
            self.shards.stop(shard)
            if how == "compact":
                compact_file(self.shards.paths[shard])
        self.shards.start(shard)
        self.quiet = 0

    # ------------------------------------------------------------------ what was promised

    def _held(self) -> tuple[Counter[Tag], dict[int, dict[int, RowTag]], list[str]]:
        """(episodes held over the shards, per shard: row id -> row tag, problems)."""
        held: Counter[Tag] = Counter()
        rows_of: dict[int, dict[int, RowTag]] = {}
        problems: list[str] = []
        for shard, single in enumerate(self.singles):
            episodes = self._until_up(single.episodes)
            rows_of[shard] = {}
            for episode in episodes:
                ids = np.arange(episode.first_row_id, episode.first_row_id + episode.length)
                rows = self._until_up(lambda ids=ids, single=single: single.get_rows(ids))
                problems += [f"shard {shard}: {p}" for p in episode_problems(rows, episode.length)]
                tag = (int(rows["actor"][0]), int(rows["episode"][0]))
                held[tag] += 1
                rows_of[shard].update(zip(ids.tolist(), self._take(rows)))
        return held, rows_of, problems

    def _writer_figures(self, shard: int) -> dict[str, Any]:
        """The writer's own figures (one snapshot of its state: the rows committed and those left
        to draw agree even while commits arrive)."""
        conn = self.singles[shard]._conn
        return dict(self._until_up(lambda: conn.request(lambda rid: P.Info(rid)).stats))  # type: ignore[attr-defined]

    @staticmethod
    def _until_up(call: Any) -> Any:
        """`call()`, waiting out a shard that is starting again (a read is refused meanwhile)."""
        deadline = time.monotonic() + 30
        while True:
            try:
                return call()
            except ServerUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)

    def check(self) -> None:
        """Everything the model says must hold now."""
        self.quiet += 1
        assert not _regressions, _regressions
        kept = self.learner.num_kept + sum(s.num_kept for s in self.singles)
        if self.removes:
            self._check_queue(kept)
        else:
            self._check_held()
        if self.consuming and not self.removes:
            sampled = sum(int(self._writer_figures(shard)["sampled"]) for shard in range(2))
            assert sampled == len(self.delivered) + kept, (
                f"the rate limit counted {sampled} rows sampled; {len(self.delivered)} reached the learner and "
                f"{kept} are kept by it")

    def _check_held(self) -> None:
        # Draws first, each of one message (one state: the parts of a split sample may come from
        # different publishes), with the state it came from: commits in flight may land meanwhile,
        # and a draw's probabilities are over the rows of its own state (ids below its view's end).
        draws = {}
        if self.prioritized:
            for shard, single in enumerate(self.singles):
                outcome = self._until_up(lambda single=single: self._try(
                    lambda: single.sample(LIMITS.max_rows_per_message, with_info=True)))
                if isinstance(outcome, tuple) and single.view is not None:
                    draws[shard] = (outcome[1], single.view.end)
        held, rows_of, problems = self._held()
        assert not problems, problems
        for tag in self.acked:
            assert held[tag] == 1, f"acknowledged episode {tag} is held {held[tag]} times"
        unsure = {tag for _, tag, _ in self.pending} | set(self.doubt)
        for tag, count in held.items():
            assert tag in self.acked or (tag in unsure and count == 1), f"episode {tag} is held {count} times, " \
                f"acknowledged: {tag in self.acked}, refused: {tag in self.refused}"
        for shard, (info, end) in draws.items():
            tags = {row_id: tag for row_id, tag in rows_of[shard].items() if row_id < end}
            total = sum(self.priority[tag] for tag in tags.values())
            expected = [self.priority[tags[int(i)]] / total for i in info.row_ids]
            assert np.allclose(info.probabilities, expected), f"shard {shard}: draw probabilities differ from the " \
                "priorities given and acknowledged"

    def _check_queue(self, kept: int) -> None:
        returned = Counter(self.delivered)
        twice = [row for row, count in returned.items() if count > 1]
        assert not twice, f"rows returned twice by a queue: {twice[:5]}"
        known = self.acked.keys() | self.doubt.keys() | {tag for _, tag, _ in self.pending}
        strange = [row for row in returned if row[:2] not in known]
        assert not strange, f"rows returned that no commit sent: {strange[:5]}"
        infos = [self._writer_figures(shard) for shard in range(2)]
        committed = sum(int(i["total_rows"]) for i in infos)
        left = sum(int(i["sampleable"]) for i in infos)
        assert committed == len(self.delivered) + kept + left, (
            f"{committed} rows committed, {len(self.delivered)} returned, {kept} kept by the learners, {left} left to "
            "draw: rows left a queue without reaching a learner")
        acked_rows = sum(self.acked.values())
        unsure_rows = sum(self.doubt.values()) + sum(n for _, _, n in self.pending)
        assert acked_rows <= committed <= acked_rows + unsure_rows, (acked_rows, committed, unsure_rows)


def _next_step(model: ServiceModel) -> tuple[str, tuple[Any, ...]]:
    """What the walk does next (a method of the model and its arguments), drawn by weight."""
    rng = model.rng
    steps: list[tuple[float, str, Any]] = [
        (3, "push", lambda: (int(rng.integers(1, 41)),)),
        (2, "push_many", lambda: ([int(n) for n in rng.integers(1, 13, size=int(rng.integers(2, 6)))],)),
        (3, "stream", lambda: (int(rng.integers(1, 41)), bool(rng.integers(2)))),
        (3, "push_in_flight", lambda: (int(rng.integers(1, 41)),)),
        (1, "flush", lambda: ()),
        (4, "sample", lambda: (int(rng.integers(1, 101)),)),
        (2, "loop", lambda: (int(rng.integers(2)), int(rng.integers(1, 5)), int(rng.integers(1, 41)))),
    ]
    if not model.removes:
        steps.append((2, "sample_windows", lambda: (int(rng.integers(1, 13)), int(rng.integers(1, 7)))))
    if model.prioritized:
        steps.append((3, "update", lambda: (int(rng.integers(1, 21)), float(rng.choice([0.25, 1.0, 3.0, 8.0])))))
    if model.quiet >= 4:  # a restart, kill or compaction now and then, not at every other step
        steps.append((2, "maintain", lambda: (int(rng.integers(2)), ["restart", "sigkill", "compact"][int(rng.integers(3))])))
    weights = np.array([w for w, _, _ in steps], np.float64)
    _, name, args = steps[int(rng.choice(len(steps), p=weights / weights.sum()))]
    return name, args()


WALKS, STEPS = PROFILES[PROFILE]


@pytest.mark.timeout(60 + 12 * STEPS)
@pytest.mark.parametrize("seed", range(WALKS))
def test_walk(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(Connection, "send", _checked_send(Connection.send))
    monkeypatch.setattr(Connection, "wait", _checked_wait(Connection.wait))
    _regressions.clear()
    world = sorted(WORLDS)[seed % len(WORLDS)]
    model = ServiceModel(world, home=(seed // len(WORLDS)) % 2, seed=seed)
    done: list[str] = []
    try:
        model.check()
        for _ in range(STEPS):
            name, args = _next_step(model)
            done.append(f"{name}{args}")
            getattr(model, name)(*args)
            model.check()
        model._flush()
        done.append("flush()")
        model.check()
    except BaseException as exc:
        raise AssertionError(f"walk {seed} ({world}) failed after steps {done}: {exc}") from exc
    finally:
        if os.environ.get("H5REPLAY_MODEL_VERBOSE"):
            print(f"\nwalk {seed}: {model.summary()}")
        model.close()
