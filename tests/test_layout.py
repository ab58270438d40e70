"""The architecture rules that review alone would let slip, checked on the source.

* Only `tf_sharded/_compat.py` reaches into TensorFlow or Keras internals:
  no `tensorflow.python` / `keras.src` import elsewhere, no private attribute
  of another object read or written (`x._name` with `x` not `self`/`cls`,
  `getattr(x, "_name")`, `object.__setattr__`).
* The import graph of the library (every import, module level or not) has
  no cycle.
* Layers run one way (`LAYERS`): no module imports a module of a higher
  layer, and the units of the map (packages, and the modules named there)
  import each other without a cycle. `strategy/` counts as what it is
  installed as, `tf_sharded.strategy`.
* No module over `MAX_LINES` lines outside the benchmarks.
* Only the table package asks whether something is a `ShardedVariable`; the
  rest goes through the table protocol.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Source directory -> the package it installs as (setup.py's package_dir).
PACKAGES = {"tf_sharded": "tf_sharded", "strategy": "tf_sharded.strategy"}
COMPAT = "tf_sharded._compat"
MAX_LINES = 1000
INTERNAL_PREFIXES = ("tensorflow.python", "keras.src", "keras._tf_keras", "tensorflow.core")
# `other` is another instance of the same class (in `__eq__` and the like).
SELF_NAMES = {"self", "cls", "other"}


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for directory, package in PACKAGES.items():
        for path in sorted((ROOT / directory).rglob("*.py")):
            parts = list(path.relative_to(ROOT / directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
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
            # `from pkg import sub` names the module `pkg.sub`; `from pkg import name`, `pkg` itself.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
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


# The layer map, lowest first (ARCHITECTURE.md: core < kinds < placements < exchange and strategy < keras and
# planning < app and benchmarks). A module belongs to the unit of its longest prefix here.
LAYERS = (
    ("core", ("tf_sharded._compat", "tf_sharded._console", "tf_sharded.errors", "tf_sharded.versions",
              "tf_sharded.trace", "tf_sharded.config", "tf_sharded.layout", "tf_sharded.initializers",
              "tf_sharded.partitioners", "tf_sharded.policies", "tf_sharded.isolation", "tf_sharded.lifetime",
              "tf_sharded.local_workers", "tf_sharded.cluster")),
    # Table kinds: fixed rows (`table`, with the registry of kinds and placements) and dynamic keys.
    ("kinds", ("tf_sharded.table", "tf_sharded.table.dynamic")),
    # Placements beyond this process's devices: table servers (sharded over workers is the exchange's).
    ("placements", ("tf_sharded.hybrid",)),
    ("exchange and strategy", ("tf_sharded.exchange", "tf_sharded.strategy", "tf_sharded.creation")),
    ("keras and planning", ("tf_sharded.keras", "tf_sharded.planning")),
    # The table server's process trains its shards with tf_sharded's own tables and optimizers.
    ("app and benchmarks", ("tf_sharded.app", "tf_sharded.benchmarks", "tf_sharded.__main__",
                            "tf_sharded.hybrid.server", "tf_sharded.hybrid.__main__")),
)  # fmt: skip
# Facades gather names for users from every layer: each is a unit of its own, on top.
FACADES = ("tf_sharded", "tf_sharded.hybrid")


def _unit(module: str) -> tuple[int, str]:
    """(layer index, unit) of `module`."""
    if module in FACADES:
        return len(LAYERS) - 1, module + " (facade)"
    best = None
    for layer, (_, units) in enumerate(LAYERS):
        for unit in units:
            if (module == unit or module.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (layer, unit)
    assert best is not None, f"{module} is in no layer of tests/test_layout.py's LAYERS: place it"
    return best


def _unit_edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> the module imports that make the edge (a package's __init__ importing
    its own submodules makes none: it only gathers their names)."""
    edges = {}
    for name, tree in TREES.items():
        for target in _imported_modules(name, tree):
            if _is_package(name) and target.startswith(name + "."):
                continue
            a, b = _unit(name)[1], _unit(target)[1]
            if a != b:
                edges.setdefault((a, b), []).append(f"{name} -> {target}")
    return edges


def test_layers_run_one_way():
    upward = []
    for name, tree in TREES.items():
        layer = _unit(name)[0]
        for target in sorted(_imported_modules(name, tree)):
            if _unit(target)[0] > layer:
                upward.append(f"{name} ({LAYERS[layer][0]}) -> {target} ({LAYERS[_unit(target)[0]][0]})")
    assert not upward, "imports up the layer map:\n" + "\n".join(upward)


def test_no_cycle_between_units():
    edges = _unit_edges()
    graph = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    cycle = _cycle(graph)
    made_by = [edges[(a, b)] for a, b in zip(cycle, cycle[1:])] if cycle else []
    assert cycle is None, "cycle between units: " + " -> ".join(cycle) + f" (made by {made_by})"


def test_the_layer_map_sees_the_strategy_package():
    assert "tf_sharded.strategy.mirrored" in MODULES and "strategy.mirrored" not in MODULES
    assert _unit("tf_sharded.strategy.mirrored")[1] == "tf_sharded.strategy"
    assert _unit("tf_sharded.table.dynamic.pool") == (1, "tf_sharded.table.dynamic")
    assert _unit("tf_sharded.hybrid.server")[0] == len(LAYERS) - 1
    assert "tf_sharded.strategy" in _imported_modules(
        "tf_sharded.exchange.transports", TREES["tf_sharded.exchange.transports"]
    )


def test_library_modules_do_not_import_package_facades():
    """Library modules import the defining submodule, so a package __init__ never hides a cycle."""
    offenders = []
    for name, tree in TREES.items():
        if _is_package(name) or name.startswith(("tf_sharded.benchmarks", "tf_sharded.app", "tf_sharded.__main__")):
            continue
        for target in _imported_modules(name, tree):
            if (
                _is_package(target)
                and target not in ("tf_sharded", "tf_sharded.strategy")
                and not name.startswith(target + ".")
            ):
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


def test_public_class_names_are_unique():
    """One name per concept: no two public classes of the library (outside the benchmarks) share a name."""
    homes = {}
    for name, tree in TREES.items():
        if name.startswith("tf_sharded.benchmarks"):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                homes.setdefault(node.name, []).append(name)
    shared = {cls: modules for cls, modules in homes.items() if len(modules) > 1}
    assert not shared, f"public classes sharing a name: {shared}"
