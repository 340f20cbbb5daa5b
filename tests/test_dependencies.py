"""Dependencies point one way: the block pool and the scheduler import no torch, and the
core never imports an extension (nanopaged/extras/ reaches the core through its hooks)."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "nanopaged"


def imports_of(module: str) -> set[str]:
    """The modules `module` imports when it runs (imports for type checkers only are skipped)."""
    tree = ast.parse((PKG / (module.replace(".", "/") + ".py")).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            node.body = []
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def transitive_imports(module: str) -> set[str]:
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        for name in imports_of(m):
            if name.startswith("nanopaged."):
                sub = name[len("nanopaged."):]
                if sub not in seen:
                    seen.add(sub)
                    todo.append(sub)
            else:
                seen.add(name)
    return seen


def test_block_pool_and_scheduler_import_no_torch():
    for module in ("core.block_pool", "core.scheduler", "core.request"):
        deps = transitive_imports(module)
        assert not any(d == "torch" or d.startswith("torch.") for d in deps), (module, deps)
        assert "transformers" not in deps


def test_scheduler_does_not_import_the_runner_or_models():
    deps = transitive_imports("core.scheduler")
    assert not {"core.model_runner", "models.llama", "core.attention", "core.engine"} & deps


def test_the_core_never_imports_an_extension():
    for path in sorted((PKG / "core").glob("*.py")):
        module = "core." + path.stem
        deps = transitive_imports(module)
        assert not any(d.startswith("extras") for d in deps), (module, sorted(d for d in deps if "extras" in d))
