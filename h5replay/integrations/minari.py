"""Minari: `to_minari(rb, dataset_id)` writes a replay's episodes as a Minari dataset, and
`from_minari(dataset_id, path)` builds a replay file from one; both go a few episodes at a time,
so memory stays flat whatever the size of the data.

A Minari episode of T steps has T + 1 observations: the T the actions were taken in, then the
final one. h5replay keeps that final observation beside the episode when the file was created
with `observation_keys=` (`RecordEpisodes` records it), so only such files export; an episode
committed without its final is refused (`missing_final="error"`, the default, naming it) or left
out (`missing_final="skip"`): h5replay never invents an observation. Leaves other than the
observation, action, reward and end flags go to the episode's `infos`, one entry per step.

`from_minari` stores the rows `RecordEpisodes` records (`row_space` of the dataset's spaces:
obs, action, float32 reward, terminated, truncated) with each episode's final observation, so
the replay can be served and extended online by `RecordEpisodes`. Minari's `infos` are not
imported. Datasets are looked up under MINARI_DATASETS_PATH (Minari's own rule) and never
downloaded. Needs minari: `pip install 'h5replay[minari]'`.
"""

from __future__ import annotations

import itertools
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np

try:
    import minari
    import PIL  # noqa: F401  # minari's HDF5 storage imports pillow, which minari[hdf5] does not require
    from minari.data_collector.episode_buffer import EpisodeBuffer
    from minari.dataset.minari_dataset import parse_dataset_id
    from minari.dataset.minari_storage import MinariStorage
    from minari.storage import get_dataset_path
    from packaging.version import InvalidVersion, Version
except ImportError as exc:  # pragma: no cover - exercised only without minari
    raise ImportError("h5replay.integrations.minari needs minari and pillow: pip install 'h5replay[minari]'") from exc

from h5replay.errors import ConfigError
from h5replay.integrations.gym import space_to_gymnasium
from h5replay.integrations.gym_record import row_space
from h5replay.spaces import DictSpace
from h5replay.spaces.gym import value_from_gymnasium, value_to_gymnasium
from h5replay.storage import ReplayBuffer

__all__ = ["to_minari", "from_minari", "OLDEST_MINARI_FORMAT"]

#: Minari 0.4.0 gave episodes their present layout (T + 1 observations, terminations and
#: truncations); h5replay reads datasets of that version on that the installed minari reads too.
OLDEST_MINARI_FORMAT = "0.4.0"
_FORMATS = ("hdf5", "arrow", "parquet")  # the storages minari 0.5 writes
_PAGE = 256  # episodes listed at a time on export
# minari's HDF5 storage keeps its file open for a whole `iterate_episodes` / `update_episodes`, and
# HDF5's caches of the episodes' groups grow with each episode (reading 1,500 episodes of 100 KB:
# +80 MB of RSS; writing them: +30 MB): going `_BATCH` episodes a call keeps memory flat, at no
# cost in time.
_BATCH = 8
_GROUP_COMMIT = 64  # episodes imported per publish of the replay file
_NAGS = r".*(is set to None|env_spec is None)"  # minari's reminders to fill in optional metadata

Progress = Callable[[int, int], None]


def to_minari(
    rb: ReplayBuffer, dataset_id: str, *, action_key: str = "action", missing_final: str = "error",
    overwrite: bool = False, progress: Progress | None = None, **metadata: Any,
) -> Any:
    """Write every complete episode `rb` holds, oldest first, as the Minari dataset `dataset_id`
    (under MINARI_DATASETS_PATH); blocks until it is written, a few episodes at a time.

    `metadata` goes to `minari.create_dataset_from_buffers` (env, eval_env, author,
    author_email, code_permalink, algorithm_name, description, requirements, data_format;
    jpeg_encoding is False unless given, so image observations stay exact); Minari's reminders
    about fields left out are not shown. `progress(done, total)` is called after each episode.

    Returns:
        The dataset, as `minari.load_dataset(dataset_id)` opens it.

    Raises:
        ConfigError: the id is malformed or taken (without `overwrite`), the buffer keeps no
            final observations or has no `action_key` leaf, an episode has no final observation
            (with `missing_final="error"`; nothing is left of the dataset), or a space has no
            gymnasium counterpart.
    """
    if missing_final not in ("error", "skip"):
        raise ConfigError(f"missing_final is 'error' or 'skip', got {missing_final!r}")
    keys = rb.transition_keys
    if keys is None:
        raise ConfigError(f"{rb.storage.filename!r} keeps no final observations (it was created without "
                          "observation_keys=): a Minari episode needs its T + 1 observations")
    space = rb.space
    if not isinstance(space, DictSpace) or action_key not in space.keys():
        raise ConfigError(f"the buffer has no action leaf {action_key!r} (its keys: "
                          f"{', '.join(map(repr, space.keys()))}): name it with action_key=")  # type: ignore[attr-defined]
    obs_space = space[keys.observation[0]] if len(keys.observation) == 1 else keys.observation_space(space)
    gym_obs, gym_action = space_to_gymnasium(obs_space), space_to_gymnasium(space[action_key])
    flags = (keys.reward, keys.terminated, keys.truncated)
    extras = [k for k in space.keys() if k not in (*keys.observation, action_key, *flags)]
    target = _new_dataset_path(dataset_id, overwrite)
    metadata.setdefault("jpeg_encoding", False)
    metadata.setdefault("description", f"exported by h5replay from replay {rb.replay_id}")
    total = rb.num_episodes

    def episodes() -> Iterator[EpisodeBuffer]:
        done, first = 0, 0
        while True:
            page = rb.episode_table(first, _PAGE)
            if not len(page):
                return
            for episode_id, first_row, length in page.tolist():
                final = rb.final_observation(episode_id)
                if final is None and missing_final == "error":
                    raise ConfigError(f"episode {episode_id} of {rb.storage.filename!r} has no final observation, "
                                      "so no T + 1 observations for Minari: pass missing_final='skip' to leave such "
                                      "episodes out")
                if final is not None:
                    rows = rb.get_rows(np.arange(first_row, first_row + length))
                    obs = rows[keys.observation[0]] if len(keys.observation) == 1 else \
                        {k: rows[k] for k in keys.observation}
                    yield EpisodeBuffer(
                        observations=value_to_gymnasium(gym_obs, _appended(obs, final)),
                        actions=value_to_gymnasium(gym_action, rows[action_key]),
                        rewards=rows[keys.reward], terminations=rows[keys.terminated],
                        truncations=rows[keys.truncated], infos={k: rows[k] for k in extras} or None,
                    )
                done += 1
                if progress is not None:
                    progress(done, total)
            first = int(page[-1, 0]) + 1

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NAGS, category=UserWarning, module=r"minari\.")
            dataset = minari.create_dataset_from_buffers(dataset_id, [], observation_space=gym_obs,
                                                         action_space=gym_action, **metadata)
        batches = iter(episodes())
        while batch := list(itertools.islice(batches, _BATCH)):
            dataset.storage.update_episodes(batch)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)  # ours: _new_dataset_path saw nothing there
        raise
    return minari.load_dataset(dataset_id)


def from_minari(
    dataset_id: str, path: str | os.PathLike[str], *, capacity: int | None = None,
    progress: Progress | None = None, **create_kwargs: Any,
) -> ReplayBuffer:
    """A new replay file at `path` holding the episodes of the local Minari dataset
    `dataset_id`, in order, each with its final observation; blocks while it reads them, a few
    episodes at a time (memory stays flat). `capacity` as in `ReplayBuffer.create` (a smaller one
    keeps the latest episodes); `create_kwargs` go to it too (overwrite=, check_bounds=,
    compression=, ...). An episode of no step is left out. `progress(done, total)` is called
    after each episode.

    Returns:
        The new buffer, open for writing (close it, or use it as a context manager).

    Raises:
        FileNotFoundError: no such dataset under MINARI_DATASETS_PATH (nothing is downloaded).
        ConfigError: the dataset was written by a Minari format h5replay does not read, names
            an unknown storage, has a space with no h5replay counterpart, or an episode is not
            laid out as Minari's (T + 1 observations for T steps); nothing is left at `path`.
        SpaceMismatchError: a value does not fit the dataset's own space.
    """
    dataset = _load_dataset(dataset_id)
    obs_space, action_space = dataset.observation_space, dataset.action_space
    try:
        space = row_space(obs_space, action_space)
    except ConfigError as exc:
        raise ConfigError(f"Minari dataset {dataset_id!r}: {exc}") from None
    rb = ReplayBuffer.create(space, capacity, path, observation_keys=("obs",), **create_kwargs)
    written = os.fspath(rb.storage.filename or path)
    total = dataset.total_episodes
    try:
        for done, episode in enumerate(_episodes(dataset), start=1):
            steps = _checked_steps(dataset_id, episode)
            if steps:
                writer = rb.open_segment_writer()
                writer.extend({
                    "obs": value_from_gymnasium(obs_space, _sliced(episode.observations, slice(0, steps))),
                    "action": value_from_gymnasium(action_space, episode.actions),
                    "reward": np.asarray(episode.rewards, np.float32),
                    "terminated": np.asarray(episode.terminations, bool),
                    "truncated": np.asarray(episode.truncations, bool),
                })
                final = value_from_gymnasium(obs_space, _sliced(episode.observations, steps))
                rb.commit_segment(writer, publish=done % _GROUP_COMMIT == 0, final=final)
            if progress is not None:
                progress(done, total)
        rb.flush()
    except BaseException:
        rb.close()
        os.remove(written)
        raise
    return rb


def _episodes(dataset: Any) -> Iterator[Any]:
    """The dataset's episodes in order, read `_BATCH` at a time."""
    indices = dataset.episode_indices
    for first in range(0, len(indices), _BATCH):
        yield from dataset.iterate_episodes(indices[first:first + _BATCH])


def _new_dataset_path(dataset_id: str, overwrite: bool) -> str:
    """Where the new dataset goes, cleared with `overwrite`.

    Raises:
        ConfigError: the id is malformed, or a dataset has it already (without `overwrite`).
    """
    try:
        parse_dataset_id(dataset_id)
    except (ValueError, TypeError):  # TypeError: minari's parser on an id without -vN
        raise ConfigError(f"{dataset_id!r} is not a Minari dataset id: they read (namespace/)name-vN, e.g. "
                          "'h5replay/cartpole-v0'") from None
    target = str(get_dataset_path(dataset_id))
    if os.path.exists(target):
        if not overwrite:
            raise ConfigError(f"Minari dataset {dataset_id!r} already exists at {target}; pass overwrite=True "
                              "(--overwrite) to replace it")
        shutil.rmtree(target)
    return target


def _load_dataset(dataset_id: str) -> Any:
    """The local dataset, once its metadata says it is of a format this module reads.

    Raises:
        FileNotFoundError: no such dataset.
        ConfigError: an unread format version or storage.
    """
    data = os.path.join(str(get_dataset_path(dataset_id)), "data")
    if not os.path.isfile(os.path.join(data, "metadata.json")):
        raise FileNotFoundError(f"no Minari dataset {dataset_id!r} at {data} (datasets are looked up under "
                                "MINARI_DATASETS_PATH, by default ~/.minari/datasets; h5replay downloads nothing: "
                                "`minari download` it first)")
    meta = MinariStorage.read_raw_metadata(data)
    version = meta.get("minari_version")
    readable = sorted(v for v in minari.supported_dataset_versions if _at_least(v, OLDEST_MINARI_FORMAT))
    if not isinstance(version, str) or version not in readable:
        raise ConfigError(f"Minari dataset {dataset_id!r} was written by Minari {version!r}, a format h5replay does "
                          f"not read: it reads those of Minari {OLDEST_MINARI_FORMAT} and later that the installed "
                          f"minari {minari.__version__} reads ({', '.join(readable)})")
    if meta.get("data_format") not in _FORMATS:
        raise ConfigError(f"Minari dataset {dataset_id!r} is stored as {meta.get('data_format')!r}; h5replay reads "
                          f"{', '.join(_FORMATS)}")
    return minari.load_dataset(dataset_id)


def _at_least(version: str, oldest: str) -> bool:
    try:
        return Version(version) >= Version(oldest)
    except InvalidVersion:
        return False


def _checked_steps(dataset_id: str, episode: Any) -> int:
    """The episode's number of steps, once every part has the length Minari's layout gives it.

    Raises:
        ConfigError: names the episode and the part whose length is off.
    """
    steps = len(episode.rewards)
    lengths = {"observations": _length(episode.observations), "actions": _length(episode.actions),
               "terminations": len(episode.terminations), "truncations": len(episode.truncations)}
    expected = {"observations": steps + 1, "actions": steps, "terminations": steps, "truncations": steps}
    for part, n in lengths.items():
        if n != expected[part]:
            raise ConfigError(f"episode {episode.id} of Minari dataset {dataset_id!r} has {n} {part} for {steps} "
                              f"rewards, not the {expected[part]} of Minari's layout (T + 1 observations)")
    return steps


def _length(value: Any) -> int:
    """The leading length of a nested batch (dict / tuple of arrays, or an array / list)."""
    if isinstance(value, Mapping):
        return _length(next(iter(value.values()))) if value else 0
    if isinstance(value, tuple):
        return _length(value[0]) if value else 0
    return len(value)


def _sliced(value: Any, at: slice | int) -> Any:
    """`value[at]` of a nested batch (dict / tuple of arrays, or an array / list)."""
    if isinstance(value, Mapping):
        return {k: _sliced(v, at) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_sliced(v, at) for v in value)
    return value[at]


def _appended(batch: Any, last: Any) -> Any:
    """A nested batch with one more sample at its end (the final observation)."""
    if isinstance(batch, Mapping):
        return {k: _appended(v, last[k]) for k, v in batch.items()}
    if isinstance(batch, list):
        return [*batch, last]
    return np.concatenate([batch, np.asarray(last, batch.dtype)[None]])
