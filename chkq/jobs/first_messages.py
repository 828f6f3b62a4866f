"""The keyword arguments of a job's first message, ``chkq.plan`` or ``chkq.stage``.

Built in one place for the two senders (Celery's canvas, and the direct
sender that writes the same message to Redis), so that both send the same
message. An optional argument travels only when set, so that the message of
an ordinary job is the one every worker version accepts.
"""

from __future__ import annotations

from typing import Any


def plan_kwargs(cleanup: bool, allow_gaps: bool, party: dict[str, Any] | None,
                through: int | None) -> dict[str, Any]:
    """``chkq.plan``'s keyword arguments."""
    kwargs: dict[str, Any] = {"cleanup": cleanup}
    if allow_gaps:
        kwargs["allow_gaps"] = True
    if party is not None:
        kwargs["party"] = party
    if through is not None:
        kwargs["through"] = through
    return kwargs


def stage_kwargs(run: str | None, to: str | None, cleanup: bool, allow_gaps: bool,
                 party: dict[str, Any] | None, verify_data: bool = False) -> dict[str, Any]:
    """``chkq.stage``'s keyword arguments."""
    kwargs: dict[str, Any] = {"run": run, "to": to, "cleanup": cleanup}
    if allow_gaps:
        kwargs["allow_gaps"] = True
    if verify_data:
        kwargs["verify_data"] = True
    if party is not None:
        kwargs["party"] = party
    return kwargs
