"""bench.py --workload disk-prefix runs end to end on the tiny model: a smoke test, not a measurement. It checks
that the restart really restarts (the warm process reads what the cold one wrote, and computes less), and that
every figure the report prints is there and is the kind of number it claims to be."""
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import bench  # noqa: E402


def test_the_disk_prefix_workload_restarts_reads_and_reports(tiny_model_dirs, tmp_path):
    out = tmp_path / "disk.json"
    result = bench.main(["--workload", "disk-prefix", "--model", tiny_model_dirs["llama"], "--num-requests", "10",
                         "--prefix-len", "64", "--input-len", "4", "12", "--disk-lengths", "32,128",
                         "--dtype", "float32", "--num-kv-blocks", "128", "--json", str(out)])
    assert json.loads(out.read_text())["workload"] == "disk-prefix"
    cold, warm = result["restart"]["cold"], result["restart"]["warm"]
    assert cold["blocks_written"] >= 5 * 64 // 16 and cold["blocks_read"] == 0
    assert warm["blocks_read"] >= 5 * 64 // 16 and warm["blocks_written"] == 0
    assert warm["prompt_tokens_computed"] < cold["prompt_tokens_computed"]
    for run in (cold, warm):
        assert 0 < run["all"]["p50_ms"] <= run["all"]["p99_ms"]
    assert set(result["tiers"]["lengths"]) == {32, 128}
    assert all(v > 0 for row in result["tiers"]["lengths"].values() for v in row.values())
    write = result["write_cost"]
    assert write["on"]["blocks_written"] > 0 and write["off"]["output_tokens_per_s"] > 0 and write["ratio"] > 0
