"""No import cycles in `miras`.

Every module of the installed package tree is read as text (`ast`, nothing is imported):
miras/ as `miras`, components/ as `miras.components`, kernels/ as `miras.kernels`, as
pyproject.toml's package-dir maps them (read from there: the one place the mapping is
written). Every executed `import` counts, at module level and inside functions: data flows one
way, so no module may reach back to one that reaches it, even lazily. Imports under
`if TYPE_CHECKING:` run only in a type checker; the whole-package check counts them too, with
no exception. A cycle is named module by module.

The packages state the layers (docs/architecture.md, "The layers"), and the tests below hold
each to its place: `miras.derive` (the sympy analyses the components call while a spec
validates, their printers and checks, and the Protocols they name a spec and its components
by) imports nothing of the components, `miras.spec` or `miras.compiler` above it, annotations
included; the IR imports only derive's leaves; `miras.compiler` (the passes and the pipeline)
sits above the spec and below the runtime's facade.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
# Installed package -> folder in the repository: pyproject.toml's [tool.setuptools.package-dir].
PACKAGE_DIRS: dict[str, str] = SETUPTOOLS["package-dir"]


def module_files() -> dict[str, Path]:
    """Module name -> file, for every .py file of the package tree (`miras/cli.py` included:
    it is a link to the top-level cli.py)."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: set[str], type_checking: bool = False) -> set[str]:
    """The package modules `module` imports, anywhere in its body (`type_checking`: the bodies
    of `if TYPE_CHECKING:` too).

    `from a.b import c` imports `a.b.c` when that is a module, else `a.b` (c is a name in it).
    `import a.b.c` imports `a.b.c`. Parent packages run first but are not counted: every module
    has them, and a package's own imports are counted where it is the importer."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(tree) if type_checking else _executed(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node)
            for alias in node.names:
                target = f"{source}.{alias.name}"
                if target in known:
                    found.add(target)
                elif source in known:
                    found.add(source)
    found.discard(module)
    return found


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")
    )


def _executed(tree: ast.AST):
    """Every node of `tree` except the bodies of `if TYPE_CHECKING:` (their `else` runs)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if _type_checking(node):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def import_graph(type_checking: bool = False) -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, path, known, type_checking) for name, path in files.items()}


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, result = {}, {}, set(), [], []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.append(member)
                    if member == node:
                        break
                if len(members) > 1:
                    result.append(sorted(members))
    return result


def _shortest_cycle(graph: dict[str, set[str]], members: list[str]) -> list[str]:
    """A shortest cycle through the first member of a component, as a path a -> ... -> a."""
    inside = set(members)
    start = members[0]
    parents, frontier = {start: None}, [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & inside):
                if child == start:
                    path = [node]
                    while parents[path[-1]] is not None:
                        path.append(parents[path[-1]])
                    return [*reversed(path), start]
                if child not in parents:
                    parents[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{members} is not a cycle")


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One shortest cycle per group of mutually importing modules."""
    return [_shortest_cycle(graph, members) for members in _components(graph)]


def cycle_report(graph: dict[str, set[str]]) -> str:
    """Each group of mutually importing modules, and a shortest cycle through it."""
    return "\n".join(
        f"  {' -> '.join(_shortest_cycle(graph, members))}   (group: {', '.join(members)})"
        for members in _components(graph)
    )


# The walker itself -----------------------------------------------------------------------------


def test_the_walker_sees_every_kind_of_import():
    graph = import_graph()
    assert {"miras.compiler.pipeline", "miras.components.retention.l2"} <= set(graph)
    assert "miras.kernels.common" in graph  # a package, named without __init__
    # from-import of a module, relative import, in-function import.
    assert "miras.spec" in graph["miras.compiler.pipeline"]
    assert "miras.components.base" in graph["miras.components.retention.l2"]
    assert "miras.checks.end_to_end" in graph["miras.rule"]
    # A TYPE_CHECKING import is not executed; asked for, it is counted.
    assert "miras.runtime.recurrent" not in graph["miras.runtime.call"]
    assert "miras.runtime.recurrent" in import_graph(type_checking=True)["miras.runtime.call"]


def test_cycles_are_found_and_named():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


# The package -----------------------------------------------------------------------------------


def test_no_import_cycles_in_miras():
    graph = import_graph()
    if import_cycles(graph):
        pytest.fail(f"import cycles in miras:\n{cycle_report(graph)}")


def test_no_import_cycles_in_miras_even_in_type_checking_imports():
    graph = import_graph(type_checking=True)
    if import_cycles(graph):
        pytest.fail(f"import cycles in miras, TYPE_CHECKING included:\n{cycle_report(graph)}")


def test_derive_imports_nothing_above_it():
    """components -> derive -> IR, TYPE_CHECKING imports included: the components call
    miras.derive while a spec validates, so no module of it imports a component (the base
    classes included), miras.spec, miras.compiler or anything above them. Besides its own
    modules it imports the IR and the errors; it names a spec and its components by the
    Protocols of `miras.derive.protocols`."""
    graph = import_graph(type_checking=True)
    called = {
        imported
        for module in graph
        if _inside(module, "miras.components")
        for imported in graph[module]
        if _inside(imported, "miras.derive")
    }
    assert {"miras.derive.affine", "miras.derive.linear_step"} <= called, sorted(called)
    derive = sorted(m for m in graph if _inside(m, "miras.derive"))
    for module in derive:
        outside = sorted(m for m in graph[module] if not _inside(m, "miras.derive"))
        assert set(outside) <= {"miras.ir", "miras.errors"}, f"{module} imports {outside}"
    above = ("miras.components", "miras.spec", "miras.compiler", "miras.runtime", "miras.rule")
    for module in [*derive, "miras.ir"]:
        banned = sorted(m for m in _reach(graph, module) if any(_inside(m, p) for p in above))
        assert not banned, f"{module} reaches {banned}"


def test_the_ir_imports_only_the_leaves_of_derive():
    """The IR's records name a gate's `Range` and `GateDefaults` and the compile-time checks'
    `CheckResult`: leaves of miras.derive that import nothing of miras but each other, so the
    IR sits between derive's leaves and its analyses (which build IR records)."""
    graph = import_graph(type_checking=True)
    leaves = {"miras.derive.protocols", "miras.derive.ranges", "miras.derive.check"}
    assert graph["miras.ir"] <= leaves, sorted(graph["miras.ir"])
    for leaf in sorted(leaves):
        assert graph[leaf] <= leaves, f"{leaf} imports {sorted(graph[leaf])}"


def test_the_layers_below_the_compiler_never_reach_it():
    """miras.compiler holds the passes and the pipeline, above the spec: nothing of
    miras.derive, the components, miras.spec or the IR reaches it, annotations included; the
    compiler imports the spec (its passes read a `Spec`)."""
    graph = import_graph(type_checking=True)
    below = ("miras.derive", "miras.components", "miras.spec", "miras.ir")
    for module in [m for m in graph if any(_inside(m, p) for p in below)]:
        reached = sorted(m for m in _reach(graph, module) if _inside(m, "miras.compiler"))
        assert not reached, f"{module} reaches {reached}"
    assert "miras.spec" in graph["miras.compiler.pipeline"]


def test_pyproject_lists_every_package():
    """A package folder of the tree that pyproject.toml's `packages` does not list would be
    missing from a wheel (the editable install finds it anyway)."""
    folders = {name for name, path in module_files().items() if path.name == "__init__.py"}
    assert folders == set(SETUPTOOLS["packages"]), sorted(folders ^ set(SETUPTOOLS["packages"]))


def test_the_runtime_imports_neither_the_facade_nor_the_compiler():
    """run(program, ...) and every form below it know the compiled rule as plain data and the
    Triton kernels through the program's provider: no runtime module imports miras.compiler,
    nor reaches miras.rule, the checks above it or the models, TYPE_CHECKING imports
    included. (It reaches miras.derive through the components, whose analyses they call.)"""
    graph = import_graph(type_checking=True)
    above = ("miras.rule", "miras.checks", "miras.models")
    for module in [m for m in graph if _inside(m, "miras.runtime")]:
        compiler = sorted(m for m in graph[module] if _inside(m, "miras.compiler"))
        assert not compiler, f"{module} imports {compiler}"
        banned = sorted(m for m in _reach(graph, module) if any(_inside(m, p) for p in above))
        assert not banned, f"{module} reaches {banned}"


# The code above the runtime that runs rules: the layer and models, the fla-style ops, the probes.
RUNTIME_CALLERS = ("miras.models", "miras.ops", "miras.probes")


def test_the_layer_ops_and_probes_go_through_the_runtimes_public_surface():
    """They import `miras.runtime` (its __init__ re-exports what they use), never one of its
    modules (`miras.runtime.forms`, `.inputs`, ...), TYPE_CHECKING imports included: the
    runtime's modules can move and split behind that surface."""
    graph = import_graph(type_checking=True)
    callers = [m for m in graph if any(_inside(m, p) for p in RUNTIME_CALLERS)]
    assert "miras.models.layer" in callers and "miras.ops" in callers
    assert any("miras.runtime" in graph[m] for m in callers)  # not vacuous
    past = {
        module: sorted(m for m in graph[module] if m.startswith("miras.runtime."))
        for module in callers
    }
    past = {module: reached for module, reached in past.items() if reached}
    assert not past, f"past the runtime's facade: {past}"


def test_the_checks_sit_above_the_facade():
    """The checks (miras.checks: end to end, and the compile-only GPU checks) call the rule
    they are handed and import nothing of the facade, which calls them (`MemoryRule.check`)."""
    graph = import_graph(type_checking=True)
    checks = [m for m in graph if _inside(m, "miras.checks")]
    assert {"miras.checks.end_to_end", "miras.checks.gpu_compile"} <= set(checks)
    for module in checks:
        assert "miras.rule" not in _reach(graph, module), module
    assert "miras.checks.end_to_end" in graph["miras.rule"]


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for child in graph[stack.pop()] - seen:
            seen.add(child)
            stack.append(child)
    return seen


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_ir_is_a_leaf_of_the_compiler_and_runtime():
    """miras.ir is plain data: it reaches neither the compiler, the runtime nor the facade."""
    graph = import_graph()
    reached = _reach(graph, "miras.ir")
    banned = [m for m in reached if _inside(m, "miras.compiler") or _inside(m, "miras.runtime")]
    assert not banned and "miras.rule" not in reached, sorted(reached)


def test_the_compiler_never_reaches_the_runtime():
    """spec -> compiler -> IR -> runtime: no compiler module imports, even indirectly, the
    runtime or the MemoryRule facade that joins the two."""
    graph = import_graph()
    for module in [m for m in graph if _inside(m, "miras.compiler")]:
        reached = _reach(graph, module)
        banned = sorted(m for m in reached if _inside(m, "miras.runtime") or m == "miras.rule")
        assert not banned, f"{module} reaches {banned}"


def _cycles_through(graph: dict[str, set[str]], packages: list[str]) -> list[list[str]]:
    """The groups of mutually importing modules that hold a module of `packages`."""
    return [
        members
        for members in _components(graph)
        if any(_inside(m, p) for m in members for p in packages)
    ]


@pytest.mark.parametrize(
    "packages",
    [
        # One Task and one IGNORE, in miras.tasks.base: the checkpoint names the task type
        # from there, not from the training loop that imports the checkpoint.
        pytest.param(["miras.training", "miras.tasks"], id="training"),
        # plots.py draws report_data's types; report.py computes them and calls plots.
        pytest.param(["miras.search"], id="search"),
    ],
)
def test_no_cycle_through_these_packages_even_in_type_checking_imports(packages):
    graph = import_graph(type_checking=True)
    groups = _cycles_through(graph, packages)
    assert not groups, "\n".join(" -> ".join(_shortest_cycle(graph, g)) for g in groups)


def private_imports(package: str) -> list[str]:
    """`importer <- module.name` for each `_`-prefixed name a module of `package` imports from
    another module of the tree (a private module itself, `from a import _b` with a/_b.py, is
    not a name and not counted)."""
    files = module_files()
    found = []
    for module, path in files.items():
        if not _inside(module, package):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _absolute(module, path.name == "__init__.py", node)
            for alias in node.names:
                private = alias.name.startswith("_") and f"{source}.{alias.name}" not in files
                if source in files and private:
                    found.append(f"{module} <- {source}.{alias.name}")
    return found


def test_the_runtime_imports_no_private_names():
    """What two runtime modules share is public (the Triton forms' launch helpers:
    miras.runtime.triton_launch), not one module's private helper reached from another."""
    assert private_imports("miras.runtime") == []


def test_the_derive_layer_sits_below_the_components_and_numerics_below_everything():
    """miras.derive is the symbolic layer below the components: none of its modules imports
    miras.spec or miras.compiler, TYPE_CHECKING imports included; its numerics library
    (torch, math and the standard library) imports nothing of miras, so components, analyses,
    checks and the runtime may all call it."""
    graph = import_graph(type_checking=True)
    derive = [m for m in graph if _inside(m, "miras.derive")]
    assert "miras.derive.numerics" in derive
    for module in derive:
        banned = sorted(
            m for m in graph[module] if _inside(m, "miras.spec") or _inside(m, "miras.compiler")
        )
        assert not banned, f"{module} imports {banned}"
    assert graph["miras.derive.numerics"] == set()
