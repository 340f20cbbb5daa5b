"""llama.cpp on bench.py's trace and prompts, run in its own environment (scripts/setup_llamacpp_peer.sh)."""
from __future__ import annotations

import json
import math
import sys
import time

from benchmarks.decode_speed import decode_tokens_per_s


def main(path_in: str, path_out: str) -> None:
    job = json.loads(open(path_in).read())
    import llama_cpp
    llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=job["threads"],
                          n_batch=512, logits_all=True, verbose=False, seed=0)
    never_stop = {job["eos"]: -float("inf")}      # ignore_eos, as every engine of the bench runs

    def generate(prompt: list[int], n: int) -> int:
        llm.reset()
        out = llm.create_completion(prompt=prompt, max_tokens=n, temperature=0.0, logit_bias=never_stop)
        return out["usage"]["completion_tokens"]

    result = {"version": llama_cpp.__version__}
    one = job["single_stream"]           # generate() resets the context: no call reuses another's
    result["decode_tokens_per_s"] = decode_tokens_per_s([lambda n: generate(one["prompt"], n)],
                                                        one["output_tokens"])[0]
    if job.get("prompts"):
        start, produced = time.perf_counter(), 0
        for prompt, n in zip(job["prompts"], job["output_lens"]):
            produced += generate(prompt, n)
        result |= {"wall_s": time.perf_counter() - start, "output_tokens": produced}
    if job.get("perplexity_ids"):
        result["perplexity"] = perplexity(llm, job["perplexity_ids"])
    open(path_out, "w").write(json.dumps(result))


def perplexity(llm, ids: list[int]) -> float:
    """exp(mean negative logprob of each token given the ones before it), one pass over the text."""
    llm.reset()
    llm.eval(ids)
    nll = 0.0
    for i in range(len(ids) - 1):
        row = llm.scores[i]
        top = max(row)
        log_z = top + math.log(sum(math.exp(x - top) for x in row))
        nll -= row[ids[i + 1]] - log_z
    return math.exp(nll / (len(ids) - 1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
