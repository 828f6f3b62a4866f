"""What a user sees when a store's credentials are missing or wrong, or its endpoint is dead.

Each case runs the command line as a user would: the error names the store and what
to set, as the message of a store that does not answer does, and a store that does
not answer is retried with a ``retrying:`` line each time, as ``chkq log commit`` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.helpers import wait_for
from support.plugins.hosts import free_port

pytestmark = pytest.mark.cluster

CLI = [sys.executable, "-m", "chkq.workers.cli"]
BUCKET = "creds-bucket"
AWS_VARIABLES = ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for "
                 "temporary ones), or AWS_PROFILE with a credentials file")


def env_without_credentials(home: Path, **extra: str) -> dict[str, str]:
    """This process's environment with no broker and no store credentials anywhere."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("AWS_", "CHKQ_BROKER", "CHKQ_RESULT", "GOOGLE_",
                                "STORAGE_EMULATOR", "CLOUDSDK_"))}
    home.mkdir(exist_ok=True)
    env.update(HOME=str(home), AWS_EC2_METADATA_DISABLED="true",
               AWS_CONFIG_FILE=str(home / "none"), AWS_SHARED_CREDENTIALS_FILE=str(home / "none"),
               AWS_DEFAULT_REGION="us-east-1", CLOUDSDK_CONFIG=str(home / "gcloud"), **extra)
    return env


def run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(CLI + list(args), env=env, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def checking_s3() -> Iterator[str]:
    """A moto S3 server that checks signatures: a key it does not know gets 403."""
    port = free_port()
    code = textwrap.dedent(f"""
        import os, time
        os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
        from moto.server import ThreadedMotoServer
        ThreadedMotoServer(ip_address="127.0.0.1", port={port}, verbose=False).start()
        time.sleep(3600)
    """)
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    try:
        import socket

        def listening() -> bool:
            with socket.socket() as probe:
                return probe.connect_ex(("127.0.0.1", port)) == 0
        wait_for(listening, 30, "moto to listen")
        yield endpoint
    finally:
        server.kill()
        server.wait()


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    path = tmp_path / "sim_chk00001.h5"
    path.write_bytes(b"x" * 100)
    return path


def test_no_s3_credentials_names_the_store_and_the_variables(tmp_path: Path,
                                                            checkpoint: Path) -> None:
    env = env_without_credentials(tmp_path / "home",
                                  AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}")
    for args, store in ((["log", "commit", f"s3://{BUCKET}/runs", "r1", str(checkpoint)],
                         f"s3://{BUCKET}/runs"),
                        (["consolidate", "sim", "--from", f"s3://{BUCKET}/runs/r1"],
                         f"s3://{BUCKET}")):
        done = run(env, *args)
        assert done.returncode == 1 and done.stdout == "", done.stderr
        error = done.stderr.splitlines()[-1]
        assert error.startswith(f"error: store {store}"), error
        assert error.endswith(f": no AWS credentials (Unable to locate credentials): "
                              f"{AWS_VARIABLES} for the user running chkq (on a cluster, "
                              "for the workers too)"), error


def test_wrong_s3_credentials_name_the_store_its_endpoint_and_the_key_sent(
        tmp_path: Path, checkpoint: Path, checking_s3: str) -> None:
    env = env_without_credentials(tmp_path / "home", AWS_ENDPOINT_URL=checking_s3,
                                  AWS_ACCESS_KEY_ID="NOBODY7EXAMPLE",
                                  AWS_SECRET_ACCESS_KEY="not-the-secret")
    for args, store, answer in (
            (["log", "commit", f"s3://{BUCKET}/runs", "r1", str(checkpoint)],
             f"s3://{BUCKET}/runs", "403 InvalidAccessKeyId"),
            (["consolidate", "sim", "--from", f"s3://{BUCKET}/runs/r1"], f"s3://{BUCKET}",
             "403 Forbidden")):
        done = run(env, *args)
        assert done.returncode == 1 and done.stdout == "", done.stderr
        error = done.stderr.splitlines()[-1]
        assert error.startswith(f"error: store {store}: "), error
        assert (f": the store at {checking_s3} refused the credentials sent (access key "
                f"NOBO… from env): {answer}: check {AWS_VARIABLES[4:]}, and that they may use "
                f"bucket '{BUCKET}' (AWS_ENDPOINT_URL names the store's endpoint)") in error, \
            error
        assert "not-the-secret" not in done.stderr


def test_no_gcs_credentials_names_the_store_and_the_variable(tmp_path: Path,
                                                            checkpoint: Path) -> None:
    env = env_without_credentials(tmp_path / "home")
    done = run(env, "log", "commit", "gs://some-bucket/runs", "r1", str(checkpoint))
    assert done.returncode == 1 and done.stdout == "", done.stderr
    assert done.stderr == (
        "error: store gs://some-bucket/runs: no Google Cloud credentials found: set "
        "GOOGLE_APPLICATION_CREDENTIALS (a service account's key file), or gcloud auth "
        "application-default login for the user running chkq (on a cluster, for the workers "
        "too)\n"), done.stderr


def test_consolidate_from_a_dead_endpoint_says_each_retry(tmp_path: Path) -> None:
    """As ``chkq log commit`` does: a ``retrying:`` line per retry, then the error."""
    env = env_without_credentials(
        tmp_path / "home", AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}",
        AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
        CHKQ_STORE_RETRY_SECONDS="3", CHKQ_STORE_CONNECT_TIMEOUT="1")
    started = time.monotonic()
    done = run(env, "consolidate", "sim", "--from", f"s3://{BUCKET}/runs/r1")
    assert done.returncode == 1 and done.stdout == "", done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) >= 3, lines
    assert all(line.startswith(f"retrying: store s3://{BUCKET}: head bucket: transient error "
                               f"(attempt {n}/8): Could not connect to the endpoint URL")
               for n, line in enumerate(lines[:-1], 1)), lines
    assert lines[-1].startswith(f"error: store s3://{BUCKET}: head bucket: no success after"), \
        lines
    assert time.monotonic() - started < 60
