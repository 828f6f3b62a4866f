"""The top folder of a chkq checkout, which is not a package: importing it explains why.

A checkout cloned as ``chkq/`` holds the package one level down
(``chkq/chkq/``). Python run in the directory holding the checkout looks
in the current directory first and, without this file, would take the
checkout itself for a namespace package ``chkq`` with none of chkq's
names (``module 'chkq' has no attribute 'consolidate_checkpoints'``).
With it, that import fails at once and says what happened. Inside the
checkout and anywhere else, ``import chkq`` finds the package; imported
under another name (pytest collects the checkout's top folder as a
package), this file does nothing.
"""

import os as _os

if __name__ == "chkq":
    raise ImportError(
        f"'import chkq' found the chkq checkout {_os.path.dirname(_os.path.abspath(__file__))!r}"
        " (Python looks in the current directory first), not the chkq package: run Python from "
        "another directory; installed (pip install -e CHECKOUT), chkq imports from any other",
        name="chkq")
