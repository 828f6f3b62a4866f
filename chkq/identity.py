"""Who submitted a job, proven to the workers, and what that party may do with it.

A deployment that gives each user a key of their own (``CHKQ_USER_KEYS_DIR``
on the workers: ``DIR/USER.key``, owned by the user, readable by no one else
but the workers) has every job-starting message carry a credential: the
user's name, when it was issued, what it asks for (the claim) and an
HMAC-SHA256 of all three under the user's key. Workers recompute the HMAC
with the key file owned by that user, check the claim against the message,
and allow the job only if that user could do it themselves: read the run's
checkpoints, write where the output goes, and delete what ``--cleanup``
deletes (:class:`Party`). Only the owner (or root) can create a file owned
by a uid, so nobody can plant a key in another user's name.

Without ``CHKQ_USER_KEYS_DIR`` there is one party: everyone who holds the
message signing key (or, without signing, the broker's password).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import pwd
import re
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from chkq import environment
from chkq.errors import ChkqError, ConfigurationError

#: The workers' directory of users' keys (and, on a client, where its own is looked up).
KEYS_VARIABLE = environment.USER_KEYS_DIR.name
#: A client's own key file, if not ``KEYS_DIR/USER.key``.
KEY_VARIABLE = environment.USER_KEY.name
#: The fewest bytes a user's key may have.
MIN_KEY_BYTES = 32
#: The largest key file read.
MAX_KEY_BYTES = 4096
#: How far in the future a credential's issue time may be (clocks differ between hosts).
CLOCK_SKEW = 300.0

READ, WRITE, SEARCH = os.R_OK, os.W_OK, os.X_OK
_USER = re.compile(r"[a-z_][a-z0-9_.-]{0,31}\$?", re.IGNORECASE)


class NotPermittedError(ChkqError, PermissionError):
    """A job its submitter may not run: no credential, a bad one, or too few rights."""


@dataclass(frozen=True)
class Party:
    """A local user as the kernel would judge their access: uid, primary and other groups."""

    name: str
    uid: int
    gids: frozenset[int]

    @classmethod
    def of_user(cls, name: str) -> Party:
        """The account ``name`` (NotPermittedError if there is none)."""
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            raise NotPermittedError(f"user {name!r} has no account on this worker") from None
        groups = frozenset(os.getgrouplist(name, entry.pw_gid))
        return cls(name, entry.pw_uid, groups)

    def _allowed(self, found: os.stat_result, want: int) -> bool:
        if self.uid == 0:
            return not want & SEARCH or bool(found.st_mode & 0o111) or \
                stat.S_ISDIR(found.st_mode)
        mode = found.st_mode
        if found.st_uid == self.uid:
            bits = (mode >> 6) & 7
        elif found.st_gid in self.gids:
            bits = (mode >> 3) & 7
        else:
            bits = mode & 7
        return bits & want == want

    def may(self, path: Path, want: int) -> bool:
        """Whether this user could reach ``path`` and open it for ``want`` (R/W/X bits).

        Every directory above it must be searchable by them, as for their own
        open; ACLs and capabilities are not considered (mode bits only). A
        path that does not exist is allowed only if ``want`` is ``WRITE``
        and they could create it (write and search its nearest directory).
        """
        path = Path(os.path.abspath(path))
        for parent in reversed(path.parents):
            try:
                found = os.stat(parent)
            except FileNotFoundError:
                return False
            if not self._allowed(found, SEARCH):
                return False
        try:
            found = os.stat(path)
        except FileNotFoundError:
            return want == WRITE and self.may(path.parent, WRITE | SEARCH)
        return self._allowed(found, want)

    def require(self, path: Path, want: int, what: str) -> None:
        """Raise NotPermittedError naming ``path`` unless :meth:`may` allows it."""
        if not self.may(path, want):
            raise NotPermittedError(
                f"user {self.name} may not {what} {str(path)!r} (mode bits as the kernel "
                f"would judge uid {self.uid}): refused, nothing was read, written or deleted")


# ---------------------------------------------------------------------------- keys


def _read_key(path: Path, owner: int | None) -> bytes:
    """The key in ``path``: a regular file, not a link, owned by ``owner`` and private."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except FileNotFoundError:
        raise NotPermittedError(f"no user key {str(path)!r}") from None
    except OSError as exc:
        raise NotPermittedError(f"user key {str(path)!r} cannot be opened: "
                                f"{exc.strerror}") from None
    try:
        found = os.fstat(fd)
        if not stat.S_ISREG(found.st_mode):
            raise NotPermittedError(f"user key {str(path)!r} is not a regular file")
        if owner is not None and found.st_uid != owner:
            raise NotPermittedError(
                f"user key {str(path)!r} is owned by uid {found.st_uid}, not by its user "
                f"(uid {owner}): refused")
        if found.st_mode & 0o007 or found.st_mode & 0o020:
            raise NotPermittedError(
                f"user key {str(path)!r} has mode {stat.filemode(found.st_mode)}: others may "
                "read or write it (chmod 0600, or 0640 with the workers' group)")
        data = os.read(fd, MAX_KEY_BYTES + 1).strip()
    finally:
        os.close(fd)
    if not MIN_KEY_BYTES <= len(data) <= MAX_KEY_BYTES:
        raise NotPermittedError(f"user key {str(path)!r} must hold {MIN_KEY_BYTES} to "
                                f"{MAX_KEY_BYTES} bytes (e.g. openssl rand -hex 32)")
    return data


def check_user_name(name: Any) -> str:
    """``name`` if it is a plausible login name (no separator, no ``..``), else refused."""
    if not isinstance(name, str) or not _USER.fullmatch(name):
        raise NotPermittedError(f"credential names no valid user: {name!r}")
    return name


def user_key(keys_dir: Path, name: str) -> tuple[Party, bytes]:
    """The party ``name`` and their key, ``keys_dir/NAME.key``, which must be theirs."""
    party = Party.of_user(check_user_name(name))
    return party, _read_key(keys_dir / f"{name}.key", party.uid)


def own_key(env: Mapping[str, str] | None = None) -> tuple[str, bytes] | None:
    """This process's user name and key, or None when this deployment has no user keys.

    ``CHKQ_USER_KEY`` names the file; otherwise ``CHKQ_USER_KEYS_DIR/USER.key``
    for the effective user. Either set but unreadable is a configuration
    error: the job would be refused by every worker.
    """
    env = environment.environ() if env is None else env
    name = pwd.getpwuid(os.geteuid()).pw_name
    explicit, directory = env.get(KEY_VARIABLE), env.get(KEYS_VARIABLE)
    if not explicit and not directory:
        return None
    path = Path(explicit) if explicit else Path(str(directory)) / f"{name}.key"
    try:
        return name, _read_key(path, os.geteuid())
    except NotPermittedError as exc:
        raise ConfigurationError(f"{exc} ({KEY_VARIABLE if explicit else KEYS_VARIABLE} is "
                                 "set: the workers run only jobs whose submitter proves who "
                                 "they are with their own key)") from None


# ---------------------------------------------------------------------------- credentials


def _signed_bytes(user: str, issued: float, task: str, claim: Mapping[str, Any]) -> bytes:
    return json.dumps({"user": user, "issued": issued, "task": task, "claim": dict(claim)},
                      sort_keys=True, separators=(",", ":")).encode()


def issue(user: str, key: bytes, task: str, claim: Mapping[str, Any],
          issued: float | None = None) -> dict[str, Any]:
    """A credential for ``task`` with ``claim`` (JSON values): what a job message carries."""
    when = time.time() if issued is None else issued
    mac = hmac.new(key, _signed_bytes(user, when, task, claim), hashlib.sha256).hexdigest()
    return {"user": user, "issued": when, "claim": dict(claim), "mac": mac}


def issue_own(task: str, claim: Mapping[str, Any]) -> dict[str, Any] | None:
    """A credential of this process's user (:func:`own_key`), or None without user keys."""
    found = own_key()
    return None if found is None else issue(found[0], found[1], task, claim)


def verify(keys_dir: Path, credential: Any, task: str, *, max_age: float | None,
           now: float | None = None) -> tuple[Party, dict[str, Any]]:
    """The party a credential proves and its claim, or NotPermittedError.

    ``max_age``: refuse a credential issued longer ago than this (None: any
    age, for a credential a worker already accepted and recorded).
    """
    if not isinstance(credential, dict) or set(credential) != {"user", "issued", "claim",
                                                                 "mac"}:
        raise NotPermittedError(f"the {task} message carries no well-formed user credential")
    user, issued, claim, mac = (credential[k] for k in ("user", "issued", "claim", "mac"))
    if isinstance(issued, bool) or not isinstance(issued, int | float) \
            or not isinstance(claim, dict) or not isinstance(mac, str):
        raise NotPermittedError(f"the {task} message's user credential is malformed")
    party, key = user_key(keys_dir, user)
    expected = hmac.new(key, _signed_bytes(user, issued, task, claim),
                        hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, mac):
        raise NotPermittedError(f"the {task} message's credential for user {user} was not made "
                                "with their key: refused")
    now = time.time() if now is None else now
    if issued > now + CLOCK_SKEW or (max_age is not None and now - issued > max_age):
        raise NotPermittedError(f"the {task} message's credential for user {user} was issued "
                                f"{now - issued:.0f} s ago, outside the {max_age} s it is "
                                "good for: refused")
    return party, claim


def check_claim(claim: Mapping[str, Any], asked: Mapping[str, Any], task: str) -> None:
    """Refuse a message that asks for something else than its credential's claim."""
    differ = sorted(k for k in set(claim) | set(asked) if claim.get(k) != asked.get(k))
    if differ:
        raise NotPermittedError(f"the {task} message does not ask for what its credential "
                                f"allows (differs in {', '.join(differ)}): refused")


# ---------------------------------------------------------------------------- what a party may do


def _checkpoint_entries(out_dir: Path, model: str) -> list[os.DirEntry[str]]:
    pattern = re.compile(re.escape(model) + r"_chk\d{5}(\.h5)?")
    with os.scandir(out_dir) as entries:
        return [e for e in entries if pattern.fullmatch(e.name)]


def check_run_directory(party: Party, out_dir: Path, model: str, cleanup: bool) -> None:
    """Refuse unless ``party`` could read the run, write its output and delete what cleanup does.

    The output is linked into ``out_dir``, so writing there is always
    needed; with cleanup, every checkpoint directory's entries are deleted
    too. Links are not followed here (the job refuses them anyway).
    """
    party.require(out_dir, READ | SEARCH, "read the run directory")
    party.require(out_dir, WRITE | SEARCH, "write the output into the run directory")
    if out_dir.stat().st_mode & stat.S_ISVTX and cleanup and party.uid not in (
            0, out_dir.stat().st_uid):
        raise NotPermittedError(f"user {party.name} may not delete checkpoints from "
                                f"{str(out_dir)!r}: it is sticky and not theirs")
    for entry in _checkpoint_entries(out_dir, model):
        path = Path(entry.path)
        if entry.is_symlink():
            continue
        if entry.is_dir():
            party.require(path, READ | SEARCH, "read the checkpoint directory")
            if cleanup:
                party.require(path, WRITE | SEARCH, "delete the checkpoints of")
            with os.scandir(path) as inner:
                for item in inner:
                    if item.name.endswith(".h5") and item.is_file(follow_symlinks=False):
                        party.require(Path(item.path), READ, "read the checkpoint")
        elif entry.is_file():
            party.require(path, READ, "read the checkpoint")


def check_local_store(party: Party, root: Path, files: list[Path], *, write: bool,
                      delete: bool, what: str) -> None:
    """Refuse unless ``party`` could read ``files`` of a local store at ``root``.

    ``write``: they must also be able to write the store (a log run's output
    entry is recorded there); ``delete``: to delete each of ``files``.
    """
    party.require(root, READ | SEARCH, f"read the {what} store")
    if write or delete:
        party.require(root, WRITE | SEARCH, f"write to the {what} store")
    for path in files:
        party.require(path, READ, "read the object")
        if delete:
            party.require(path.parent, WRITE | SEARCH, "delete objects from")


def check_destination(party: Party, root: Path, key: str) -> None:
    """Refuse unless ``party`` could create ``key`` in the local store at ``root``."""
    target = root / key
    nearest = target.parent
    while not nearest.exists() and nearest != nearest.parent:
        nearest = nearest.parent
    party.require(nearest, WRITE | SEARCH, "publish into")

