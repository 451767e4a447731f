"""Runnable examples behind `h5replay actor` and `h5replay learner`: a gymnasium actor that streams
real episodes, and a learner that samples them and reports what it sees.

gymnasium is optional (`pip install h5replay[gym]`); it is imported only when an example runs.
"""

from __future__ import annotations

from h5replay.examples.gym_actor import gym_row_space, make_env, run_actor, space_json
from h5replay.examples.learner import run_learner

__all__ = ["gym_row_space", "make_env", "run_actor", "run_learner", "space_json"]
