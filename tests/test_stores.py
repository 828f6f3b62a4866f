"""Contract tests for every object store, against real servers.

The shipped contract suite, :class:`chkq.stores.testing.StoreTests`, runs on
the in-memory, local directory, S3 (moto's HTTP server) and GCS
(fake-gcs-server) stores; the tests after it are each backend's own.  Network faults are injected
for real with :class:`support.plugins.object_stores.FaultProxy`.
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from chkq.stores import (
    CheckpointStore,
    InvalidKeyError,
    LocalDirectoryStore,
    MemoryStore,
    open_store,
)
from chkq.stores.faults import FaultyStore
from chkq.stores.testing import StoreTests
from support.helpers import modules_loaded_by
from support.plugins.object_stores import BUCKET, BlackHole, FaultProxy, make_store
from support.races import put_if_absent_race

MiB = 1 << 20

class TestMemoryStore(StoreTests):
    @pytest.fixture
    def store(self) -> CheckpointStore:
        return MemoryStore()


class TestLocalDirectoryStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> CheckpointStore:
        return LocalDirectoryStore(tmp_path / "store")


@pytest.mark.integration
class TestS3Store(StoreTests):
    """Against moto's HTTP server."""

    @pytest.fixture
    def store(self, request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
        return make_store("s3", request, tmp_path)

    def test_the_emulator_refuses_a_second_create(self, store: CheckpointStore) -> None:
        """moto honours If-None-Match: * on PutObject and on CompleteMultipartUpload."""
        from botocore.exceptions import ClientError

        client, name = store.client, f"{store.url.rsplit('/', 1)[1]}/raw"  # type: ignore[attr-defined]
        client.put_object(Bucket=BUCKET, Key=name, Body=b"first", IfNoneMatch="*")
        with pytest.raises(ClientError, match="PreconditionFailed"):
            client.put_object(Bucket=BUCKET, Key=name, Body=b"second", IfNoneMatch="*")
        upload = client.create_multipart_upload(Bucket=BUCKET, Key=name)["UploadId"]
        part = client.upload_part(Bucket=BUCKET, Key=name, UploadId=upload, PartNumber=1,
                                  Body=b"third")
        with pytest.raises(ClientError, match="PreconditionFailed"):
            client.complete_multipart_upload(
                Bucket=BUCKET, Key=name, UploadId=upload, IfNoneMatch="*",
                MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": 1}]})
        client.abort_multipart_upload(Bucket=BUCKET, Key=name, UploadId=upload)
        assert store.get("raw") == b"first"

    def test_upload_copies_large_ranges_server_side(self, store: CheckpointStore) -> None:
        copies: list[int] = []
        store.client.meta.events.register(  # type: ignore[attr-defined]
            "after-call.s3.UploadPartCopy", lambda **kwargs: copies.append(1))
        source = os.urandom(13 * MiB)
        store.put("src", source)
        store.part_size = 5 * MiB  # type: ignore[attr-defined]
        with store.upload("out") as upload:
            upload.write(b"h" * 100)
            upload.copy("src", 0, len(source))
            upload.copy("src", 7, 11 * MiB)
            upload.complete()
        assert store.get("out") == b"h" * 100 + source + source[7 : 7 + 11 * MiB]
        assert len(copies) == 2, "the rest of each range went server-side in one part"
        assert store.stray_uploads() == []
        with store.upload("out") as again:
            again.copy("src", 0, len(source))
            with pytest.raises(FileExistsError):
                again.complete()
        assert store.stray_uploads() == []

    def test_list_reads_every_page(self, store: CheckpointStore) -> None:
        pages: list[int] = []
        store.page_size = 7  # type: ignore[attr-defined]
        store.client.meta.events.register(  # type: ignore[attr-defined]
            "after-call.s3.ListObjectsV2", lambda **kwargs: pages.append(1))
        keys = [f"many/{i:03d}" for i in range(30)]
        for key in keys:
            store.put(key, b"x")
        assert store.list("many/") == keys
        assert len(pages) == 5


@pytest.mark.integration
class TestGCSStore(StoreTests):
    """Against fake-gcs-server."""

    @pytest.fixture
    def store(self, request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
        return make_store("gcs", request, tmp_path)

    @pytest.mark.xfail(strict=True, reason="fake-gcs-server 1.54.0 ignores ifGenerationMatch "
                       "on compose (and on copy, rewrite and resumable uploads)")
    def test_upload_never_replaces_an_object(self, store: CheckpointStore) -> None:
        super().test_upload_never_replaces_an_object(store)

    def test_the_emulator_refuses_a_second_simple_create(self, store: CheckpointStore) -> None:
        """The one precondition fake-gcs-server 1.54.0 honours, and the one
        ``put_if_absent`` uses below the client's 8 MiB resumable threshold."""
        from google.api_core import exceptions as api_exceptions

        bucket = store.client.bucket(BUCKET)  # type: ignore[attr-defined]
        blob = bucket.blob(f"{store.url.rsplit('/', 1)[1]}/simple")
        blob.upload_from_string(b"first", if_generation_match=0)
        with pytest.raises(api_exceptions.PreconditionFailed):
            blob.upload_from_string(b"second", if_generation_match=0)
        assert store.get("simple") == b"first"

    def test_staged_parts_are_never_listed_nor_writable(self, store: CheckpointStore) -> None:
        from chkq.stores import InvalidKeyError

        store.part_size = 10  # type: ignore[attr-defined]
        upload = store.upload("out/obj")
        upload.write(b"x" * 100)
        assert store.list() == []
        assert [u.key for u in store.stray_uploads()] == ["out/obj"]
        for operation in (lambda: store.put(".chkq-uploads/x", b""),
                          lambda: store.put_if_absent(".chkq-uploads/x", b""),
                          lambda: store.upload(".chkq-uploads/x")):
            with pytest.raises(InvalidKeyError, match="reserved"):
                operation()
        upload.abort()
        assert store.stray_uploads() == []

    def test_more_parts_than_one_compose_takes(self, store: CheckpointStore) -> None:
        store.part_size = 3  # type: ignore[attr-defined]
        data = bytes(range(256)) * 2
        with store.upload("out/obj") as upload:
            upload.write(data)
            upload.complete()
        assert store.get("out/obj") == data
        assert store.stray_uploads() == []


@pytest.mark.parametrize("anonymous", [True, False], ids=["O_TMPFILE", "private-dir"])
def test_file_store_hides_temporaries_during_a_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anonymous: bool
) -> None:
    """A write in flight is nowhere to be seen (O_TMPFILE: no name at all; without it, a
    file in the writer's own 0700 directory), and nothing of it is left afterwards."""
    monkeypatch.setattr("chkq.stores.local_files.ANONYMOUS", anonymous)
    store = LocalDirectoryStore(tmp_path / "s")
    in_flight = threading.Event()
    release = threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        in_flight.set()
        release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr("chkq.stores.local.os.fsync", slow_fsync)
    writer = threading.Thread(target=store.put_if_absent, args=("d/obj", b"y" * MiB))
    writer.start()
    assert in_flight.wait(10)
    temporaries = [p for p in (tmp_path / "s").rglob("*") if p.is_file()]
    if anonymous:
        assert temporaries == [], "an O_TMPFILE write has no name while in flight"
    else:
        (temporary,) = temporaries
        assert temporary.parent.name.startswith(".chkq-tmp-")
        assert temporary.parent.stat().st_mode & 0o777 == 0o700
    assert store.list() == []
    assert not store.exists("d/obj")
    with pytest.raises(KeyError):
        store.get("d/obj")
    monkeypatch.setattr("chkq.stores.local.os.fsync", real_fsync)
    release.set()
    writer.join(10)
    assert store.list() == ["d/obj"]
    assert store.get("d/obj") == b"y" * MiB
    store.put("d/obj", b"z")
    assert store.get("d/obj") == b"z"
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["d"], "nothing left"
    for reserved in (".chkq-tmp/x", ".chkq-tmp-abc/x"):
        with pytest.raises(InvalidKeyError):
            store.put(reserved, b"")


@pytest.mark.cluster
def test_put_if_absent_one_winner_across_processes(store: CheckpointStore) -> None:
    """Several processes race to create the same keys: exactly one wins each.

    Bodies are small: moto checks-then-writes without a lock, so large bodies
    could show two winners there (a moto limitation, not the client's).
    """
    keys = [f"race/{i:02d}" for i in range(16)]
    writers = 4
    if isinstance(store, MemoryStore):
        barrier_t = threading.Barrier(writers)
        results_t: list[list[bool]] = [[] for _ in range(writers)]

        def run(i: int) -> None:
            results_t[i] = put_if_absent_race(store.url, i, keys, barrier_t)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(writers)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        results = results_t
    else:
        context = multiprocessing.get_context("spawn")
        with context.Manager() as manager:
            barrier = manager.Barrier(writers)
            with context.Pool(writers) as pool:
                jobs = [(store.url, i, keys, barrier) for i in range(writers)]
                results = pool.starmap(put_if_absent_race, jobs)
    for index, key in enumerate(keys):
        winners = [w for w in range(writers) if results[w][index]]
        assert len(winners) == 1, (key, winners)
        assert store.get(key) == f"writer {winners[0]}".encode()


def test_open_store_urls(tmp_path: Path) -> None:
    local = open_store(tmp_path.as_uri())
    assert isinstance(local, LocalDirectoryStore)
    assert local.url == tmp_path.as_uri()
    one, two = open_store("memory://shared-name"), open_store("memory://shared-name")
    one.put("k", b"v")
    assert two.get("k") == b"v"
    assert open_store(two.url).get("k") == b"v"
    for bad in ["file://relative/dir", "relative/dir", "/abs/without/scheme", "ftp://x/y",
                "s3://", "gs:///prefix", "memory://"]:
        with pytest.raises(ValueError, match="URL"):
            open_store(bad)


@pytest.mark.integration
def test_cloud_urls(request: pytest.FixtureRequest) -> None:
    request.getfixturevalue("s3_endpoint")
    request.getfixturevalue("gcs_endpoint")
    for url in (f"s3://{BUCKET}/some/prefix", f"gs://{BUCKET}/some/prefix"):
        store = open_store(url)
        assert store.url == url
        store.put("k", b"v")
        assert open_store(f"{url.rsplit('/', 2)[0]}").get("some/prefix/k") == b"v"


# S3 specifics --------------------------------------------------------------


def _s3(endpoint: str, prefix: str, **options: Any) -> CheckpointStore:
    from chkq.stores import S3Store

    return S3Store(BUCKET, prefix, endpoint_url=endpoint, **options)


def test_s3_multipart_conditional(s3_endpoint: str) -> None:
    store = _s3(s3_endpoint, "multipart", multipart_threshold=MiB, part_size=5 * MiB)
    big = os.urandom(11 * MiB)
    assert store.put_if_absent("big", big) is True
    assert store.get("big") == big
    assert store.put_if_absent("big", b"z" * (2 * MiB)) is False
    assert store.get("big") == big
    store.put("big2", big[: 6 * MiB])
    assert store.get("big2") == big[: 6 * MiB]
    uploads = store.client.list_multipart_uploads(Bucket=BUCKET).get("Uploads", [])  # type: ignore[attr-defined]
    assert uploads == [], "failed conditional uploads must be aborted"


def test_s3_lost_response_to_own_write_is_success(s3_proxy: FaultProxy) -> None:
    store = _s3(s3_proxy.url, "lost")
    s3_proxy.lose_next_response(b"PUT ")
    assert store.put_if_absent("obj", b"mine") is True
    assert s3_proxy.lost == 1
    assert store.get("obj") == b"mine"
    assert store.put_if_absent("obj", b"other") is False


def test_s3_lost_response_to_multipart_completion(s3_proxy: FaultProxy) -> None:
    store = _s3(s3_proxy.url, "lost-mp", multipart_threshold=MiB, part_size=5 * MiB)
    data = os.urandom(6 * MiB)
    s3_proxy.lose_next_response(b"POST /" + BUCKET.encode() + b"/lost-mp/obj?uploadId")
    assert store.put_if_absent("obj", data) is True
    assert s3_proxy.lost == 1
    assert store.get("obj") == data


def test_s3_lost_response_to_an_upload_completion_is_success(s3_proxy: FaultProxy) -> None:
    """The completion reached moto, its answer did not: the resent completion is
    refused (NoSuchUpload or 412) and recognised by its write id as this upload's own."""
    store = _s3(s3_proxy.url, "lost-up")
    data = os.urandom(6 * MiB)
    s3_proxy.lose_next_response(b"POST /" + BUCKET.encode() + b"/lost-up/out?uploadId")
    with store.upload("out") as upload:
        upload.write(data)
        upload.complete()
    assert s3_proxy.lost == 1
    assert store.get("out") == data
    assert store.stray_uploads() == []


def test_s3_pinned_read_cut_mid_object_resumes_where_it_broke(s3_proxy: FaultProxy) -> None:
    """One GET streams the object; a connection cut under it is resumed by a ranged GET
    from the byte it broke at, of the same version."""
    store = _s3(s3_proxy.url, "stream")
    data = os.urandom(24 * MiB)
    store.put("obj", data)
    reading = store.read_pinned("obj", store.version("obj"), 2 * MiB)
    first = next(reading)
    s3_proxy.go_down(0.5)
    rest = list(reading)
    assert s3_proxy.refused >= 1, "the read was not cut"
    assert None not in rest
    assert first + b"".join(p or b"" for p in rest) == data


def test_s3_conditional_conflict_409_is_retried(s3_proxy: FaultProxy) -> None:
    store = _s3(s3_proxy.url, "conflict")
    body = (
        b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>ConditionalRequestConflict</Code>"
        b"<Message>A conflicting conditional operation is in progress</Message></Error>"
    )
    s3_proxy.answer_next(
        b"PUT ",
        b"HTTP/1.1 409 Conflict\r\nContent-Type: application/xml\r\nConnection: close\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body,
    )
    assert store.put_if_absent("obj", b"data") is True
    assert s3_proxy.answered == 1
    assert store.get("obj") == b"data"


def test_s3_briefly_unreachable_is_retried(s3_proxy: FaultProxy) -> None:
    store = _s3(s3_proxy.url, "down")
    store.put("warm", b"x")
    s3_proxy.go_down(1.0)
    start = time.monotonic()
    assert store.put_if_absent("obj", b"data") is True
    assert time.monotonic() - start >= 0.9
    assert s3_proxy.refused >= 1
    assert store.get("obj") == b"data"


# GCS specifics -------------------------------------------------------------


def _gcs_via(proxy: FaultProxy, prefix: str) -> CheckpointStore:
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage

    from chkq.stores import GCSStore

    client = storage.Client(
        project="test",
        credentials=AnonymousCredentials(),
        client_options={"api_endpoint": proxy.url},
    )
    return GCSStore(BUCKET, prefix, client=client)


def test_gcs_large_object_round_trip(gcs_endpoint: str) -> None:
    """Above 8 MiB the client uses a resumable upload; the emulator (v1.54)
    ignores preconditions there, so only the round trip is checked."""
    from chkq.stores import GCSStore

    store = GCSStore(BUCKET, "large")
    big = os.urandom(10 * MiB)
    assert store.put_if_absent("big", big) is True
    assert store.get("big") == big
    store.put("big", big[::-1])
    assert store.get("big") == big[::-1]


def test_gcs_lost_response_to_own_write_is_success(gcs_proxy: FaultProxy) -> None:
    store = _gcs_via(gcs_proxy, "lost")
    gcs_proxy.lose_next_response(b"POST /upload/")
    assert store.put_if_absent("obj", b"mine") is True
    assert gcs_proxy.lost == 1
    assert store.get("obj") == b"mine"
    assert store.put_if_absent("obj", b"other") is False


def test_gcs_briefly_unreachable_is_retried(gcs_proxy: FaultProxy) -> None:
    store = _gcs_via(gcs_proxy, "down")
    store.put("warm", b"x")
    gcs_proxy.go_down(1.0)
    start = time.monotonic()
    assert store.put_if_absent("obj", b"data") is True
    assert time.monotonic() - start >= 0.9
    assert gcs_proxy.refused >= 1
    assert store.get("obj") == b"data"


# bounded waits -------------------------------------------------------------------


AWS_TEST_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                "AWS_DEFAULT_REGION": "us-east-1"}


def _timed_failure(operation: Callable[[], object]) -> tuple[float, str]:
    from chkq.stores import TransientStoreError

    start = time.monotonic()
    with pytest.raises(TransientStoreError) as caught:
        operation()
    return time.monotonic() - start, str(caught.value)


@pytest.mark.parametrize("kind", ["s3", "gcs"])
def test_store_that_stops_answering_fails_within_its_budget(
        kind: str, black_hole: BlackHole, monkeypatch: pytest.MonkeyPatch) -> None:
    """Connect and read timeouts, one retry budget per operation, no library
    retries inside it; the error names the store and the key."""
    from chkq.stores.base import StoreTimeouts

    timeouts = StoreTimeouts(connect=1.0, read=1.0, budget=2.5)
    store: CheckpointStore
    if kind == "s3":
        from chkq.stores import S3Store

        for name, value in AWS_TEST_ENV.items():
            monkeypatch.setenv(name, value)
        store = S3Store(BUCKET, "silent", endpoint_url=black_hole.url, timeouts=timeouts)
    else:
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage

        from chkq.stores import GCSStore

        client = storage.Client(project="test", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": black_hole.url})
        store = GCSStore(BUCKET, "silent", client=client, timeouts=timeouts)
    key = "runs/r1/records/" + "ab" * 32 + ".json"
    for operation in (lambda: store.get(key), lambda: store.put_if_absent(key, b"x"),
                      lambda: store.list("runs/r1/")):
        black_hole.accepted = 0
        elapsed, message = _timed_failure(operation)
        assert elapsed <= timeouts.worst_case + 1.0, elapsed
        assert store.url in message
        assert ("runs/r1/" if operation.__code__.co_names[-1] == "list" else key) in message
        assert 2 <= black_hole.accepted <= 4, "one retry layer: a few attempts, not 4 x 8"


def test_store_timeouts_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from chkq.stores.base import StoreTimeouts

    monkeypatch.setenv("CHKQ_STORE_READ_TIMEOUT", "2.5")
    monkeypatch.setenv("CHKQ_STORE_RETRY_SECONDS", "7")
    assert StoreTimeouts.from_env() == StoreTimeouts(connect=5.0, read=2.5, budget=7.0)
    assert StoreTimeouts().worst_case < 60
    assert StoreTimeouts().complete == 300.0, "S3 allows minutes to assemble a large object"
    monkeypatch.setenv("CHKQ_STORE_COMPLETE_TIMEOUT", "90")
    assert StoreTimeouts.from_env().complete == 90.0
    monkeypatch.setenv("CHKQ_STORE_CONNECT_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="CHKQ_STORE_CONNECT_TIMEOUT"):
        StoreTimeouts.from_env()


def _cli(*args: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], float]:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("CHKQ_BROKER_URL", "CHKQ_RESULT_BACKEND")}
    environment.update(env)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "chkq.workers.cli", *args], env=environment,
                          capture_output=True, text=True, timeout=90)
    return done, time.monotonic() - start


def test_cli_on_a_silent_gcs_endpoint_fails_well_under_a_minute_by_default(
        black_hole: BlackHole) -> None:
    """The reported hang: a GCS endpoint that accepts connections and never answers.
    With the default settings, ``chkq log list`` gives up with one clear line."""
    done, elapsed = _cli("log", "list", f"gs://{BUCKET}/silent", "r1",
                         env={"STORAGE_EMULATOR_HOST": black_hole.url})
    assert done.returncode == 1
    assert elapsed < 45, elapsed
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"error: store gs://{BUCKET}/silent: list 'runs/r1/")


def test_cli_store_timeouts_are_configurable(black_hole: BlackHole) -> None:
    done, elapsed = _cli("log", "list", f"s3://{BUCKET}/silent", "r1",
                         env={**AWS_TEST_ENV, "AWS_ENDPOINT_URL": black_hole.url,
                              "CHKQ_STORE_READ_TIMEOUT": "1", "CHKQ_STORE_RETRY_SECONDS": "1"})
    assert done.returncode == 1
    assert elapsed < 10, elapsed
    assert done.stderr.startswith(f"error: store s3://{BUCKET}/silent: list 'runs/r1/")
    assert "retry budget 1 s" in done.stderr


@pytest.mark.cluster
def test_chkq_does_not_import_pytest() -> None:
    """The contract suite is shipped in chkq but pytest is only a test dependency."""
    imports = ["chkq", "chkq.stores", "chkq.stores.s3", "chkq.stores.gcs", "chkq.log",
               "chkq.workers.cli"]
    assert modules_loaded_by(imports, ["pytest", "chkq.stores.testing"]) == []


# the fault-injecting wrapper ---------------------------------------------------------


class TestFaultyStoreWithoutRules(StoreTests):
    """With no rule, the wrapper is a store like any other."""

    @pytest.fixture
    def store(self) -> CheckpointStore:
        return FaultyStore(MemoryStore())


def test_faulty_store_fails_the_nth_matching_call_before_the_store_acts() -> None:
    from chkq.stores import TransientStoreError

    store = FaultyStore(MemoryStore())
    store.fail("put_if_absent", "/records/", nth=2)
    assert store.put_if_absent("runs/r/records/a", b"a") is True
    assert store.put_if_absent("runs/r/payloads/b", b"b") is True, "not matched"
    with pytest.raises(TransientStoreError, match="runs/r/records/c"):
        store.put_if_absent("runs/r/records/c", b"c")
    assert not store.inner.exists("runs/r/records/c")
    assert store.put_if_absent("runs/r/records/c", b"c") is True, "fires once by default"
    assert [key for _, key in store.calls].count("runs/r/records/c") == 2


def test_faulty_store_loses_the_answer_after_the_store_acted() -> None:
    store = FaultyStore(MemoryStore())
    store.lose_response({"put", "delete"}, lambda key: key.endswith(".json"), times=None,
                        error=ConnectionResetError("cut"))
    with pytest.raises(ConnectionResetError):
        store.put("x.json", b"1")
    assert store.inner.get("x.json") == b"1"
    with pytest.raises(ConnectionResetError):
        store.delete("x.json")
    assert not store.inner.exists("x.json")
    store.put("x.bin", b"2")
    with pytest.raises(ValueError, match="unknown store operation"):
        store.fail("rename")


def test_faulty_store_delays_and_runs_a_callback_first() -> None:
    store = FaultyStore(MemoryStore())
    seen: list[tuple[str, str, bool]] = []
    store.before("get", lambda op, key: seen.append((op, key, store.inner.exists(key))))
    store.delay("get", 0.3)
    store.put("k", b"v")
    start = time.monotonic()
    assert store.get("k") == b"v"
    assert time.monotonic() - start >= 0.3
    assert seen == [("get", "k", True)]


def test_a_commit_whose_record_answer_was_lost_is_completed_by_running_it_again() -> None:
    """The store wrote the record but the committer saw an error: running the same
    commit again gives the same id and leaves one record and no orphan."""
    import hashlib

    from chkq.log import CheckpointLog
    from chkq.stores import TransientStoreError

    store = FaultyStore(MemoryStore())
    log = CheckpointLog(store, "run")
    data = os.urandom(50_000)
    checkpoint = hashlib.sha256(data).hexdigest()
    store.lose_response("put_if_absent", "/records/")
    with pytest.raises(TransientStoreError):
        log.commit(data)
    assert store.inner.exists(log.record_key(checkpoint)), "the store acted"
    assert log.commit(data) == checkpoint
    assert [r.id for r in log.manifest()] == [checkpoint]
    assert store.list("runs/run/payloads/") == [log.record(checkpoint).payload]
    assert CheckpointLog(store.inner, "run").load(checkpoint) == data


# a seekable file over an object ------------------------------------------------------


def test_h5py_opens_an_hdf5_file_in_the_store(store: CheckpointStore, tmp_path: Path) -> None:
    """h5py reads datasets, attributes and chunks through ranged reads, never the
    whole object at once; the block cache serves repeated metadata reads."""
    import h5py
    import numpy as np

    from chkq.stores.fileobj import ObjectFile

    path = tmp_path / "m.h5"
    rows = np.arange(200_000, dtype="<f8").reshape(-1, 4)
    with h5py.File(path, "w") as out:
        out.attrs["trials_completed"] = 50_000
        out.create_dataset("data/x", data=rows, chunks=(1000, 4), compression="gzip",
                           shuffle=True)
        out.create_dataset("names", data=np.array([b"a", b"bc"], dtype="S2"))
    raw = path.read_bytes()
    store.put("runs/m.h5", raw)

    block = 64 * 1024
    with ObjectFile(store, "runs/m.h5", block_size=block, cache_blocks=4) as fileobj, \
            h5py.File(fileobj, "r") as source:
        assert source.attrs["trials_completed"] == 50_000
        assert np.array_equal(source["data/x"][:], rows)
        assert source["data/x"].compression == "gzip"
        assert list(source["names"][:]) == [b"a", b"bc"]
        assert fileobj.fetches >= len(raw) // block, "every block read"
        assert fileobj.fetches < 4 * (len(raw) // block + 1)


def test_object_file_reads_seeks_and_refuses_what_a_file_would(store: CheckpointStore) -> None:
    import io

    from chkq.stores.fileobj import ObjectFile

    data = bytes(range(256)) * 40
    store.put("obj", data)
    fileobj = ObjectFile(store, "obj", block_size=100, cache_blocks=2)
    assert fileobj.size == len(data)
    assert fileobj.read(250) == data[:250]
    assert fileobj.seek(-10, io.SEEK_END) == len(data) - 10
    assert fileobj.read(100) == data[-10:], "short at the end"
    assert fileobj.read(5) == b""
    fileobj.seek(95)
    assert fileobj.read(10) == data[95:105], "across a block boundary"
    fileobj.seek(3, io.SEEK_CUR)
    assert fileobj.tell() == 108
    assert io.BufferedReader(ObjectFile(store, "obj")).read() == data
    with pytest.raises(OSError, match="negative"):
        fileobj.seek(-1)
    assert not fileobj.writable()
    with pytest.raises(OSError):
        fileobj.write(b"x")
    fileobj.close()
    with pytest.raises(ValueError, match="closed"):
        fileobj.read(1)
    with pytest.raises(KeyError):
        ObjectFile(store, "missing")


_PUBLISHER = """
import sys, time
import chkq.stores.local_files
from chkq.stores import open_store
chkq.stores.local_files.ANONYMOUS = sys.argv[2:] != ["private"]
store = open_store(sys.argv[1])
if hasattr(store, "part_size"):
    store.part_size = 5 << 20
upload = store.upload("out/MODEL.h5")
upload.write(b"x" * (6 << 20))
print("parts sent", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("store", ["file", "s3", "gcs"], indirect=True)
@pytest.mark.cluster
@pytest.mark.fault
def test_a_killed_publisher_leaves_a_stray_upload_that_abort_removes(
        store: CheckpointStore) -> None:
    """A local store writing as on NFS (no O_TMPFILE): its private directory is the stray;
    with O_TMPFILE nothing is left (tests/test_publish.py)."""
    import signal

    publisher = subprocess.Popen([sys.executable, "-c", _PUBLISHER, store.url, "private"],
                                 stdout=subprocess.PIPE, text=True)
    try:
        assert publisher.stdout is not None
        assert publisher.stdout.readline() == "parts sent\n"
        publisher.send_signal(signal.SIGKILL)
    finally:
        publisher.wait(30)
    assert not store.exists("out/MODEL.h5")
    assert store.list() == []
    strays = store.stray_uploads()
    assert len(strays) == 1
    if isinstance(store, LocalDirectoryStore):
        assert strays[0].key == "", "a temporary does not record its key"
    else:
        assert strays[0].key == "out/MODEL.h5"
        assert store.stray_uploads("out/") == strays
        assert store.stray_uploads("elsewhere/") == []
    if not store.url.startswith("s3://"):  # moto reports one fixed initiation time
        assert abs(strays[0].started - time.time()) < 120
    store.abort_upload(strays[0])
    store.abort_upload(strays[0])
    assert store.stray_uploads() == []
    assert not store.exists("out/MODEL.h5")


def test_links_are_a_capability_of_a_local_directory(tmp_path: Path) -> None:
    """A local directory links the *open* file (a name swapped meanwhile is not what is
    published); a store without files says so and refuses, so that the caller copies."""
    from chkq.stores.base import ObjectVersion

    source = tmp_path / "scratch" / "out.h5"
    source.parent.mkdir()
    source.write_bytes(b"verified")
    local = LocalDirectoryStore(tmp_path / "store")
    with open(source, "rb") as handle:
        source.rename(source.with_name("moved.h5"))
        source.write_bytes(b"planted")
        made = local.link_from("out.h5", handle.fileno())
        assert local.link_from("out.h5", handle.fileno()) is None, "create-if-absent"
    assert local.supports_links and made == local.version("out.h5")
    assert local.get("out.h5") == b"verified"
    memory = MemoryStore()
    assert not memory.supports_links
    with open(source, "rb") as handle, pytest.raises(OSError, match="no local files"):
        memory.link_from("out.h5", handle.fileno())
    with pytest.raises(OSError, match="no local files"):
        memory.link_to("out.h5", ObjectVersion(1, "x"), os.open(tmp_path, os.O_RDONLY), "x")
