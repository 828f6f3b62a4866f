"""``chkq flower``: Flower 2.2 on the chkq app, always behind basic auth.

Flower's API can shut workers down and send any task, and its pages show
every task's arguments and results and the workers' configuration; on
loopback, every local user can reach them. So ``chkq flower`` always has
Flower require credentials: ``CHKQ_FLOWER_BASIC_AUTH=user:password``
(comma-separated for several users) if set, otherwise a user ``chkq`` with
a random password generated at start and printed on the command's stderr
only, for the person who started it. It listens on 127.0.0.1 by default and
refuses any other address unless ``CHKQ_FLOWER_BASIC_AUTH`` is set.
``/metrics`` (Prometheus) and ``/healthcheck`` stay open, as Flower intends.

Flower's configuration file (``flowerconfig.py`` in the current directory
by default) is not read: it could turn the credentials off, and nothing a
command runs may depend on the directory it is started from. ``FLOWER_*``
environment variables still apply.

Ctrl-C, SIGTERM and SIGHUP stop Flower at once: its threads are stopped
and the command exits with 128 + the signal's number, as every command.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import signal
import sys
from types import FrameType
from typing import Any

AUTH_VARIABLE = "CHKQ_FLOWER_BASIC_AUTH"
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})
#: User name of the credentials generated when ``CHKQ_FLOWER_BASIC_AUTH`` is unset.
GENERATED_USER = "chkq"


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
    return ["flower", f"--address={address}", f"--port={port}", f"--conf={os.devnull}"]


def check_listen(address: str) -> str | None:
    """Basic-auth credentials configured for ``address``; refuse an open non-loopback one.

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


def generated_credentials() -> str:
    """``chkq:PASSWORD`` with a fresh random password (128 bits)."""
    return f"{GENERATED_USER}:{secrets.token_urlsafe(16)}"


def run_flower(address: str, port: int) -> int:
    """Start Flower on the chkq app in this process; returns when it stops.

    Raises
    ------
    chkq.workers.cli.Interrupted
        When a signal stopped it (after its threads were stopped).
    """
    from chkq.workers.cli import ENDING_SIGNALS, Interrupted

    auth = check_listen(address)
    if auth is None:
        auth = generated_credentials()
        user, _, password = auth.partition(":")
        print(f"flower: user {user}, password {password} (generated for this run; set "
              f"{AUTH_VARIABLE}=user:password to choose)", file=sys.stderr, flush=True)
    os.environ["FLOWER_BASIC_AUTH"] = auth

    import flower.command

    from chkq.config.celery_app import get_app

    caught: list[int] = []
    running: list[Any] = []

    def interrupt(signum: int, frame: FrameType | None) -> None:
        for sig in ENDING_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
        caught.append(signum)
        raise Interrupted(signum)

    class StoppableFlower(flower.command.Flower):
        """Flower whose signals are chkq's, and which the command can stop."""

        def start(self) -> None:
            # Flower's own SIGTERM handler exits 0 and KeyboardInterrupt is swallowed:
            # record the signal instead, so that the command reports it.
            for sig in ENDING_SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    signal.signal(sig, interrupt)
            running.append(self)
            super().start()

    original = flower.command.Flower
    flower.command.Flower = StoppableFlower
    try:
        get_app().start(argv=flower_argv(address, port))
    finally:
        flower.command.Flower = original
        for app in running:
            app.stop()
    if caught:
        raise Interrupted(caught[0])
    return 0


def cmd_flower(args: argparse.Namespace) -> int:
    """``chkq flower``: run Flower until interrupted."""
    return run_flower(args.address, args.port)


def register(sub: Any) -> None:
    """Add ``chkq flower [--port P] [--address A]`` to the ``chkq`` command line."""
    p = sub.add_parser(
        "flower", help="start Flower, the web monitor (always behind basic auth)",
        description="Start Flower on the chkq app, behind basic auth: "
        f"{AUTH_VARIABLE}=user:password, or a generated password printed on stderr. It "
        "listens on 127.0.0.1 unless --address says otherwise; any other address needs "
        f"{AUTH_VARIABLE}. /metrics serves Prometheus metrics, /healthcheck answers OK.")
    p.add_argument("--port", type=int, default=5555, help="TCP port (default: 5555)")
    p.add_argument("--address", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1)")
    p.set_defaults(func=cmd_flower)
