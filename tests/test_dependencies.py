"""What a user installs is what the code imports: `pip install -e .` must be enough for every path but the extras'.

Every third-party import statement in the package and the scripts (those inside functions too) names a distribution
that pyproject.toml's [project] dependencies declare; a package that only some paths need is imported through
qnext.optional.optional_import, naming an extra that lists it. The test venv has the test extra installed, so an
import it satisfies would pass unnoticed at run time: this audit reads the source instead. (.ci/run also runs the
README's commands and imports every module in a venv with the base dependencies only.)"""
from __future__ import annotations

import ast
import importlib.metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest

from qnext.optional import optional_import

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("qnext", "pallas_kernels", "cache", "scripts")
OWN = {"qnext", "pallas_kernels", "cache", "scripts", "__future__"} | {p.stem for p in (ROOT / "scripts").glob("*.py")}
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))


BASE = {requirement_name(r) for r in PROJECT["dependencies"]}
EXTRAS = {extra: {requirement_name(r) for r in reqs} for extra, reqs in PROJECT["optional-dependencies"].items()}
MODULE_DISTRIBUTIONS = importlib.metadata.packages_distributions()


def distributions(module: str) -> set[str]:
    """The distributions that provide top-level module `module` (its own name, canonical, when none is installed)."""
    top = module.split(".")[0]
    return {canonical(d) for d in MODULE_DISTRIBUTIONS.get(top, ())} or {canonical(top)}


def source_files() -> list[Path]:
    return sorted(p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py"))


def third_party_imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
        out += [(node.lineno, n) for n in names
                if n.split(".")[0] not in OWN and n.split(".")[0] not in sys.stdlib_module_names]
    return out


def optional_imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module, extra) of each optional_import("module", "extra", ...) call."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "optional_import":
            module, extra = (a.value for a in node.args[:2])
            out.append((node.lineno, module, extra))
    return out


def test_every_import_statement_names_a_base_dependency():
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}, which no base dependency provides "
             f"({' / '.join(sorted(distributions(module)))}): declare it or use qnext.optional.optional_import"
             for path in source_files() for line, module in third_party_imports(path)
             if not distributions(module) & BASE]
    assert not wrong, "\n".join(wrong)


def test_every_optional_import_names_an_extra_that_brings_it():
    calls = [(path, *call) for path in source_files() for call in optional_imports(path)]
    assert len(calls) >= 8            # the audit sees the calls (plots, the reference, grammar libraries, ...)
    wrong = [f"{path.relative_to(ROOT)}:{line} optional_import({module!r}, {extra!r}): the [{extra}] extra "
             f"{'does not exist' if extra not in EXTRAS else 'does not list ' + ' / '.join(distributions(module))}"
             for path, line, module, extra in calls
             if not distributions(module) & EXTRAS.get(extra, set())]
    assert not wrong, "\n".join(wrong)


def test_the_audit_sees_imports_inside_functions(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import os\n\ndef f():\n    import matplotlib.pyplot as plt\n    from PIL import Image\n")
    assert third_party_imports(source) == [(4, "matplotlib.pyplot"), (5, "PIL")]
    assert "pillow" in distributions("PIL") and "pillow" in BASE


def test_a_missing_optional_package_names_its_extra():
    with pytest.raises(ImportError, match=r"--plot needs the 'no_such_module_q' package, which the \[bench\] extra "
                                          r"brings: pip install -e '\.\[bench\]'"):
        optional_import("no_such_module_q", "bench", "--plot")
