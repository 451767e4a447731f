"""Statistics for tests of samplers: Pearson's chi-square without scipy."""

from __future__ import annotations

import math

import numpy as np


def chi_square_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """The p-value of Pearson's chi-square test (bins of expected count < 5 pooled), by the
    Wilson-Hilferty approximation of the chi-square law."""
    order = np.argsort(expected)
    obs, exp = observed[order].astype(float), expected[order].astype(float)
    small = np.cumsum(exp) < 5.0
    if small.any():
        cut = int(small.sum()) + 1
        obs = np.concatenate([[obs[:cut].sum()], obs[cut:]])
        exp = np.concatenate([[exp[:cut].sum()], exp[cut:]])
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(exp) - 1
    z = ((stat / df) ** (1 / 3) - (1 - 2 / (9 * df))) / math.sqrt(2 / (9 * df))
    return 0.5 * math.erfc(z / math.sqrt(2))
