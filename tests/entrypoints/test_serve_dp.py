"""`nanopaged serve --data-parallel-size 2`: two engine cores behind two API servers (entrypoints/dp_router.py).

Concurrent streams get the offline greedy answers; round-robin spreads requests evenly; prefix-aware
routing sends requests that share a system prompt to one core, so it hits the prefix cache where
round-robin misses; killing one engine core ends its own requests with an error while the other's finish,
/health says "degraded" until another core is started in its place, and both serve new requests; SIGTERM
leaves no process. The router's rules are checked on their own.
"""
import asyncio
import json
import os
import pathlib
import signal
import sys
import time
import urllib.error
import urllib.request

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client", "zmq", "msgspec"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM, SamplingParams  # noqa: E402
from nanopaged.entrypoints.dp_router import OVERLOAD, Router  # noqa: E402
from test_serve import ENGINE_ARGS, SETTINGS, wait_idle  # noqa: E402
from test_serve_processes import alive, descendants, health  # noqa: E402

DP = [*ENGINE_ARGS, "--api-server-count", "2", "--data-parallel-size", "2"]


def core_pids(server) -> list[int]:
    line = next(x for x in server.log.read_text().splitlines() if x.startswith("nanopaged: serving "))
    return [int(p) for p in line.rsplit("engine core pid ", 1)[1].rstrip(")").split(", ")]


def start(model, routing):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        return start_nanopaged(model, [*DP, "--dp-routing", routing], served_model_name="tiny", timeout_s=180)


def complete_all(server, prompts, max_tokens=16):
    async def one(client, prompt):
        out = await client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0)
        return out.choices[0].text

    async def run():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()
    return asyncio.run(run())


def per_engine(m: dict, name: str) -> list[float]:
    return [m.get(f"nanopaged:{name}{{engine={i}}}", 0.0) for i in range(2)]


def test_two_engine_cores_answer_as_offline_and_round_robin_spreads_them(tiny_model_dirs, make_prompts):
    prompts = make_prompts(512, n=16, seed=7, min_len=3, max_len=40)
    offline = LLM(tiny_model_dirs["llama"], **SETTINGS)
    want = [o.outputs[0].text for o in offline.generate([{"prompt_token_ids": p} for p in prompts],
                                                         SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)]
    with start(tiny_model_dirs["llama"], "round-robin") as server:
        assert len(core_pids(server)) == 2
        assert complete_all(server, prompts) == want
        m = wait_idle(server)
        tokens = per_engine(m, "engine_generation_tokens_total")
        assert all(t > 0 for t in tokens) and sum(tokens) == 16 * 16
        assert min(tokens) >= 16 * 4        # two API servers each alternate: neither core is left idle
        assert m["nanopaged:kv_cache_usage_perc"] == 0 and health(server) == 200


@pytest.mark.parametrize("routing, api_servers", [("prefix-aware", "2"), ("round-robin", "1")])
def test_prefix_aware_routing_keeps_a_system_prompt_on_one_core(tiny_model_dirs, routing, api_servers):
    """Two system prompts of 8 blocks, 6 questions each, sent one after another (families 0, 0, 1, 1, ...):
    prefix-aware routing sends each family to one core, which hits its cache from the second request on,
    though two API servers share the work (each learns where the other's requests went from the cores'
    figures); round-robin (one API server, so its turns are known) sends each family to both cores."""
    systems = [list(range(10 + 100 * s, 10 + 100 * s + 32)) for s in range(2)]
    prompts = [systems[(i // 2) % 2] + [300 + i, 301 + i, 302 + i] for i in range(12)]
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        args = [*ENGINE_ARGS, "--api-server-count", api_servers, "--data-parallel-size", "2", "--dp-routing", routing]
        with start_nanopaged(tiny_model_dirs["llama"], args, served_model_name="tiny", timeout_s=180) as server:
            for p in prompts:
                complete_all(server, [p], max_tokens=2)
            hits = wait_idle(server)["nanopaged:prefix_cache_hits_total"]
    # prefix-aware: all but each family's first find its 32-token prompt; round-robin: each core misses each once
    assert hits == (10 * 32 if routing == "prefix-aware" else 8 * 32)


def health_text(server) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(server.base_url + "/health", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def wait_for(check, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def engine_stats(server) -> dict:
    with urllib.request.urlopen(server.base_url + "/engine_stats", timeout=5) as response:
        return json.loads(response.read())


def test_a_killed_engine_core_ends_only_its_requests_and_is_started_again(tiny_model_dirs, make_prompts):
    prompts = make_prompts(512, n=8, seed=9, min_len=3, max_len=30)
    with start(tiny_model_dirs["llama"], "round-robin") as server:
        victim, survivor = core_pids(server)

        async def run():
            client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)
            try:
                calls = [client.completions.create(model="tiny", prompt=p, max_tokens=450, temperature=0,
                                                   extra_body={"ignore_eos": True}) for p in prompts]
                tasks = [asyncio.ensure_future(c) for c in calls]
                deadline = time.monotonic() + 60
                while True:          # both cores running requests (their figures, as this API server has them)
                    engines = (await asyncio.to_thread(engine_stats, server))["engines"]
                    if len(engines) == 2 and all(e["num_running"] > 0 for e in engines.values()):
                        break
                    assert time.monotonic() < deadline and not all(t.done() for t in tasks), engines
                    await asyncio.sleep(0.01)
                os.kill(victim, signal.SIGKILL)
                return await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                await client.close()
        results = asyncio.run(run())
        failed = [r for r in results if isinstance(r, Exception)]
        finished = [r for r in results if not isinstance(r, Exception)]
        assert failed and finished                       # the dead core's requests, and the other's
        assert all(len(r.choices[0].text) > 0 for r in finished)
        assert alive(survivor) and not alive(victim)
        # the supervisor starts another core in its place; until then /health says which is down
        wait_for(lambda: "engine core 0 started again" in server.log.read_text())
        wait_for(lambda: all(health_text(server) == (200, "") for _ in range(10)))   # both API servers, likely
        before = engine_stats(server)["engines"]
        assert complete_all(server, prompts, max_tokens=4)     # round-robin: both cores serve again
        after = wait_idle(server) and engine_stats(server)["engines"]
        assert all(after[i]["num_generated_tokens"] > before[i]["num_generated_tokens"] for i in ("0", "1")), \
            (before, after)
        pids = descendants(server.process.pid)
        replaced = int(server.log.read_text().split("engine core 0 started again (pid ")[1].split(";")[0])
        assert alive(replaced) and replaced in pids and victim not in pids
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0
        wait_for(lambda: not any(alive(p) for p in pids), timeout_s=15)


# ---- the router on its own -------------------------------------------------------------------------
def test_least_loaded_picks_the_core_with_fewest_requests_then_least_kv():
    router = Router("least-loaded", 3, block_size=4)
    router.figures(0, running=5, waiting=1, kv_usage=0.5)
    router.figures(1, running=2, waiting=0, kv_usage=0.9)
    router.figures(2, running=2, waiting=0, kv_usage=0.1)
    keys = router.block_keys(list(range(9)), None, 0)
    assert router.choose(keys) == 2
    assert router.choose(keys) == 1       # core 2 now has one sent, not yet in its figures
    router.died(1)
    assert router.choose(router.block_keys(list(range(50, 59)), None, 0)) == 2


def test_prefix_aware_follows_the_prefix_unless_its_core_is_overloaded():
    router = Router("prefix-aware", 2, block_size=4)
    system = list(range(100, 116))
    keys = lambda tokens, salt=None: router.block_keys(tokens, salt, 0)     # noqa: E731
    first = router.choose(keys(system + [1, 2]))
    router.figures(first, running=2, waiting=0, kv_usage=0.5)          # busier than the other, not overloaded
    assert router.choose(keys(system + [3, 4])) == first               # the same first 4 blocks
    assert router.choose(keys(system, salt="other")) == 1 - first      # another salt: another prefix
    router.learn(1 - first, keys([9] * 16))                            # taken by the other core, via another server
    assert router.choose(keys([9] * 16 + [1])) == 1 - first
    router.figures(first, running=2 * 3 + OVERLOAD, waiting=0, kv_usage=0.5)
    router.figures(1 - first, running=3, waiting=0, kv_usage=0.0)
    assert router.choose(keys(system + [5])) == first                  # twice the other's queue and 4 more: still
    router.figures(first, running=2 * 3 + OVERLOAD + 1, waiting=0, kv_usage=0.5)
    router.figures(1 - first, running=3, waiting=0, kv_usage=0.0)
    assert router.choose(keys(system + [6])) == 1 - first              # overloaded: least loaded instead
    # a cache salt or an adapter makes another prefix
    assert router.block_keys(system, None, 0) != router.block_keys(system, "salt", 0)
    assert router.block_keys(system, None, 0) != router.block_keys(system, None, 3)


def test_round_robin_takes_each_live_core_in_turn_and_refuses_when_none_is_left():
    router = Router("round-robin", 3, block_size=4)
    assert [router.choose([]) for _ in range(4)] == [0, 1, 2, 0]
    router.died(1)
    assert [router.choose([]) for _ in range(3)] == [2, 0, 2]
    router.died(0)
    router.died(2)
    with pytest.raises(ValueError, match="no engine core is alive"):
        router.choose([])
    with pytest.raises(ValueError, match="--dp-routing"):
        Router("random", 2, 4)


def test_a_shared_preamble_alone_does_not_draw_a_new_system_prompt_to_one_core():
    router = Router("prefix-aware", 2, block_size=4)
    preamble = list(range(100, 108))                           # 2 blocks every system prompt begins with
    first = router.choose(router.block_keys(preamble + list(range(200, 216)), None, 0))
    router.figures(first, running=1, waiting=0, kv_usage=0.1)
    # another system prompt: the first core holds 2 of its 6 blocks, under half: the least loaded takes it
    assert router.choose(router.block_keys(preamble + list(range(300, 316)), None, 0)) == 1 - first
    # the first system prompt again: its core holds all 6 blocks
    assert router.choose(router.block_keys(preamble + list(range(200, 216)) + [5], None, 0)) == first
