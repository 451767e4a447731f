"""Padding of windows (h5replay/windows.py): ids never past a window's episode, zeros (empty text)
past its valid steps in every nested leaf, read-only inputs left as they are."""

from __future__ import annotations

import numpy as np
import pytest

from h5replay.windows import MASK, masked, step_mask, unmasked, window_rows

pytestmark = pytest.mark.timeout(30)


def test_window_rows_repeat_the_episodes_last_row_and_never_pass_it() -> None:
    rows = window_rows(np.array([10, 4, 0]), np.array([2, 1, 3]), 3)
    assert rows.tolist() == [[10, 11, 11], [4, 4, 4], [0, 1, 2]]
    assert step_mask(np.array([2, 1, 3]), 3).tolist() == [[True, True, False], [True, False, False], [True] * 3]


def test_masked_zeroes_every_leaf_past_its_valid_steps() -> None:
    ids = np.arange(6).reshape(2, 3)
    ids.flags.writeable = False  # as a reply's arrays arrive
    text = np.array([["a", "b", "c"], ["d", "e", "f"]], dtype=object)
    out = masked({"obs": {"id": ids, "pos": np.ones((2, 3, 2))}, "note": text}, np.array([1, 3]), 3)
    assert out["obs"]["id"].tolist() == [[0, 0, 0], [3, 4, 5]] and ids.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["obs"]["pos"][0, 1:].sum() == 0 and out["obs"]["pos"][1].sum() == 6
    assert out["note"].tolist() == [["a", "", ""], ["d", "e", "f"]]
    assert out[MASK].tolist() == [[True, False, False], [True, True, True]]
    assert set(unmasked(out)) == {"obs", "note"}
