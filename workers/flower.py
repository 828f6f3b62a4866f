"""``chkq flower``: Flower 2.2 on the chkq app, with basic auth beyond loopback.

Flower's API can shut workers down and send any task (NOTES.md), so it must
never be reachable without authentication: ``chkq flower`` listens on
127.0.0.1 by default and refuses any other address unless
``CHKQ_FLOWER_BASIC_AUTH=user:password`` (comma-separated for several users)
is set, which it then hands to Flower. ``/metrics`` (Prometheus) and
``/healthcheck`` stay open, as Flower intends.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
from typing import Any

AUTH_VARIABLE = "CHKQ_FLOWER_BASIC_AUTH"
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})


def is_loopback(address: str) -> bool:
    """True if ``address`` (an IP address or ``localhost``) is only reachable locally.

    Tornado listens on every interface for an empty address, so that is not
    loopback; neither is any host name but ``localhost``.
    """
    if address.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(address.strip("[]")).is_loopback
    except ValueError:
        return False


def basic_auth_from_env() -> str | None:
    """``CHKQ_FLOWER_BASIC_AUTH`` checked (``user:password[,user2:password2]``), or None.

    Raises
    ------
    ValueError
        If it is set but an entry lacks a user or a password.
    """
    raw = os.environ.get(AUTH_VARIABLE, "")
    if not raw:
        return None
    for entry in raw.split(","):
        user, sep, password = entry.partition(":")
        if not sep or not user or not password:
            raise ValueError(f"{AUTH_VARIABLE} must be user:password (comma-separated for "
                             "several users), with a non-empty user and password")
    return raw


def flower_argv(address: str, port: int) -> list[str]:
    """The Celery command line that starts Flower, after ``celery -A APP``.

    Address and port are given on the command line so that they win over
    ``FLOWER_ADDRESS``/``FLOWER_PORT`` and a ``flowerconfig.py`` (Flower
    applies environment, then configuration file, then command line). The
    credentials go through the environment (``FLOWER_BASIC_AUTH``), not the
    command line, where ``ps`` would show them.
    """
    return ["flower", f"--address={address}", f"--port={port}"]


def check_listen(address: str) -> str | None:
    """Basic-auth credentials to use for ``address``; refuse an open non-loopback one.

    Raises
    ------
    PermissionError
        If ``address`` is beyond loopback and ``CHKQ_FLOWER_BASIC_AUTH`` is unset.
    """
    auth = basic_auth_from_env()
    if auth is None and not is_loopback(address):
        raise PermissionError(
            f"refusing to listen on {address or 'every interface'!s} without authentication: "
            f"set {AUTH_VARIABLE}=user:password (Flower's API can stop workers and send "
            "tasks), or listen on 127.0.0.1"
        )
    return auth


def run_flower(address: str, port: int) -> int:
    """Start Flower on the chkq app in this process; returns when it stops."""
    auth = check_listen(address)
    if auth is not None:
        os.environ["FLOWER_BASIC_AUTH"] = auth
    from chkq.config.celery_app import get_app

    get_app().start(argv=flower_argv(address, port))
    return 0


def cmd_flower(args: argparse.Namespace) -> int:
    """``chkq flower``: run Flower until interrupted."""
    return run_flower(args.address, args.port)


def register(sub: Any) -> None:
    """Add ``chkq flower [--port P] [--address A]`` to the ``chkq`` command line."""
    p = sub.add_parser(
        "flower", help="start Flower, the web monitor (basic auth required beyond loopback)",
        description="Start Flower on the chkq get_app(). It listens on 127.0.0.1 unless --address "
        f"says otherwise; any other address needs {AUTH_VARIABLE}=user:password. "
        "/metrics serves Prometheus metrics.")
    p.add_argument("--port", type=int, default=5555, help="TCP port (default: 5555)")
    p.add_argument("--address", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1)")
    p.set_defaults(func=cmd_flower)
