"""The reading path is what `LLM.generate` runs, counted honestly, file by file.

A student follows one request from `LLM.generate` down to the attention that reads K/V
through a block table, on the reference kernels (the torch attention backend, the model's own
torch ops, nn.Linear: `cpu_kernels="reference"`, `cpu_linear="reference"`); the fast paths beside
them are imported only when chosen. These tests load a model and generate in a fresh interpreter, list
every nanopaged module that call imported, and hold that list to the one the README and
docs/00_how_to_read.md print, in reading order, with each file's line count (comments and
docstrings included). Code `generate` never runs (beam search, tensor parallelism, the
server, the demo model's converter, the Triton and flash backends) is not imported and not
counted. A change that adds a file to the path, or lines to it, updates the two tables.
"""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# In reading order: the three parts the design card names, the engine step and `LLM`, then what
# they use, in the order a request meets it, then the packages' __init__ files (their indexes).
READING_PATH = [
    "nanopaged/core/block_pool.py", "nanopaged/core/request.py", "nanopaged/core/scheduler.py",
    "nanopaged/worker/model_runner.py", "nanopaged/attention/metadata.py", "nanopaged/attention/torch_backend.py",
    "nanopaged/models/llama.py", "nanopaged/engine/llm_engine.py", "nanopaged/llm.py",
    "nanopaged/config.py", "nanopaged/validation.py", "nanopaged/cpu/features.py", "nanopaged/attention/backends.py",
    "nanopaged/models/config.py", "nanopaged/models/loader.py", "nanopaged/cpu/linear.py",
    "nanopaged/sampling_params.py",
    "nanopaged/engine/input_processor.py", "nanopaged/sample/sampler.py", "nanopaged/sample/parallel_sampling.py",
    "nanopaged/engine/output_processor.py", "nanopaged/engine/detokenizer.py", "nanopaged/outputs.py",
    "nanopaged/engine/stats.py", "nanopaged/cpu/thread_governor.py", "nanopaged/logger.py",
    "nanopaged/__init__.py", "nanopaged/core/__init__.py", "nanopaged/engine/__init__.py",
    "nanopaged/worker/__init__.py", "nanopaged/attention/__init__.py", "nanopaged/models/__init__.py",
    "nanopaged/extras/__init__.py",
]
LINE_BUDGET = 3700  # 3,400 until quantization, the structured-output hooks, decode grouping (issues 28, 27, 23); 3,500 until speculative decoding (26); 3,600 until the CPU fast paths' choice (cpu_kernels, cpu_linear="dpbf16": 23)
# The design card's three parts: the block manager, the scheduler, the model runner with the
# torch attention it calls (the metadata it builds, the reference backend).
THREE_PARTS = {
    "block manager": ["nanopaged/core/block_pool.py", "nanopaged/core/request.py"],
    "scheduler": ["nanopaged/core/scheduler.py"],
    "model runner + torch attention": ["nanopaged/worker/model_runner.py", "nanopaged/attention/metadata.py",
                                       "nanopaged/attention/torch_backend.py"],
}
THREE_PARTS_BUDGET = 1000
# Names that would mean an extension's logic lives in the block pool, the scheduler or the engine step.
EXTENSION_WORDS = ("beam", "graph", "stats", "statistic", "bench", "triton", "flash", "demo")
CORE_STEP = ["nanopaged/core/block_pool.py", "nanopaged/core/request.py", "nanopaged/core/scheduler.py",
             "nanopaged/engine/llm_engine.py", "nanopaged/worker/model_runner.py"]

PROGRAM = """
import json, sys
from nanopaged import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", attention_backend="torch", cpu_kernels="reference", cpu_linear="reference",
          num_kv_blocks=16)
llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=3), use_tqdm=False)
print(json.dumps(sorted(m.__file__ for name, m in sys.modules.items() if name.split(".")[0] == "nanopaged")))
"""


def lines(path: str) -> int:
    return len((ROOT / path).read_text().splitlines())


def imported_by_generate(model_dir: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", PROGRAM, model_dir], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    files = json.loads(done.stdout.splitlines()[-1])
    return sorted(str(Path(f).resolve().relative_to(ROOT)) for f in files)


def expected_table() -> str:
    rows = [f"| {i} | `{p}` | {lines(p)} |" for i, p in enumerate(READING_PATH, 1)]
    return "\n".join(rows) + f"\ntotal {sum(lines(p) for p in READING_PATH)}"


def test_the_reading_path_is_exactly_what_generate_imports(tiny_model_dirs):
    assert imported_by_generate(tiny_model_dirs["llama"]) == sorted(READING_PATH)


def test_the_reading_path_holds_at_most_its_budget():
    counts = {p: lines(p) for p in READING_PATH}
    assert sum(counts.values()) <= LINE_BUDGET, f"the reading path holds {sum(counts.values())} lines: {counts}"


def test_the_three_parts_hold_about_1000_lines():
    counts = {part: sum(lines(p) for p in files) for part, files in THREE_PARTS.items()}
    assert sum(counts.values()) <= THREE_PARTS_BUDGET, counts


def table_rows(text: str) -> list[tuple[str, int]]:
    """The rows `| n | `nanopaged/...py` | lines | ...` of a document's reading-path table."""
    return [(m.group(1), int(m.group(2)))
            for m in re.finditer(r"^\|\s*\d+\s*\|\s*`(nanopaged/[\w/]+\.py)`\s*\|\s*(\d+)\s*\|", text, re.MULTILINE)]


def test_readme_and_chapter_0_print_the_path_with_each_files_count():
    want = [(p, lines(p)) for p in READING_PATH]
    total = sum(n for _, n in want)
    for doc in (ROOT / "README.md", ROOT / "docs" / "00_how_to_read.md"):
        text = doc.read_text()
        assert table_rows(text) == want, (f"{doc.name}: the reading-path table should read (python "
                                          f"scripts/reading_path.py --write updates it)\n{expected_table()}")
        assert f"{total:,} lines" in text, f"{doc.name} should state the total, {total:,} lines"
        assert f"{len(READING_PATH)} files" in text, f"{doc.name} should state the file count, {len(READING_PATH)}"
        parts = sum(lines(p) for files in THREE_PARTS.values() for p in files)
        assert f"the three parts: {parts:,} lines" in text, f"{doc.name} should say: the three parts: {parts:,} lines"


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


def test_no_extension_logic_in_the_core_step():
    found = {}
    for path in CORE_STEP:
        bad = sorted(n for n in identifiers(ROOT / path) if any(w in n.lower() for w in EXTENSION_WORDS))
        if bad:
            found[path] = bad
    assert not found, f"extension code in the core step: {found}"
