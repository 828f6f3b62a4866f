"""The key rules every store enforces: ``/``-separated relative names that cannot escape a root.

The public methods of :class:`~chkq.stores.base.CheckpointStore` validate keys
once, with these functions, so that no backend can be handed a key with empty,
``.`` or ``..`` components, a leading ``/``, a backslash or a NUL.
"""

from __future__ import annotations

from chkq.errors import InvalidKeyError

__all__ = ["bucket_prefix", "validate_key", "validate_prefix"]


def _key_problem(key: str) -> str | None:
    if not isinstance(key, str):
        return "not a string"
    if not key:
        return "empty key"
    if "\x00" in key:
        return "contains NUL"
    if "\\" in key:
        return "contains a backslash"
    if key.startswith("/"):
        return "leading '/'"
    for part in key.split("/"):
        if part == "":
            return "empty path component"
        if part in (".", ".."):
            return f"{part!r} path component"
    return None


def validate_key(key: str) -> str:
    """Return ``key`` unchanged if it is a valid store key.

    Parameters
    ----------
    key
        A ``/``-separated relative name such as ``runs/r1/records/abc.json``.

    Returns
    -------
    str
        The same key.

    Raises
    ------
    InvalidKeyError
        If the key is empty, has empty components, ``.`` or ``..``
        components, a leading ``/``, a backslash or a NUL character; the
        message names the key, because a bad key is almost always a caller
        bug that must be traceable.
    """
    problem = _key_problem(key)
    if problem is not None:
        raise InvalidKeyError(f"invalid store key {key!r}: {problem}")
    return key


def bucket_prefix(prefix: str) -> str:
    """A bucket store's key prefix as given in its URL, as ``"a/b/"`` (or ``""``).

    Raises
    ------
    InvalidKeyError
        Under the key rules, for the prefix without its surrounding ``/``.
    """
    prefix = prefix.strip("/")
    if prefix:
        validate_key(prefix)
    return prefix + "/" if prefix else ""


def validate_prefix(prefix: str) -> str:
    """Return ``prefix`` unchanged if it is a valid listing prefix.

    A prefix is either empty or a key, optionally with a trailing ``/``
    (``runs/r1/``) or a partial last component (``runs/r1/rec``).

    Raises
    ------
    InvalidKeyError
        Under the same rules as :func:`validate_key`, applied to the prefix
        without its trailing ``/``.
    """
    if prefix == "":
        return prefix
    trimmed = prefix[:-1] if prefix.endswith("/") else prefix
    problem = _key_problem(trimmed)
    if problem is not None:
        raise InvalidKeyError(f"invalid store prefix {prefix!r}: {problem}")
    return prefix
