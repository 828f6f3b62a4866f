"""Shared uploads whose parts other processes write, against every store kind that has them.

The contract suite (:class:`chkq.stores.testing.StoreTests`) checks a shared upload
through several handles of one process; here the parts come from spawned processes,
resumed from the upload's record as tasks on other machines would, and what a GCS
upload stages is listed with the raw client.
"""

from __future__ import annotations

import multiprocessing
import random
import uuid
from pathlib import Path
from typing import Any

import pytest

from chkq.stores import CheckpointStore
from chkq.stores.shared_upload import PartRecord, checksums_match, crc32c_combine
from support.plugins.object_stores import BUCKET, FaultProxy, make_store
from support.shared_parts import built, complete_parts, write_parts

MiB = 1 << 20
PART = 5 * MiB


def _staged(store: CheckpointStore) -> list[str]:
    """Names of every object a GCS store stages (its ``.chkq-uploads/``), by the raw client."""
    prefix = f"{store._prefix}.chkq-uploads/"  # type: ignore[attr-defined]
    return [blob.name for blob in store.client.list_blobs(BUCKET, prefix=prefix)]  # type: ignore[attr-defined]


@pytest.mark.cluster
@pytest.mark.parametrize("kind", ["file", "s3", "gcs"])  # a memory store is one process's
def test_parts_written_by_two_processes_make_one_object(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    store = make_store(kind, request, tmp_path)
    source = random.Random(7).randbytes(PART + 4096)
    store.put("src/a", source)
    pinned = store.version("src/a")
    upload = store.begin_shared_upload("out/obj")
    token = upload.to_record()
    copy = {"kind": "copy", "number": 1, "source": "src/a",
            "pinned": [pinned.size, pinned.version], "start": 123, "length": PART,
            "offset": 0}
    build = {"kind": "put", "number": 2, "seed": 8, "size": PART, "offset": PART}
    tail = {"kind": "put", "number": 3, "seed": 9, "size": 1000, "offset": 2 * PART}
    context = multiprocessing.get_context("spawn")
    with context.Pool(2) as pool:
        first = pool.apply_async(write_parts, (store.url, token, [copy, tail]))
        second = pool.apply_async(write_parts, (store.url, token, [build, build]))
        records: list[dict[str, Any]] = first.get(300) + second.get(300)[1:]
        if store.url.startswith("gs://"):
            assert len(_staged(store)) == 4, "three parts and the upload's mark"
        assert not store.exists("out/obj")
        assert pool.apply(complete_parts, (store.url, token, records)) is True
    expected = source[123 : 123 + PART] + built(8, PART) + built(9, 1000)
    assert store.get("out/obj") == expected
    parts = sorted((PartRecord.from_record(r) for r in records), key=lambda p: p.number)
    assert checksums_match(store.checksums("out/obj"), store.shared_upload_checksums(parts))
    assert store.stray_uploads() == []
    if store.url.startswith("gs://"):
        assert _staged(store) == [], "every staged part and intermediate was deleted"


@pytest.mark.parametrize("kind", ["s3"])
def test_s3_refuses_a_short_part_but_the_last(kind: str, request: pytest.FixtureRequest,
                                              tmp_path: Path) -> None:
    store = make_store(kind, request, tmp_path)
    upload = store.begin_shared_upload("out/obj")
    parts = [store.put_part(upload, 1, b"short", 0), store.put_part(upload, 2, b"last", 5)]
    with pytest.raises(ValueError, match="at least 5242880"):
        store.complete_shared_upload(upload, parts)
    store.abort_shared_upload(upload)
    assert store.stray_uploads() == []


@pytest.mark.parametrize("kind", ["gcs"])
def test_gcs_composes_many_parts_in_rounds(kind: str, request: pytest.FixtureRequest,
                                           tmp_path: Path) -> None:
    store = make_store(kind, request, tmp_path)
    upload = store.begin_shared_upload("out/obj")
    pieces = [bytes([n % 256]) * (n + 1) for n in range(70)]
    parts, offset = [], 0
    for number, piece in enumerate(pieces, start=1):
        parts.append(store.put_part(upload, number, piece, offset))
        offset += len(piece)
    assert store.complete_shared_upload(upload, parts) is True
    assert store.get("out/obj") == b"".join(pieces)
    assert checksums_match(store.checksums("out/obj"), store.shared_upload_checksums(parts))
    assert _staged(store) == []


@pytest.mark.parametrize("kind", ["gcs"])
def test_gcs_abort_and_refused_completion_leave_nothing_staged(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    store = make_store(kind, request, tmp_path)
    store.put("src", b"s" * 100)
    upload = store.begin_shared_upload("out/obj")
    store.put_part(upload, 1, b"x" * 10, 0)
    store.copy_part(upload, 2, "src", store.version("src"), 0, 50, 10)
    assert len(_staged(store)) == 3
    store.abort_shared_upload(upload)
    assert _staged(store) == []
    store.put("out/obj", b"taken")
    refused = store.begin_shared_upload("out/obj")
    part = store.put_part(refused, 1, b"mine", 0)
    assert store.complete_shared_upload(refused, [part]) is False
    assert _staged(store) == []
    assert store.get("out/obj") == b"taken"


@pytest.mark.parametrize("kind", ["gcs"])
def test_gcs_copies_a_large_range_through_the_client(
        kind: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """A range above google-cloud-storage's 8 MiB and 32 MiB (two chunks of a resumable
    upload, each read pinned) is staged with its CRC32C."""
    store = make_store(kind, request, tmp_path)
    source = random.Random(10).randbytes(41 * MiB)
    store.put("src", source)
    upload = store.begin_shared_upload("out/obj")
    part = store.copy_part(upload, 1, "src", store.version("src"), 7, 40 * MiB, 0)
    assert store.complete_shared_upload(upload, [part]) is True
    assert store.get("out/obj") == source[7 : 7 + 40 * MiB]
    assert checksums_match(store.checksums("out/obj"), store.shared_upload_checksums([part]))
    assert _staged(store) == []


def test_crc32c_combined_from_parts_is_the_whole_objects() -> None:
    google_crc32c = pytest.importorskip("google_crc32c")
    rng = random.Random(11)
    pieces = [rng.randbytes(size) for size in (0, 1, 7, 4096, 65537, 3)]
    whole = 0
    for piece in pieces:
        whole = crc32c_combine(whole, int(google_crc32c.value(piece)), len(piece))
    assert whole == google_crc32c.value(b"".join(pieces))


def test_s3_lost_answer_to_a_shared_completion_is_settled(s3_proxy: FaultProxy) -> None:
    """The completion reached moto, its answer did not: the completion asked again is
    refused, and the object's write id (the token's) shows it this upload's own; a
    completer that asks once more after that is told True too."""
    from chkq.stores import S3Store

    prefix = f"lost-shared-{uuid.uuid4().hex[:8]}"
    store = S3Store(BUCKET, prefix, endpoint_url=s3_proxy.url)
    upload = store.begin_shared_upload("out")
    parts = [store.put_part(upload, 1, b"a" * PART, 0), store.put_part(upload, 2, b"b", PART)]
    s3_proxy.lose_next_response(f"POST /{BUCKET}/{prefix}/out?uploadId".encode())
    assert store.complete_shared_upload(upload, parts) is True
    assert s3_proxy.lost == 1
    assert store.get("out") == b"a" * PART + b"b"
    assert store.complete_shared_upload(upload, parts) is True, "asked again: still ours"
    other = store.begin_shared_upload("out")
    assert store.complete_shared_upload(other, [store.put_part(other, 1, b"c", 0)]) is False
    assert store.stray_uploads() == []
