"""Transitions: each episode's final observation, kept and read back, and n-step transitions
drawn from a table (`sample_transitions`) or read at given rows (`get_transitions`). A mixin of `ReplayBuffer`: the file's layout lives in
`finals.py`, the n-step arithmetic in `transitions.py`, the draw in a table (`table.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from h5replay.errors import ConfigError, EvictedError
from h5replay.records import NO_EPISODE, SampleInfo
from h5replay.spaces import Schema
from h5replay.storage.replay.draws import ordered_draw, positive_int
from h5replay.storage.replay.episodes import EpisodeTable
from h5replay.storage.replay.finals import FinalsFile
from h5replay.storage.replay.ring import as_row_ids, check_held
from h5replay.storage.replay.rows import RowStore
from h5replay.storage.replay.state import State
from h5replay.storage.replay.table import Sampling
from h5replay.storage.replay.tables import Tables
from h5replay.transitions import DISCOUNT, NEXT, TransitionKeys, check_n_step, plan_n_step

__all__ = ["Transitions"]

_T = TypeVar("_T")


class Transitions:
    """ReplayBuffer's verbs of final observations and transitions."""

    # What this mixin uses of ReplayBuffer (set in its __init__, defined in buffer.py and draws.py).
    storage: RowStore
    _episodes: EpisodeTable
    _tables: Tables
    _finals: FinalsFile | None
    _transition_schema: Schema | None = None

    if TYPE_CHECKING:

        def _check_open(self) -> None: ...
        def _phys(self, ids: Any, view: State) -> Any: ...
        def _consistent(self, attempt: Callable[[State], tuple[_T, int]]) -> _T: ...
        def _check_sampler(self, sampling: Sampling) -> None: ...
        def _check_sample(self, sampling: Sampling, rows: int) -> None: ...
        def _count_sampled(self, sampling: Sampling, row_ids: np.ndarray, rows: int) -> None: ...

    @property
    def transition_keys(self) -> TransitionKeys | None:
        """The observation keys and reward / end-flag leaves the file was created with (None:
        it keeps no final observations)."""
        return None if self._finals is None else self._finals.keys

    def _finals_or_raise(self) -> FinalsFile:
        if self._finals is None:
            raise ConfigError("this buffer keeps no final observations: create it with observation_keys= "
                              "(serve --observation-keys) to give episodes a final")
        return self._finals

    def _encode_final(self, final: Any) -> dict[str, np.ndarray] | None:
        """A final observation in storage form, checked before anything is written (None: none):
        the value of the one observation key, or a dict of the observation keys when there are
        several.

        Raises:
            ConfigError: the file was created without observation keys.
            SpaceMismatchError: it is not a sample of the observation part of the space.
        """
        if final is None:
            return None
        finals = self._finals_or_raise()
        return finals.schema.encode_one(finals.keys.as_observation(final))

    def finals_from_stored(self, arrays: Mapping[str, np.ndarray], episodes: int,
                           has_final: np.ndarray | None = None) -> list[Any]:
        """The final observations of `episodes` episodes off the wire, checked and as `final=`
        takes them (None for an episode without): `arrays` in storage form, one array per
        observation leaf, a row for each episode `has_final` marks (None: for every episode).
        No arrays: no episode has a final.

        Raises:
            ConfigError: the file keeps no final observations.
            SpaceMismatchError: the arrays are not the observation part of the space.
        """
        if not arrays:
            return [None] * episodes
        finals = self._finals_or_raise()
        marked = np.ones(episodes, dtype=bool) if has_final is None else np.asarray(has_final, dtype=bool)
        count = int(marked.sum())
        checked = finals.schema.validate_stored(arrays, count)
        values = iter([finals.keys.as_final(finals.schema.decode_one({path: arr[i] for path, arr in checked.items()}))
                       for i in range(count)])
        return [next(values) if has else None for has in marked.tolist()]

    def final_observation(self, episode_id: int) -> Any:
        """The final observation an episode held was committed with (as `final=` took it), or
        None when it has none (or the file keeps none).

        Raises:
            EvictedError / IndexError: the episode is not held (never committed, or evicted).
        """
        self._check_open()
        episode = int(episode_id)
        finals = self._finals

        def attempt(view: State) -> tuple[Any, int]:
            if not view.ep_begin <= episode < view.ep_end:
                if episode >= view.ep_end or episode < 0:
                    raise IndexError(f"episode {episode} was never committed: the next episode id is {view.ep_end}")
                raise EvictedError(f"episode {episode} is no longer held (the oldest held is {view.ep_begin})")
            last = self._episodes.start_of(episode) + self._episodes.length_of(episode) - 1
            if finals is None:
                return None, last
            has, rows = finals.read(np.array([self._episodes.slot(episode)], dtype=np.int64))
            if not has[0]:
                return None, last
            return finals.keys.as_final(finals.schema.decode_one({path: arr[0] for path, arr in rows.items()})), last

        return self._consistent(attempt)

    def sample_transitions(
        self, batch_size: int, *, n_step: int = 1, gamma: float = 0.99, with_info: bool = False,
        rng: np.random.Generator | None = None, decode: bool = True, table: str | None = None, skip: int = 0,
    ) -> Any:
        """`batch_size` n-step transitions, each from a step drawn by `table`'s sampler (by the
        priority of that step when it is prioritized): the step's leaves, with `reward` the
        discounted sum of the next `k = min(n_step, steps left in its episode)` rewards,
        `discount` = gamma ** k, `terminated` / `truncated` those of the last step summed, and
        `next` the observation leaves `n_step` steps later, or the episode's final observation
        when it ends sooner. An episode without a final (or not yet ended) gives its last steps
        `discount` 0 and `truncated` set: `reward + discount * (1 - terminated) * V(next)` is the
        target of every transition. `with_info=True`: (batch, SampleInfo) with `has_final`.

        Raises:
            ConfigError: the file was created without observation keys, or lacks the reward /
                end-flag leaves; a bad n_step or gamma; no such table.
            NotEnoughDataError / RateLimitedError / ReadOnlyError: as `sample`.
        """
        keys = self.transition_keys
        if keys is None or self._finals is None:
            raise ConfigError("sample_transitions needs a buffer created with observation_keys= (serve "
                              "--observation-keys): the keys of the space that are the observation")
        n, discount_rate = check_n_step(n_step, gamma)
        keys.check_sampling(self.storage.single_instance_space)
        size = positive_int(batch_size, "batch_size")
        sampling = self._tables.pick(table)
        rng = rng if rng is not None else np.random.default_rng()
        self._check_sampler(sampling)
        self._check_sample(sampling, size)

        def attempt(view: State) -> tuple[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray, np.ndarray], int]:
            g, probabilities = ordered_draw(sampling, view, size, rng, skip)
            out, episode_ids, has = self._transitions_from(view, g, keys, n, discount_rate)
            return (out, g, probabilities, episode_ids, has), int(g.min())

        out, g, probabilities, episode_ids, has = self._consistent(attempt)
        self._count_sampled(sampling, g, size)
        batch = self._decoded_transitions(out, keys) if decode else out
        if not with_info:
            return batch
        return batch, SampleInfo(g.astype(np.uint64), episode_ids, probabilities, has_final=has)

    def get_transitions(self, row_ids: Any, *, n_step: int = 1, gamma: float = 0.99, with_info: bool = False,
                        decode: bool = True) -> Any:
        """The n-step transitions that start at these rows (by global row id, any order,
        duplicates kept), as `sample_transitions` returns them; for offline passes over every
        step in an order of one's own. No sampler runs: nothing is counted as sampled.
        `with_info=True`: (batch, SampleInfo) with probabilities 0 (nothing was drawn).

        Raises:
            ConfigError: as `sample_transitions`.
            EvictedError / IndexError / TypeError: as `get_rows`.
        """
        self._check_open()
        keys = self.transition_keys
        if keys is None or self._finals is None:
            raise ConfigError("get_transitions needs a buffer created with observation_keys= (serve "
                              "--observation-keys): the keys of the space that are the observation")
        n, discount_rate = check_n_step(n_step, gamma)
        keys.check_sampling(self.storage.single_instance_space)
        ids = as_row_ids(row_ids)
        if ids.size == 0:
            raise ConfigError("get_transitions takes at least one row id")

        def attempt(view: State) -> tuple[tuple[dict[str, np.ndarray], np.ndarray, np.ndarray], int]:
            lowest = check_held(ids, view)  # before any read: an id not held names itself
            return self._transitions_from(view, ids, keys, n, discount_rate), lowest

        out, episode_ids, has = self._consistent(attempt)
        batch = self._decoded_transitions(out, keys) if decode else out
        if not with_info:
            return batch
        return batch, SampleInfo(ids.astype(np.uint64), episode_ids, np.zeros(ids.size), has_final=has)

    def _decoded_transitions(self, out: dict[str, np.ndarray], keys: TransitionKeys) -> Any:
        if self._transition_schema is None:  # made once: a Schema costs more than a small draw
            self._transition_schema = Schema(keys.transition_space(self.storage.single_instance_space))
        return self._transition_schema.decode(out)

    def _transitions_from(self, view: State, g: np.ndarray, keys: TransitionKeys, n: int,
                          discount_rate: float) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
        """The stored transitions starting at held rows `g` in `view`: (arrays in storage form,
        their episode ids, whether each episode has its final)."""
        finals = self._finals_or_raise()
        observed = [path for path, _ in finals.schema.leaves]
        size = g.shape[0]
        episode_ids, starts, lengths = self._episodes.locate(g)
        recorded = episode_ids != NO_EPISODE
        open_tail = ~recorded & (g >= view.open_start)  # the episode being appended: to the tail
        lasts = np.where(recorded, starts + lengths - 1, np.where(open_tail, view.end - 1, g))
        plan = plan_n_step(g, lasts, n, discount_rate)
        out: dict[str, np.ndarray] = self.storage.read("array", self._phys(g, view), False)
        ends = self.storage.read_leaves([keys.terminated, keys.truncated], self._phys(plan.last_ids, view))
        rewards = self.storage.read_leaves([keys.reward], self._phys(plan.reward_ids, view))[keys.reward]
        to_final = plan.next_ids < 0
        nexts = self.storage.read_leaves(observed, self._phys(np.where(to_final, g, plan.next_ids), view))
        has = np.zeros(size, dtype=bool)
        if recorded.any():
            slots = self._episodes.slots(episode_ids[recorded])
            has[recorded] = finals.has(slots)
            bootstrap = has & to_final  # only these read a final's rows
            if bootstrap.any():
                held = finals.rows(self._episodes.slots(episode_ids[bootstrap]))
                for path in observed:
                    nexts[path][bootstrap] = held[path]
        cut = to_final & ~has  # nothing to bootstrap from
        for path in observed:
            nexts[path][cut] = 0
        discount = np.where(cut, 0.0, plan.discount(discount_rate)).astype(np.float32)
        out[keys.reward] = plan.reward(rewards).astype(out[keys.reward].dtype)
        terminated, truncated = ends[keys.terminated], ends[keys.truncated]
        truncated[cut & (terminated.reshape(size, -1) == 0).all(axis=1)] = 1  # (an ended episode needs none)
        out[keys.terminated], out[keys.truncated] = terminated, truncated
        out.update({f"{NEXT}/{path}": nexts[path] for path in observed})
        out[DISCOUNT] = discount
        return out, episode_ids, has
