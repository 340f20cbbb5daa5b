"""CTranslate2 (OpenNMT's inference engine) on bench.py's trace, run in its own environment
(scripts/setup_ctranslate2_peer.sh)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

from benchmarks.trace import WARMUP_PROMPT

# The compute types "auto" tries, best first: int8 weights, then the activations' type.
CHOICE = ("int8_bfloat16", "int8_float32", "int8", "bfloat16", "float32")


def main(path_in: str, path_out: str) -> None:
    job = json.loads(open(path_in).read())
    import ctranslate2
    supported = set(ctranslate2.get_supported_compute_types("cpu"))
    wanted = [choose_compute_type(c, supported) for c in job["compute_types"]]
    runs = [run_trace(ctranslate2, job, c) for c in dict.fromkeys(wanted)]   # in order, once each
    result = {"version": ctranslate2.__version__, "supported": sorted(supported), "runs": runs}
    open(path_out, "w").write(json.dumps(result))


def choose_compute_type(requested: str, supported: set[str]) -> str:
    """`requested`, or for "auto" the first of CHOICE the CPU supports; a ValueError names the rest."""
    if requested == "auto":
        return next((c for c in CHOICE if c in supported), "float32")
    if requested not in supported:
        raise ValueError(f"compute type {requested!r}: this CPU supports {', '.join(sorted(supported))} (or auto)")
    return requested


def run_trace(ctranslate2, job: dict, compute_type: str) -> dict:
    """The trace at one compute type: converted (once), loaded, warmed up, then timed."""
    folder = converted(job["model"], Path(job["cache_dir"]), compute_type, ctranslate2)
    load = time.perf_counter()
    generator = ctranslate2.Generator(str(folder), device="cpu", compute_type=compute_type,
                                      intra_threads=job["threads"], inter_threads=1)
    load = time.perf_counter() - load
    vocab = vocabulary(folder)
    generate_exact(generator, vocab, [WARMUP_PROMPT["prompt_token_ids"]], [4], job["max_batch_size"])
    start = time.perf_counter()
    outputs, num_calls = generate_exact(generator, vocab, job["prompts"], job["output_lens"], job["max_batch_size"])
    wall = time.perf_counter() - start
    return {"compute_type": generator.compute_type, "wall_s": wall, "output_tokens": sum(map(len, outputs)),
            "num_calls": num_calls, "load_s": load}


def generate_exact(generator, vocab: list[str], prompts: list[list[int]], output_lens: list[int],
                   max_batch_size: int) -> tuple[list[list[int]], int]:
    """Each prompt's greedy continuation of exactly its own length, in calls of at most
    `max_batch_size` prompts; the outputs' token ids and the number of calls."""
    starts = range(0, len(prompts), max_batch_size)
    outputs = [out for i in starts for out in one_call(generator, [token_strings(p, vocab) for p in
               prompts[i:i + max_batch_size]], output_lens[i:i + max_batch_size])]
    produced = [len(o) for o in outputs]
    if produced != list(output_lens):
        wrong = [(i, n, want) for i, (n, want) in enumerate(zip(produced, output_lens)) if n != want]
        raise RuntimeError(f"ctranslate2 produced other lengths than asked (request, got, asked): {wrong[:5]}")
    return outputs, len(starts)


def one_call(generator, prompts: list[list[str]], lens: list[int]) -> list[list[int]]:
    """One generate_batch call: no end token (ignore_eos), max_length its longest request, and a
    callback that ends each row once it has its own length (True stops that row, this token kept)."""
    done = [0] * len(lens)

    def stop_at_own_length(step) -> bool:
        done[step.batch_id] += 1
        return done[step.batch_id] >= lens[step.batch_id]

    results = generator.generate_batch(prompts, max_length=max(lens), end_token=[], include_prompt_in_result=False,
                                       sampling_topk=1, callback=stop_at_own_length)
    return [list(r.sequences_ids[0]) for r in results]


def token_strings(ids: list[int], vocab: list[str]) -> list[str]:
    """Token ids as the strings `generate_batch` takes (the converted model's vocabulary, in id order)."""
    if max(ids) >= len(vocab):
        raise ValueError(f"token id {max(ids)} is outside the converted vocabulary of {len(vocab)} tokens")
    return [vocab[i] for i in ids]


def vocabulary(folder: Path) -> list[str]:
    """The converted model's tokens in id order (vocabulary.json; older converters wrote a .txt)."""
    if (folder / "vocabulary.json").is_file():
        return json.loads((folder / "vocabulary.json").read_text())
    return (folder / "vocabulary.txt").read_text().split("\n")[:-1]


def converted(model_dir: str, cache: Path, compute_type: str, ctranslate2) -> Path:
    """The model folder converted for `compute_type`, made once (into a temporary folder, then renamed),
    named after the source folder, its weights and the CTranslate2 version."""
    src = Path(model_dir).resolve()
    weights = sorted(src.glob("*.safetensors"))
    stamp = hashlib.sha256(repr([str(src), ctranslate2.__version__] + [
        (w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights]).encode()).hexdigest()[:10]
    folder = cache / f"{src.name}-{stamp}-{compute_type}"
    if (folder / "model.bin").is_file():
        return folder
    print(f"ctranslate2 peer: converting {src} for {compute_type} into {folder} (once)", file=sys.stderr)
    from ctranslate2.converters import TransformersConverter
    tmp = folder.with_name(folder.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    TransformersConverter(str(src)).convert(str(tmp), quantization=compute_type, force=True)
    shutil.rmtree(folder, ignore_errors=True)
    os.rename(tmp, folder)
    return folder


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
