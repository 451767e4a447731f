"""The h5replay service: one writer process owns the file; reader processes serve learners."""

from __future__ import annotations

from h5replay.server.writer import Server, ServerProcess

__all__ = ["Server", "ServerProcess"]
