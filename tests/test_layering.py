"""The folder tree is the architecture: each package imports only the layers below it
(and the base modules), and no module imports itself back through a cycle.

    storage <- format <- layout <- state <- engine <- protocol
            <- {tiers, catalog, view, interop, compat} <- manager <- {cli, integrations}

``errors``, ``progress`` and ``_faults`` are the base every layer may use; ``__init__``
and ``__main__`` sit on top. The packages of one layer may import each other, but never
in a cycle. Every import counts: module level, inside functions, under TYPE_CHECKING.
Pure ast walk over dckpt/, no import of dckpt itself."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dckpt")

LAYERS = [
    {"errors", "progress", "_faults"},
    {"storage"},
    {"format"},
    {"layout"},
    {"state"},
    {"engine"},
    {"protocol"},
    {"tiers", "catalog", "view", "interop", "compat"},
    {"manager"},
    {"cli", "integrations"},
    {"__init__", "__main__"},
]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}


def modules(root: str = ROOT) -> dict[str, str]:
    """{dotted module name: file} for every .py file under ``root``."""
    out = {}
    base = os.path.dirname(root)
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                p = os.path.join(dirpath, f)
                name = os.path.relpath(p, base)[:-3].replace(os.sep, ".")
                out[name[:-len(".__init__")] if name.endswith(".__init__") else name] = p
    return out


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """{module: the dckpt modules it imports}, resolved to modules that exist (``from
    pkg import name`` counts as ``pkg.name`` when that is a module, else ``pkg``)."""
    out: dict[str, set[str]] = {}
    for mod, path in mods.items():
        is_pkg = path.endswith("__init__.py")
        here = mod.split(".") if is_pkg else mod.split(".")[:-1]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[:len(here) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    full = f"{target}.{a.name}"
                    deps.add(full if full in mods else target)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        out[mod] = {_module(d, mods) for d in deps if d.split(".")[0] == "dckpt"} - {mod, None}
    return out


def _module(name: str, mods: dict[str, str]) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def layer(mod: str) -> int:
    parts = mod.split(".")
    head = parts[1] if len(parts) > 1 else "__init__"
    if head not in LEVEL:
        raise AssertionError(f"{mod}: dckpt/{head} is in no layer of the layering test")
    return LEVEL[head]


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{m} imports {d}" for m, ds in graph.items() for d in ds
                  if layer(d) > layer(m))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_no_layer_imports_a_higher_one():
    assert upward(imports(modules())) == []


def test_no_import_cycles():
    assert cycles(imports(modules())) == []


def test_only_the_base_modules_sit_at_the_top_level():
    loose = sorted(f for f in os.listdir(ROOT) if f.endswith(".py"))
    assert loose == ["__init__.py", "__main__.py", "_faults.py", "errors.py", "progress.py"]


def test_the_checks_fail_on_an_upward_import_and_a_cycle(tmp_path):
    """The rule is not vacuous: a copy of dckpt/ with one upward import added (the
    storage layer importing the manager) and a cycle (two catalog modules importing
    each other) fails both checks."""
    import shutil

    copy = tmp_path / "dckpt"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "storage" / "base.py", "a") as f:
        f.write("\n\ndef _bad():\n    from ..manager import core  # noqa\n")
    with open(copy / "catalog" / "local.py", "a") as f:
        f.write("\nfrom . import verify  # noqa\n")
    graph = imports(modules(str(copy)))
    assert "dckpt.storage.base imports dckpt.manager.core" in upward(graph)
    assert any("dckpt.catalog.local" in c and "dckpt.catalog.verify" in c
               for c in cycles(graph))


@pytest.mark.parametrize("mod", sorted(modules()))
def test_every_module_is_in_a_layer(mod):
    layer(mod)


def cross_adapter(graph: dict[str, set[str]]) -> list[str]:
    """Imports from one integration package (``dckpt.integrations.<name>``) into another
    one's, and from the shared ``common`` package into any adapter's: an adapter
    imports only the shared ``dckpt.integrations.common`` (and the layers below)."""
    def pkg(mod: str) -> str | None:
        parts = mod.split(".")
        return parts[2] if len(parts) > 3 and parts[1] == "integrations" else None

    out = []
    for m, ds in graph.items():
        src = pkg(m)
        if src is None:
            continue
        for d in ds:
            dst = pkg(d)
            if dst is not None and dst != src and dst != "common":
                out.append(f"{m} imports {d}")
    return sorted(out)


def test_no_adapter_imports_another_adapters_package():
    assert cross_adapter(imports(modules())) == []


def test_the_adapter_rule_is_not_vacuous(tmp_path):
    import shutil

    copy = tmp_path / "dckpt"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "integrations" / "accelerate" / "contents.py", "a") as f:
        f.write("\n\ndef _bad():\n    from ..lightning import state  # noqa\n")
    with open(copy / "integrations" / "common" / "tree.py", "a") as f:
        f.write("\n\ndef _bad():\n    from ..accelerate import contents  # noqa\n")
    bad = cross_adapter(imports(modules(str(copy))))
    assert "dckpt.integrations.accelerate.contents imports dckpt.integrations.lightning.state" in bad
    assert "dckpt.integrations.common.tree imports dckpt.integrations.accelerate.contents" in bad
