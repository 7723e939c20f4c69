"""Imports only point down (shared design): server -> engine -> model -> vision -> kernels and cache; flax/ is a front
end over model/; distributed/ sits beside engine/ (it wraps an engine, imports none); cache/ and pallas_kernels/
import nothing of qnext. Every import counts, those inside functions and under TYPE_CHECKING too, and no chain of
imports comes back to where it started (no module imports itself through others)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# package -> the packages of ours it must not import
FRONT_ENDS = ("qnext.server", "qnext.soak", "qnext.llm", "qnext.flax", "qnext.bench")
FORBIDDEN = {
    "qnext/model": ("qnext.engine", "qnext.lora", "qnext.distributed", *FRONT_ENDS),
    "qnext/vision": ("qnext.model", "qnext.engine", "qnext.distributed", *FRONT_ENDS),
    "qnext/distributed": ("qnext.engine", "qnext.server", "qnext.soak", "qnext.llm", "qnext.flax"),
    "qnext/structured": ("qnext.model", "qnext.vision", "qnext.engine", "qnext.distributed", *FRONT_ENDS),
    "qnext/agents": ("qnext.model", "qnext.vision", "qnext.engine", "qnext.distributed", *FRONT_ENDS),
    "qnext/flax": ("qnext.engine", "qnext.distributed", "qnext.server", "qnext.soak", "qnext.llm", "qnext.bench"),
    "qnext/bench": ("qnext.server", "qnext.soak", "qnext.llm"),
    "qnext/server": ("qnext.soak", "qnext.bench"),
    "qnext/soak": (),                      # the top: drives servers it starts
    "qnext/ops": ("qnext.config", "qnext.model", "qnext.vision", "qnext.structured", "qnext.agents",
                  "qnext.engine", "qnext.distributed", *FRONT_ENDS),
    "qnext/engine": ("qnext.distributed", *FRONT_ENDS),
    # LoRA adapters sit over model/ (they read its plan and wrap its weights) and under engine/, which holds them
    "qnext/lora": ("qnext.engine", "qnext.distributed", "qnext.vision", *FRONT_ENDS),
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


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (`from package import submodule` counts as the submodule)."""
    paths = {module_name(p): p for top in ("qnext", "cache", "pallas_kernels") for p in (ROOT / top).rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if a.name in paths}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in paths:
                subs = {f"{node.module}.{a.name}" for a in node.names} & paths.keys()
                targets |= subs if len(subs) == len(node.names) else subs | {node.module}
        graph[name] = targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on_stack.add(root)
        while work:
            v, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1
                    stack.append(child); on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[v] = min(low[v], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop(); on_stack.discard(w); component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_package_has_its_rule():
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "qnext").glob("*/__init__.py")}
    assert packages - FORBIDDEN.keys() == set()


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_circle_check_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
