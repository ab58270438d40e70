"""The architecture rules that review alone would let slip, checked on the source.

* Only `tf_sharded/_compat.py` reaches into TensorFlow or Keras internals:
  no `tensorflow.python` / `keras.src` import elsewhere, no private attribute
  of another object read or written (`x._name` with `x` not `self`/`cls`,
  `getattr(x, "_name")`, `object.__setattr__`).
* The import graph of the library (every import, module level or not) has
  no cycle.
* No module over `MAX_LINES` lines outside the benchmarks.
* Only the table package asks whether something is a `ShardedVariable`; the
  rest goes through the table protocol.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("tf_sharded", "strategy")
COMPAT = "tf_sharded._compat"
MAX_LINES = 1000
INTERNAL_PREFIXES = ("tensorflow.python", "keras.src", "keras._tf_keras", "tensorflow.core")
# `other` is another instance of the same class (in `__eq__` and the like).
SELF_NAMES = {"self", "cls", "other"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imported_modules(name: str, tree: ast.AST) -> set[str]:
    """Library modules `name` imports, anywhere in its body (a `from pkg import sub` counts as `pkg.sub`)."""
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _private_accesses(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            attr = node.attr
            if attr.startswith("_") and not attr.startswith("__"):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in SELF_NAMES:
                    continue
                if isinstance(owner, ast.Call) and getattr(owner.func, "id", None) == "super":
                    continue
                if isinstance(owner, ast.Name) and owner.id == "_compat":
                    continue  # the compat module's own helpers
                if ast.unparse(node) == "os._exit":
                    continue  # public, documented for ending a forked child: the underscore is historical
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
            on_self = bool(node.args) and isinstance(node.args[0], ast.Name) and node.args[0].id in SELF_NAMES
            if name in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and not on_self:
                key = node.args[1]
                if isinstance(key, ast.Constant) and isinstance(key.value, str) and key.value.startswith("_"):
                    found.append((node.lineno, ast.unparse(node)))
            # object.__setattr__(self, ...) is how a frozen dataclass normalises its own fields.
            if name == "__setattr__" and ast.unparse(func.value) == "object" and not on_self:
                found.append((node.lineno, ast.unparse(node)))
    return found


def _internal_imports(tree: ast.AST) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]  # importlib.import_module("keras.src...")
        found.extend((node.lineno, n) for n in names if n.startswith(INTERNAL_PREFIXES))
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != COMPAT))
def test_no_internals_outside_compat(module):
    tree = TREES[module]
    problems = _internal_imports(tree) + _private_accesses(tree)
    assert not problems, f"{MODULES[module].relative_to(ROOT)} reaches internals (move behind _compat): {problems}"


def test_the_rules_catch_what_they_are_for():
    bad = ast.parse(
        "from tensorflow.python.ops import array_ops\n"
        "import keras.src.layers\n"
        "v._handle\n"
        "getattr(strategy, '_num_ps')\n"
        "object.__setattr__(layer, 'x', 1)\n"
        "self._ok\n"
        "object.__setattr__(self, 'field', 1)\n"
        "super()._ok()\n"
    )
    assert [line for line, _ in _internal_imports(bad)] == [1, 2]
    assert [line for line, _ in _private_accesses(bad)] == [3, 4, 5]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_is_acyclic():
    graph = {}
    for name, tree in TREES.items():
        # A package's __init__ only gathers its submodules' names for users; the
        # library's own modules import the submodule that defines a name.
        if _is_package(name):
            continue
        graph[name] = {m for m in _imported_modules(name, tree) if not _is_package(m)}
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_library_modules_do_not_import_package_facades():
    """Library modules import the defining submodule, so a package __init__ never hides a cycle."""
    offenders = []
    for name, tree in TREES.items():
        if _is_package(name) or name.startswith(("tf_sharded.benchmarks", "tf_sharded.app", "tf_sharded.__main__")):
            continue
        for target in _imported_modules(name, tree):
            if _is_package(target) and target not in ("tf_sharded", "strategy") and not name.startswith(target + "."):
                offenders.append((name, target))
    assert not offenders, offenders


@pytest.mark.parametrize("module", sorted(MODULES))
def test_modules_stay_small(module):
    if module.startswith("tf_sharded.benchmarks"):
        pytest.skip("benchmarks are scripts, not library modules")
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)} has {lines} lines (limit {MAX_LINES})"


def test_only_the_table_package_checks_for_sharded_variable():
    offenders = []
    for name, tree in TREES.items():
        if name.startswith("tf_sharded.table"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
                if "ShardedVariable" in ast.unparse(node.args[1]):
                    offenders.append((name, node.lineno))
    assert not offenders, f"use tf_sharded.table.is_table / the Table protocol: {offenders}"
