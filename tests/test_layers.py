"""The layering holds by test: every core module is under the import contract of pyproject."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYERS = {"tasks", "workers", "config"}


def test_every_core_module_is_under_the_core_contract() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    core = next(c for c in config["contracts"] if c["type"] == "forbidden")
    listed = set(core["source_modules"])
    modules = {f"chkq.{p.stem}" for p in (ROOT / "chkq").glob("*.py") if p.stem != "__init__"}
    packages = {f"chkq.{p.name}" for p in (ROOT / "chkq").iterdir()
                if p.is_dir() and p.name not in LAYERS and (p / "__init__.py").exists()}
    assert modules | packages <= listed, f"not under the contract: {(modules | packages) - listed}"
    assert {"celery", "chkq.tasks", "chkq.workers", "chkq.config"} <= set(core["forbidden_modules"])


#: What the config layer holds: settings, the app factory, routing, limits, signing.
CONFIG_MODULES = {"settings", "celery_app", "routing", "limits", "security", "auth_serializer"}


def test_the_config_layer_holds_no_worker_runtime() -> None:
    found = {p.stem for p in (ROOT / "config").glob("*.py") if p.stem != "__init__"}
    assert found == CONFIG_MODULES, f"worker runtime in config/: {found - CONFIG_MODULES}"


def test_the_worker_runtime_named_by_config_is_in_the_workers_layer() -> None:
    from kombu.utils.imports import symbol_by_name

    from chkq.config.celery_app import CONSUMER_CLASS, TRANSPORT_CLASS
    from chkq.config.limits import REQUEST_CLASS

    for name in (CONSUMER_CLASS, TRANSPORT_CLASS, REQUEST_CLASS):
        assert name.startswith("chkq.workers."), name
        assert isinstance(symbol_by_name(name), type), name
