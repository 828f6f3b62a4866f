"""Which directories a worker may touch, when the deployment says so.

Task messages are untrusted input: with ``CHKQ_ALLOWED_ROOTS`` set, a task
refuses any run directory, checkpoint file or local store outside those
directories (symbolic links resolved), before touching anything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def check_allowed(path: str | Path, roots: Sequence[str]) -> Path:
    """Return ``path`` if ``roots`` is empty or ``path`` lies inside one of them.

    Raises
    ------
    PermissionError
        Naming the path and the allowed roots.
    """
    if not roots:
        return Path(path)
    real = Path(os.path.realpath(path))
    for root in roots:
        base = Path(os.path.realpath(root))
        if real == base or base in real.parents:
            return Path(path)
    raise PermissionError(
        f"{str(path)!r} is outside the directories this worker may touch "
        f"(CHKQ_ALLOWED_ROOTS={os.pathsep.join(roots)})"
    )
