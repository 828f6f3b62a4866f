"""Throughput of chkq through each broker: Redis and RabbitMQ, one ``chkq worker -c 2``.

For each broker: a private redis-server (the result backend, and the broker
for the Redis round) and, for the RabbitMQ round, a vhost of its own on the
machine's RabbitMQ (127.0.0.1:5672, guest; created and deleted with
``rabbitmqctl``). One ``chkq worker -c 2`` serves every queue. After one
untimed warm-up job, ``--jobs`` small jobs (``--files`` one-writer
checkpoint files each) are submitted at once and waited for; reported are
jobs per minute and tasks per second (every task of every job: plan, copy
and verify units, merge, link, as each job's plan counts them), medians
over ``--repeat`` rounds, the brokers alternating.

Node-loss times are measured by the fault tests (they print them):
``pytest -s tests/test_hosts.py``.

Usage::

    .venv/bin/python bench/brokers.py [--jobs 20] [--files 64] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

from chkq.config.celery_app import close_app, get_app, get_settings, make_app, use_app
from chkq.demo import RunShape, make_run
from chkq.tasks.state import job_status
from chkq.workers.broker import PrivateRedis
from chkq.workers.client import submit_consolidation
from chkq.workers.runtime.launch import launch_worker, worker_environment


def rabbitmqctl(*args: str) -> None:
    subprocess.run(["rabbitmqctl", *args], check=True, capture_output=True, timeout=60)


def start_worker(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    name = f"bench-{uuid.uuid4().hex[:6]}@localhost"
    with open(log, "wb") as out:
        worker = launch_worker(name, log=out, env=worker_environment(extra=env),
                               concurrency=2, peers=True)
    deadline = time.monotonic() + 60
    while not get_app().control.ping(destination=[name], timeout=0.5):
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker did not start: {log.read_text()[-2000:]}")
    return worker


def one_round(runs: list[Path]) -> tuple[float, int]:
    """Submit a job per run at once, wait for all; (seconds, tasks run)."""
    for run in runs:
        (run / "run.h5").unlink(missing_ok=True)
    started = time.monotonic()
    jobs = [submit_consolidation("run", run) for run in runs]
    for job in jobs:
        job.wait_for_output(timeout=600)
    seconds = time.monotonic() - started
    tasks = 0
    for job in jobs:
        plan = job_status(job.id).plan or {}
        tasks += 3 + int(plan.get("copy_units") or 0) + int(plan.get("verify_units") or 0)
    return seconds, tasks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--files", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="chkq-bench-brokers-"))
    shape = RunShape(checkpoints=args.files, trials=20)
    runs = []
    for n in range(args.jobs):
        make_run(root / f"run{n:03d}", "run", replace(shape, seed=n))
        runs.append(root / f"run{n:03d}")
    vhost = f"chkq-bench-{uuid.uuid4().hex[:8]}"
    rabbitmqctl("add_vhost", vhost)
    rabbitmqctl("set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
    results: dict[str, list[tuple[float, int]]] = {"redis": [], "rabbitmq": []}
    try:
        with PrivateRedis() as redis_server:
            brokers = {"redis": redis_server.url,
                       "rabbitmq": f"amqp://guest:guest@127.0.0.1:5672/{vhost}"}
            for rnd in range(args.repeat):
                order = list(brokers) if rnd % 2 == 0 else list(reversed(brokers))
                for name in order:
                    env = {"CHKQ_BROKER_URL": brokers[name],
                           "CHKQ_RESULT_BACKEND": redis_server.url}
                    app = make_app(replace(get_settings(), broker_url=brokers[name],
                                           result_backend=redis_server.url))
                    previous = use_app(app)
                    worker = start_worker(env, root / f"worker-{name}.log")
                    try:
                        one_round(runs[:1])  # warm-up, untimed
                        results[name].append(one_round(runs))
                    finally:
                        os.killpg(worker.pid, signal.SIGTERM)
                        worker.wait(60)
                        use_app(previous)
                        close_app(app)
                    seconds, tasks = results[name][-1]
                    print(f"round {rnd} {name:<9} {args.jobs} jobs in {seconds:.1f} s "
                          f"({tasks} tasks)", flush=True)
    finally:
        rabbitmqctl("delete_vhost", vhost)
    print(f"\n{args.jobs} jobs of {args.files} files, one chkq worker -c 2, "
          f"median of {args.repeat}:")
    for name, samples in results.items():
        seconds = statistics.median(s for s, _ in samples)
        tasks = statistics.median(t for _, t in samples)
        print(f"  {name:<9} {60 * args.jobs / seconds:6.1f} jobs/min  "
              f"{tasks / seconds:6.1f} tasks/s  ({seconds:.1f} s per round)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
