"""vLLM's CPU engine on bench.py's trace, run in its own environment (scripts/setup_vllm_peer.sh).

    VENV/bin/python benchmarks/vllm_peer.py IN.json OUT.json

bench.py writes IN.json (the model folder, the trace's prompts and output lengths, the engine
settings nanopaged resolved: dtype, KV bytes, max_num_seqs, token budget, max_model_len) and reads
OUT.json back. vLLM pins other library versions than nanopaged's, so it cannot share bench.py's
process; this file imports nothing of nanopaged or of benchmarks/, only vLLM and the standard
library, and vLLM only inside main(), so bench.py can import it to find it. The timing rules are
bench.py's: one warm-up, then output tokens / wall time of one generate over the whole trace
(greedy, ignore_eos); one request at a time, decode tokens/s = (N - 1) / (time(N) - time(1)).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time

WARMUP = [list(range(3, 19))]     # benchmarks/trace.py: WARMUP_PROMPT
REPEATS = 3


def main(path_in: str, path_out: str) -> None:
    job = json.loads(open(path_in).read())
    # The CPU backend sizes its KV cache from this variable (GiB); kv_cache_memory_bytes says the same.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, math.ceil(job["kv_cache_bytes"] / 2**30))))
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    load = time.perf_counter()
    # Its own block size: vLLM's CPU attention takes only multiples of 32 (nanopaged's default is 16).
    llm = LLM(job["model"], dtype=job["dtype"], max_num_seqs=job["max_num_seqs"],
              max_num_batched_tokens=job["max_num_batched_tokens"], max_model_len=job["max_model_len"],
              kv_cache_memory_bytes=job["kv_cache_bytes"], enable_prefix_caching=True, seed=0)
    load = time.perf_counter() - load

    def generate(prompts, lens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
        return llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    generate(WARMUP, [4])
    start = time.perf_counter()
    outs = generate(job["prompts"], job["output_lens"])
    wall = time.perf_counter() - start
    result = {"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
              "load_s": load, "vllm": vllm.__version__,
              "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
              "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
    one = job.get("single_stream")
    if one:
        result["decode_tokens_per_s"] = decode_tokens_per_s(generate, one["prompt"], one["output_tokens"])
    open(path_out, "w").write(json.dumps(result))


def decode_tokens_per_s(generate, prompt: list[int], n: int) -> float:
    """Best of REPEATS: (n - 1) new tokens over the time n tokens take beyond one (no prefix caching
    gain: the prompt is computed in both, as nanopaged's single-stream run does with caching off)."""
    generate([prompt], [n])
    best = 0.0
    for i in range(REPEATS):                   # a first token of its own each time: no prefix-cache hit
        t0 = time.perf_counter()
        generate([[100 + 2 * i] + prompt[1:]], [1])
        t1 = time.perf_counter()
        generate([[101 + 2 * i] + prompt[1:]], [n])
        t2 = time.perf_counter()
        best = max(best, (n - 1) / max((t2 - t1) - (t1 - t0), 1e-9))
    return best


if __name__ == "__main__":      # vLLM's LLM must be created under the main guard (it spawns workers)
    main(sys.argv[1], sys.argv[2])
