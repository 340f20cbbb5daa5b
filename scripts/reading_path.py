"""Print the reading path's line counts, or write them into README.md and docs/00_how_to_read.md.

    python scripts/reading_path.py           # the counts, file by file, and the totals
    python scripts/reading_path.py --write   # update the two tables and their totals in place

The list of files and the budgets are tests/test_reading_path.py's; that test fails when a
table's counts are not the files' own.
"""
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_reading_path import READING_PATH, THREE_PARTS, lines  # noqa: E402

DOCS = [ROOT / "README.md", ROOT / "docs" / "00_how_to_read.md"]


def write(doc: Path, total: int, parts: int) -> None:
    text = doc.read_text()
    for path in READING_PATH:
        text = re.sub(rf"^(\|\s*\d+\s*\|\s*`{re.escape(path)}`\s*\|\s*)\d+", rf"\g<1>{lines(path)}", text,
                      flags=re.MULTILINE)
    text = re.sub(r"[\d,]+ lines in \d+ files", f"{total:,} lines in {len(READING_PATH)} files", text)
    text = re.sub(r"the three parts: [\d,]+ lines", f"the three parts: {parts:,} lines", text)
    doc.write_text(text)


def main() -> None:
    for path in READING_PATH:
        print(f"{lines(path):5d}  {path}")
    total = sum(lines(p) for p in READING_PATH)
    parts = sum(lines(p) for files in THREE_PARTS.values() for p in files)
    print(f"{total:,} lines in {len(READING_PATH)} files; the three parts {parts:,} lines")
    if "--write" in sys.argv[1:]:
        for doc in DOCS:
            write(doc, total, parts)


if __name__ == "__main__":
    main()
