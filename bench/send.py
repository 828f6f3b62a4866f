"""Measure a fresh client's first send of a job: through Celery against straight to Redis.

Set-up: a private redis-server (:class:`chkq.workers.broker.PrivateRedis`). Then
``--repeat`` rounds, alternating which goes first, of two fresh interpreters that
import ``chkq.workers.client``, build this process's app and read one job record
(as a submission does before it sends), then time only the send of a job's
first message: ``consolidation_signature(...).apply_async()`` (Celery) or
:func:`chkq.workers.sender.send_job` (direct). Nothing consumes the messages.

Reported: min and median wall and CPU milliseconds of each, their ratio, and
the modules the send loaded.

Usage::

    .venv/bin/python bench/send.py [--repeat 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time, uuid
import chkq.workers.client
from chkq.config.celery_app import get_app
from chkq.tasks.canvas import consolidation_signature
from chkq.tasks.state import records
from chkq.jobs.first_messages import plan_kwargs
from chkq.workers.sender import PLAN_TASK, send_job

app = get_app()
records().job_info("0" * 32)
before = set(sys.modules)
job = uuid.uuid4().hex
args = ["/nowhere", "run", job]
wall, cpu = time.perf_counter(), time.process_time()
if sys.argv[1] == "celery":
    consolidation_signature(*args, False).apply_async()
else:
    assert send_job(app, PLAN_TASK, job, args, plan_kwargs(False, False, None, None), args)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps([wall, cpu, sorted(set(sys.modules) - before)]))
"""

WAYS = ("celery", "direct")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=10, help="rounds of each")
    options = parser.parse_args()
    from chkq.workers.broker import PrivateRedis

    print(f"# load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    found: dict[str, list[tuple[float, float, list[str]]]] = {way: [] for way in WAYS}
    with PrivateRedis() as server:
        env = dict(os.environ, CHKQ_BROKER_URL=server.url, CHKQ_RESULT_BACKEND=server.url)
        for round_ in range(options.repeat):
            for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
                done = subprocess.run([sys.executable, "-c", CHILD, way], env=env,
                                      capture_output=True, text=True, check=False)
                if done.returncode != 0:
                    raise SystemExit(f"{way} round {round_ + 1} failed:\n{done.stderr}")
                wall, cpu, loaded = json.loads(done.stdout)
                found[way].append((wall, cpu, loaded))
    print(f"# load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    medians = {}
    for way, rows in found.items():
        walls, cpus = [r[0] * 1e3 for r in rows], [r[1] * 1e3 for r in rows]
        medians[way] = statistics.median(cpus)
        print(f"{way:7s} wall min {min(walls):6.1f} ms median {statistics.median(walls):6.1f} ms"
              f"  cpu min {min(cpus):6.1f} ms median {medians[way]:6.1f} ms"
              f"  modules loaded by the send: {len(rows[0][2])} {' '.join(rows[0][2])}")
    print(f"direct / celery, median CPU: {medians['direct'] / medians['celery']:.3f}")


if __name__ == "__main__":
    main()
