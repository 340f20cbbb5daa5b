"""Every package's __init__.py is the index of its folder: its docstring names each .py file of the
folder and each subpackage (`name.py` or `name/` at the start of an indented line, then a few words),
so a reader who opens a folder sees every room in it, and names nothing that is not there."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent for p in (ROOT / "nanopaged").rglob("__init__.py"))
ENTRY = re.compile(r"^\s+([\w.]+\.py|\w+/)\s")         # "    block_pool.py   the KV cache in ..."


def indexed(package: Path) -> set[str]:
    """The names the package's docstring lists, as `name.py` and `name/`."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False) or ""
    return {m.group(1) for m in map(ENTRY.match, doc.splitlines()) if m}


def present(package: Path) -> set[str]:
    """The folder's .py files (__init__.py aside) and subpackages, as `name.py` and `name/`."""
    return ({p.name for p in package.glob("*.py") if p.name != "__init__.py"}
            | {f"{p.parent.name}/" for p in package.glob("*/__init__.py")})


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_index_names_every_file_of_its_folder(package):
    missing = sorted(present(package) - indexed(package))
    assert not missing, f"{package.relative_to(ROOT)}/__init__.py's docstring does not list {missing}"


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_each_package_index_names_nothing_its_folder_lacks(package):
    stale = sorted(name for name in indexed(package) if not (package / name).exists())
    assert not stale, f"{package.relative_to(ROOT)}/__init__.py's docstring lists {stale}, not in the folder"


def test_the_index_rule_sees_every_package_and_reads_an_entry():
    """The rule above would pass vacuously if it found no packages or parsed no entries."""
    assert {"nanopaged", "core", "cpu", "entrypoints", "openai", "tensor_parallel"} <= {p.name for p in PACKAGES}
    assert {"block_pool.py", "request.py", "scheduler.py", "state_pages.py",
            "encoder_cache.py"} == indexed(ROOT / "nanopaged" / "core")
