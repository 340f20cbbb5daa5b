"""`nanopaged serve` in the default dtype: 16 concurrent streams get the answers the same prompts get
sent alone. The server batches whoever is connected; with batch invariance (the default where the
CPU's fast path holds it, tests/engine/test_batch_invariance.py) a client's answer does not depend
on who else was. The other server tests (test_serve.py) pin float32, where this was never promised.
"""
import asyncio
import pathlib
import random
import sys

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import EngineConfig  # noqa: E402
from nanopaged.cpu.choose import choose  # noqa: E402

MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    if not choose(EngineConfig(tiny_model_dirs["llama"], device="cpu")).batch_invariant:
        pytest.skip("batch invariance is not the default here (it needs AVX512-BF16 and the C++ kernels)")
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(tiny_model_dirs["llama"], ["--max-num-seqs", "16"], served_model_name=MODEL_NAME,
                             timeout_s=120) as s:
            yield s


def test_16_concurrent_streams_equal_the_same_prompts_sent_alone(server, make_prompts):
    rng = random.Random(3)
    prompts = make_prompts(512, n=16, seed=21, min_len=4, max_len=60)
    max_tokens = [rng.randint(8, 32) for _ in prompts]

    async def one(client, prompt, m):
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=m, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run(concurrently: bool):
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            if concurrently:
                return await asyncio.gather(*(one(client, p, m) for p, m in zip(prompts, max_tokens)))
            return [await one(client, p, m) for p, m in zip(prompts, max_tokens)]
        finally:
            await client.close()

    alone = asyncio.run(run(concurrently=False))
    together = asyncio.run(run(concurrently=True))
    assert together == alone
    assert len(set(alone)) > 1
