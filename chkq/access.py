"""Which files a worker may touch, when the deployment says so.

Task messages are untrusted input: with ``CHKQ_ALLOWED_ROOTS`` set, a task
refuses any run directory, checkpoint file or local store outside those
directories (symbolic links and ``..`` resolved), before touching anything.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from chkq.errors import BadNameError


def _refusal(path: str | Path, roots: Sequence[str], real: Path | None = None) -> PermissionError:
    shown = repr(str(path)) if real is None or str(real) == str(path) else \
        f"{str(path)!r} (resolved: {str(real)!r})"
    return PermissionError(
        f"{shown} is outside the directories this worker may touch "
        f"(CHKQ_ALLOWED_ROOTS={os.pathsep.join(roots)})"
    )


def _inside(real: Path, roots: Sequence[str]) -> bool:
    for root in roots:
        base = Path(os.path.realpath(root))
        if real == base or base in real.parents:
            return True
    return False


def resolve_allowed(path: str | os.PathLike[str], roots: Sequence[str]) -> Path:
    """Return the resolved ``path`` after checking it lies inside one of ``roots``.

    The result is ``os.path.realpath(path)``: absolute, with every symbolic
    link and ``..`` resolved. Callers must use the result, never ``path``
    itself, so that the file checked is the file opened (a link changed
    afterwards aside). With ``roots`` empty nothing is refused, but the path
    is resolved all the same.

    Parameters
    ----------
    path
        An absolute path (the caller has decoded any URL encoding).
    roots
        The allowed directories (``settings.allowed_roots``); empty: any.

    Raises
    ------
    ValueError
        If ``path`` is relative or contains a NUL byte.
    PermissionError
        Naming the path, its resolution and the allowed roots.
    """
    text = os.fspath(path)
    if "\x00" in text:
        raise BadNameError(f"path {text!r} contains a NUL byte")
    if not os.path.isabs(text):
        raise BadNameError(f"path {text!r} must be absolute")
    real = Path(os.path.realpath(text))
    if roots and not _inside(real, roots):
        raise _refusal(text, roots, real)
    return real


def check_allowed(path: str | Path, roots: Sequence[str]) -> Path:
    """Return ``path`` if ``roots`` is empty or ``path`` lies inside one of them.

    Symbolic links are resolved for the check; ``path`` is returned as
    given. New code should prefer :func:`resolve_allowed`, which returns
    the resolved path to use.

    Raises
    ------
    PermissionError
        Naming the path and the allowed roots.
    """
    if not roots:
        return Path(path)
    real = Path(os.path.realpath(path))
    if not _inside(real, roots):
        raise _refusal(path, roots)
    return Path(path)
