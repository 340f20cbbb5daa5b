"""`nanopaged serve --async-scheduling`, in both process layouts: concurrent streams (some ended by a stop
string the API server finds, some cut short by their client) get the text an offline engine that steps
one at a time gives the same prompts, and the engine is left with nothing running."""
import asyncio
import pathlib
import random
import sys
import time
import urllib.request

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client", "zmq", "msgspec"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM, SamplingParams  # noqa: E402

MODEL_NAME = "tiny"


@pytest.mark.parametrize("layout", [[], ["--engine-in-process"]], ids=["engine-core", "in-process"])
def test_streams_equal_a_synchronous_engine_and_nothing_is_left_running(tiny_model_dirs, make_prompts, layout):
    model = tiny_model_dirs["llama"]
    rng = random.Random(4)
    prompts = make_prompts(512, n=12, seed=31, min_len=4, max_len=50)
    max_tokens = [rng.randint(6, 24) for _ in prompts]
    offline = LLM(model, async_scheduling=False, dtype="float32")
    plain = [o.outputs[0].text for o in offline.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in max_tokens], use_tqdm=False)]
    stops = [text[3:5] if i % 3 == 0 and len(text) > 6 else None for i, text in enumerate(plain)]
    want = [o.outputs[0].text for o in offline.generate(
        [{"prompt_token_ids": p} for p in prompts],
        [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, stop=[s] if s else None)
         for m, s in zip(max_tokens, stops)], use_tqdm=False)]

    async def one(client, prompt, m, stop):
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=m, temperature=0,
                                                 stream=True, stop=[stop] if stop else None,
                                                 extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def leave_early(client, prompt):
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=200, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            break
        await stream.close()

    async def run(base_url):
        client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            got = await asyncio.gather(*(one(client, p, m, s) for p, m, s in zip(prompts, max_tokens, stops)),
                                       *(leave_early(client, p) for p in prompts[:3]))
            return got[:len(prompts)]
        finally:
            await client.close()

    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        args = ["--async-scheduling", "--dtype", "float32", "--max-num-seqs", "16", *layout]
        with start_nanopaged(model, args, served_model_name=MODEL_NAME, timeout_s=120) as server:
            assert asyncio.run(run(server.base_url)) == want
            for _ in range(100):         # the clients that left are aborted in the engine; nothing runs on
                metrics = urllib.request.urlopen(server.base_url + "/metrics", timeout=30).read().decode()
                if "nanopaged:num_requests_running 0.0" in metrics and "nanopaged:kv_cache_usage_perc 0.0" in metrics:
                    break
                time.sleep(0.1)
            else:
                pytest.fail("requests still running or KV blocks held after every client finished or left")
