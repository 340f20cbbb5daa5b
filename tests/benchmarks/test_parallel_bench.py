"""benchmarks/research/parallel.py end to end at a tiny size: every layout's row, its figures in range,
and the greedy tokens of every layout equal to one process's (the benchmark checks and prints it)."""
import pathlib
import re
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks.research import parallel  # noqa: E402

pytestmark = pytest.mark.timeout(900)     # a hang guard: seven LLMs, five of them with two ranks


def test_every_layout_reports_a_row_with_equal_tokens(capsys):
    parallel.main(["--dense", "tiny-qwen3", "--moe", "tiny-olmoe", "--num-requests", "4", "--input-len", "4", "12",
                   "--output-len", "4", "8", "--num-kv-blocks", "64"])
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith("| layout")}
    assert set(rows) == set(parallel.DENSE_LAYOUTS) | set(parallel.MOE_LAYOUTS)
    assert all(row.rstrip().endswith("| yes |") for row in rows.values()), rows
    pipelined = [float(b) for b in re.findall(r"(\d+)%", rows["PP=2, 2 batches"].split("|")[5])]
    assert len(pipelined) == 2 and all(0 <= b <= 100 for b in pipelined)          # one bubble per stage
    for name in ("TP=2", "PP=2, 1 batch", "EP=2"):
        shares = [int(x) for x in re.findall(r"\((\d+)%\)", rows[name].split("|")[2])]
        assert len(shares) == 2 and all(s < 100 for s in shares), name         # each rank holds less than all
        assert float(rows[name].split("|")[3].replace(",", "")) > 0, name       # bytes crossed ranks
