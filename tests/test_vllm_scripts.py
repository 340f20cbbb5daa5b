"""Scripts written for vLLM run on nanopaged with only their import lines changed.

tests/vllm_scripts/ holds offline scripts in the style of vLLM's examples/offline_inference/basic/,
written against vLLM's API. Each is run here, in this interpreter, after one edit: `vllm` becomes
`nanopaged` on its import lines, and nowhere else (the test checks that no other line names vLLM).
"""
import re
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parent / "vllm_scripts"
IMPORT = re.compile(r"^(from|import) vllm\b")


def on_nanopaged(path: Path) -> str:
    """The script with its import lines pointed at nanopaged, the only change."""
    lines = path.read_text().splitlines(keepends=True)
    assert any(IMPORT.match(line) for line in lines), f"{path.name} imports nothing from vllm"
    changed = [IMPORT.sub(lambda m: f"{m.group(1)} nanopaged", line) for line in lines]
    # the docstring may say "vLLM"; no code line but an import may name the package
    code = [line for line in changed if not IMPORT.match(line) and re.search(r"\bvllm\b", line)]
    assert not code, f"{path.name} names vllm outside its imports: {code}"
    return "".join(changed)


def run_script(path: Path, argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(path), *argv])
    exec(compile(on_nanopaged(path), str(path), "exec"), {"__name__": "__main__", "__file__": str(path)})


@pytest.mark.parametrize("name", ["basic.py", "chat.py", "generate.py", "token_ids.py"])
def test_a_vllm_script_runs_with_only_its_imports_changed(name, tiny_model_dirs, monkeypatch, capsys):
    argv = ["--model", tiny_model_dirs["llama"]]
    if name == "generate.py":
        argv += ["--dtype", "float32", "--max-tokens", "6", "--temperature", "0", "--max-num-seqs", "8"]
    run_script(SCRIPTS / name, argv, monkeypatch)
    printed = capsys.readouterr().out
    expected = {"basic.py": (r"output: '", 4), "chat.py": (r"answer: '", 5), "generate.py": (r"' -> '", 4),
                "token_ids.py": (r"allowed \[", 1)}[name]
    assert len(re.findall(expected[0], printed)) == expected[1], printed


def test_every_script_in_the_folder_is_run():
    assert sorted(p.name for p in SCRIPTS.glob("*.py")) == ["basic.py", "chat.py", "generate.py", "token_ids.py"]
