"""Idempotency keys: the receipts of a buffer's recent keyed commits, kept in its own file.

A client makes a key (16 random bytes) once per episode and sends it with the commit and with
every retry of that commit. The writer answers a key it already holds with the original receipt
instead of committing the episode again, so a commit applied after the client timed out is not
stored twice by the client's retry.

The window: the keys of the last `window` episodes committed (by episode id, keyed or not;
65,536 by default, fixed when the file is made). A key whose episode is older is forgotten; a
retry that late commits again.

In the file, `/_h5replay/replay/commit_keys`: (n, 6) int64 rows (the key as two int64, episode
id, first row id, length, CRC-32 of the five), episode `e`'s in row `e % window` (grown in chunks
up to `window` rows). A row is written before the publish that makes its episode visible and
counts only once that publish is in the file: a row whose episode id is not in
[ep_end - window, ep_end) of the published state, or whose CRC disagrees, is ignored. A reopen
(after a close, or a SIGKILL) therefore remembers exactly the keys of the published episodes in
the window. Rows of episodes that were never published are blanked before their slot is used by
an episode without a key.

A damaged row (its CRC disagrees, or it names an episode of another slot: a torn or misplaced
write, a bad disk) is dropped with a warning, as if its key were forgotten: a retry of that
episode commits it again rather than being answered with a receipt the row may have wrong.

Only the writer reads the table; readers never open it. Files made before it get it (empty) at
their first writable open.
"""

from __future__ import annotations

import logging
import zlib

import h5py
import numpy as np

from h5replay.errors import ConfigError, SegmentStateError, StorageError
from h5replay.records import Receipt
from h5replay.storage._h5file import check_dataset, h5_errors
from h5replay.storage._rowio import read_slice, write_slots

__all__ = ["KEY_BYTES", "DEFAULT_KEY_WINDOW", "MAX_KEY_WINDOW", "KeyFile", "KeyTable", "check_key"]

log = logging.getLogger("h5replay.storage")

KEY_BYTES = 16
DEFAULT_KEY_WINDOW = 65_536  # 3 MiB of file at most; an episode retried later than this is rare
#: The largest window (4M episodes): the writer reads the whole table into memory when it opens
#: the file, 192 MiB of file and about a GiB of memory at this size.
MAX_KEY_WINDOW = 1 << 22
_TABLE = "commit_keys"
_COLUMNS = 6
_CHUNK_ROWS = 4096
_BLANK = np.zeros((1, _COLUMNS), dtype=np.int64)


def check_key(key: object) -> bytes | None:
    """`key` as bytes (None: no key).

    Raises:
        ConfigError: not 16 bytes.
    """
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray, memoryview)) or len(key) != KEY_BYTES:
        raise ConfigError(f"an idempotency key must be {KEY_BYTES} bytes (e.g. os.urandom({KEY_BYTES})), "
                          f"got {type(key).__name__} {key!r:.60}")
    return bytes(key)


def _row(key: bytes, receipt: Receipt) -> np.ndarray:
    row = np.zeros((1, _COLUMNS), dtype=np.int64)
    row[0, :2] = np.frombuffer(key, dtype="<i8")
    row[0, 2:5] = receipt
    row[0, 5] = zlib.crc32(row[0, :5].tobytes())
    return row


class KeyFile:
    """The key table of one writable buffer file: create, read all, write one row."""

    def __init__(self, ds: h5py.Dataset) -> None:
        """Raises:
            StorageError: `ds` is not a key table h5replay makes ((n, 6) int64 of at most a
                window of 1 to MAX_KEY_WINDOW rows).
        """
        where = repr(ds.file.filename)
        check_dataset(ds, where, np.int64, (None, _COLUMNS))
        window = ds.maxshape[0]
        if window is None or not 1 <= window <= MAX_KEY_WINDOW:
            raise StorageError(f"{where}: the idempotency key table {ds.name!r} has a window of {window} rows (its "
                               f"maxshape), not 1 to {MAX_KEY_WINDOW}: the file is damaged or was not written by h5replay")
        self._ds = ds
        self.window = int(window)
        self._rows = int(ds.shape[0])  # kept here: h5py's `shape` costs ~25 us a call
        self._pending: dict[int, np.ndarray] = {}  # slot -> row, written by `write_pending`

    @staticmethod
    def check_window(window: object) -> int:
        """Raises:
            ConfigError: `window` is not an int >= 1.
        """
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_KEY_WINDOW:
            raise ConfigError(f"the idempotency key window must be an int from 1 to {MAX_KEY_WINDOW} (episodes), "
                              f"got {window!r}")
        return window

    @staticmethod
    def create_table(group: h5py.Group, window: int = DEFAULT_KEY_WINDOW) -> None:
        """Add an empty key table of `window` rows at most to a replay group (before SWMR starts)."""
        KeyFile.check_window(window)
        if _TABLE not in group:
            group.create_dataset(_TABLE, shape=(0, _COLUMNS), maxshape=(window, _COLUMNS),
                                 chunks=(min(_CHUNK_ROWS, window), _COLUMNS), dtype=np.int64)

    @classmethod
    def of(cls, group: h5py.Group) -> KeyFile | None:
        """The group's key table (None: a file opened read-only that was made before it)."""
        with h5_errors("opening the idempotency key table"):
            ds = group.get(_TABLE)
        return None if ds is None else cls(ds)

    @property
    def filename(self) -> str:
        return str(self._ds.file.filename)

    def read(self) -> np.ndarray:
        with h5_errors("reading the idempotency key table"):
            return read_slice(self._ds, 0, self._ds.shape[0])

    def write(self, slot: int, row: np.ndarray) -> None:
        """Record `row` in `slot` (growing the table now): written to the file by the next
        `write_pending`, which the journal's publish calls before it writes the state."""
        if slot >= self._rows:
            with h5_errors("recording an idempotency key"):
                self._rows = min(self.window, max(slot + 1, 2 * self._rows, _CHUNK_ROWS))
                self._ds.resize(self._rows, axis=0)
        self._pending[slot] = row

    def write_pending(self) -> None:
        """Write the rows recorded since the last call, one write per run of slots."""
        pending, self._pending = self._pending, {}
        with h5_errors("recording idempotency keys"):
            write_slots(self._ds, pending, (self._rows, _COLUMNS))


class KeyTable:
    """The writer's memory of the key table: key -> receipt, and what each slot holds. Pure
    bookkeeping; `file` (None: memory only) gets every change."""

    def __init__(self, window: int, file: KeyFile | None = None) -> None:
        self.window = window
        self.file = file
        self._receipts: dict[bytes, Receipt] = {}
        self._slots: dict[int, bytes] = {}  # slot -> the key recorded there
        self._stale: set[int] = set()  # slots whose file row names an episode never published

    def __len__(self) -> int:
        return len(self._receipts)

    def load(self, ep_end: int) -> None:
        """Remember the file's rows of published episodes in the window (`ep_end`: published)."""
        if self.file is None:
            return
        rows = self.file.read()
        damaged = []
        for slot, row in enumerate(rows):
            if not row.any():
                continue
            episode_id = int(row[2])
            if int(row[5]) != zlib.crc32(row[:5].tobytes()) or episode_id % self.window != slot:
                damaged.append(slot)
                self._stale.add(slot)
                continue
            if not ep_end - self.window <= episode_id < ep_end:
                self._stale.add(slot)  # an episode never published, or one the window has left
                continue
            key = row[:2].astype("<i8").tobytes()
            self._receipts[key] = Receipt(episode_id, int(row[3]), int(row[4]))
            self._slots[slot] = key
        if damaged:
            log.warning("%s: %d damaged idempotency key rows (slots %s) were dropped: a retry of their episodes "
                        "commits them again", self.file.filename, len(damaged), damaged[:8])

    def held(self, ep_end: int) -> list[tuple[bytes, Receipt]]:
        """(key, receipt) of every episode below `ep_end` in the window that has a key."""
        return [(key, receipt) for slot, key in self._slots.items()
                if (receipt := self._receipts.get(key)) is not None and receipt.episode_id % self.window == slot
                and ep_end - self.window <= receipt.episode_id < ep_end]

    def find(self, key: bytes, length: int | None, ep_end: int) -> Receipt | None:
        """The receipt of `key` if an episode below `ep_end` in the window was committed with it.

        Raises:
            SegmentStateError: the key's episode has another length than `length` (None: not
                known): a key reused for other content.
        """
        receipt = self._receipts.get(key)
        if receipt is None:
            return None
        e = receipt.episode_id
        if not ep_end - self.window <= e < ep_end or self._slots.get(e % self.window) != key:
            return None
        if length is not None and length != receipt.length:
            raise SegmentStateError(
                f"idempotency key {key.hex()} is already the key of episode {e} ({receipt.length} rows), but this "
                f"commit has {length} rows; make a fresh key for each episode")
        return receipt

    def put(self, key: bytes | None, receipt: Receipt) -> None:
        """Record the episode of `receipt` (its key, or none) in its slot, in the file first."""
        slot = receipt.episode_id % self.window
        if key is None:
            if slot in self._stale or slot in self._slots:
                # The slot's row names an episode this one replaces: blank it, or a reopen could
                # take it for this episode's key.
                if self.file is not None and slot in self._stale:
                    self.file.write(slot, _BLANK)
                self._stale.discard(slot)
                self._drop(slot)
            return
        if self.file is not None:
            self.file.write(slot, _row(key, receipt))
        self._stale.discard(slot)
        self._drop(slot)
        self._slots[slot] = key
        self._receipts[key] = receipt

    def forget_from(self, episode_id: int) -> None:
        """Episodes from `episode_id` on were never published (a failed commit or publish)."""
        for slot, key in list(self._slots.items()):
            if self._receipts[key].episode_id >= episode_id:
                self._drop(slot)
                self._stale.add(slot)

    def _drop(self, slot: int) -> None:
        old = self._slots.pop(slot, None)
        if old is not None and self._receipts.get(old, Receipt(-1, -1, 0)).episode_id % self.window == slot:
            del self._receipts[old]
