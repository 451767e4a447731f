"""`h5replay learner`: sample batches from a server and print what they say about the data.

It stands in for a training loop: it samples as fast as the server serves, and every few seconds
prints the rows and episodes held, the episodes' mean length and return (when the space has
'reward'), the sampling rate, and the mean and spread of every numeric field seen so far. It waits
politely while the server is not up yet or the buffer is empty, and reconnects if the server
goes away. SIGTERM or SIGINT ends it at once, in the middle of a request if need be (a request to
a server that went away would otherwise hold it for its whole timeout), and it prints how much it
sampled: a learner has nothing to save.

Any space works; nothing here needs gymnasium. Reports go to stdout, logs to stderr.
"""

from __future__ import annotations

import contextlib
import logging
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, TextIO

import numpy as np

from h5replay.errors import ConfigError, EvictedError, NotEnoughDataError, ServerUnavailableError
from h5replay.spaces import BinarySpace, BoxSpace, LeafSpace, named_leaves

__all__ = ["run_learner", "LeafStats"]

log = logging.getLogger("h5replay.examples.learner")

_EMPTY_WAIT = 0.5  # seconds between samples while the buffer is empty
_RECENT_EPISODES = 100  # episodes whose returns a report reads...
_REPORT_BYTES = 4 * 1024 * 1024  # ... at most this many bytes of them
_MAX_COMPONENTS = 8  # fields with at most this many numbers per row are reported per component


class LeafStats:
    """Running mean and standard deviation of one numeric field, overall and (for small fields)
    per component. Sums are float64, plenty for a report."""

    def __init__(self, leaf: LeafSpace) -> None:
        self.size = int(np.prod(leaf.shape, dtype=np.int64))
        self.per_component = 1 < self.size <= _MAX_COMPONENTS
        self.count = 0
        self.total = np.zeros(self.size if self.per_component else 1)
        self.total_sq = np.zeros_like(self.total)

    def add(self, values: np.ndarray) -> None:
        rows = np.asarray(values, dtype=np.float64).reshape(len(values), -1)
        if not self.per_component:
            rows = rows.reshape(-1, 1)
        self.count += rows.shape[0]
        self.total += rows.sum(axis=0)
        self.total_sq += np.square(rows).sum(axis=0)

    def mean_std(self) -> tuple[np.ndarray, np.ndarray]:
        n = max(1, self.count)
        mean = self.total / n
        return mean, np.sqrt(np.maximum(self.total_sq / n - np.square(mean), 0.0))

    def describe(self) -> str:
        if not self.count:
            return "no data yet"
        mean, std = self.mean_std()
        return f"mean {self._format(mean)}  std {self._format(std)}"

    def _format(self, values: np.ndarray) -> str:
        if self.per_component:
            return "[" + ", ".join(f"{x:.3g}" for x in values) + "]"
        return f"{values[0]:.4g}"


class _Report:
    """What the learner has seen: batches, rows, and per-field statistics."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.started = self.since = time.monotonic()
        self.batches = self.rows = 0
        self.recent_batches = self.recent_rows = 0
        self.fields: dict[str, LeafStats] = {}

    def add(self, leaves: list[tuple[str, LeafSpace]], batch: Any) -> None:
        n = 0
        for path, leaf in leaves:
            if not isinstance(leaf, (BoxSpace, BinarySpace)):
                continue  # text: nothing to average
            values = _leaf_value(batch, path)
            n = len(values)
            self.fields.setdefault(path, LeafStats(leaf)).add(values)
        self.batches += 1
        self.recent_batches += 1
        self.rows += n
        self.recent_rows += n

    def print(self, client: Any) -> None:
        now = time.monotonic()
        elapsed = max(1e-9, now - self.since)
        info = client.info()
        lines = [
            f"learner @ {now - self.started:.1f} s: {info['length']:,} rows held (capacity {info['capacity']:,}) in "
            f"{info['num_episodes']:,} episodes; sampled {self.recent_batches / elapsed:.1f} batches/s, "
            f"{self.recent_rows / elapsed:,.0f} rows/s ({self.batches:,} batches so far)",
            f"  episodes: {_episode_summary(client)}",
        ]
        width = max([len(p) for p in self.fields] + [1])
        lines += [f"  {path:<{width}}  {stats.describe()}" for path, stats in self.fields.items()]
        print("\n".join(lines), file=self.out, flush=True)
        self.since, self.recent_batches, self.recent_rows = now, 0, 0


def _leaf_value(batch: Any, path: str) -> np.ndarray:
    node = batch
    for key in path.split("/") if isinstance(batch, dict) else []:
        node = node[key]
    return np.asarray(node)


def _episode_summary(client: Any) -> str:
    """Mean length of every episode held and, with a 'reward' field, the mean return of the most
    recent ones. Read by row id with two requests while actors write: when the ring evicted some
    of those rows in between, the returns are left out of this report. Works over several shards
    too (the ids are then packed ids)."""
    segments = [(ep.first_row_id, ep.length) for ep in client.episodes()]
    if not segments:
        return "none complete yet"
    lengths = np.array([n for _, n in segments])
    text = f"{len(segments):,} complete, mean length {lengths.mean():.1f} (min {lengths.min()}, max {lengths.max()})"
    leaves = dict(named_leaves(client.space))
    if "reward" not in leaves or not isinstance(leaves["reward"], BoxSpace):
        return text
    row_bytes = sum(leaf.row_bytes for leaf in leaves.values())
    budget = min(client.limits.max_rows_per_message, max(1, _REPORT_BYTES // max(1, row_bytes)))
    recent: list[tuple[int, int]] = []
    for start, length in reversed(segments[-_RECENT_EPISODES:]):
        if recent and sum(n for _, n in recent) + length > budget:
            break
        recent.append((start, length))
    if not recent or sum(n for _, n in recent) > budget:
        return text
    try:
        rows = client.get_rows(np.concatenate([np.arange(s, s + n) for s, n in recent]))
    except EvictedError:
        return text
    rewards = _leaf_value(rows, "reward")
    done = np.zeros(len(rewards), bool)
    for flag in ("terminated", "truncated", "done"):
        if flag in leaves and isinstance(leaves[flag], BinarySpace) and leaves[flag].shape == ():
            done |= _leaf_value(rows, flag)
    checks = any(flag in leaves for flag in ("terminated", "truncated", "done"))
    returns, offset = [], 0
    for _, n in recent:
        ends = done[offset : offset + n]
        if not checks or (ends[-1] and not ends[:-1].any()):
            returns.append(float(rewards[offset : offset + n].sum()))
        offset += n
    if returns:
        text += f"; mean return {np.mean(returns):.2f} over the last {len(returns)}"
    return text


class _Stopped(Exception):
    """A stop signal came: raised wherever the learner was, a request waiting on the server included."""


@contextlib.contextmanager
def _stop_at_once_on_signals() -> Iterator[threading.Event]:
    """An event set by the first SIGTERM or SIGINT while the block runs, which also raises _Stopped
    where the main thread is; a blocking ZeroMQ poll is interrupted by it too. Off the main thread
    nothing is installed. The previous handlers come back afterwards."""
    stop = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(*_: Any) -> None:
        if not stop.is_set():  # only once: a second signal must not break the way out
            stop.set()
            raise _Stopped

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _where(endpoint: str | Sequence[str]) -> dict[str, Any]:
    """The client argument for one server, or for several (shards)."""
    if isinstance(endpoint, str):
        return {"endpoint": endpoint}
    endpoints = list(endpoint)
    return {"endpoint": endpoints[0]} if len(endpoints) == 1 else {"endpoints": endpoints}


def _connect(endpoint: str | Sequence[str], timeout: float, deadline: float, stop: Any, keys: dict[str, Any]) -> Any:
    """A LearnerClient, retrying until the server answers, the deadline passes or a signal comes."""
    from h5replay.client import LearnerClient

    waiting = False
    while not stop.is_set():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        try:
            return LearnerClient(timeout=min(timeout, remaining), **_where(endpoint), **keys)
        except ServerUnavailableError:
            if not waiting:
                log.info("waiting for the server at %s", endpoint)
                waiting = True
    return None


def run_learner(
    endpoint: str | Sequence[str],
    batch_size: int = 256,
    seconds: float = 0.0,
    report_every: float = 5.0,
    timeout: float = 30.0,
    secret_key: str | None = None,
    server_key: str | None = None,
    *,
    out: TextIO | None = None,
) -> int:
    """Sample `batch_size` rows at a time for `seconds` (0: until SIGTERM / SIGINT), printing a report
    every `report_every` seconds and a last one at the end.

    `endpoint` may be a list of several servers (shards): the learner samples all of them.

    Blocks for the whole run. Each connection attempt and each request waits up to `timeout`;
    while the server is down the learner keeps trying (until `seconds` pass). Empty key paths
    mean no key.

    Returns:
        0 when it ran its course or was stopped by a signal (at once, mid-request if need be), 1
        when no server ever answered.
    """
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    if seconds < 0:
        raise ConfigError(f"seconds must be >= 0 (0: until stopped), got {seconds}")
    if report_every <= 0:
        raise ConfigError(f"report_every must be > 0 seconds, got {report_every}")
    out = out or sys.stdout
    deadline = time.monotonic() + seconds if seconds > 0 else math.inf
    keys = {"secret_key": secret_key or None, "server_key": server_key or None}
    report = _Report(out)
    connected = stopped = False
    with _stop_at_once_on_signals() as stop:
        try:
            while not stop.is_set() and time.monotonic() < deadline:
                client = _connect(endpoint, timeout, deadline, stop, keys)
                if client is None:
                    break
                connected = True
                try:
                    with client:
                        _sample(client, batch_size, report_every, deadline, stop, report)
                except ServerUnavailableError as exc:
                    log.warning("lost the server: %s; reconnecting", exc)
        except _Stopped:
            log.info("stopped by a signal")
            stopped = True
    if not connected and not stopped:
        log.error("no server answered at %s", endpoint)
        return 1
    elapsed = time.monotonic() - report.started
    print(f"learner done: {report.batches:,} batches ({report.rows:,} rows) sampled in {elapsed:.1f} s",
          file=out, flush=True)
    return 0


def _sample(client: Any, batch_size: int, report_every: float, deadline: float, stop: Any, report: _Report) -> None:
    leaves = named_leaves(client.space)
    if client.shards is not None:
        log.info("sampling batches of %d from %d shards: %s", batch_size, len(client.endpoints), " ".join(client.endpoints))
    else:
        log.info("sampling batches of %d from %s (reads on %s)", batch_size, client.config.endpoint, client.read_endpoint)
    next_report = time.monotonic() + report_every
    empty = False
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            batch = client.sample(batch_size)
        except NotEnoughDataError:
            if not empty:
                log.info("the buffer is empty; waiting for actors")
                empty = True
            stop.wait(max(0.0, min(_EMPTY_WAIT, deadline - time.monotonic())))
        else:
            empty = False
            report.add(leaves, batch)
        if time.monotonic() >= next_report:
            report.print(client)
            next_report = time.monotonic() + report_every
    if time.monotonic() - report.since > 0.1:  # the last one, unless one was just printed
        report.print(client)
