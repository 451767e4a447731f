"""TorchRL: `H5ReplayStorage`, a TorchRL replay-buffer storage kept in an h5replay file or server.

    rb = TensorDictReplayBuffer(storage=H5ReplayStorage(100_000, path="replay.h5"),   # a file
                                sampler=RandomSampler(), batch_size=256)
    rb = TensorDictReplayBuffer(storage=H5ReplayStorage(endpoint="tcp://host:5555"))  # a server
    rb.extend(collector_batch.reshape(-1)); batch = rb.sample()

The mapping: one row is one TorchRL transition, exactly as `extend` hands it over: every leaf of
the TensorDict, the `("next", ...)` ones included (next observation, reward, done, terminated,
truncated, as TorchRL's envs and collectors write them), nested in the row's Dict space as in the
TensorDict. `get` returns the rows as a TensorDict of the same layout, so TorchRL's samplers,
losses and transforms see what they would see from a `LazyTensorStorage`. We store `next`
rather than rebuild it from h5replay's episodes and final observations (`sample_transitions`):
TorchRL's `extend` takes transitions in any order (several envs interleaved, shuffled, one
trajectory cut over several calls, transforms applied), so the next row is not in general the next
observation, and its samplers address single rows by index. The price is each observation
stored twice (as `observation` and as `("next", "observation")`).

The row space is the first TensorDict's (its leading batch dimension counts rows; the rest of
each leaf's shape is the row's), unless the file or server already has one; `transition_space`
/ `space_json` make it from an example (e.g. `env.fake_tensordict()`) for `h5replay serve
--space`. TorchRL's own `"index"` entry (the writer's cursor) is never stored. A TensorDict whose
keys, shapes or dtypes differ from the space is refused naming the key (SpaceMismatchError);
bfloat16, complex and non-tensor leaves cannot be stored (ConfigError).

Index `i` of the storage is the `i`-th oldest row held (h5replay's logical index): TorchRL's
`RandomSampler` (and `SamplerWithoutReplacement`) draw uniformly over all rows held, the other
writers' too on a server. Rows are written once and the ring drops the oldest, wherever TorchRL's
writer cursor points: overwriting rows (`rb[i] = td`, `ConsumingSampler`) is refused, and
samplers that keep per-index state across writes (prioritized, slice) do not apply. Each
`extend` is one h5replay segment. A local file is durable at each read (each training step) and
at `close`; a server write is sent without waiting and is acknowledged before the next read, so
a process always samples its own rows. Pickling keeps where the storage lives, not its rows; a
file has one writing process, so processes that share rows share a server.

Needs TorchRL (`pip install 'h5replay[torchrl]'`).
"""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

try:
    import torch
    from tensordict import TensorDict, TensorDictBase
    from torchrl.data.replay_buffers.storages import Storage, StoreStorage
except ImportError as exc:  # pragma: no cover - exercised only without torchrl
    raise ImportError("h5replay.integrations.torchrl needs TorchRL: pip install 'h5replay[torchrl]'") from exc

from h5replay.errors import ClosedError, ConfigError, SpaceMismatchError
from h5replay.spaces import BinarySpace, BoxSpace, DictSpace, LeafSpace, Space

__all__ = ["H5ReplayStorage", "transition_space"]

_IN_FLIGHT = 8  # extends sent to a server and not yet acknowledged, at most
_UNBOUNDED = 2**62  # max_size of a replay without a capacity (h5replay's ids stop below 2**62)
_INDEX_KEY = "index"  # TorchRL's writers and samplers put the storage index here; not data


def _name(key: tuple[str, ...]) -> str:
    """A TensorDict key as TorchRL spells it: 'obs' or ('next', 'obs')."""
    return repr(key[0]) if len(key) == 1 else repr(key)


def _leaves(td: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key tuple, leaf) of every leaf but TorchRL's "index"; non-tensor data (which TensorDict's
    own `leaves_only` walk skips) is a leaf too, so that it is refused rather than lost."""
    for key, value in td.items():
        where = (*prefix, key)
        if where == (_INDEX_KEY,):
            continue
        if isinstance(value, TensorDictBase):
            yield from _leaves(value, where)
        else:
            yield where, value


def _numpy_dtype(key: tuple[str, ...], value: Any) -> np.dtype[Any]:
    """The numpy dtype of a leaf's tensor.

    Raises:
        ConfigError: the leaf is not a tensor, or its dtype has no numpy twin h5replay stores.
    """
    if not isinstance(value, torch.Tensor):
        raise ConfigError(f"key {_name(key)} holds {type(value).__name__}, not a tensor: H5ReplayStorage stores "
                          f"tensors only (exclude it, e.g. td.exclude({_name(key)}), before extend)")
    if value.dtype == torch.bool:
        return np.dtype(bool)
    dtype: np.dtype[Any] | None
    try:
        dtype = np.dtype(torch.empty((), dtype=value.dtype).numpy().dtype)
    except TypeError:  # bfloat16 and friends: numpy has no such dtype
        dtype = None
    if dtype is None or dtype.kind not in "fiu":
        raise ConfigError(f"key {_name(key)} has dtype {value.dtype}, which h5replay cannot store: convert it to a "
                          f"float, integer or bool dtype first")
    return dtype


def _leaf_space(shape: tuple[int, ...], dtype: np.dtype[Any]) -> LeafSpace:
    """A leaf that holds any value of `dtype` (TorchRL stores what the env gave; bounds are its specs')."""
    if dtype == np.bool_:
        return BinarySpace(shape)
    if dtype.kind == "f":
        return BoxSpace(-np.inf, np.inf, shape, dtype)
    info = np.iinfo(dtype)
    return BoxSpace(int(info.min), int(info.max), shape, dtype)


def transition_space(example: Any) -> DictSpace:
    """The row space of TensorDicts shaped like `example` (a TensorDict): one row per element of
    its first batch dimension (a TensorDict without batch dimensions is one row), each leaf a
    Box (floats, integers) or Binary (bool) space of the rest of its shape. TorchRL's "index"
    entry is left out.

    Raises:
        ConfigError: `example` is not a TensorDict, has no leaves, a key h5replay cannot name
            (empty, or with '/'), or a leaf it cannot store (names the key).
    """
    if not isinstance(example, TensorDictBase):
        raise ConfigError(f"H5ReplayStorage stores TensorDicts, got {type(example).__name__}")
    skip = 1 if example.batch_dims else 0
    tree: dict[str, Any] = {}
    for key, value in _leaves(example):
        for part in key:
            if not part or "/" in part or part in (".", ".."):
                raise ConfigError(f"key {_name(key)} cannot name an h5replay leaf: a key part must be non-empty and "
                                  f"without '/'; rename it")
        node = tree
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = _leaf_space(tuple(value.shape[skip:]), _numpy_dtype(key, value))
    if not tree:
        raise ConfigError("the TensorDict has no tensors to store")
    return DictSpace(tree)


def _expected(space: Space) -> dict[tuple[str, ...], LeafSpace]:
    return {tuple(path.split("/")): leaf for path, leaf in space.leaves()}


def _check(td: Any, space: Space) -> None:
    """Refuse rows `td` (one leading row axis) that `space` cannot hold, naming the key.

    Raises:
        SpaceMismatchError: a key missing or unexpected, a shape or dtype that differs.
        ConfigError: a leaf that is not a tensor or of a dtype h5replay cannot store.
    """
    expected = _expected(space)
    given = dict(_leaves(td))
    missing = [_name(k) for k in expected if k not in given]
    extra = [_name(k) for k in given if k not in expected]
    if missing or extra:
        parts = ([f"missing {', '.join(missing)}"] if missing else []) + \
                ([f"unexpected {', '.join(extra)}"] if extra else [])
        raise SpaceMismatchError(f"the TensorDict's keys differ from the storage's: {'; '.join(parts)}; its keys are "
                                 f"{', '.join(_name(k) for k in expected)}")
    for key, leaf in expected.items():
        value = given[key]
        dtype = _numpy_dtype(key, value)
        shape = tuple(value.shape[1:])
        if shape != leaf.shape:
            raise SpaceMismatchError(f"key {_name(key)} has shape {shape} per transition but the storage holds "
                                     f"{leaf.shape}; check the env's specs (or reshape(-1) a [envs, time] batch)")
        if dtype != leaf.dtype:
            raise SpaceMismatchError(f"key {_name(key)} has dtype {value.dtype} but the storage holds "
                                     f"{np.dtype(leaf.dtype)}; convert it before extend")


def _rows(td: Any) -> dict[str, Any]:
    """The rows as the nested dict of numpy arrays h5replay takes."""
    out: dict[str, Any] = {}
    for key, value in _leaves(td):
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = value.detach().cpu().numpy()
    return out


def _tensors(value: Any) -> Any:
    """Decoded rows as tensors (copied only when read-only: a server's arrays view its message)."""
    if isinstance(value, Mapping):
        return {key: _tensors(sub) for key, sub in value.items()}
    arr = np.asarray(value)
    return torch.from_numpy(arr if arr.flags.writeable else arr.copy())


# TorchRL picks a replay buffer's default collate by the storage's class
# (torchrl/data/replay_buffers/storages/utils.py, `_get_default_collate`): only its own classes
# have one. StoreStorage, its storage of rows kept outside the process whose `get` returns a
# whole batch, is the one whose batches it passes on as they are, so H5ReplayStorage is one of
# those: `TensorDictReplayBuffer(storage=H5ReplayStorage(...))` needs no collate_fn. Every method
# StoreStorage has is H5ReplayStorage's own; its __init__ (which wants redis) is not called.
class H5ReplayStorage(StoreStorage):  # type: ignore[misc,unused-ignore]  # Any without torchrl installed
    """A TorchRL `Storage` whose rows live in an h5replay file (`path`) or server (`endpoint`).

    Args:
        max_size: rows held at most (the ring's capacity). A new file needs it; an existing file
            or a server has its own (None takes it; another number is refused).
        path: an HDF5 file, created at the first write (its space: that TensorDict's), or opened
            and continued when it exists.
        endpoint: a server's endpoint instead (its space: `space_json` of an example).
        timeout: seconds a request to the server may take.

    Raises:
        ConfigError: neither or both of path and endpoint, no max_size for a new file, a max_size
            other than the file's or server's capacity, a server whose space is not a Dict.
    """

    def __init__(self, max_size: int | None = None, *, path: str | os.PathLike[str] | None = None,
                 endpoint: str | None = None, timeout: float = 30.0) -> None:
        if (path is None) == (endpoint is None):
            raise ConfigError("H5ReplayStorage takes a local file (path=) or a server (endpoint=): exactly one")
        if max_size is not None and (isinstance(max_size, bool) or not isinstance(max_size, (int, np.integer))
                                     or max_size < 1):
            raise ConfigError(f"max_size must be an integer >= 1, got {max_size!r}")
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        self.path = None if path is None else os.fspath(path)
        self.endpoint = endpoint
        self.timeout = float(timeout)
        self._asked = None if max_size is None else int(max_size)
        if self.path is not None and not os.path.exists(self.path) and max_size is None:
            raise ConfigError(f"{self.path} does not exist yet: give max_size, the rows the new file holds")
        Storage.__init__(self, self._asked or 1)
        self._forget_handles()
        self._open()

    # ------------------------------------------------------------------ where the rows live

    def _forget_handles(self) -> None:
        self._rb: Any = None
        self._actor: Any = None
        self._learner: Any = None
        self._in_flight: collections.deque[Any] = collections.deque()
        self._unflushed = False
        self._closed = False
        self.space: DictSpace | None = None

    def _check_open(self) -> None:
        if self._closed:
            raise ClosedError(f"this H5ReplayStorage over {self.path or self.endpoint} was closed")

    def _capacity(self, capacity: int | None, where: str) -> None:
        """Take the file's or server's capacity as max_size (refusing another one asked for)."""
        size = _UNBOUNDED if capacity is None else int(capacity)
        if self._asked is not None and self._asked != size:
            self.close()
            raise ConfigError(f"{where} holds {capacity} rows at most, not max_size={self._asked}: give "
                              f"max_size={capacity} or None")
        self.max_size = size

    def _open(self) -> None:
        """Open the file (when it exists) or the server's clients; a new file waits for rows."""
        from h5replay.client import ActorClient, LearnerClient
        from h5replay.storage import ReplayBuffer

        if self.path is not None:
            if os.path.exists(self.path):
                self._rb = ReplayBuffer.load_from(self.path, read_only=False)
                self.space = self._dict_space(self._rb.space, self.path)
                self._capacity(self._rb.capacity, self.path)
            return
        endpoint = str(self.endpoint)
        self._actor = ActorClient(endpoint, timeout=self.timeout)
        self._learner = LearnerClient(endpoint, timeout=self.timeout)
        self.space = self._dict_space(self._actor.space, f"the server at {endpoint}")
        self._capacity(self._learner.capacity, f"the server at {endpoint}")

    def _dict_space(self, space: Space, where: str) -> DictSpace:
        if not isinstance(space, DictSpace):
            self.close()
            raise ConfigError(f"{where} stores {space!r}, not TensorDict rows (a Dict space): serve it with --space "
                              f"of H5ReplayStorage.space_json(example)")
        for path, leaf in space.leaves():
            if not isinstance(leaf, (BoxSpace, BinarySpace)):
                self.close()
                raise ConfigError(f"{where} stores {leaf!r} at key {_name(tuple(path.split('/')))}, which a TensorDict "
                                  f"of tensors cannot hold")
        return space

    @staticmethod
    def space_json(example: Any) -> dict[str, Any]:
        """The space file of a server for TensorDicts like `example` (`h5replay serve --space FILE`)."""
        return transition_space(example).to_json()

    # ------------------------------------------------------------------ TorchRL's Storage

    def set(self, cursor: Any, data: Any, *, set_cursor: bool = True) -> None:
        """Append `data`'s rows (one per element of its first batch dimension; a TensorDict
        without batch dimensions is one row) as one segment, at the tail, wherever `cursor`
        points. Locally it returns once written; to a server once sent (at most 8 unacknowledged).

        Raises:
            NotImplementedError: `set_cursor=False` (an overwrite: `rb[i] = td`, `write_at`).
            SpaceMismatchError / ConfigError: rows the space cannot hold (names the key).
            ClosedError: the storage was closed.
            H5ReplayError: what the server refused of an earlier write (its acknowledgement comes later).
        """
        self._check_open()
        if not set_cursor:
            raise NotImplementedError("H5ReplayStorage writes each row once, at its tail: it cannot overwrite rows "
                                      "(rb[index] = ..., write_at, ConsumingSampler); extend instead")
        if not isinstance(data, TensorDictBase):
            raise ConfigError(f"H5ReplayStorage stores TensorDicts, got {type(data).__name__}: use a "
                              f"TensorDictReplayBuffer, or extend with TensorDicts")
        rows = data.unsqueeze(0) if not data.batch_dims else data
        if self.space is None:
            self._create(rows)
        if self.space is None:  # (set by _create; for mypy)
            raise RuntimeError("H5ReplayStorage has no space after creating its file")
        _check(rows, self.space)
        batch = _rows(rows)
        self._set_last_cursor(cursor)
        if self._rb is not None:
            self._rb.extend(batch)
            self._rb.end_episode()
            self._unflushed = True
        else:
            while len(self._in_flight) >= _IN_FLIGHT or (self._in_flight and self._in_flight[0].done()):
                self._in_flight.popleft().result()  # raises what the server refused
            self._in_flight.append(self._actor.push_episode(batch, wait=False))
        self._bump_mutation_revision()

    def _create(self, rows: Any) -> None:
        """Create the new file with the space of its first rows."""
        from h5replay.storage import ReplayBuffer

        space = transition_space(rows)
        self._rb = ReplayBuffer.create(space, self._asked, str(self.path))
        self.space = space
        self.max_size = int(self._rb.capacity)

    def get(self, index: Any) -> Any:
        """Rows by storage index (0: the oldest held; an int, a slice, a list or tensor of ints,
        negatives from the end) as a TensorDict: batch size [] for an int, [n] otherwise.
        Blocks on the file's read, or on the server (acknowledging this process's writes first).

        Raises:
            IndexError: an index out of range (or nothing stored yet).
            ClosedError: the storage was closed.
        """
        self._check_open()
        single = isinstance(index, (int, np.integer)) or (isinstance(index, torch.Tensor) and index.ndim == 0)
        if isinstance(index, slice):
            where: Any = np.arange(*index.indices(len(self)), dtype=np.int64)
        else:
            where = np.asarray(index.detach().cpu().numpy() if isinstance(index, torch.Tensor) else index)
            if where.dtype == np.bool_:  # a mask over the rows held
                where = np.flatnonzero(where)
            where = where.astype(np.int64, copy=False).reshape(-1)
        if self.space is None:
            raise IndexError(f"index {index!r} is out of range: the storage holds no rows yet")
        self._settle()
        if where.size == 0:
            rows: Any = {path: np.zeros((0, *leaf.shape), leaf.storage_dtype) for path, leaf in self.space.leaves()}
            rows = self._unflatten(rows)
        elif self._rb is not None:
            rows = self._rb.get_at(where)
        else:
            rows = self._learner.get(where)
        out = TensorDict(_tensors(rows), batch_size=[int(where.size)])
        return out[0] if single else out

    def _unflatten(self, flat: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path, value in flat.items():
            node = out
            *parents, last = path.split("/")
            for part in parents:
                node = node.setdefault(part, {})
            node[last] = value
        return out

    def _settle(self) -> None:
        """Before a read: a file's rows published (durable, and twice as fast to read), a
        server's acknowledged (so this process sees its own writes)."""
        if self._rb is not None and self._unflushed:
            self._rb.flush()
            self._unflushed = False
        while self._in_flight:
            self._in_flight.popleft().result()

    def __len__(self) -> int:
        """Rows held (every writer's, on a server; a round trip there)."""
        self._check_open()
        if self._rb is not None:
            return len(self._rb)
        if self._learner is None:
            return 0
        self._settle()
        return len(self._learner)

    def contains(self, item: Any) -> Any:
        """Whether storage index `item` (an int, or a tensor of them) is held."""
        length = len(self)
        if isinstance(item, torch.Tensor):
            return (item >= -length) & (item < length)
        if isinstance(item, (int, np.integer)):
            return -length <= int(item) < length
        raise NotImplementedError(f"H5ReplayStorage.contains takes an int or a tensor of ints, not {type(item).__name__}")

    def _empty(self) -> None:
        """`rb.empty()`: a local file is cleared (its ids go on); a server's replay is shared and
        is not emptied by one of its clients (NotImplementedError)."""
        self._check_open()
        if self._learner is not None:
            raise NotImplementedError(f"H5ReplayStorage does not empty the server at {self.endpoint}: its rows are "
                                      f"shared by every client; start the server on a new file instead")
        if self._rb is not None:
            self._rb.clear()
            self._unflushed = True
        self._bump_mutation_revision()

    def state_dict(self) -> dict[str, Any]:
        """Where the rows live (they stay there): a checkpoint of the buffer names the file or server."""
        if self._rb is not None and self._unflushed:
            self._rb.flush()
            self._unflushed = False
        return {"path": self.path, "endpoint": self.endpoint, "max_size": self.max_size}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accept the state of a storage over the same file or server (the rows are already there).

        Raises:
            ConfigError: the state names another file or server.
        """
        theirs = (state_dict.get("path"), state_dict.get("endpoint"))
        if theirs != (self.path, self.endpoint):
            raise ConfigError(f"this state is of a storage over {theirs[0] or theirs[1]!r}, not "
                              f"{self.path or self.endpoint!r}: make an H5ReplayStorage over that one instead")
        self._bump_mutation_revision()

    def dumps(self, path: Any) -> None:
        """`rb.dumps(path)`: the rows stay in the file or server (published first, for a file);
        the checkpoint at `path` holds TorchRL's own state (writer, sampler), not the rows."""
        self._settle()
        super().dumps(path)

    # ------------------------------------------------------------------ life cycle

    def close(self) -> None:
        """Flush and close the file, or settle the writes in flight and close the clients. Safe
        twice; the storage cannot be used after it."""
        try:
            while self._in_flight:
                self._in_flight.popleft().result()
        finally:
            for handle in (self._rb, self._actor, self._learner):
                if handle is not None:
                    handle.close()
            self._rb = self._actor = self._learner = None
            self._closed = True

    def __enter__(self) -> H5ReplayStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        self._settle()  # what was written is there for the process that unpickles it
        state: dict[str, Any] = Storage.__getstate__(self)
        for handle in ("_rb", "_actor", "_learner", "_in_flight", "_unflushed", "_closed", "space"):
            state.pop(handle, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        Storage.__setstate__(self, state)
        self._forget_handles()
        self._open()

    def __repr__(self) -> str:
        where = f"path={self.path!r}" if self.path is not None else f"endpoint={self.endpoint!r}"
        return f"H5ReplayStorage({where}, max_size={self.max_size})"
