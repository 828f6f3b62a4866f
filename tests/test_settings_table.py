"""Every ``CHKQ_*`` setting in one table: the docs show it, the core reads no environment itself."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from chkq.config.settings import VARIABLES, Settings, markdown_table
from chkq.core_settings import CoreSettings
from chkq.errors import ConfigurationError
from chkq.stores.retry import StoreTimeouts

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"tasks", "workers", "config"}


def test_the_docs_settings_table_is_the_settings_table() -> None:
    text = (ROOT / "docs" / "cluster.md").read_text(encoding="utf-8")
    assert markdown_table() in text, (
        "docs/cluster.md's settings table differs from config/settings.py VARIABLES: paste "
        "the output of `python -c 'from chkq.config.settings import markdown_table as t; "
        "print(t())'`")


def test_every_chkq_variable_the_code_names_is_in_the_table() -> None:
    named = {v.name for v in VARIABLES}
    found: set[str] = set()
    for folder in ("chkq", "tasks", "workers", "config"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                        and node.value.startswith("CHKQ_") and node.value.isupper() \
                        and node.value.replace("_", "").isalnum():
                    found.add(node.value)
    assert found <= named, f"read but not in the settings table: {sorted(found - named)}"
    assert len(named) == len(VARIABLES), "a variable appears twice in the table"


def test_only_the_environment_module_of_the_core_reads_os_environ() -> None:
    readers = []
    for path in (ROOT / "chkq").rglob("*.py"):
        if path.relative_to(ROOT / "chkq").parts[0] in LAYERS or path.name == "environment.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb") \
                    and isinstance(node.value, ast.Name) and node.value.id == "os":
                readers.append(str(path.relative_to(ROOT)))
    assert readers == [], f"core modules reading the environment themselves: {sorted(readers)}"


def test_settings_carry_the_core_variables_and_pass_them_down() -> None:
    env = {"CHKQ_STORE_READ_TIMEOUT": "2.5", "CHKQ_STORE_RETRY_SECONDS": "7",
           "CHKQ_LOG_MAX_CHECKPOINT_BYTES": "1234"}
    settings = Settings.from_env(env)
    core = settings.core()
    assert core.timeouts == StoreTimeouts(read=2.5, budget=7.0)
    assert core.max_checkpoint == 1234
    assert CoreSettings.from_env(env) == core
    assert Settings.from_env({}) == Settings()
    assert StoreTimeouts.from_env({}) == StoreTimeouts()


@pytest.mark.parametrize(("name", "raw"), [("CHKQ_STORE_CONNECT_TIMEOUT", "0"),
                                           ("CHKQ_STORE_READ_TIMEOUT", "soon"),
                                           ("CHKQ_LOG_MAX_CHECKPOINT_BYTES", "-1"),
                                           ("CHKQ_BLOCK_BYTES", "lots")])
def test_a_bad_value_is_refused_naming_the_variable(name: str, raw: str) -> None:
    with pytest.raises(ConfigurationError, match=name):
        Settings.from_env({name: raw})


def test_an_explicit_timeouts_argument_reaches_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("boto3")
    from chkq.stores import open_store

    monkeypatch.setenv("CHKQ_STORE_READ_TIMEOUT", "99")
    given = StoreTimeouts(connect=1.0, read=2.0, budget=3.0, complete=4.0)
    store = open_store("s3://bucket/prefix", timeouts=given)
    assert store.timeouts == given  # type: ignore[attr-defined]
    assert open_store("s3://bucket/prefix").timeouts.read == 99.0  # type: ignore[attr-defined]
