"""Rows a consuming draw handed to a learner that no call of it has returned yet.

A draw that changes the server's state (a queue's removal, a rate limit's count) cannot be drawn
again: when a batch is put together from several messages or shards and one part fails (the
queue ran dry meanwhile, the rate limit held it past its timeout, a shard went down), the parts
already served have left their queues for good. They are kept here, in the order they were drawn,
and the learner's next sample of the same kind returns them first; the failed call raises as it
would have, saying how many rows it kept. So no row leaves a queue without reaching a caller,
whatever splits the request (Reverb's queue tables promise the same of their samplers).

Pure (numpy only): parts are (arrays by leaf path, SampleInfo), one entry per row or per window.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable, Mapping
from typing import Any

import numpy as np

from h5replay.records import SampleInfo

__all__ = ["Kept", "Part", "kept_error", "join_parts"]

#: Rows (or windows) drawn together: leaf arrays with one entry per row, and their info.
Part = tuple[Mapping[str, np.ndarray], SampleInfo]


class Kept:
    """Parts per kind of draw (`("rows",)`, `("windows", length)`), oldest first."""

    def __init__(self) -> None:
        self._parts: dict[Hashable, collections.deque[Part]] = {}

    def count(self, kind: Hashable | None = None) -> int:
        """Rows (windows) kept of `kind`, or of every kind."""
        queues = self._parts.values() if kind is None else [self._parts.get(kind, collections.deque())]
        return sum(len(info) for queue in queues for _, info in queue)

    def take(self, kind: Hashable, n: int) -> list[Part]:
        """Up to `n` of the oldest rows kept of `kind`, taken out (a part is split when needed)."""
        queue = self._parts.get(kind)
        out: list[Part] = []
        have = 0
        while queue and have < n:
            arrays, info = queue.popleft()
            room = n - have
            if len(info) > room:  # keep the rest for later, in front
                queue.appendleft(({k: a[room:] for k, a in arrays.items()}, info.slice(room, len(info))))
                arrays, info = {k: a[:room] for k, a in arrays.items()}, info.slice(0, room)
            out.append((arrays, info))
            have += len(info)
        if queue is not None and not queue:
            del self._parts[kind]
        return out

    def put(self, kind: Hashable, parts: list[Part]) -> None:
        """Keep `parts` (in order) after everything of `kind` kept now."""
        queue = self._parts.setdefault(kind, collections.deque())
        queue.extend(p for p in parts if len(p[1]))
        if not queue:
            del self._parts[kind]

    def give_back(self, kind: Hashable, parts: list[Part]) -> None:
        """Keep `parts` (in order) ahead of anything of `kind` kept now: a call that took kept
        rows and then failed puts them back where they were, followed by what it drew."""
        parts = [p for p in parts if len(p[1])]
        if not parts:
            return
        queue = self._parts.setdefault(kind, collections.deque())
        queue.extendleft(reversed(parts))

    def take_all(self) -> dict[Hashable, list[Part]]:
        """Everything kept, by kind (a client closing hands it to its owner, or drops it)."""
        parts, self._parts = self._parts, {}
        return {kind: list(queue) for kind, queue in parts.items()}


def kept_error(error: BaseException, count: int) -> BaseException:
    """`error` (of the same class, so callers catch it as before) saying that `count` rows drawn
    by the failed call are kept for the next one."""
    if count <= 0:
        return error
    try:
        again: BaseException = type(error)(f"{error}; the {count} rows (or windows) drawn before it are kept by this "
                                           "client and come first in its next sample")
    except Exception:  # an exception class that takes other arguments: keep it as it is
        return error
    again.__cause__ = error
    return again


def join_parts(parts: list[Part], names: Any) -> tuple[dict[str, np.ndarray], SampleInfo]:
    """One part of all `parts`, in order (leaves `names`)."""
    if len(parts) == 1:
        return dict(parts[0][0]), parts[0][1]
    arrays = {name: np.concatenate([p[0][name] for p in parts]) for name in names}
    info = parts[0][1]
    for _, more in parts[1:]:
        info = info.concatenate(more)
    return arrays, info
