"""A plain-Python model of n-step transitions over episodes whose rows name themselves, shared
by the local (tests/unit/test_transitions.py) and served (tests/integration/test_transitions_service.py)
tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from h5replay.spaces import BinarySpace, BoxSpace, DictSpace

SPACE = DictSpace({
    "obs": {"pos": BoxSpace(-1e6, 1e6, (2,), np.float32), "id": BoxSpace(0, 1 << 30, (), np.int64)},
    "action": BoxSpace(0, 5, (), np.int64),
    "reward": BoxSpace(-1e6, 1e6, (), np.float32),
    "terminated": BinarySpace(),
    "truncated": BinarySpace(),
})


def episode(first: int, length: int, kind: str) -> tuple[dict[str, np.ndarray], dict[str, Any] | None]:
    """Rows of an episode whose row t has obs id first + t, and its final (None: cut short)."""
    t = np.arange(length)
    rows = {
        "obs": {"pos": np.stack([first + t, -(first + t)], axis=1).astype(np.float32), "id": (first + t).astype(np.int64)},
        "action": t % 5,
        "reward": (1.0 + (first + t) % 7).astype(np.float32),
        "terminated": np.zeros(length, bool),
        "truncated": np.zeros(length, bool),
    }
    if kind == "terminated":
        rows["terminated"][-1] = True
    elif kind == "truncated":
        rows["truncated"][-1] = True
    final = None if kind == "cut" else {"pos": np.array([-7.0, 7.0], np.float32) * (first + 1), "id": np.int64(10**6 + first)}
    return rows, final


class Model:
    """Every committed episode: its first row id, rows and final (None: none)."""

    def __init__(self) -> None:
        self.episodes: list[tuple[int, dict[str, Any], dict[str, Any] | None]] = []

    def expected(self, row: int, n: int, gamma: float) -> dict[str, Any]:
        for first, rows, final in self.episodes:
            length = len(rows["action"])
            if first <= row < first + length:
                t = row - first
                k = min(n, length - t)
                reward = sum(gamma ** i * float(rows["reward"][t + i]) for i in range(k))
                last = t + k - 1
                terminated, truncated = bool(rows["terminated"][last]), bool(rows["truncated"][last])
                if t + n < length:
                    nxt, discount = (rows["obs"]["pos"][t + n], rows["obs"]["id"][t + n]), gamma ** k
                elif final is not None:
                    nxt, discount = (final["pos"], final["id"]), gamma ** k
                else:
                    nxt, discount = (np.zeros(2, np.float32), 0), 0.0
                    truncated = truncated or not terminated
                return {"reward": reward, "discount": discount, "next": nxt, "terminated": terminated,
                        "truncated": truncated, "has_final": final is not None}
        raise AssertionError(f"row {row} is in no episode of the model")


def check_sample(rb: Any, model: Model, n: int, gamma: float, size: int = 300) -> np.ndarray:
    seeded = {"rng": np.random.default_rng(n)} if hasattr(rb, "storage") else {"seed": n}  # a buffer, or a learner
    batch, info = rb.sample_transitions(size, n_step=n, gamma=gamma, with_info=True, **seeded)
    check_batch(batch, info, model, n, gamma)
    return info.row_ids.astype(np.int64)


def check_every_held(rb: Any, model: Model, n: int, gamma: float) -> None:
    """`get_transitions` of every held row, in a shuffled order with a duplicate, is the model's."""
    ids = np.random.default_rng(n).permutation(np.arange(rb.view.begin, rb.view.end))
    ids = np.concatenate([ids, ids[:1]])
    batch, info = rb.get_transitions(ids, n_step=n, gamma=gamma, with_info=True)
    np.testing.assert_array_equal(info.row_ids.astype(np.int64), ids)
    check_batch(batch, info, model, n, gamma)


def check_batch(batch: Any, info: Any, model: Model, n: int, gamma: float) -> None:
    for i, row in enumerate(info.row_ids.astype(np.int64)):
        want = model.expected(int(row), n, gamma)
        assert batch["obs"]["id"][i] == row, "the step's own leaves"
        assert batch["reward"][i] == pytest.approx(want["reward"], rel=1e-6), (row, n)
        assert batch["discount"][i] == pytest.approx(want["discount"], rel=1e-6), (row, n)
        np.testing.assert_array_equal(batch["next"]["obs"]["pos"][i], want["next"][0])
        assert batch["next"]["obs"]["id"][i] == want["next"][1]
        assert (bool(batch["terminated"][i]), bool(batch["truncated"][i])) == (want["terminated"], want["truncated"])
        assert bool(info.has_final[i]) == want["has_final"]
