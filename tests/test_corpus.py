"""HDF5 files written by other software, consolidated on real workers, checked independently.

Each case (a file of tests/data/corpus, or a synthetic file of tests/support/corpus.py)
becomes a checkpointed run (two single-file checkpoints and a directory of
two rank files, rows varied between them), is consolidated through the
session's worker processes, and then EITHER the output equals, object by
object, what tests/support/corpus_expect.py computes from the sources, OR the job was
refused with ValueError/TypeError/NotImplementedError naming the object and
left the run directory exactly as it was. Anything else fails.

By default a representative subset runs; the whole corpus with
``CHKQ_CORPUS=all pytest -m corpus tests/test_corpus.py`` (or
``pytest -m corpus --corpus-all tests/test_corpus.py``).
"""

from __future__ import annotations

import os
import re
import warnings
from pathlib import Path

import h5py
import pytest

from chkq.workers.client import submit_consolidation
from support.corpus import all_cases, make_run, resolve
from support.corpus_expect import compare_full, template_of, walk
from support.helpers import snapshot

pytestmark = pytest.mark.corpus

TIMEOUT = 120
# chkq's errors for a written output that failed its read-back checks, or for
# inputs that changed under the job: failures, never acceptable refusals.
NOT_REFUSALS = {"OutputMismatchError", "CheckpointChangedError", "CheckpointCorruptionError"}
MODEL = "run"

# One or two of each producer and of each problem class: fast enough for every run.
SUBSET = [
    "pytables-attr-u16.h5",          # hard-link aliases, int128, fill undefined, gzip
    "pytables-slink.h5",             # soft links, NULLTERM CLASS attributes
    "pytables-elink.h5",             # external link
    "pytables-vlunicode_endian.h5",  # extensible vlen sequences
    "pytables-test_ref_array1.mat",  # MATLAB 7.3: userblock, object-reference cells
    "pytables-Tables_lzo2_shuffle.h5",  # filter without a plugin (LZO)
    "pytables-blosc_bigendian.h5",   # Blosc, big-endian
    "h5py-vlen_string_s390x.h5",     # big-endian enum, vlen strings
    "rhdf5-h5ex_t_cmpd.h5",          # HDF Group example: compound with vlen string
    "hdf5r-test-h5link.h5",          # soft, external and hard links
    "anndata-adata-v0.7.8.h5ad",     # lzf, references, extensible
    "hdf5ex-REF_REG.h5",             # region references
    "netcdfc-cf_timeseries.nc",      # netCDF-4: dimension scales, deflate, unlimited time
    "netcdfc-usertypes.nc",          # netCDF-4: named types, vlen, compound, groups
    "syn-fullwidth-strings.h5",
    "syn-committed-types.h5",
    "syn-extensible-vlen.h5",
    "syn-gzip-padding.h5",
]


def _full_corpus(config: pytest.Config) -> bool:
    if os.environ.get("CHKQ_CORPUS", "").lower() == "all":
        return True
    try:
        return bool(config.getoption("corpus_all"))
    except ValueError:
        return False


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "corpus_case" in metafunc.fixturenames:
        cases = all_cases() if _full_corpus(metafunc.config) else SUBSET
        metafunc.parametrize("corpus_case", cases)


def test_subset_names_exist() -> None:
    missing = sorted(set(SUBSET) - set(all_cases()))
    assert not missing, f"SUBSET names no corpus case: {missing}"


def names_an_object(message: str, template: Path, scratch: Path) -> bool:
    """``message`` names an object of ``template`` by its path (or a root attribute)."""
    text = message.replace(str(scratch), "<tmp>")
    with h5py.File(template, "r") as f:
        tree = walk(f)
        root_attrs = [name for name in f.attrs]
    for path in sorted(tree.links, key=len, reverse=True):
        if path == "/":
            continue
        pattern = r"(?<![\w.-])/?" + re.escape(path.lstrip("/")) + r"(?![\w.-])"
        if re.search(pattern, text):
            return True
    return any(re.search(r"['\"]" + re.escape(a) + r"['\"]", text) for a in root_attrs)


def test_corpus_file(corpus_case: str, tmp_path: Path, worker: object) -> None:
    source, companions = resolve(corpus_case, tmp_path / "source")
    run_dir = tmp_path / "run"
    files = make_run(source, run_dir, MODEL, n_checkpoints=2, directory=True,
                     companions=companions)
    before = snapshot(run_dir)
    try:
        output = submit_consolidation(MODEL, run_dir, False).wait_for_output(timeout=TIMEOUT)
    except (ValueError, TypeError, NotImplementedError) as e:
        message = f"{type(e).__name__}: {e}"
        # A refusal comes before anything is written; chkq's own read-back
        # check failing means it wrote a wrong output: not a refusal.
        assert type(e).__name__ not in NOT_REFUSALS, (
            f"the job wrote an output that its own verification rejected: {message}")
        assert not (run_dir / f"{MODEL}.h5").exists(), f"refused but wrote output: {message}"
        assert snapshot(run_dir) == before, f"refused but changed the run: {message}"
        assert names_an_object(str(e), template_of(files), tmp_path), (
            f"refusal does not name the object: {message}")
        print(f"\n[corpus] {corpus_case}: refused: {message}")
        return
    assert output == run_dir / f"{MODEL}.h5"
    result = compare_full(output, files)
    print(f"\n[corpus] {corpus_case}: consolidated, {len(result.differences)} difference(s)")
    for text in result.warnings:
        warnings.warn(text, stacklevel=1)
    assert result.differences == [], "\n".join(
        [f"{len(result.differences)} difference(s):", *result.differences[:40]])
