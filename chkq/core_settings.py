"""What the core takes as arguments where it opens stores and logs: :class:`CoreSettings`.

Kept apart from :mod:`chkq.environment`, which defines the variables these are
read from, so that the environment module depends on none of the types it
configures.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from chkq import environment
from chkq.log.signing import LogTrust
from chkq.stores.retry import StoreTimeouts

__all__ = ["CoreSettings"]


@dataclass(frozen=True)
class CoreSettings:
    """What the core takes as arguments where it opens stores and logs (staging, tasks).

    Attributes
    ----------
    timeouts
        Waits of the network stores (``open_store(url, timeouts=...)``).
    trust
        The log's keys (``CheckpointLog(..., trust=...)``).
    max_checkpoint
        The log's size cap (``CheckpointLog(..., max_checkpoint=...)``).
    """

    timeouts: StoreTimeouts
    trust: LogTrust
    max_checkpoint: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> CoreSettings:
        """The environment's (a library user's default; this process's environment if None).

        Raises
        ------
        ConfigurationError
            If a variable's text is not of its kind, naming the variable.
        LogKeyError
            If a configured key file cannot be used.
        """
        return cls(StoreTimeouts.from_env(env), LogTrust.from_env(env),
                   environment.max_checkpoint_bytes(env))
