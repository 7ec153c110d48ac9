"""microbench: kernel-level microbenchmarks of the speculative-decoding verify step.

Data flows one way: case -> shapes -> inputs -> correctness gate -> timer -> record ->
report / compare / model.  This package is the harness; ``microbench.kernels`` holds the
Triton kernels beside their torch references and ``microbench.cases`` binds the two.
"""

from __future__ import annotations

import os as _os

__version__ = "0.1.0"

# In a source checkout that has not been installed, kernels/ and cases/ sit beside this
# folder: let them import as microbench.kernels / microbench.cases, the names an
# install gives them, so a plain checkout (e.g. on a GPU host with no network) works.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(
    _os.path.join(_root, "kernels")
):
    if _root not in __path__:  # type: ignore[name-defined]
        __path__.append(_root)  # type: ignore[name-defined]
