"""MkDocs hook: the site's home page is the repository's README.

The README is written to be read on its own (its links point into ``docs/``);
the site serves the same text as ``index.md`` with those links made relative
to the docs folder, so that there is one copy of the quick start and
``mkdocs build --strict`` checks the README's links and anchors with the rest.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files


def on_files(files: Files, config: Any) -> Files:
    """Add the README, its ``docs/`` links made relative, as the page ``index.md``."""
    readme = Path(config["config_file_path"]).parent / "README.md"
    text = re.sub(r"\]\(docs/", "](", readme.read_text(encoding="utf-8"))
    files.append(File.generated(config, "index.md", content=text))
    return files
