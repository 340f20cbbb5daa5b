"""bench.py --workload multimodal: chat requests of a short question and one image, the images drawn from a pool
smaller than the trace so that several requests share one; nanopaged and vLLM's CPU build on the same folder
(random weights at SmolVLM-256M's shape unless --model names one) and the same messages, each after a warm-up
conversation with an image of its own: out tok/s, each request's time from the call's start to its first token,
and nanopaged's encoder counts (a shared image is encoded once: encoder calls = distinct images)."""
from __future__ import annotations

import base64
import io
import random
import statistics
import time

import numpy as np
import torch
from PIL import Image

from benchmarks.hooks import observing
from benchmarks.moe import release_memory
from benchmarks.nanopaged_run import greedy, resolved_settings
from benchmarks.peers import run_vllm_side, vllm_job
from nanopaged import LLM

# (width, height): at SmolVLM's processing (the longest edge to 2,048 pixels, then 512-pixel tiles) grids of
# 4 x 4, 4 x 2 and 4 x 1 tiles, each with the whole image as one more. The image follows its question, so the
# prefix cache cannot spare a shared image's work: only the encoder cache can.
IMAGE_SIZES = ((640, 640), (640, 320), (640, 160))
QUESTIONS = ("What is in this image?", "Describe the picture in one sentence.", "What colours do you see?",
             "Is there any text in the image?", "Where might this have been taken?")


def random_image(rng: np.random.Generator, size: tuple[int, int]) -> Image.Image:
    """Seeded colour waves with a little noise: deterministic, and no two alike."""
    w, h = size
    y, x = np.mgrid[0:h, 0:w] / max(w, h)
    waves = [np.sin(2 * np.pi * (fx * x + fy * y) + phase) for fx, fy, phase in rng.uniform(0, 8, (3, 3))]
    pixels = 127.5 * (1 + np.stack(waves, -1)) + rng.normal(0, 4, (h, w, 3))
    return Image.fromarray(pixels.clip(0, 255).astype(np.uint8))


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def conversation(question: str, url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": question},
                                         {"type": "image_url", "image_url": {"url": url}}]}]


def chat_trace(num_requests: int, num_images: int, seed: int) -> tuple[list, list[int], list]:
    """The conversations, the pool index of each one's image (every image used once, the rest drawn at random,
    shuffled) and the warm-up conversation (an image of its own)."""
    rng, pixels = random.Random(seed), np.random.default_rng(seed)
    pool = [data_url(random_image(pixels, IMAGE_SIZES[i % len(IMAGE_SIZES)])) for i in range(num_images + 1)]
    which = list(range(num_images)) + [rng.randrange(num_images) for _ in range(num_requests - num_images)]
    rng.shuffle(which)
    return [conversation(rng.choice(QUESTIONS), pool[i]) for i in which], which, conversation(QUESTIONS[0], pool[-1])


def ttft_figures(seconds: list[float]) -> dict:
    return {"mean_s": statistics.fmean(seconds), "p50_s": statistics.median(seconds), "max_s": max(seconds)}


def run_multimodal(args, model_dir: str, settings: dict) -> dict:
    conversations, which, warm = chat_trace(args.num_requests, args.num_images, args.seed)
    params = greedy(args.output_len[1])
    ours, model_config, resolved = nanopaged_chat(model_dir, settings, conversations, warm, params)
    out = {"settings": {"model": model_dir, "random_weights": args.random_weights, "num_requests": len(which),
                        "distinct_images": len(set(which)), "max_tokens": params.max_tokens,
                        "image_sizes": [IMAGE_SIZES[i % len(IMAGE_SIZES)] for i in range(args.num_images)],
                        "seed": args.seed, "threads": torch.get_num_threads(), **resolved},
           "engine": ours}
    if "vllm" in args.peers:
        job = {**vllm_job(model_dir, model_config, resolved, [], []), "conversations": conversations,
               "warmup": warm, "max_tokens": params.max_tokens}
        out["vllm"] = vllm_chat(args, job)
    out["targets"] = multimodal_targets(out)
    return out


def nanopaged_chat(model_dir: str, settings: dict, conversations: list, warm: list, params) -> tuple:
    """The conversations in one chat call after the warm-up one: the figures, the model's config and the
    settings as resolved; the engine is freed before vLLM loads beside this process."""
    load = time.perf_counter()
    llm = LLM(model_dir, **settings)
    load = time.perf_counter() - load
    llm.chat(warm, params, use_tqdm=False)
    llm.reset_stats()
    first: dict[str, float] = {}

    def look(step) -> None:         # the step that samples a request's first token ends its wait
        for request in step.sampled:
            first.setdefault(request.request_id, step.times[3] - start)

    with observing(llm, look):
        start = time.perf_counter()
        outs = llm.chat(conversations, params, use_tqdm=False)
        wall = time.perf_counter() - start
    stats, config = llm.get_stats(), llm.llm_engine.config
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ours = {"load_s": load, "wall_s": wall, "output_tokens": tokens, "output_tokens_per_s": tokens / wall,
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs), "ttft": ttft_figures(list(first.values())),
            "multimodal": stats["multimodal"]}
    del llm, outs
    release_memory()
    return ours, config.model_config, resolved_settings(config, stats)


def vllm_chat(args, job: dict) -> dict:
    """vLLM's CPU engine on the same conversations (benchmarks/vllm_peer.py's chat_run); an error says why not."""
    theirs = run_vllm_side(args, job)
    if "error" in theirs:
        return theirs
    return {"version": theirs["vllm"], "load_s": theirs["load_s"], "wall_s": theirs["wall_s"],
            "output_tokens": theirs["output_tokens"], "prompt_tokens": theirs["prompt_tokens"],
            "output_tokens_per_s": theirs["output_tokens"] / theirs["wall_s"], "ttft": ttft_figures(theirs["ttft_s"])}


def multimodal_targets(r: dict) -> dict:
    calls, distinct = r["engine"]["multimodal"]["encoder_calls"], r["settings"]["distinct_images"]
    targets = {"shared images encoded once (encoder calls = distinct images)": {"value": calls,
                                                                               "met": calls == distinct}}
    theirs = r.get("vllm", {}).get("output_tokens_per_s")
    if theirs:
        x = r["engine"]["output_tokens_per_s"] / theirs
        targets["out tok/s >= 1.5x vLLM CPU's"] = {"value": x, "met": x >= 1.5}
    return targets
