"""Imports only point down (shared design): server -> engine -> model -> kernels and cache, and flax/ is a front end
over model/; cache/ and pallas_kernels/ import nothing of qnext. Every import counts, those inside functions too."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the packages of ours it must not import
FORBIDDEN = {
    "qnext/model": ("qnext.engine", "qnext.flax", "qnext.server", "qnext.llm"),
    "qnext/vision": ("qnext.engine", "qnext.flax", "qnext.server", "qnext.llm"),
    "qnext/engine": ("qnext.flax", "qnext.server", "qnext.llm"),
    "qnext/testing": ("qnext.server", "qnext.engine", "qnext.llm"),
    "cache": ("qnext",),
    "pallas_kernels": ("qnext", "cache"),
}


def imported_modules(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_down(package):
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in sorted((ROOT / package).rglob("*.py"))
             for line, module in imported_modules(path)
             if any(module == up or module.startswith(up + ".") for up in FORBIDDEN[package])]
    assert not wrong, "\n".join(wrong)


def test_the_check_sees_an_upward_import(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    from qnext.engine.sampler import first_argmax\n")
    assert imported_modules(source) == [(2, "qnext.engine.sampler")]
