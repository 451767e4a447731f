"""LeRobot datasets (layout "v3.0") to and from h5replay files: `to_lerobot(buffer, root, fps=)`
writes one that `lerobot`'s `LeRobotDataset(repo_id, root=root)` loads with the same episodes and
frames; `from_lerobot(root, path)` builds a replay file from one, streaming.

What is written (LeRobot's own v3.0 layout, as `LeRobotDataset.create` + `save_episode` write it):
`meta/info.json`, `meta/stats.json`, `meta/tasks.parquet` (one task, `task=`),
`meta/episodes/chunk-000/file-000.parquet` (one row per episode: its length, where its frames are,
its stats), `data/chunk-CCC/file-FFF.parquet` (the frames; a new file past
`data_files_size_in_mb`), no videos. Beside them, `meta/h5replay_finals.parquet` keeps the final
observations (below), and `info.json` gains an `"h5replay"` entry: the space (bounds included)
and which leaf each feature is, so that an import gives back the very space. LeRobot reads
neither, and loads the dataset the same without them.

How leaves map to features (a row of h5replay is one frame of LeRobot; the observation the
action was taken in, the action, then what followed it: the layout of `RecordEpisodes`):

    h5replay leaf (space key)            LeRobot feature
    obs  (the only observation key)      observation.state
    obs/<k>  (a Dict observation)        observation.<k>     (deeper keys joined with ".")
    <key> (several observation keys)     observation.<key>
    action, action/<k>                   action, action.<k>
    reward      (the reward key)         next.reward
    terminated  (the terminated key)     next.done
    truncated   (the truncated key)      next.truncated
    any other leaf a/b                   a.b

The observation keys are the buffer's `observation_keys` (else "obs" when the space has it); the
reward and end keys its `reward_key` / `terminated_key` / `truncated_key`. An import maps back the
same way ("observation.state" alone becomes `obs`, several `observation.*` become a Dict `obs`,
any other feature a key of its own name) unless `info.json` names the leaves itself.

Values: Box leaves (any float or integer dtype) and Binary leaves (`bool`) of up to 5 dimensions
are numeric features of their dtype and shape; a scalar leaf is a feature of shape (1,), as
LeRobot stores scalars (it hands a feature of shape (1,) back as a scalar). An image (a uint8 Box
of shape (H, W, C)) is a numeric uint8 feature, not LeRobot's "image" / "video" (no decoding, no
camera). Text leaves are refused on export; "image", "video" and "string" features on import
(`ConfigError` naming the leaf or feature). LeRobot's bookkeeping (`timestamp` = frame_index /
fps, `frame_index`, `episode_index`, `index`, `task_index`) is written on export and left out of
the replay on import; episodes are numbered 0, 1, ... in the dataset, oldest held first.

Final observations: LeRobot has no frame T+1, so an episode's final observation (h5replay's
`final_observation`) is not a frame. It is kept in `meta/h5replay_finals.parquet` (episode_index
and one column per observation feature, null for an episode without one) and restored by
`from_lerobot`. A dataset without that file (any other LeRobot dataset) imports episodes without
final observations: `sample_transitions` bootstraps their last step from nothing (discount 0).

Memory: the export holds one episode at a time (its stats need it whole); the import holds one
batch of `batch_rows` frames and one parquet row group (LeRobot writes one per episode), whatever
the dataset's size. `from_lerobot(..., exclude=[...])` leaves out features it cannot map
(cameras). Needs pyarrow and pandas (`pip install 'h5replay[lerobot]'`); `lerobot` itself only
to read the result.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from h5replay.errors import ConfigError, StorageError
from h5replay.spaces import BinarySpace, BoxSpace, DictSpace, LeafSpace, Space, space_from_json
from h5replay.spaces.schema import flatten_value, unflatten_value
from h5replay.storage.replay import ReplayBuffer
from h5replay.transitions import TransitionKeys

__all__ = ["to_lerobot", "from_lerobot", "CODEBASE_VERSION", "FINALS_PATH"]

CODEBASE_VERSION = "v3.0"
_INFO_PATH = "meta/info.json"
_STATS_PATH = "meta/stats.json"
_TASKS_PATH = "meta/tasks.parquet"
_EPISODES_PATH = "meta/episodes/chunk-000/file-000.parquet"
FINALS_PATH = "meta/h5replay_finals.parquet"
_DATA_PATH = "data/chunk-{chunk_index:03d}/file-{file_index:03d}.parquet"
_CHUNKS_SIZE = 1000  # files per chunk folder (LeRobot's default)
_DATA_FILE_MB = 100  # LeRobot's default size of one data file
_QUANTILES = (0.01, 0.10, 0.50, 0.90, 0.99)  # the quantiles LeRobot's stats carry, as q01 ... q99
#: LeRobot's bookkeeping columns: in every frame, never a leaf of the replay.
_BOOKKEEPING = ("timestamp", "frame_index", "episode_index", "index", "task_index")
_MAX_DIMS = 5  # LeRobot's features go up to Array5D
_FINALS_EVERY = 256  # episodes per row group of the finals and episodes files
_OBS = "observation"
_KEY_SETTINGS = ("reward_key", "terminated_key", "truncated_key")  # what a recorded entry may set
_NEXT = {"reward": "next.reward", "terminated": "next.done", "truncated": "next.truncated"}


@dataclass(frozen=True)
class _Feature:
    """One LeRobot feature and the h5replay leaf it is."""

    name: str
    leaf_path: str
    leaf: LeafSpace

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.leaf.storage_dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self.leaf.shape if self.leaf.shape else (1,)

    def describe(self) -> dict[str, Any]:
        return {"dtype": "bool" if self.dtype.kind == "b" else self.dtype.name, "shape": list(self.shape),
                "names": None}

    def arrow_type(self) -> pa.DataType:
        kind = pa.from_numpy_dtype(self.dtype)
        if self.shape == (1,):  # LeRobot reads a feature of shape (1,) as a plain value
            return kind
        if len(self.shape) == 1:
            return pa.list_(kind, self.shape[0])
        for _ in self.shape:
            kind = pa.list_(kind)
        return kind

    def column(self, values: np.ndarray) -> pa.Array:
        """The frames' values (rows on axis 0) as this feature's parquet column."""
        n = values.shape[0]
        flat = pa.array(np.ascontiguousarray(values).reshape(-1))
        if self.shape == (1,):
            return flat
        if len(self.shape) == 1:
            return pa.FixedSizeListArray.from_arrays(flat, self.shape[0])
        out: pa.Array = flat
        count = n * int(np.prod(self.shape))
        for size in reversed(self.shape):  # innermost lists first; _export_features refuses empty dimensions
            count //= size
            out = pa.ListArray.from_arrays(pa.array(np.arange(count + 1, dtype=np.int64) * size, pa.int32()), out)
        return out

    def values(self, column: pa.ChunkedArray | pa.Array) -> np.ndarray:
        """A parquet column of this feature back as (rows, *leaf shape) of the leaf's dtype.

        Raises:
            StorageError: nulls, or rows of another size than the feature's.
        """
        n = len(column)
        if column.null_count:
            raise StorageError(f"feature {self.name!r} has missing values (nulls) in the dataset's frames")
        flat = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        while pa.types.is_list(flat.type) or pa.types.is_fixed_size_list(flat.type) or pa.types.is_large_list(flat.type):
            flat = flat.flatten()
        arr = np.asarray(flat.to_numpy(zero_copy_only=False))
        size = int(np.prod(self.leaf.shape, dtype=np.int64))
        if arr.shape[0] != n * size:
            raise StorageError(f"feature {self.name!r} has {arr.shape[0]} values for {n} frames; its shape "
                               f"{list(self.shape)} needs {size} a frame")
        if arr.dtype != self.dtype and not np.can_cast(arr.dtype, self.dtype, "same_kind"):
            raise StorageError(f"feature {self.name!r} holds {arr.dtype} values but info.json says {self.dtype}")
        return arr.reshape((n, *self.leaf.shape)).astype(self.dtype, copy=False)


# ---------------------------------------------------------------------------- mapping


def _observation_keys(space: DictSpace, keys: TransitionKeys | None) -> tuple[str, ...]:
    if keys is not None:
        return keys.observation
    return ("obs",) if "obs" in space.keys() else ()


def _export_features(space: Space, keys: TransitionKeys | None = None) -> list[_Feature]:
    """The LeRobot features of `space`'s leaves (see the module's table), in leaf order.

    Raises:
        ConfigError: a leaf that is not a Box or Binary of at most 5 dimensions, or two leaves that
            map to one feature name; the message names the leaf.
    """
    if not isinstance(space, DictSpace):
        raise ConfigError(f"a LeRobot export needs a Dict space of named leaves (observation, action ...), got {space!r}")
    obs = _observation_keys(space, keys)
    ends = {getattr(keys, k, k) if keys is not None else k: name for k, name in _NEXT.items()}
    out: list[_Feature] = []
    seen: dict[str, str] = {}
    for path, leaf in space.leaves():
        top, _, rest = path.partition("/")
        if top in obs:
            tail = rest if len(obs) == 1 else path
            name = f"{_OBS}.{tail.replace('/', '.')}" if tail else f"{_OBS}.state"
        elif path in ends:
            name = ends[path]
        else:
            name = path.replace("/", ".")
        if not isinstance(leaf, (BoxSpace, BinarySpace)):
            raise ConfigError(f"leaf {path!r} is {leaf!r}: a LeRobot export takes Box and Binary leaves only")
        if len(leaf.shape) > _MAX_DIMS or 0 in leaf.shape:
            raise ConfigError(f"leaf {path!r} has shape {leaf.shape}; LeRobot features have 1 to {_MAX_DIMS} "
                              "dimensions, none of them empty")
        if name in _BOOKKEEPING or name in seen:
            other = "LeRobot's own column" if name in _BOOKKEEPING else f"leaf {seen[name]!r}"
            raise ConfigError(f"leaf {path!r} would be the LeRobot feature {name!r}, which is already {other}; "
                              "rename the leaf")
        seen[name] = path
        out.append(_Feature(name, path, leaf))
    return out


def _leaf_of_feature(name: str, spec: Mapping[str, Any]) -> LeafSpace:
    """An h5replay leaf for a LeRobot feature, from its dtype and shape.

    Raises:
        ConfigError: names the feature and its dtype or shape.
    """
    dtype, shape = spec.get("dtype"), tuple(spec.get("shape") or ())
    if dtype in ("image", "video", "string"):
        raise ConfigError(f"feature {name!r} is of dtype {dtype!r}, which h5replay cannot import (numeric and "
                          f"bool features only); {_leave_out(name)}")
    try:
        np_dtype = np.dtype(str(dtype))
    except TypeError as exc:
        raise ConfigError(f"feature {name!r} has dtype {dtype!r}, which is not a numpy dtype; {_leave_out(name)}") from exc
    if not shape or len(shape) > _MAX_DIMS or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ConfigError(f"feature {name!r} has shape {list(shape)}; expected 1 to {_MAX_DIMS} dimensions; "
                          f"{_leave_out(name)}")
    if name in _NEXT.values() and shape == (1,):
        shape = ()  # a step's reward and end flags are scalars in h5replay
    if np_dtype.kind == "b":
        return BinarySpace(shape)
    if np_dtype.kind == "f":
        return BoxSpace(-np.inf, np.inf, shape, np_dtype)
    if np_dtype.kind in "iu":
        info = np.iinfo(np_dtype)
        return BoxSpace(info.min, info.max, shape, np_dtype)
    raise ConfigError(f"feature {name!r} has dtype {dtype!r}; h5replay imports float, integer and bool features; "
                      f"{_leave_out(name)}")


def _leave_out(name: str) -> str:
    return f"leave it out with from_lerobot(..., exclude=[{name!r}])"


@dataclass(frozen=True)
class _Plan:
    """How a dataset's features become a replay: the space, its transition keys, the features."""

    space: DictSpace
    observation_keys: tuple[str, ...] | None
    keys: dict[str, str]  # reward_key / terminated_key / truncated_key
    features: list[_Feature]


def _import_plan(info: Mapping[str, Any], exclude: Sequence[str] = ()) -> _Plan:
    """The replay a dataset's `info.json` becomes (its `"h5replay"` entry when it has a usable one),
    without the features named in `exclude`.

    Raises:
        ConfigError: a feature that cannot be mapped (named), an unknown name in `exclude`, or
            features whose names collide.
    """
    declared = dict(info.get("features") or {})
    unknown = [name for name in exclude if name not in declared]
    if isinstance(exclude, str) or unknown:
        raise ConfigError(f"exclude names features of the dataset; {unknown or exclude!r} are not among "
                          f"{sorted(declared)}")
    specs = {k: v for k, v in declared.items() if k not in _BOOKKEEPING and k not in exclude}
    recorded = _recorded_plan(info.get("h5replay"), specs)
    if recorded is not None:
        return recorded
    leaves = {name: _leaf_of_feature(name, spec) for name, spec in specs.items()}
    observation = [n for n in leaves if n.startswith(_OBS + ".")]
    back = {v: k for k, v in _NEXT.items()}
    paths: dict[str, str] = {}
    tops: dict[str, str] = {}  # the replay's top-level keys, and the feature that took each
    for name in leaves:
        if "/" in name:
            raise ConfigError(f"feature {name!r} has a '/' in its name, which h5replay keys may not hold")
        if name in observation:
            path = "obs" if observation == [f"{_OBS}.state"] else f"obs/{name[len(_OBS) + 1:]}"
        else:
            path = back.get(name, name)
        top, nested = path.split("/")[0], "/" in path
        if top in tops and not (nested and "/" in paths[tops[top]]):
            raise ConfigError(f"features {tops[top]!r} and {name!r} would both be the replay's key {top!r}")
        tops[top] = name
        paths[name] = path
    if not leaves:
        raise ConfigError("the dataset has no feature besides LeRobot's bookkeeping columns: nothing to import")
    tree: dict[str, Any] = {}
    for name, path in paths.items():
        node = tree
        *parents, last = path.split("/")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = leaves[name]
    features = [_Feature(name, paths[name], leaves[name]) for name in specs]
    return _Plan(DictSpace(tree), ("obs",) if observation else None, {}, features)


def _recorded_plan(entry: Any, specs: Mapping[str, Any]) -> _Plan | None:
    """The plan `to_lerobot` recorded, when it still describes exactly these features (else None:
    LeRobot's tools may have changed the dataset since)."""
    if not isinstance(entry, Mapping):
        return None
    try:
        space = space_from_json(entry["space"])
        leaves = dict(space.leaves())
        paths = {str(k): str(v) for k, v in dict(entry["features"]).items()}
        obs = entry.get("observation_keys")
        keys = {str(k): str(v) for k, v in dict(entry.get("keys") or {}).items() if k in _KEY_SETTINGS}
    except (KeyError, TypeError, ValueError):
        return None
    if not isinstance(space, DictSpace) or set(paths) != set(specs) or set(paths.values()) != set(leaves):
        return None
    features = [_Feature(name, paths[name], leaves[paths[name]]) for name in specs]
    if any(f.describe()["dtype"] != specs[f.name].get("dtype") or list(f.shape) != list(specs[f.name].get("shape") or ())
           for f in features):
        return None
    return _Plan(space, tuple(obs) if obs else None, keys, features)


# ---------------------------------------------------------------------------- stats


def _episode_stats(values: np.ndarray) -> dict[str, np.ndarray]:
    """LeRobot's stats of one feature over one episode (rows on axis 0): per element."""
    data = values.reshape(values.shape[0], -1) if values.ndim > 1 else values.reshape(-1, 1)
    as_float = data.astype(np.float64)
    stats = {"min": as_float.min(axis=0), "max": as_float.max(axis=0), "mean": as_float.mean(axis=0),
             "std": as_float.std(axis=0), "count": np.array([data.shape[0]], dtype=np.int64)}
    for q, value in zip(_QUANTILES, np.quantile(as_float, _QUANTILES, axis=0)):
        stats[f"q{round(q * 100):02d}"] = value
    return stats


class _Totals:
    """The dataset's stats of one feature, folded from its episodes' as LeRobot aggregates them
    (count-weighted means and quantiles, the parallel variance)."""

    def __init__(self) -> None:
        self.count = 0
        self.sums: dict[str, np.ndarray] = {}
        self.low: np.ndarray | None = None
        self.high: np.ndarray | None = None

    def add(self, stats: Mapping[str, np.ndarray]) -> None:
        n = int(stats["count"][0])
        self.count += n
        weighted = {k: v * n for k, v in stats.items() if k not in ("min", "max", "count", "std")}
        weighted["square"] = (stats["std"] ** 2 + stats["mean"] ** 2) * n
        for k, v in weighted.items():
            self.sums[k] = self.sums[k] + v if k in self.sums else v
        self.low = stats["min"] if self.low is None else np.minimum(self.low, stats["min"])
        self.high = stats["max"] if self.high is None else np.maximum(self.high, stats["max"])

    def result(self, shape: tuple[int, ...]) -> dict[str, Any]:
        mean = self.sums["mean"] / self.count
        std = np.sqrt(np.maximum(self.sums["square"] / self.count - mean ** 2, 0.0))
        out = {"min": self.low, "max": self.high, "mean": mean, "std": std}
        out.update({k: v / self.count for k, v in self.sums.items() if k.startswith("q")})
        result: dict[str, Any] = {k: np.asarray(v).reshape(shape).tolist() for k, v in out.items()}
        result["count"] = [self.count]
        return result


# ---------------------------------------------------------------------------- export


def _write_json(path: Path, data: Any) -> None:
    """Write `data` to a temp name and rename it into place (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=4, ensure_ascii=False))
    os.replace(tmp, path)


def _write_tasks(root: Path, task: str) -> None:
    """meta/tasks.parquet as LeRobot writes it: a pandas frame of task_index indexed by the task."""
    import pandas as pd  # only here: the frame's index is what LeRobot looks tasks up by

    path = root / _TASKS_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame({"task_index": [0]}, index=[task]).to_parquet(path)


class _DataFiles:
    """The frames' parquet files, one row group per episode, a new file past the size limit."""

    def __init__(self, root: Path, schema: pa.Schema, limit_bytes: int) -> None:
        self.root, self.schema, self.limit = root, schema, limit_bytes
        self.chunk = self.file = 0
        self.written = 0
        self._writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> tuple[int, int]:
        """Write one episode's frames; returns the (chunk, file) indices it went to."""
        if self._writer is not None and self.written + table.nbytes > self.limit:
            self.close()
            self.file += 1
            if self.file == _CHUNKS_SIZE:
                self.chunk, self.file = self.chunk + 1, 0
        if self._writer is None:
            path = self.root / _DATA_PATH.format(chunk_index=self.chunk, file_index=self.file)
            path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(path, self.schema, compression="snappy")
            self.written = 0
        self._writer.write_table(table)
        self.written += table.nbytes
        return self.chunk, self.file

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _check_root(root: Path) -> None:
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ConfigError(f"{str(root)!r} exists and is not an empty folder: a LeRobot export writes a new dataset")


def to_lerobot(
    buffer: ReplayBuffer, root: str | os.PathLike[str], *, fps: int, task: str = "", robot_type: str | None = None,
    data_files_size_in_mb: int = _DATA_FILE_MB,
) -> Path:
    """Write every complete episode `buffer` holds, oldest first, as a LeRobot dataset (v3.0) in
    the new folder `root`; `LeRobotDataset(repo_id, root=root)` then loads it. `fps`: the frame
    rate LeRobot records (timestamps are frame_index / fps); `task`: the one task of every frame.
    Holds one episode in memory at a time. Returns `root`.

    Raises:
        ConfigError: `root` is not empty, a bad `fps`, or a leaf LeRobot cannot hold (named).
        StorageError: the buffer's file failed.
    """
    if isinstance(fps, bool) or not isinstance(fps, int) or fps < 1:
        raise ConfigError(f"fps is the dataset's frame rate, an int >= 1, got {fps!r}")
    if isinstance(data_files_size_in_mb, bool) or not isinstance(data_files_size_in_mb, int) or data_files_size_in_mb < 1:
        raise ConfigError(f"data_files_size_in_mb is an int >= 1, got {data_files_size_in_mb!r}")
    space, keys = buffer.storage.single_instance_space, buffer.transition_keys
    features = _export_features(space, keys)
    observation = _observation_keys(space, keys) if isinstance(space, DictSpace) else ()
    obs = [f for f in features if f.leaf_path.partition("/")[0] in observation]
    table = buffer.episode_table()
    if not table.shape[0]:
        raise ConfigError("the buffer holds no complete episode: a LeRobot dataset needs at least one")
    out = Path(root)
    _check_root(out)
    schema = pa.schema([(f.name, f.arrow_type()) for f in features] + [
        ("timestamp", pa.float32()), ("frame_index", pa.int64()), ("episode_index", pa.int64()),
        ("index", pa.int64()), ("task_index", pa.int64())])
    totals = {name: _Totals() for name in [f.name for f in features] + list(_BOOKKEEPING)}
    data = _DataFiles(out, schema, data_files_size_in_mb << 20)
    episodes = _RowFile(out / _EPISODES_PATH)
    finals_schema = pa.schema([("episode_index", pa.int64())] + [(f.name, f.arrow_type()) for f in obs])
    finals = _RowFile(out / FINALS_PATH, finals_schema) if obs else None
    frames = 0
    try:
        for number, (episode_id, first, length) in enumerate(table.tolist()):
            rows = buffer.get_rows(np.arange(first, first + length, dtype=np.int64), decode=False)
            frame_index = np.arange(length, dtype=np.int64)
            columns = {f.name: rows[f.leaf_path] for f in features}
            columns.update({"timestamp": (frame_index / fps).astype(np.float32), "frame_index": frame_index,
                            "episode_index": np.full(length, number, np.int64),
                            "index": frames + frame_index, "task_index": np.zeros(length, np.int64)})
            arrays = [f.column(columns[f.name]) for f in features] + [pa.array(columns[k]) for k in _BOOKKEEPING]
            chunk, file = data.write(pa.Table.from_arrays(arrays, schema=schema))
            record: dict[str, Any] = {
                "episode_index": number, "tasks": [task], "length": length, "data/chunk_index": chunk,
                "data/file_index": file, "dataset_from_index": frames, "dataset_to_index": frames + length}
            for name, values in columns.items():
                stats = _episode_stats(values)
                totals[name].add(stats)
                record.update({f"stats/{name}/{k}": v.tolist() for k, v in stats.items()})
            record.update({"meta/episodes/chunk_index": 0, "meta/episodes/file_index": 0})
            episodes.add(record)
            if finals is not None:
                finals.add(_final_row(buffer, episode_id, number, obs))
            frames += length
    finally:
        data.close()
        try:
            episodes.close()
        finally:
            if finals is not None:
                finals.close()
    _write_tasks(out, task)
    shapes = {f.name: f.shape for f in features}
    _write_json(out / _STATS_PATH, {name: t.result(shapes.get(name, (1,))) for name, t in totals.items()})
    described = {f.name: f.describe() for f in features}
    described["timestamp"] = {"dtype": "float32", "shape": [1], "names": None}
    described.update({k: {"dtype": "int64", "shape": [1], "names": None} for k in _BOOKKEEPING[1:]})
    _write_json(out / _INFO_PATH, {  # last: a folder without it is no dataset, for LeRobot nor for us
        "codebase_version": CODEBASE_VERSION, "robot_type": robot_type, "total_episodes": int(table.shape[0]),
        "total_frames": frames, "total_tasks": 1, "chunks_size": _CHUNKS_SIZE,
        "data_files_size_in_mb": data_files_size_in_mb, "video_files_size_in_mb": 200, "fps": fps,
        "splits": {"train": f"0:{table.shape[0]}"}, "data_path": _DATA_PATH, "video_path": None,
        "features": described,
        "h5replay": {"space": space.to_json(), "features": {f.name: f.leaf_path for f in features},
                     "observation_keys": None if keys is None else list(keys.observation),
                     "keys": {} if keys is None else {"reward_key": keys.reward, "terminated_key": keys.terminated,
                                                      "truncated_key": keys.truncated}},
    })
    return out


class _RowFile:
    """A parquet file of records (dicts), written `_FINALS_EVERY` records to a row group."""

    def __init__(self, path: Path, schema: pa.Schema | None = None) -> None:
        self.path, self.schema = path, schema
        self._rows: list[dict[str, Any]] = []
        self._writer: pq.ParquetWriter | None = None

    def add(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        if len(self._rows) >= _FINALS_EVERY:
            self._flush()

    def _flush(self) -> None:
        table = pa.Table.from_pylist(self._rows, schema=self.schema)
        if self._writer is None:  # the first records' schema (inferred) is the file's
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.path, table.schema, compression="snappy")
        self._writer.write_table(table.cast(self._writer.schema))
        self._rows.clear()

    def close(self) -> None:
        try:
            if self._rows:
                self._flush()
        finally:
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def _final_row(buffer: ReplayBuffer, episode_id: int, number: int, obs: list[_Feature]) -> dict[str, Any]:
    """One episode's row of the finals file: its final observation by feature, or nulls."""
    final, keys = buffer.final_observation(episode_id), buffer.transition_keys
    row: dict[str, Any] = {"episode_index": number}
    if final is None or keys is None:
        return row | {f.name: None for f in obs}
    leaves = flatten_value(keys.observation_space(buffer.storage.single_instance_space), keys.as_observation(final))
    for f in obs:
        value = np.asarray(leaves[f.leaf_path], dtype=f.dtype)
        row[f.name] = value.item() if f.shape == (1,) else value.tolist()
    return row


# ---------------------------------------------------------------------------- import


def _read_info(root: str | os.PathLike[str]) -> dict[str, Any]:
    """A dataset's `meta/info.json`, checked to be of LeRobot's v3 layout.

    Raises:
        ConfigError: no such file, or a `codebase_version` that is not v3.x (named).
    """
    path = Path(root) / _INFO_PATH
    try:
        info: Any = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{str(root)!r} is not a LeRobot dataset: it has no {_INFO_PATH}") from exc
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{str(path)!r} is not readable JSON: {exc}") from exc
    version = info.get("codebase_version") if isinstance(info, dict) else None
    if not isinstance(version, str) or not (version.startswith("v3.") and version[3:].replace(".", "").isdigit()):
        raise ConfigError(f"{str(root)!r} is a LeRobot dataset of codebase_version {version!r}; h5replay reads the "
                          "v3 layout (v3.0) only: convert it with LeRobot's "
                          "lerobot.datasets.v30.convert_dataset_v21_to_v30 first")
    return dict(info)


def _batches(files: list[Path], columns: list[str], batch_rows: int) -> Iterator[pa.RecordBatch]:
    """The files' rows, `batch_rows` at a time. One row group at a time, without threads:
    `iter_batches` over a whole file reads ahead across row groups (memory grew with the file)."""
    for path in files:
        with pq.ParquetFile(path) as file:
            for group in range(file.num_row_groups):
                yield from file.iter_batches(batch_size=batch_rows, row_groups=[group], columns=columns,
                                             use_threads=False)


def _episodes(root: Path, batch_rows: int) -> Iterator[tuple[int, int]]:
    """(episode_index, length) of every episode, in the order of the episodes files."""
    files = sorted((root / "meta" / "episodes").glob("*/*.parquet"))
    if not files:
        raise StorageError(f"{str(root)!r} has no meta/episodes/*/*.parquet: the dataset is incomplete")
    for batch in _batches(files, ["episode_index", "length"], batch_rows):
        yield from zip(batch.column(0).to_pylist(), batch.column(1).to_pylist())


def _finals(root: Path, plan: _Plan, batch_rows: int) -> Iterator[tuple[int, dict[str, Any] | None]]:
    """(episode_index, its final observation as `end_episode(final=)` takes it, or None)."""
    obs = [f for f in plan.features if plan.observation_keys and f.leaf_path.partition("/")[0] in plan.observation_keys]
    path = root / FINALS_PATH
    if not obs or not path.exists():
        return
    names = set(pq.ParquetFile(path).schema_arrow.names)
    if any(f.name not in names for f in obs):
        return
    obs_space = DictSpace({k: plan.space[k] for k in plan.observation_keys or ()})
    for batch in _batches([path], ["episode_index"] + [f.name for f in obs], batch_rows):
        for i, episode in enumerate(batch.column(0).to_pylist()):
            cells = {f.name: batch.column(f.name).slice(i, 1) for f in obs}
            if any(c.null_count for c in cells.values()):
                yield episode, None
                continue
            sample = unflatten_value(obs_space, {f.leaf_path: f.values(cells[f.name])[0] for f in obs})
            keys = plan.observation_keys or ()
            yield episode, sample[keys[0]] if len(keys) == 1 else sample


def from_lerobot(
    root: str | os.PathLike[str], path: str | os.PathLike[str], *, capacity: int | None = None,
    exclude: Sequence[str] = (), batch_rows: int = 4096, **create_kwargs: Any,
) -> ReplayBuffer:
    """A new replay file at `path` holding every episode of the LeRobot dataset (v3.x) in `root`,
    streamed file by file in batches of `batch_rows` frames, so memory stays flat whatever the
    dataset's size. Final observations come back from `meta/h5replay_finals.parquet` when the
    dataset has it. `exclude`: features to leave out (cameras, say). `capacity`: the replay's
    (None: unbounded); `create_kwargs` go to `ReplayBuffer.create` (sampler, tables ...). Returns
    the buffer, open for writing (extend it online, close it when done).

    Raises:
        ConfigError: not a v3 dataset (its version named), a feature that cannot be mapped (named),
            a bad `batch_rows`.
        StorageError: frames and episode records disagree (the dataset is incomplete or damaged);
            the replay file is left as far as it got.
    """
    if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
        raise ConfigError(f"batch_rows is how many frames are read at a time, an int >= 1, got {batch_rows!r}")
    src = Path(root)
    info = _read_info(src)
    plan = _import_plan(info, exclude)
    files = sorted((src / "data").glob("*/*.parquet"))
    if not files:
        raise StorageError(f"{str(src)!r} has no data/*/*.parquet: the dataset holds no frames")
    settings: dict[str, Any] = {**plan.keys, **create_kwargs}
    buffer = ReplayBuffer.create(plan.space, capacity, path, observation_keys=plan.observation_keys, **settings)
    try:
        _stream_into(buffer, src, files, plan, batch_rows)
    except BaseException:
        buffer.close()
        raise
    return buffer


def _stream_into(buffer: ReplayBuffer, src: Path, files: list[Path], plan: _Plan, batch_rows: int) -> None:
    """Cut the frames into episodes by meta/episodes' lengths, checking each frame's episode_index."""
    episodes = _episodes(src, batch_rows)
    finals = _finals(src, plan, batch_rows)
    next_final = next(finals, None)
    columns = [f.name for f in plan.features] + ["episode_index"]
    episode, left = -1, 0
    for file in files:
        for batch in _batches([file], columns, batch_rows):
            at = 0
            while at < batch.num_rows:
                if left == 0:
                    found = next(episodes, None)
                    if found is None:
                        raise StorageError(f"{str(file)!r} holds frames after the last episode of meta/episodes")
                    episode, left = int(found[0]), int(found[1])
                take = min(left, batch.num_rows - at)
                part = batch.slice(at, take)
                index = part.column(len(columns) - 1).to_numpy(zero_copy_only=False)
                if index.size and (index.min() != episode or index.max() != episode):
                    raise StorageError(f"{str(file)!r}: frames of episode {int(index.max())} where meta/episodes "
                                       f"puts episode {episode}")
                buffer.extend(unflatten_value(plan.space, {f.leaf_path: f.values(part.column(f.name))
                                                           for f in plan.features}))
                at, left = at + take, left - take
                if left == 0:
                    final = None
                    while next_final is not None and next_final[0] <= episode:
                        final = next_final[1] if next_final[0] == episode else final
                        next_final = next(finals, None)
                    buffer.end_episode(final=final)
        buffer.flush()  # one publish per data file: what is imported so far survives a crash
    if left or next(episodes, None) is not None:
        raise StorageError(f"{str(src)!r}: meta/episodes lists more frames than data/ holds; the dataset is incomplete")
