"""`python -m h5replay`: the same as the `h5replay` command."""

from __future__ import annotations

import sys

from h5replay.cli import main

if __name__ == "__main__":
    sys.exit(main())
