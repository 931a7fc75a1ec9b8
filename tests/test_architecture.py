"""The import graph of vlm_pack has no cycle, and no submodule imports the top-level package.

Every ``import`` / ``from ... import`` statement counts: at module level, inside functions and under
``if TYPE_CHECKING:`` (a cycle hidden in a function or a type-only import is still two modules that need
each other). Relative imports are resolved; ``from pkg import name`` is an edge to ``pkg.name`` when that is
a module, else to ``pkg`` (its ``__init__``). The parent packages Python imports implicitly are not edges.

The top-level ``vlm_pack`` re-exports lazily (``__getattr__`` over a table of submodules), so it depends on
nearly every module without an import statement saying so: a submodule importing it (``from .. import
Preprocessor``) would close a loop the graph cannot see. Submodules import what they need from the module
that defines it; ``from vlm_pack import offline`` (a submodule) is fine.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from pathlib import Path

import vlm_pack

PACKAGE = Path(vlm_pack.__file__).parent


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """``{dotted name: (file, is a package __init__)}`` for every ``.py`` under the package ``root``."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def _targets(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> list[str]:
    """The modules of ``known`` one import statement of ``module`` names."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:
            here = module.split(".") if is_package else module.split(".")[:-1]
            base = here[: len(here) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
        # the other names are read from ``target`` itself (its __init__ for a package)
        names = submodules + ([target] if len(submodules) < len(node.names) else [])
    out = []
    for name in names:
        while name and name not in known:  # ``import a.b.c`` of a name inside module ``a.b``: ``a.b``
            name = name.rpartition(".")[0]
        if name and name != module:
            out.append(name)
    return out


def import_edges(root: Path) -> dict[str, dict[str, int]]:
    """``{module: {imported module: line of the first such import}}`` within the package at ``root``."""
    modules = _modules(root)
    known = set(modules)
    edges: dict[str, dict[str, int]] = {name: {} for name in modules}
    for module, (path, is_package) in modules.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in _targets(module, is_package, node, known):
                    edges[module].setdefault(target, node.lineno)
    return edges


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return sorted(found)


def _describe(component: list[str], edges: dict[str, dict[str, int]]) -> str:
    members = set(component)
    lines = [
        f"  {module.replace('.', '/')}.py:{line} imports {target}"
        for module in component
        for target, line in sorted(edges[module].items())
        if target in members
    ]
    return " <-> ".join(component) + "\n" + "\n".join(lines)


def test_no_import_cycle_in_vlm_pack():
    edges = import_edges(PACKAGE)
    assert len(edges) > 40 and edges["vlm_pack.data.pipeline"], "the graph was not built"
    found = cycles(edges)
    assert not found, "import cycles (move the shared piece down into a lower module):\n" + "\n".join(
        _describe(component, edges) for component in found
    )


def test_no_submodule_imports_the_top_level_package():
    edges = import_edges(PACKAGE)
    offenders = [
        f"{module.replace('.', '/')}.py:{edges[module]['vlm_pack']}"
        for module in sorted(edges)
        if module != "vlm_pack" and "vlm_pack" in edges[module]
    ]
    assert not offenders, (
        "these modules import names from the top-level vlm_pack (which lazily re-exports nearly every "
        f"module): import them from the module that defines them instead: {offenders}"
    )


def test_the_checker_finds_cycles_through_function_and_type_only_imports(tmp_path):
    # a package with one cycle through an in-function relative import, one through a TYPE_CHECKING
    # import of a package's __init__, and edges that are no cycle (a parent package, a submodule by name)
    pkg = tmp_path / "pkg"
    files = {
        "__init__.py": "from .a import A\n",
        "a.py": "A = 1\ndef f():\n    from .sub import deep\n    return deep\n",
        "b.py": "from . import a\n",
        "sub/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .deep import D\n",
        "sub/deep.py": "from ..a import A\nD = A\n",
        "c.py": "import pkg.sub.deep as d\n",
        "d.py": "from .sub import deep\n",
        "e.py": "def g():\n    from . import f\n",
        "f.py": "from .e import g\n",
    }
    for name, text in files.items():
        (pkg / name).parent.mkdir(parents=True, exist_ok=True)
        (pkg / name).write_text(textwrap.dedent(text))
    edges = import_edges(pkg)
    assert edges["pkg.b"] == {"pkg.a": 1}
    assert edges["pkg.c"] == {"pkg.sub.deep": 1}
    assert edges["pkg.d"] == {"pkg.sub.deep": 1}  # a submodule by name: not the package's __init__
    assert edges["pkg.sub"] == {"pkg.sub.deep": 3}
    assert cycles(edges) == [["pkg.a", "pkg.sub.deep"], ["pkg.e", "pkg.f"]]


# -- the built objects travel: every dataset and adapter takes a Preprocessor, never its parts ------------

_PARTS = ("tokenizer", "image_processor", "processor", "family", "template")


def _adapters() -> list:
    """Every dataset, planner and trainer adapter that reads samples: each takes the Preprocessor whole."""
    from vlm_pack.data.map_style import PackedMapDataset
    from vlm_pack.data.pipeline import PackedWebDataset
    from vlm_pack.data.plan import build_plan
    from vlm_pack.integrations.energon import VLMPackingTaskEncoder
    from vlm_pack.integrations.ray import build_plan_ray
    from vlm_pack.integrations.trl import packed_dataset

    return [PackedWebDataset, PackedMapDataset, packed_dataset, build_plan, build_plan_ray, VLMPackingTaskEncoder]


def test_datasets_and_adapters_take_a_preprocessor_not_its_parts():
    """(source, preprocessor, config): the Preprocessor alone owns tokenizer, processor, family, template,
    layout and spec, so no dataset or adapter rebuilds one (without layout or spec) from loose keywords."""
    import inspect

    from vlm_pack.preprocessor import Preprocessor

    for adapter in _adapters():
        params = inspect.signature(adapter).parameters
        names = list(params)
        assert not set(names) & set(_PARTS), f"{adapter.__name__} takes {sorted(set(names) & set(_PARTS))}"
        assert "preprocessor" in names, f"{adapter.__name__} takes no preprocessor"
        pre = params["preprocessor"]
        assert pre.default is inspect.Parameter.empty, f"{adapter.__name__}: preprocessor must be required"
        assert pre.annotation in (Preprocessor, "Preprocessor"), f"{adapter.__name__}: {pre.annotation!r}"
        # (source, preprocessor, config); Energon's encoder has no source (Energon reads the dataset)
        at = 0 if adapter.__name__ == "VLMPackingTaskEncoder" else 1
        assert names[at : at + 2] == ["preprocessor", "config"], f"{adapter.__name__}{inspect.signature(adapter)}"


def test_a_part_given_to_a_dataset_names_the_preprocessor_to_build():
    """The keywords the datasets took before (tokenizer= ... template=) are refused with the replacement,
    not swallowed as unknown packing settings."""
    import pytest

    from vlm_pack.data.map_style import PackedMapDataset
    from vlm_pack.data.pipeline import PackedWebDataset
    from vlm_pack.integrations.trl import packed_dataset

    for adapter in (PackedWebDataset, PackedMapDataset, packed_dataset):
        with pytest.raises(TypeError, match=r"tokenizer=, image_processor= belong to the Preprocessor: build it"):
            adapter("x.tar", None, tokenizer=object(), image_processor=object(), capacity=64)
    with pytest.raises(TypeError, match=r"expected a vlm_pack.Preprocessor, got object"):
        PackedWebDataset("x.tar", object(), capacity=64)


# ---------------------------------------------------------------------------------------------- room sizes
# Issue 32, "rooms a reader can hold": no module of vlm_pack over MAX_MODULE_LINES lines, no function (or
# method) over MAX_FUNCTION_LINES. The allow-lists name today's offenders, each being split by its owner:
# remove an entry when its module or function is split (the test fails while a listed one already fits,
# so the list only shrinks), and a new module or function over the line fails at once.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

MODULES_OVER_THE_LIMIT: dict[str, str] = {}
FUNCTIONS_OVER_THE_LIMIT: dict[str, str] = {}


def module_sizes(root: Path) -> dict[str, int]:
    """``{path relative to root: its number of lines}`` for every ``.py`` under ``root``."""
    return {
        path.relative_to(root).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(root.rglob("*.py"))
    }


def function_sizes(root: Path) -> dict[str, int]:
    """``{"path::Qual.name": lines from its ``def`` to its last line}`` for every function and method."""
    sizes: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    sizes[f"{where}::{name}"] = child.end_lineno - child.lineno + 1
                visit(child, f"{name}.", where)
            else:
                visit(child, prefix, where)

    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), "", where)
    return sizes


def _size_failures(sizes: dict[str, int], limit: int, allowed: dict[str, str], what: str) -> list[str]:
    over = {name for name, n in sizes.items() if n > limit}
    new = [f"{name}: {sizes[name]} lines" for name in sorted(over - set(allowed))]
    fixed = [f"{name}: {sizes.get(name, 0)} lines" for name in sorted(set(allowed) - over)]
    failures = []
    if new:
        failures.append(f"{what} over {limit} lines (split it into rooms of one concern): {new}")
    if fixed:
        failures.append(f"listed as over {limit} lines but split or gone now: remove them from the list: {fixed}")
    return failures


def test_no_module_over_600_lines():
    sizes = module_sizes(PACKAGE)
    assert len(sizes) > 40 and "collate/collator.py" in sizes, "the modules were not found"
    failures = _size_failures(sizes, MAX_MODULE_LINES, MODULES_OVER_THE_LIMIT, "modules")
    assert not failures, "\n".join(failures)


def test_no_function_over_80_lines():
    sizes = function_sizes(PACKAGE)
    assert "cli/main.py::main" in sizes and "collate/collator.py::PackingCollator.__call__" in sizes
    failures = _size_failures(sizes, MAX_FUNCTION_LINES, FUNCTIONS_OVER_THE_LIMIT, "functions")
    assert not failures, "\n".join(failures)


def test_the_size_rules_see_a_long_module_a_long_method_and_a_stale_entry(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "small.py").write_text("def f():\n    return 1\n")
    long_method = "class A:\n    def m(self):\n" + "        x = 1\n" * 80 + "        return x\n"
    (pkg / "sub" / "big.py").write_text(long_method + "\n" * 600)
    modules, functions = module_sizes(pkg), function_sizes(pkg)
    assert modules == {"small.py": 2, "sub/big.py": 83 + 600}
    assert functions == {"small.py::f": 2, "sub/big.py::A.m": 82}
    assert _size_failures(modules, 600, {}, "modules") == [
        "modules over 600 lines (split it into rooms of one concern): ['sub/big.py: 683 lines']"
    ]
    assert _size_failures(functions, 80, {"sub/big.py::A.m": "being split"}, "functions") == []
    stale = _size_failures(functions, 80, {"sub/big.py::A.m": "", "small.py::f": ""}, "functions")
    assert stale == ["listed as over 80 lines but split or gone now: remove them from the list: ['small.py::f: 2 lines']"]


def test_every_module_is_listed_in_docs_architecture():
    """``docs/architecture.md`` gives every module one line: a new module without its line (or a line for a
    module that moved or is gone) fails here, so a newcomer's map stays the package's."""
    import re

    doc = (PACKAGE.parent / "docs" / "architecture.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^\| `([\w/]+\.py)` \|", doc, flags=re.M))
    modules = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py" or path.parent == PACKAGE
    }
    assert not modules - listed, f"add a line to docs/architecture.md for: {sorted(modules - listed)}"
    assert not listed - modules, f"docs/architecture.md lists modules that are gone: {sorted(listed - modules)}"
