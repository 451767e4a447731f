"""The idempotency keys of a ReplayBuffer's file against a plain model: the keys of the last
`window` episodes, each with its receipt.

Random commits (a key from a small pool, so keys come back: inside the window, after it, with
the same or another length), group commits published later, and reopens of the file. After every
step each key of the pool must give exactly the model's receipt.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from h5replay.errors import SegmentStateError
from h5replay.records import Receipt
from h5replay.storage import BoxSpace, ReplayBuffer

WINDOW = 4
KEYS = [bytes([k]) * 16 for k in range(6)]
SPACE = BoxSpace(-1.0, 1.0, (2,), np.float32)


class KeyTableMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.dir.name, "rb.h5")
        self.buffer = ReplayBuffer.create(SPACE, 40, self.path, idempotency_window=WINDOW)
        self.episodes: list[tuple[bytes | None, Receipt]] = []  # the model: every episode committed
        self.next_row = 0

    def model(self, key: bytes) -> Receipt | None:
        recent = [receipt for k, receipt in self.episodes[-WINDOW:] if k == key]
        return recent[-1] if recent else None

    @rule(key=st.sampled_from([None, *KEYS]), n=st.integers(1, 5), publish=st.booleans())
    def commit(self, key: bytes | None, n: int, publish: bool) -> None:
        writer = self.buffer.open_segment_writer()
        writer.extend(np.zeros((n, 2), np.float32))
        known = self.model(key) if key is not None else None
        if known is not None and known.length != n:
            with pytest.raises(SegmentStateError):
                self.buffer.commit_segment(writer, publish=publish, idempotency_key=key)
            writer.abort()
            return
        receipt = self.buffer.commit_segment(writer, publish=publish, idempotency_key=key)
        if known is not None:
            assert receipt == known and writer.state == "aborted"
            return
        assert receipt == Receipt(len(self.episodes), self.next_row, n)
        self.episodes.append((key, receipt))
        self.next_row += n

    @rule()
    def flush(self) -> None:
        self.buffer.flush()

    @rule()
    def reopen(self) -> None:
        self.buffer.close()
        self.buffer = ReplayBuffer.load_from(self.path, read_only=False)

    @invariant()
    def every_key_gives_the_models_receipt(self) -> None:
        for key in KEYS:
            assert self.buffer.receipt_for(key) == self.model(key), key

    def teardown(self) -> None:
        self.buffer.close()
        self.dir.cleanup()


TestKeyTable = KeyTableMachine.TestCase
TestKeyTable.settings = settings(max_examples=25, stateful_step_count=40, deadline=None)
