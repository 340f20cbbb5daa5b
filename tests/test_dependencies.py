"""Dependencies point one way: the block pool and the scheduler import no torch."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "nanopaged"


def imports_of(module: str) -> set[str]:
    tree = ast.parse((PKG / (module.replace(".", "/") + ".py")).read_text())
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
    for module in ("block_pool", "scheduler", "request"):
        deps = transitive_imports(module)
        assert not any(d == "torch" or d.startswith("torch.") for d in deps), (module, deps)
        assert "transformers" not in deps


def test_scheduler_does_not_import_the_runner_or_models():
    deps = transitive_imports("scheduler")
    assert not {"model_runner", "models", "attention", "engine"} & deps
