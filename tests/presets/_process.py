"""Process helpers shared by the compare tests (independent of the runner under test)."""

from __future__ import annotations

import os


def group_alive(pgid: int) -> bool:
    """True while any process of process group ``pgid`` exists."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
