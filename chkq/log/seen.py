"""What a reader saw of a signed log before: how it notices names rolled back or brought back.

A store tenant without the signing key cannot forge an entry, but can delete
any: removing a name's newest entries makes the one before look current
(rollback), and removing a deletion brings the name back (resurrection).
Nothing left in the store shows this when the whole newest part of a name's
history is gone, so the reader keeps, outside the store, the newest number it
saw of each name (:class:`SeenNames`, a file of its own user's) and refuses a
name whose newest entry in the store is older than that.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any

from chkq.log.names import NameEntry, newest

__all__ = ["SeenNames"]


class SeenNames:
    """The newest entry number seen of each name of one run in one store, kept in a file.

    Parameters
    ----------
    path
        The file (created 0600, its directory 0700, when first written).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    @classmethod
    def for_run(cls, directory: str | Path, store_url: str, run_id: str) -> SeenNames:
        """The file for ``run_id`` in ``store_url`` under ``directory``."""
        digest = hashlib.sha256(f"{store_url}\n{run_id}".encode()).hexdigest()[:32]
        return cls(Path(directory) / f"{digest}.json")

    def load(self) -> dict[str, dict[str, Any]]:
        """Name -> ``{"seq", "id", "deleted"}`` as last saved (empty if none or unreadable)."""
        try:
            obj = json.loads(self.path.read_bytes())
        except (OSError, ValueError):
            return {}
        names = obj.get("names") if isinstance(obj, dict) else None
        if not isinstance(names, dict):
            return {}
        return {name: seen for name, seen in names.items()
                if isinstance(seen, dict) and type(seen.get("seq")) is int}

    def check(self, history: dict[str, list[NameEntry]]) -> dict[str, str]:
        """Names whose newest entry in ``history`` is older than one seen before, with why.

        Every other name's newest numbered entry is saved as seen; a name
        found rolled back keeps the number seen, so it stays refused until
        its history in the store is whole again.
        """
        seen = self.load()
        found: dict[str, str] = {}
        changed = False
        for name, before in sorted(seen.items()):
            top = newest(history.get(name, []))
            now = 0 if top is None else top.seq or 0
            if now >= before["seq"]:
                continue
            shown = "none" if top is None else f"#{now}"
            if before.get("deleted"):
                found[name] = (f"name {name!r} was deleted (its entry #{before['seq']}, seen "
                               f"here before), but the store's newest entry of it is {shown}: "
                               "the deletion was removed from the store")
            else:
                found[name] = (f"this reader saw entry #{before['seq']} of name {name!r} "
                               f"(checkpoint {str(before.get('id'))[:12]}), but the store's "
                               f"newest entry of it is {shown}: newer entries were removed "
                               "from the store")
        for name, entries in history.items():
            top = newest(entries)
            if top is None or name in found:
                continue
            known = seen.get(name)
            if known is None or (top.seq or 0) > known["seq"]:
                seen[name] = {"seq": top.seq, "id": top.id, "deleted": top.deleted}
                changed = True
        if changed:
            self._save(seen)
        return found

    def _save(self, names: dict[str, dict[str, Any]]) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        temp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            with open(fd, "w") as fh:
                json.dump({"names": names}, fh)
            os.replace(temp, self.path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
