"""Print both reading paths' line counts, or write them into docs/00_how_to_read.md (and any copy).

    python scripts/reading_path.py           # both paths, file by file, and their totals
    python scripts/reading_path.py --write   # update the tables and totals in place, wherever printed

The reference path is what `LLM.generate` runs on the reference kernels (torch everywhere); the
default path is what it runs with default settings on a CPU with bfloat16 matrix units: the
reference path, the CPU annex's fast layers, and the C++ they compile. The lists and the budgets
are tests/test_reading_path.py's; that test fails when a table's counts are not the files' own,
and checks which path `auto` picks on the host it runs on.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_reading_path import (DEFAULT_PATH, LOADED, READING_PATH, REPLACED, TABLES, THREE_PARTS,  # noqa: E402
                               documents_printing_the_paths, lines, total)


def write(doc: Path) -> None:
    text = doc.read_text()
    for path in TABLES:
        text = re.sub(rf"^(\|\s*\d+\s*\|\s*`{re.escape(path)}`\s*\|\s*)\d+", rf"\g<1>{lines(path)}", text,
                      flags=re.MULTILINE)
    for name, paths in (("reference path", READING_PATH), ("default path", DEFAULT_PATH),
                        ("loaded, run only when installed", LOADED)):
        text = re.sub(rf"{name}: [\d,]+ lines in \d+ files", f"{name}: {total(paths):,} lines in "
                      f"{len(paths)} files", text)
    parts = sum(lines(p) for files in THREE_PARTS.values() for p in files)
    text = re.sub(r"the three parts: [\d,]+ lines", f"the three parts: {parts:,} lines", text)
    doc.write_text(text)


def main() -> None:
    print("reference path:")
    for path in READING_PATH:
        print(f"{lines(path):5d}  {path}")
    print(f"default path: the reference path's files but {', '.join(REPLACED)}, and")
    for path in TABLES[len(READING_PATH):len(TABLES) - len(LOADED)]:
        print(f"{lines(path):5d}  {path}")
    print("imported by every call, run only when installed or chosen:")
    for path in LOADED:
        print(f"{lines(path):5d}  {path}")
    parts = sum(lines(p) for files in THREE_PARTS.values() for p in files)
    print(f"reference path: {total(READING_PATH):,} lines in {len(READING_PATH)} files; the three parts {parts:,} lines")
    print(f"default path: {total(DEFAULT_PATH):,} lines in {len(DEFAULT_PATH)} files (C++ included)")
    print(f"loaded, run only when installed: {total(LOADED):,} lines in {len(LOADED)} files")
    if "--write" in sys.argv[1:]:
        for doc in documents_printing_the_paths():
            write(ROOT / doc)


if __name__ == "__main__":
    main()
