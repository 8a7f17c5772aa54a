"""The layers of ``gateway/`` (README "Layout"), read from the source: which package may import
which, no import cycle between modules, a short top level, and every package saying in its
docstring what it may import.

Every ``import`` and ``from ... import`` counts, module level or inside a function, relative
ones resolved; ``from pkg import name`` is an import of ``pkg.name`` when that is a module, else
of ``pkg``. An import of a package is an import of its ``__init__``.
"""
import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

import gateway

PACKAGE = Path(gateway.__file__).parent
SHARED = {"gateway.config", "gateway.db", "gateway.models", "gateway.errors", "gateway.endings",
          "gateway.billing", "gateway.background"}
# import nothing of gateway at all
NOTHING = {"gateway.errors", "gateway.endings", "gateway.background"}
ROOTS = {"gateway", "gateway.wsgi"}  # the composition root: anything
# package -> the packages (besides the shared modules) its modules may import
MAY_IMPORT = {
    "backends": {"backends"},
    "contract": {"contract", "backends"},
    "ledger": {"ledger"},
    "flow": {"flow", "contract", "ledger", "backends"},
    "dialects": {"dialects", "flow", "contract", "backends"},
    "ops": {"ops", "ledger", "contract", "backends"},
    "api": None,  # anything in gateway
}


def module_name(path):
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_package(name):
    return MODULES[name].name == "__init__.py"


def imports_of(name):
    """The gateway modules ``name`` imports, anywhere in its body: ``{module: first line}``."""
    tree = ast.parse(MODULES[name].read_text(), str(MODULES[name]))
    here = name if is_package(name) else name.rpartition(".")[0]
    found = {}

    def add(target, line):
        # The longest known module the dotted name starts with (``gateway.api.auth.create_key``
        # is ``gateway.api.auth``).
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.setdefault(target, line)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "gateway" or alias.name.startswith("gateway."):
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here.split(".")
                base = base[:len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != "gateway" and not source.startswith("gateway."):
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in MODULES:
                    add(f"{source}.{alias.name}", node.lineno)
                else:
                    add(source, node.lineno)
    return found


GRAPH = {name: imports_of(name) for name in MODULES}


def package_of(name):
    """``api``, ``flow``, ... for a module inside a package; None for a top module."""
    parts = name.split(".")
    if len(parts) >= 3 or (len(parts) == 2 and is_package(name)):
        return parts[1]
    return None


def allowed(importer, target):
    if importer in ROOTS:
        return True
    if importer in NOTHING:
        return False
    if importer in SHARED:
        return target in SHARED
    package = package_of(importer)
    if package not in MAY_IMPORT:
        return False  # a top module that is not a known one: the third test names it
    if MAY_IMPORT[package] is None or target in SHARED:
        return True
    return package_of(target) in MAY_IMPORT[package]


def test_the_rules_name_every_package_and_top_module():
    """The rules cover the whole tree: no package or top module is left unjudged."""
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert packages == set(MAY_IMPORT)
    top = {name for name in MODULES if package_of(name) is None}
    assert top == SHARED | ROOTS


def test_each_module_imports_only_what_its_layer_may():
    """Every import inside ``gateway`` (module level or in a function) is one its layer allows:
    the shared modules only each other (``errors`` and ``endings`` nothing), ``backends`` the
    shared ones, ``contract`` also ``backends``, ``ledger`` the shared ones, ``flow`` also
    ``contract``, ``ledger`` and ``backends``, ``dialects`` also ``flow`` (never ``ledger``),
    ``ops`` ``ledger``, ``contract`` and ``backends``, ``api`` anything."""
    broken = sorted(f"{importer} -> {target} ({MODULES[importer].relative_to(PACKAGE.parent)}"
                    f":{line})"
                    for importer, targets in GRAPH.items()
                    for target, line in targets.items() if not allowed(importer, target))
    assert broken == [], "imports across the layers:\n" + "\n".join(broken)


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                found.append(sorted(component))
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_cycles_are_found():
    """The cycle finder itself: it sees a two-module and a three-module cycle, and no chain."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert cycles(graph) == [["a", "b"], ["c", "d", "e"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_no_import_cycle_between_gateway_modules():
    """No module reaches itself through imports, counting those inside functions: an import
    of a package is one of its ``__init__``, which imports what it imports."""
    found = cycles({name: set(targets) for name, targets in GRAPH.items()})
    assert found == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_top_level_is_short_and_every_package_says_what_it_may_import():
    """At most a dozen modules directly in ``gateway/``; each package's ``__init__`` has a
    docstring that says what it may import."""
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    silent = []
    for init in sorted(PACKAGE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        if "may import" not in doc.lower():
            silent.append(init.parent.name)
    assert silent == [], f"packages whose docstring does not say what they may import: {silent}"


@pytest.mark.parametrize("importer,target,ok", [
    ("gateway.errors", "gateway.config", False),
    ("gateway.billing", "gateway.errors", True),
    ("gateway.billing", "gateway.flow.outcomes", False),
    ("gateway.backends.fleet", "gateway.contract.catalog", False),
    ("gateway.contract.catalog", "gateway.backends.routing", True),
    ("gateway.contract.catalog", "gateway.api.auth", False),
    ("gateway.ledger.worker", "gateway.flow.outcomes", False),
    ("gateway.dialects", "gateway.ledger", False),
    ("gateway.ops.cli", "gateway.api.chat", False),
    ("gateway.api.chat", "gateway.ops.metrics", True),
    ("gateway.wsgi", "gateway.api", True),
])
def test_the_rules_bite(importer, target, ok):
    """The rules as written above, on imports the layers forbid and allow."""
    assert allowed(importer, target) is ok


def test_the_reader_resolves_relative_and_function_level_imports(tmp_path, monkeypatch):
    """An import inside a function and a relative one (``from ..x import y``) are both seen."""
    pkg = tmp_path / "gateway"
    (pkg / "flow").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "errors.py").write_text("")
    (pkg / "flow" / "__init__.py").write_text('"""May import nothing."""')
    (pkg / "flow" / "a.py").write_text("def f():\n    from ..errors import X\n"
                                       "    from . import b\n    import gateway.flow.b.c\n")
    (pkg / "flow" / "b.py").write_text("")
    modules = {module_name_in(tmp_path, p): p for p in pkg.rglob("*.py")}
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    monkeypatch.setattr(sys.modules[__name__], "MODULES", modules)
    assert imports_of("gateway.flow.a") == {"gateway.errors": 2, "gateway.flow.b": 3}


def module_name_in(root, path):
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_every_layer_is_read():
    """The reader finds imports in every package (a silent reader would pass the rules)."""
    by_package = defaultdict(int)
    for name, targets in GRAPH.items():
        by_package[package_of(name)] += len(targets)
    assert all(by_package[p] > 0 for p in MAY_IMPORT if p != "dialects"), dict(by_package)


def test_no_two_test_modules_share_a_name():
    """pytest imports test modules by their base name (no packages under tests/): two modules
    of one name stop the whole run at collection, though each directory alone passes."""
    names = [p.name for p in (PACKAGE.parent / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
