"""Dependencies point one way: the block pool and the scheduler import no torch, the engine,
token selection, the worker, the CPU annex, the models and the attention backends import no
extension and no entry point, the reference (models, attention) never imports the CPU annex that
replaces it, and no two modules of the package import each other, directly or around a circle."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "nanopaged"
MODULES = {".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__"): p
           for p in PKG.rglob("*.py")}


def imports_of(module: str, type_checking: bool = False) -> set[str]:
    """What `module` imports, anywhere in it (functions included); with type_checking, also the
    imports under `if TYPE_CHECKING:`. `from pkg import sub` counts as importing pkg.sub."""
    tree = ast.parse(MODULES[module].read_text())
    if not type_checking:
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
                node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in MODULES)
    return names


def transitive_imports(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        for name in imports_of(todo.pop()):
            if name not in seen:
                seen.add(name)
                if name in MODULES:
                    todo.append(name)
    return seen


def test_block_pool_and_scheduler_import_no_torch():
    for module in ("nanopaged.core.block_pool", "nanopaged.core.scheduler", "nanopaged.core.request"):
        deps = transitive_imports(module)
        assert not any(d == "torch" or d.startswith("torch.") for d in deps), (module, deps)
        assert "transformers" not in deps


def test_scheduler_does_not_import_the_runner_or_models():
    deps = transitive_imports("nanopaged.core.scheduler")
    assert not {d for d in deps if d.startswith(("nanopaged.worker", "nanopaged.models", "nanopaged.attention",
                                                 "nanopaged.engine"))}, deps


def test_the_layers_below_llm_never_import_an_extension_or_an_entry_point():
    for module in MODULES:
        if module.startswith(("nanopaged.core", "nanopaged.engine", "nanopaged.sample", "nanopaged.worker",
                              "nanopaged.cpu", "nanopaged.models", "nanopaged.attention")):
            bad = sorted(d for d in transitive_imports(module) if d.startswith(("nanopaged.extras", "nanopaged.entrypoints")))
            assert not bad, (module, bad)


def test_no_import_circles_among_the_package_modules():
    """Type-only imports count: a circle of them is still a circle a reader walks."""
    graph = {m: {d for d in imports_of(m, type_checking=True) if d in MODULES and d != m} for m in MODULES}
    # Importing a package's submodule runs the package's __init__ first: that edge is Python's, not ours.
    graph = {m: {d for d in deps if not m.startswith(d + ".")} for m, deps in graph.items()}
    state, circles = {}, []

    def visit(m, stack):
        state[m] = "open"
        for d in sorted(graph[m]):
            if state.get(d) == "open":
                circles.append(stack[stack.index(d):] + [d])
            elif d not in state:
                visit(d, stack + [d])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert not circles, "import circles: " + "; ".join(" -> ".join(c) for c in circles)


def test_the_reference_never_imports_the_cpu_annex_that_replaces_it():
    """models/ and attention/ are what a reader studies; the annex (nanopaged/cpu/) sits above them and
    swaps its layers in after loading. The one name the attention table gives the `cpu` backend is a
    string, imported only when chosen."""
    for module in MODULES:
        if module.startswith(("nanopaged.models", "nanopaged.attention", "nanopaged.core")):
            bad = sorted(d for d in transitive_imports(module) if d.startswith("nanopaged.cpu"))
            assert not bad, (module, bad)
