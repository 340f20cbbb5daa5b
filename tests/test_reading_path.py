"""The reading path stays what the README promises: seven files, at most 1,200 lines, no extension code.

`nanopaged/core/` is what a student reads to understand PagedAttention end to end. If a
change pushes it past the budget, or threads an extension's logic into it, these fail:
the change belongs in an extension behind a hook (docs/00_how_to_read.md, "Around the core").
"""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORE = ROOT / "nanopaged" / "core"
READING_PATH = ["block_pool.py", "request.py", "scheduler.py", "attention.py", "model_runner.py",
                "engine.py", "llm.py"]
LINE_BUDGET = 1200
# Names that would mean an extension's logic lives in the core (its comments may name them).
EXTENSION_WORDS = ("beam", "graph", "stats", "statistic", "bench", "triton", "flash", "demo")


def core_files():
    return sorted(CORE.glob("*.py"))


def test_the_core_folder_holds_exactly_the_reading_path():
    assert sorted(p.name for p in core_files()) == sorted(READING_PATH + ["__init__.py"])


def test_the_reading_path_holds_at_most_1200_lines():
    counts = {p.name: len(p.read_text().splitlines()) for p in core_files()}
    total = sum(counts.values())
    assert total <= LINE_BUDGET, f"nanopaged/core/ holds {total} lines > {LINE_BUDGET}: {counts}"


def test_readme_and_chapter_0_name_every_file_of_the_reading_path():
    for doc in (ROOT / "README.md", ROOT / "docs" / "00_how_to_read.md"):
        text = doc.read_text()
        missing = [f for f in READING_PATH if f"nanopaged/core/{f}" not in text]
        assert not missing, f"{doc.name} does not name {missing}"


def identifiers(path: Path) -> set[str]:
    """The names the code defines, imports or keeps on `self` (not comments, not other libraries' API)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_extension_logic_in_the_core():
    found = {}
    for path in core_files():
        bad = sorted(n for n in identifiers(path) if any(w in n.lower() for w in EXTENSION_WORDS))
        if bad:
            found[path.name] = bad
    assert not found, f"extension code in the core: {found}"
