"""`bench.py --workload structured` on a tiny model: it runs, both runs generate the same tokens, and
every figure it prints is there and in range (the figures themselves: docs/10_structured_outputs.md)."""
import pathlib
import sys

import pytest

pytest.importorskip("xgrammar", reason="the structured extra: pip install -e '.[structured]'")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import bench  # noqa: E402
from benchmarks.structured import COMPILED  # noqa: E402


def test_structured_workload_smoke(tiny_model_dirs, capsys):
    r = bench.main(["--workload", "structured", "--model", tiny_model_dirs["llama"], "--num-requests", "4",
                    "--input-len", "4", "8", "--output-len", "4", "8", "--num-kv-blocks", "64"])
    plain, constrained = r["plain"], r["constrained"]
    assert plain["output_tokens"] == constrained["output_tokens"] > 0       # like for like: the same tokens
    assert plain["mask_s"] == 0 and constrained["mask_s"] > 0
    assert 0 < constrained["mask_and_matcher_share"] < 1 and r["target_met"] == (r["overhead_per_token"] <= 0.10)
    assert set(r["compile"]) == set(COMPILED)                               # every constraint, cold and cached
    assert all(t["cold_s"] > 0 and t["cached_s"] >= 0 for t in r["compile"].values())
    assert "per output token (target <= 10%" in capsys.readouterr().out
