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

Flower here is read-only: every API handler that sends a task or a control
message (apply, async-apply, send-task, abort, revoke, timeout, rate-limit,
worker shutdown, pool and queue control) answers 403, whatever the
credentials. A Flower login shows the cluster; it is no way to run a job,
stop one or change a worker (``chkq consolidate``, ``chkq cancel`` and the
workers' own command line do that, with the submitter's own credentials).

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


def read_only_handler() -> type:
    """A Tornado handler that answers 403 to every method, naming why.

    It replaces each Flower handler that acts (sends a task or a control
    message): the route stays, so a client learns that the action is
    refused rather than unknown.
    """
    import tornado.web

    class Refused(tornado.web.RequestHandler):
        def prepare(self) -> None:
            self.set_status(403)
            self.set_header("Content-Type", "text/plain; charset=utf-8")
            self.finish("403: chkq's Flower is read-only: it sends no task and no control "
                        "message (submit and cancel jobs with chkq, which proves who you are)\n")

        def check_xsrf_cookie(self) -> None:
            """The refusal needs no XSRF token: nothing is done."""

    return Refused


def acting_handlers() -> tuple[type, ...]:
    """Flower's handlers that send tasks or control messages: every API handler with ``post``.

    Chosen by what they can do (a POST method in Flower's task and control
    API), not by a list of names, so that a handler a later Flower adds is
    refused too.
    """
    import flower.api.control
    import flower.api.tasks

    found = []
    for module in (flower.api.tasks, flower.api.control):
        for value in vars(module).values():
            if isinstance(value, type) and value.__module__ == module.__name__ \
                    and "post" in vars(value):
                found.append(value)
    return tuple(found)


def make_read_only(application: Any) -> list[str]:
    """Replace, in a Flower application's routes, every acting handler by a 403 refusal.

    Returns the patterns refused. Raises RuntimeError if none was found
    (Flower's routes changed: starting with its actions live is not an option).
    """
    acting, refused = acting_handlers(), read_only_handler()
    patterns = []
    for rule in application.wildcard_router.rules:
        if isinstance(rule.target, type) and issubclass(rule.target, acting):
            patterns.append(rule.matcher.regex.pattern)
            rule.target = refused
    if not patterns:
        raise RuntimeError("no task-sending route found in Flower's routes: refusing to start "
                           "a Flower whose API could send tasks")
    return patterns


def generated_credentials() -> str:
    """``chkq:PASSWORD`` with a fresh random password (128 bits)."""
    return f"{GENERATED_USER}:{secrets.token_urlsafe(16)}"


def run_flower(address: str, port: int) -> int:
    """Start Flower on the chkq app in this process; returns when it stops.

    Raises
    ------
    chkq.workers.cli.common.Interrupted
        When a signal stopped it (after its threads were stopped).
    """
    from chkq.workers.cli.common import ENDING_SIGNALS, Interrupted

    auth = check_listen(address)
    if auth is None:
        auth = generated_credentials()
        user, _, password = auth.partition(":")
        print(f"flower: user {user}, password {password} (generated for this run; set "
              f"{AUTH_VARIABLE}=user:password to choose)", file=sys.stderr, flush=True)
    os.environ["FLOWER_BASIC_AUTH"] = auth
    # No submitter's credential in Flower's process, should anything in it send a task.
    for variable in ("CHKQ_USER_KEY", "CHKQ_USER_KEYS_DIR"):
        os.environ.pop(variable, None)

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
        """Flower whose signals are chkq's, stoppable by the command, acting on nothing."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            make_read_only(self)

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
        "flower", help="start Flower, the web monitor (read-only, always behind basic auth)",
        description="Start Flower on the chkq app, read-only (its API sends no task or control "
        "message: those routes answer 403), behind basic auth: "
        f"{AUTH_VARIABLE}=user:password, or a generated password printed on stderr. It "
        "listens on 127.0.0.1 unless --address says otherwise; any other address needs "
        f"{AUTH_VARIABLE}. /metrics serves Prometheus metrics, /healthcheck answers OK.")
    p.add_argument("--port", type=int, default=5555, help="TCP port (default: 5555)")
    p.add_argument("--address", default="127.0.0.1",
                   help="address to listen on (default: 127.0.0.1)")
    p.set_defaults(func=cmd_flower)
