"""Packages that only some paths need (benchmarks, plots, the transformers reference), imported on first use.

`pip install -e .` brings what serving, generating and library use need; the rest comes with an extra of
pyproject.toml. A missing one fails with an ImportError that names the feature and the extra to install, never with
a bare ModuleNotFoundError. tests/test_dependencies.py holds every import of the project to this: a third-party
import statement names a base dependency, anything else goes through `optional_import`, whose extra must list it."""
from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINTS = {   # extras whose install wants a word more than `pip install 'qnext[EXTRA]'`
    "reference": "install torch's CPU wheel first (pip install torch==2.13.0), then pip install -e '.[reference]'",
}


def optional_import(module: str, extra: str, purpose: str) -> ModuleType:
    """The module, or ImportError: "`purpose` needs `module`, which `pip install 'qnext[extra]'` brings"."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        how = INSTALL_HINTS.get(extra, f"pip install -e '.[{extra}]' (or pip install 'qnext[{extra}]')")
        raise ImportError(f"{purpose} needs the {module.split('.')[0]!r} package, which the [{extra}] extra "
                          f"brings: {how}") from e
