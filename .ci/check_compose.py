"""Check what an administrator relies on in compose.yaml, from ``docker compose config``.

Reads the resolved configuration (JSON, with the ``flower`` and ``rabbitmq``
profiles) on stdin; the password given to the command is argv[1]. Exits 1
naming each broken promise. Run with chkq installed: the workers' time limits
are checked by chkq's own rule (:meth:`chkq.config.settings.Settings.check`).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
#: chkq's queues (control, copy, verify, commit), each with its own prefetch on RabbitMQ.
QUEUES = 4


def seconds(duration: str) -> float:
    """A Go duration as compose prints it (``1h1m0s``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a duration: {duration!r}")
    return sum(float(n) * UNITS[u] for n, u in parts)


def limit_problems(env: dict[str, str]) -> list[str]:
    """What chkq's settings check says of the workers' time limits (nothing if they hold)."""
    from chkq.config.settings import Settings
    from chkq.errors import ConfigurationError

    try:
        Settings(soft_time_limit=int(env["CHKQ_SOFT_TIME_LIMIT"]),
                 time_limit=int(env["CHKQ_TIME_LIMIT"]),
                 visibility_timeout=int(env["CHKQ_VISIBILITY_TIMEOUT"])).check()
    except (ConfigurationError, KeyError, ValueError) as exc:
        return [f"the workers' time limits are refused: {exc}"]
    return []


def rabbitmq_problems(config: dict, time_limit: float) -> list[str]:
    """What the RabbitMQ service must promise: health, restarts, a consumer timeout above
    the hard task limit, workers that wait for it, no password on a command line."""
    rabbitmq = config["services"].get("rabbitmq")
    if rabbitmq is None:
        return ["no rabbitmq service (profile rabbitmq)"]
    found = []
    env = rabbitmq.get("environment", {})
    if "rabbitmq-diagnostics" not in " ".join(rabbitmq.get("healthcheck", {}).get("test", [])):
        found.append("the rabbitmq service has no health check")
    if rabbitmq.get("restart") != "unless-stopped":
        found.append("the rabbitmq service is not restarted")
    if not rabbitmq.get("hostname"):
        found.append("the rabbitmq service has no fixed hostname (its data is per node name)")
    match = re.search(r"consumer_timeout (\d+)", env.get("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", ""))
    # On quorum queues prefetch is per queue: a message may wait in a worker behind a task
    # of each of the other queues, then run for up to the hard limit.
    if not match or int(match.group(1)) <= (QUEUES * time_limit + 60) * 1000:
        found.append(f"RabbitMQ's consumer_timeout is not above {QUEUES} x CHKQ_TIME_LIMIT + "
                     "60 s: it would take back a task still waiting in its worker or running")
    secret = env.get("RABBITMQ_DEFAULT_PASS")
    if secret and secret in json.dumps(rabbitmq.get("command")):
        found.append("the RabbitMQ password is on a command line (ps shows it)")
    waits = config["services"]["worker"].get("depends_on", {}).get("rabbitmq", {})
    if waits.get("condition") != "service_healthy":
        found.append("workers do not wait for a healthy rabbitmq")
    return found


def problems(config: dict, password: str, dockerfile: str) -> list[str]:
    found = []
    redis, worker = config["services"]["redis"], config["services"]["worker"]
    if password in json.dumps(redis.get("command")):
        found.append("the Redis password is on redis-server's command line (ps shows it)")
    env = worker["environment"]
    found += limit_problems(env)
    found += rabbitmq_problems(config, float(env["CHKQ_TIME_LIMIT"]))
    if seconds(worker.get("stop_grace_period", "10s")) < float(env["CHKQ_TIME_LIMIT"]):
        found.append("stop_grace_period is shorter than CHKQ_TIME_LIMIT: a stop cuts tasks short")
    test = " ".join(worker.get("healthcheck", {}).get("test", []))
    if "inspect ping" not in test or "kill" not in test:
        found.append("an unhealthy worker does not end itself (Docker never restarts it)")
    if worker.get("restart") != "unless-stopped":
        found.append("workers are not restarted")
    if not re.search(r"install -d -o chkq -g chkq[^\n]* /runs\b", dockerfile):
        found.append("the image has no /runs owned by the workers' user")
    return found


if __name__ == "__main__":
    root = Path(__file__).resolve().parent.parent
    broken = problems(json.load(sys.stdin), sys.argv[1], (root / "Dockerfile").read_text())
    for problem in broken:
        print(f"compose.yaml: {problem}", file=sys.stderr)
    sys.exit(1 if broken else 0)
