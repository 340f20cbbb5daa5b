"""The course text cannot drift from the code: every example in docs/ runs here.

Each ```python block of docs/*.md (benchmarks.md aside: its examples are shell commands
that run for minutes) is executed on its own, in a fresh namespace. A block that uses the
name `MODEL` gets the folder of a tiny random Llama model (the `tiny_model_dirs` fixture);
the chapters say "MODEL: any model folder, e.g. nanopaged.DEMO_MODEL". Blocks marked
```text or ```bash are not run. The examples hold their own asserts, so they show the rule
and check it at once.

Three more checks keep the pointers honest: every `nanopaged/<file>.py: Name` a chapter cites
names a class or function defined in that file (and every `nanopaged/.../<file>.cpp: name` a C++
function or struct defined there), every relative link points at a file, and
every `nanopaged/...` (or `tests/`, `benchmarks/`, `scripts/`, `docs/`) path the text names exists.
"""
import ast
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
NOT_RUN = {"benchmarks.md"}          # shell commands only, minutes each (docs/07_benchmarks.md explains them)
CHAPTERS = sorted(p for p in DOCS.glob("*.md") if p.name not in NOT_RUN)

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
CITATION = re.compile(r"`(nanopaged/[\w/]+\.py): ([\w.]+)`")
CPP_CITATION = re.compile(r"`(nanopaged/[\w/]+\.(?:cpp|h)): (\w+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def python_blocks():
    for path in CHAPTERS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            if m.group(1) == "python":
                line = text.count("\n", 0, m.start()) + 1
                yield pytest.param(path, line, m.group(2), id=f"{path.name}:{line}")


@pytest.mark.parametrize("path, line, source", list(python_blocks()))
def test_example_runs(path, line, source, request):
    namespace = {"__name__": f"docs_example_{path.stem}_{line}"}
    if re.search(r"\bMODEL\b", source):
        namespace["MODEL"] = request.getfixturevalue("tiny_model_dirs")["llama"]
    code = compile(source, f"{path.relative_to(ROOT)}:{line}", "exec")
    exec(code, namespace)


def test_every_chapter_has_an_example():
    numbered = {p.name for p in CHAPTERS if p.name[0].isdigit()}
    with_examples = {param.values[0].name for param in python_blocks()}
    assert numbered and numbered <= with_examples, numbered - with_examples


def defined_names(py_file: Path) -> set[str]:
    """Top-level classes/functions/assignments and Class.method names of a module."""
    tree = ast.parse(py_file.read_text())
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        names.add(f"{node.name}.{item.name}")
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        names.add(f"{node.name}.{item.target.id}")
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize("path", CHAPTERS + [ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_functions_exist(path):
    missing = []
    for file, name in CITATION.findall(path.read_text()):
        source = ROOT / file
        if not source.is_file() or name not in defined_names(source):
            missing.append(f"{file}: {name}")
    assert not missing, f"{path.name} cites names that do not exist: {missing}"


def defined_in_cpp(source: Path, name: str) -> bool:
    """A struct, class or enum of that name, or a function defined (not only declared) at the top of
    a line: `torch::Tensor name(...` with no `;` after it on that line."""
    text = source.read_text()
    return bool(re.search(rf"\b(?:struct|class|enum class)\s+{name}\b", text)
                or re.search(rf"^[\w:<>,*& ]*\b{name}\s*\([^;]*$", text, re.MULTILINE))


@pytest.mark.parametrize("path", CHAPTERS + [ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_cpp_functions_exist(path):
    missing = [f"{file}: {name}" for file, name in CPP_CITATION.findall(path.read_text())
               if not (ROOT / file).is_file() or not defined_in_cpp(ROOT / file, name)]
    assert not missing, f"{path.name} cites C++ names that are not defined there: {missing}"


@pytest.mark.parametrize("path", CHAPTERS + [ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    broken = [target for target in LINK.findall(path.read_text())
              if "://" not in target and not (path.parent / target).exists()]
    assert not broken, f"{path.name} links to missing files: {broken}"


def test_the_kv_cache_size_command_of_chapter_1(tmp_path, capsys):
    """`python -m nanopaged.entrypoints.kv_cache_size config.json --dtype bfloat16 --tokens 8192`."""
    from nanopaged.entrypoints.kv_cache_size import main
    config = {"architectures": ["Qwen2ForCausalLM"], "hidden_size": 8192, "num_attention_heads": 64,
              "num_key_value_heads": 8, "num_hidden_layers": 80, "intermediate_size": 29568,
              "vocab_size": 152064}
    (tmp_path / "config.json").write_text(json.dumps(config))
    main([str(tmp_path / "config.json"), "--dtype", "bfloat16", "--tokens", "8192"])
    printed = capsys.readouterr().out
    assert "327,680 bytes" in printed and "2.500 GiB" in printed
    with pytest.raises(SystemExit):                     # a bad path is a usage error, not a traceback
        main([str(tmp_path / "missing.json")])
    assert "no config.json at" in capsys.readouterr().err


PATH = re.compile(r"(?<![\w/.~$-])((?:nanopaged|tests|benchmarks|scripts|docs)/[\w/.-]*\w)(?![\w*{])")


@pytest.mark.parametrize("path", sorted(DOCS.glob("*.md")) + [ROOT / "README.md"], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_the_docs_mention_exists(path):
    """Every `nanopaged/...`, `tests/...`, `benchmarks/...`, `scripts/...` or `docs/...` path in the
    text names a real file or folder of the checkout."""
    missing = sorted({p for p in PATH.findall(path.read_text()) if not (ROOT / p).exists()})
    assert not missing, f"{path.name} mentions paths that do not exist: {missing}"


# The front door and the results page stay pages, not manuals (issue 52): reference text goes to docs/.
PAGE_LIMITS = {"README.md": 150, "docs/benchmarks.md": 350}


@pytest.mark.parametrize("page, limit", PAGE_LIMITS.items())
def test_the_front_door_and_the_results_page_stay_short(page, limit):
    lines = len((ROOT / page).read_text().splitlines())
    assert lines <= limit, f"{page} has {lines} lines, over its {limit}: move reference text into docs/"
