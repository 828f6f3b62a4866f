"""How long to wait before trying again: one policy of capped doubling waits.

Every retry in chkq waits ``first``, then twice as long each time, never more
than ``most``; with ``jitter`` each wait is drawn from ``[wait / 2, wait]`` so
that processes that failed together do not all try again together.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Backoff:
    """Capped doubling waits (seconds): ``first``, ``2 * first``, ... up to ``most``."""

    first: float
    most: float
    jitter: bool = False

    def wait(self, tried: int) -> float:
        """Seconds to wait after the ``tried``-th failure (0 for the first)."""
        wait = min(self.most, self.first * 2.0 ** min(tried, 64))
        return random.uniform(wait / 2, wait) if self.jitter else wait
