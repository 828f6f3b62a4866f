"""Check what an administrator relies on in compose.yaml, from ``docker compose config``.

Reads the resolved configuration (JSON) on stdin; the password given to the
command is argv[1]. Exits 1 naming each broken promise.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def seconds(duration: str) -> float:
    """A Go duration as compose prints it (``1h1m0s``) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    if not parts or "".join(n + u for n, u in parts) != duration:
        raise ValueError(f"not a duration: {duration!r}")
    return sum(float(n) * UNITS[u] for n, u in parts)


def problems(config: dict, password: str, dockerfile: str) -> list[str]:
    found = []
    redis, worker = config["services"]["redis"], config["services"]["worker"]
    if password in json.dumps(redis.get("command")):
        found.append("the Redis password is on redis-server's command line (ps shows it)")
    env = worker["environment"]
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
