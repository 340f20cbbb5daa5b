"""Ray Data (nanopaged/extras/ray_data/, docs/14_ray_data.md): a dataset through engine replicas.

Without a cluster: the configs' checks, and one replica driven in-process (its engine stays full
across the batches in flight; bad rows become errors). With a cluster of two nodes started here as
Ray does it on real machines (`ray start --head` and `ray start --address`, two processes on
loopback, each with its own CPU count and a custom resource): one replica per node equals
LLM.generate row for row; a replica killed mid-dataset loses no row and doubles none; the same
processor through a running `nanopaged serve`, and Ray's own HttpRequestProcessorConfig against it.
A server replica forwards every sampling field a server request carries and refuses the others by
name; a wrong key or model fails the job, not each row; a cancelled batch stops its work. A stand-in
server that answers 5xx or never answers fails the batch (no row turned into an error), and Ray Data,
told to retry errors, sends the batch again: every row once.
"""
import asyncio
import dataclasses
import http.server
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

pyarrow = pytest.importorskip("pyarrow", reason="the ray extra: pip install -e '.[ray]'")
ray = pytest.importorskip("ray", reason="the ray extra: pip install -e '.[ray]'")

from nanopaged import LLM, SamplingParams  # noqa: E402
from nanopaged.extras.ray_data import EngineProcessorConfig, ServerProcessorConfig, build_processor  # noqa: E402
from nanopaged.extras.ray_data.replica import EngineReplica  # noqa: E402
from nanopaged.extras.ray_data.rows import table_of  # noqa: E402
from nanopaged.extras.ray_data.server_replica import ServerReplica  # noqa: E402
from nanopaged.sampling_params import VLLM_ONLY  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_num_seqs=16)
PROMPTS = [[5 + i, 9, 17 + i % 7, 33, 40 + i % 11][: 2 + i % 4] for i in range(24)]
MAX_TOKENS = [4 + (i * 5) % 13 for i in range(24)]


def rows(n=24):
    return [{"id": i, "prompt_token_ids": PROMPTS[i],
             "sampling_params": {"temperature": 0.0, "max_tokens": MAX_TOKENS[i]}} for i in range(n)]


@pytest.fixture(scope="module")
def expected(tiny_model_dirs):
    """Each row's greedy tokens from one LLM.generate call in this process."""
    llm = LLM(tiny_model_dirs["llama"], **SETTINGS)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        [SamplingParams(temperature=0, max_tokens=m) for m in MAX_TOKENS], use_tqdm=False)
    return {i: list(o.outputs[0].token_ids) for i, o in enumerate(outs)}


# ---- without a cluster --------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(concurrency=0), "concurrency must be in [1, inf]"),
    (dict(concurrency=(3, 2)), "concurrency max must be in [3, inf]"),
    (dict(concurrency=(1, 2, 3)), "a (min, max) pair"),
    (dict(batch_size=0), "batch_size must be in [1, inf]"),
    (dict(max_concurrent_batches=0), "max_concurrent_batches"),
    (dict(cpus_per_replica=1.5), "cpus_per_replica must be an integer"),
    (dict(engine_kwargs={"cpu_threads": "auto"}), "cpus_per_replica"),
    (dict(engine_kwargs={"no_such_setting": 1}), "no_such_setting"),
    (dict(resources_per_replica={"slot": 0}), "resources_per_replica['slot']"),
    (dict(sampling_params={"temperature": -1}), "temperature"),
])
def test_a_bad_engine_config_is_a_value_error_before_any_actor(tiny_model_dirs, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineProcessorConfig(model_source=tiny_model_dirs["llama"], **kwargs)


def test_a_bad_server_config_or_processor_is_a_value_error():
    with pytest.raises(ValueError, match="base URL"):
        ServerProcessorConfig(url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        ServerProcessorConfig(url="http://127.0.0.1:8000", max_concurrent_requests=0)
    with pytest.raises(ValueError, match="EngineProcessorConfig or a ServerProcessorConfig"):
        build_processor({"model_source": None})
    with pytest.raises(ValueError, match="preprocess must be a function"):
        build_processor(ServerProcessorConfig(url="http://127.0.0.1:8000"), preprocess="upper")


def run_batches(replica, batches):
    """Ray's calls, as Ray makes them on an async actor: each batch its own task, all at once."""
    async def one(batch):
        return [t async for t in replica(table_of(batch))]

    async def all_of():
        return await asyncio.gather(*(one(b) for b in batches))
    return [row for tables in asyncio.run(all_of()) for table in tables for row in table.to_pylist()]


def test_one_replica_runs_the_rows_of_every_batch_in_flight_at_once(tiny_model_dirs, expected):
    """Four batches of two rows in flight: the engine runs eight at once, not two, and each row's
    tokens equal LLM.generate's."""
    replica = EngineReplica(tiny_model_dirs["llama"], SETTINGS, cpus=1)
    given = rows(8)
    out = run_batches(replica, [given[i:i + 2] for i in range(0, 8, 2)])
    assert sorted(r["id"] for r in out) == list(range(8))
    for r in out:
        assert r["error"] is None and r["generated_tokens"] == expected[r["id"]], r
        assert r["num_generated_tokens"] == len(r["generated_tokens"]) and r["finish_reason"] == "length"
    # more than one batch's rows at once (all 8 unless a batch ended before the last one was queued)
    assert max(r["replica"]["max_num_running"] for r in out) > 2
    assert max(r["replica"]["rows_done"] for r in out) == 8
    assert out[0]["sampling_params"] == given[out[0]["id"]]["sampling_params"]     # the row in, kept


def test_a_bad_row_is_its_own_error_and_the_others_run(tiny_model_dirs, expected):
    replica = EngineReplica(tiny_model_dirs["llama"], SETTINGS, cpus=1,
                            sampling_params={"temperature": 0.0, "max_tokens": MAX_TOKENS[0]})
    bad = [{"id": 100, "prompt_token_ids": [5] * 600},                                   # past the context
           {"id": 101, "prompt_token_ids": [5, 6], "sampling_params": {"temperature": -1.0}},
           {"id": 102},                                                                   # no prompt
           {"id": 103, "prompt": "a", "prompt_token_ids": [5]},                           # two prompts
           {"id": 104, "prompt_token_ids": [5, 6], "sampling_params": {"n": 2}}]
    good = [{"id": 0, "prompt_token_ids": PROMPTS[0]}]                                   # the config's params
    out = {r["id"]: r for r in run_batches(replica, [bad[:3] + good, bad[3:]])}
    assert out[0]["error"] is None and out[0]["generated_tokens"] == expected[0]
    assert "max_model_len" in out[100]["error"] or "context" in out[100]["error"], out[100]["error"]
    assert "temperature" in out[101]["error"]
    assert "exactly one of" in out[102]["error"] and "exactly one of" in out[103]["error"]
    assert "n=2" in out[104]["error"]
    assert all(out[i]["generated_text"] is None for i in range(100, 105))
    assert replica.engine.scheduler.block_pool.usage() == 0.0


def test_chat_rows_go_through_the_chat_template(tiny_model_dirs):
    replica = EngineReplica(tiny_model_dirs["llama"], SETTINGS, cpus=1)
    messages = [{"role": "user", "content": "Name a colour."}]
    [row] = run_batches(replica, [[{"id": 0, "messages": messages,
                                    "sampling_params": {"temperature": 0.0, "max_tokens": 6}}]])
    chat = LLM(tiny_model_dirs["llama"], **SETTINGS).chat(messages, SamplingParams(temperature=0, max_tokens=6),
                                                          use_tqdm=False)[0]
    assert row["generated_tokens"] == list(chat.outputs[0].token_ids)
    assert row["num_input_tokens"] == len(chat.prompt_token_ids)


def test_rows_with_different_logit_bias_keys_each_get_their_own_bias(tiny_model_dirs, expected):
    """One batch's rows become one Arrow table: logit_bias turns into a struct with every row's keys,
    None where a row has none. Each row still gets its own bias, and a row without one none."""
    replica = EngineReplica(tiny_model_dirs["llama"], SETTINGS, cpus=1)
    params = {"temperature": 0.0, "max_tokens": 4, "ignore_eos": True}
    given = [{"id": 0, "prompt_token_ids": PROMPTS[1], "sampling_params": {**params, "logit_bias": {"11": 100.0}}},
             {"id": 1, "prompt_token_ids": PROMPTS[1], "sampling_params": {**params, "logit_bias": {"13": 100.0}}},
             {"id": 2, "prompt_token_ids": PROMPTS[0],
              "sampling_params": {**params, "max_tokens": MAX_TOKENS[0]}}]
    out = {r["id"]: r for r in run_batches(replica, [given])}
    assert [out[i]["error"] for i in range(3)] == [None] * 3, out
    assert out[0]["generated_tokens"] == [11] * 4 and out[1]["generated_tokens"] == [13] * 4
    assert out[2]["generated_tokens"] == expected[0]


def wait_for(condition, limit_s=60.0) -> bool:
    """Poll until `condition()`; the limit only guards a hang."""
    deadline = time.monotonic() + limit_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_cancelled_batch_aborts_its_rows_in_the_engine(tiny_model_dirs):
    """Ray cancels an async actor's call by cancelling its task: the rows it queued are aborted, their
    blocks freed, far fewer tokens made than the rows asked for."""
    replica = EngineReplica(tiny_model_dirs["llama"], SETTINGS, cpus=1)
    asked = 2 * 400
    batch = [{"id": i, "prompt_token_ids": PROMPTS[i],
              "sampling_params": {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}} for i in range(2)]

    async def cancel_midway():
        task = asyncio.ensure_future(run_one(replica, batch))
        while replica.llm.stats.num_generated_tokens < 8:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        deadline = time.monotonic() + 60              # the loop stays open, as Ray's does; guards a hang
        while replica.engine.has_unfinished_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    asyncio.run(cancel_midway())
    assert not replica.engine.has_unfinished_requests()
    assert replica.llm.stats.num_generated_tokens < asked / 2
    assert replica.engine.scheduler.block_pool.usage() == 0.0


async def run_one(replica, batch):
    return [t async for t in replica(table_of(batch))]


def server_replica(url="http://127.0.0.1:9", **kw):
    return ServerReplica(url, "tiny", {}, max_concurrent_requests=8, sampling_params=None, timeout_s=600, **kw)


# A value away from the default for each SamplingParams field a row may set (n: one per row)
NOT_DEFAULT = dict(temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=3, stop=["x"], stop_token_ids=[7],
                   include_stop_str_in_output=True, ignore_eos=True, max_tokens=9, min_tokens=2, logprobs=2,
                   prompt_logprobs=1, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2,
                   skip_special_tokens=False, spaces_between_special_tokens=False, detokenize=False,
                   truncate_prompt_tokens=3, bad_words=["no"], allowed_token_ids=[5, 6], logit_bias={"5": 1.0})


def test_a_server_replica_forwards_each_sampling_field_or_refuses_it_by_name():
    """Every SamplingParams field either reaches the request body under the server's name, or the row
    (or the config) is refused naming it: nothing is dropped in silence."""
    fields = {f.name for f in dataclasses.fields(SamplingParams) if f.init} - set(VLLM_ONLY) - {
        "n", "output_kind", "structured_outputs"}
    assert set(NOT_DEFAULT) == fields               # a new field needs a value here
    replica = server_replica()
    for name, value in NOT_DEFAULT.items():
        row = {"prompt": "a", "sampling_params": {name: value}}
        try:
            _, body = replica.request_of(row)
        except ValueError as e:
            assert name in str(e), (name, str(e))
            with pytest.raises(ValueError, match=name):
                ServerProcessorConfig(url="http://127.0.0.1:9", sampling_params={name: value})
            continue
        assert body.get(name) == value, (name, body)


class StubServer(http.server.ThreadingHTTPServer):
    """Answers every POST with `status` and an OpenAI error body; with status None it never answers,
    and counts the requests that came in and the clients that closed their connection."""
    daemon_threads = True

    def __init__(self, status):
        self.status, self.opened, self.closed = status, [], []
        super().__init__(("127.0.0.1", 0), StubHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self):
        return f"http://127.0.0.1:{self.server_address[1]}"


    def answer(self, request: dict) -> tuple[int, dict]:
        return self.status, {"error": {"message": f"stub says {self.status}"}}


class FlakyServer(StubServer):
    """Answers its first `failures` requests with `status`, then every request as a completion of
    `max_tokens` tokens [7, 7, ...] would be; counts both."""

    def __init__(self, status, failures):
        self.failures, self.failed, self.served, self.lock = failures, 0, 0, threading.Lock()
        super().__init__(status)

    def answer(self, request: dict) -> tuple[int, dict]:
        with self.lock:
            if self.failed < self.failures:
                self.failed += 1
                return super().answer(request)
            self.served += 1
        tokens = [7] * request["max_tokens"]
        return 200, {"choices": [{"index": 0, "text": "x" * len(tokens), "token_ids": tokens, "finish_reason": "length"}],
                     "usage": {"prompt_tokens": len(request["prompt"]), "completion_tokens": len(tokens)}}


class StubHandler(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.server.status is None:
            self.server.opened.append(1)
            while self.rfile.read(1):                    # until the client closes
                pass
            self.server.closed.append(1)
            return
        status, reply = self.server.answer(request)
        body = json.dumps(reply).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status", [401, 403, 404])
def test_a_wrong_key_or_model_fails_the_batch_not_each_row(status):
    """A 401/403 (the key) or a 404 (the model's name) is no row's fault: the batch fails with the
    server's message, so Ray stops the dataset once instead of writing it into every row."""
    stub = StubServer(status)
    try:
        with pytest.raises(RuntimeError, match=f"HTTP {status}.*stub says {status}"):
            run_batches(server_replica(stub.url), [[{"id": i, "prompt": "a"} for i in range(3)]])
    finally:
        stub.shutdown()


@pytest.mark.parametrize("status", [500, 502, 503])
def test_a_server_answering_5xx_fails_the_batch_and_turns_no_row_into_an_error(status):
    """A 5xx is the server's fault, not a row's: the batch raises (so Ray Data, told to retry errors,
    sends it again: test_a_batch_failed_by_a_5xx_is_retried_by_ray_and_every_row_comes_out_once) and
    yields no row, rather than rows whose error column says HTTP 5xx."""
    stub = FlakyServer(status, failures=10**9)
    out = []

    async def consume():
        async for table in server_replica(stub.url)(table_of([{"id": i, "prompt": "a"} for i in range(3)])):
            out.extend(table.to_pylist())
    try:
        with pytest.raises(RuntimeError, match=f"HTTP {status}.*stub says {status}"):
            asyncio.run(consume())
        assert out == [] and stub.failed >= 1
    finally:
        stub.shutdown()


def test_a_server_that_does_not_answer_in_time_fails_the_batch_and_closes_its_requests():
    """A request past timeout_s fails the batch (no row comes out as an error), and the batch's other
    requests are closed, so the server aborts them rather than generating for nobody."""
    stub = StubServer(None)
    out = []

    async def consume():
        replica = ServerReplica(stub.url, "tiny", {}, max_concurrent_requests=8, sampling_params=None, timeout_s=0.5)
        async for table in replica(table_of([{"id": i, "prompt": "a"} for i in range(3)])):
            out.extend(table.to_pylist())
    try:
        with pytest.raises(TimeoutError):
            asyncio.run(asyncio.wait_for(consume(), 60))
        assert out == []
        assert wait_for(lambda: len(stub.closed) == len(stub.opened) == 3), (stub.opened, stub.closed)
    finally:
        stub.shutdown()


def test_a_cancelled_batch_closes_its_requests_to_the_server():
    """A cancelled call closes the connections of its rows' requests, so the server sees each client
    leave (and aborts its request, tests/entrypoints/test_serve.py)."""
    stub = StubServer(None)
    replica = server_replica(stub.url)

    async def cancel_midway():
        task = asyncio.ensure_future(run_one(replica, [{"id": i, "prompt": "a"} for i in range(3)]))
        while len(stub.opened) < 3:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    try:
        asyncio.run(asyncio.wait_for(cancel_midway(), 60))
        assert wait_for(lambda: len(stub.closed) == 3), len(stub.closed)
    finally:
        stub.shutdown()


# ---- a cluster of two nodes on loopback ---------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A head node and a second node, each its own `ray start` process on a loopback address of its
    own (127.0.0.2, 127.0.0.3), two CPUs and one `replica_slot` each (a custom resource a replica
    asks for, so Ray places one replica per node); this process is the driver."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.ray_data import ray_cluster
    node = {"num_cpus": 2, "resources": {"replica_slot": 1}}
    with ray_cluster(tmp_path_factory.mktemp("ray"), [node, node]) as address:
        context = ray.data.DataContext.get_current()
        context.enable_progress_bars = False
        context.wait_for_min_actors_s = 120      # rows flow once every replica is up: each gets some
        yield address


def engine_config(model, **kw):
    return EngineProcessorConfig(model_source=model, engine_kwargs=SETTINGS, batch_size=3, max_concurrent_batches=2,
                                 resources_per_replica={"replica_slot": 1}, **kw)


def test_one_replica_per_node_equals_llm_generate_row_for_row(cluster, tiny_model_dirs, expected):
    """Two replicas, one on each node (each takes the node's one replica_slot); the rows stream out
    (iter_rows: never gathered by Ray); every row once, with LLM.generate's greedy tokens; a bad row
    is its row's error and the dataset goes on."""
    given = rows() + [{"id": 99, "prompt_token_ids": [5] * 600}]
    processor = build_processor(engine_config(tiny_model_dirs["llama"], concurrency=2),
                                postprocess=lambda row: {**row, "answer_length": row["num_generated_tokens"]})
    out = list(processor(ray.data.from_items(given)).iter_rows())
    assert sorted(r["id"] for r in out) == [r["id"] for r in given]
    for r in out:
        if r["id"] == 99:
            assert r["error"] and r["generated_tokens"] is None
        else:
            assert r["error"] is None and list(r["generated_tokens"]) == expected[r["id"]], r["id"]
            assert r["answer_length"] == len(expected[r["id"]])
    nodes = {r["replica"]["node_id"] for r in out}
    assert nodes == {n["NodeID"] for n in ray.nodes() if n["Alive"]} and len(nodes) == 2


def test_an_autoscaling_pool_of_replicas_runs_every_row(cluster, tiny_model_dirs, expected):
    """concurrency=(1, 2): Ray starts one replica and may add a second as batches queue up."""
    config = EngineProcessorConfig(model_source=tiny_model_dirs["llama"], engine_kwargs=SETTINGS, concurrency=(1, 2),
                                   batch_size=2, max_concurrent_batches=1)
    out = list(build_processor(config)(ray.data.from_items(rows(8))).iter_rows())
    assert sorted(r["id"] for r in out) == list(range(8))
    assert all(list(r["generated_tokens"]) == expected[r["id"]] for r in out)


def test_a_replica_killed_mid_dataset_loses_no_row_and_doubles_none(cluster, tiny_model_dirs, expected):
    """SIGKILL one replica's process once rows have come out: Ray restarts it and hands its
    unfinished batches to a live replica; every row comes out exactly once, with its greedy tokens."""
    given = [{**row, "id": i, "source": row["id"]} for i, row in enumerate(rows() * 3)]
    processor = build_processor(engine_config(tiny_model_dirs["llama"], concurrency=2))
    out, killed = [], None
    for row in processor(ray.data.from_items(given)).iter_rows():
        out.append(row)
        if killed is None and len(out) == 6:
            killed = row["replica"]["pid"]
            os.kill(killed, signal.SIGKILL)
    assert sorted(r["id"] for r in out) == list(range(len(given)))
    for r in out:
        assert list(r["generated_tokens"]) == expected[r["source"]], r["id"]
    assert any(r["replica"]["pid"] != killed for r in out[6:])


@pytest.fixture(scope="module")
def server(tiny_model_dirs, cluster):
    """A `nanopaged serve` for the HTTP path, with the engine settings of the offline run."""
    pytest.importorskip("fastapi", reason="the serve extra: pip install -e '.[serve]'")
    from benchmarks.serve import start_nanopaged
    args = ["--dtype", "float32", "--block-size", "4", "--num-kv-blocks", "256", "--max-num-seqs", "16"]
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(tiny_model_dirs["llama"], args, served_model_name="tiny", timeout_s=120) as s:
            yield s


def test_the_same_processor_through_a_running_server(cluster, server, expected):
    """ServerProcessorConfig: rows to `nanopaged serve` over its OpenAI API, tokens back through
    return_token_ids; the same rows out as the engine replicas give; a bad row is its error (the
    server's 400 names the field)."""
    given = rows() + [{"id": 99, "prompt_token_ids": [5] * 600},                         # the server's 400
                      {"id": 98, "prompt": "a", "sampling_params": {"top_p": 2.0}}]          # refused before sending
    config = ServerProcessorConfig(url=server.base_url, model="tiny", concurrency=2, batch_size=4,
                                   max_concurrent_requests=8)
    out = list(build_processor(config)(ray.data.from_items(given)).iter_rows())
    assert sorted(r["id"] for r in out) == sorted(r["id"] for r in given)
    for r in out:
        if r["id"] in (98, 99):
            assert ("top_p" if r["id"] == 98 else "max_model_len") in r["error"], r["error"]
        else:
            assert r["error"] is None and list(r["generated_tokens"]) == expected[r["id"]], r["id"]
            assert r["finish_reason"] == "length" and r["num_input_tokens"] == len(PROMPTS[r["id"]])


def test_a_wrong_model_name_fails_the_job_once_with_the_servers_message(cluster, server):
    config = ServerProcessorConfig(url=server.base_url, model="no-such-model", batch_size=4)
    with pytest.raises(Exception, match="HTTP 404.*no-such-model"):
        list(build_processor(config)(ray.data.from_items(rows(8))).iter_rows())


def test_a_batch_failed_by_a_5xx_is_retried_by_ray_and_every_row_comes_out_once(cluster):
    """Told to retry a call that raised (DataContext.actor_task_retry_on_errors, docs/14_ray_data.md),
    Ray Data sends a batch the server failed with a 503 again: the failures cost retries, not rows.
    Every row comes out once without an error; the stub counted the 503s and at least one answer a row."""
    stub = FlakyServer(503, failures=2)
    context = ray.data.DataContext.get_current()
    before, context.actor_task_retry_on_errors = context.actor_task_retry_on_errors, True
    given = [{"id": i, "prompt_token_ids": [5, 6], "sampling_params": {"max_tokens": 3}} for i in range(8)]
    try:
        config = ServerProcessorConfig(url=stub.url, model="tiny", batch_size=4, max_concurrent_requests=4)
        out = list(build_processor(config)(ray.data.from_items(given)).iter_rows())
    finally:
        context.actor_task_retry_on_errors = before
        stub.shutdown()
    assert sorted(r["id"] for r in out) == list(range(8))
    assert all(r["error"] is None and list(r["generated_tokens"]) == [7, 7, 7] for r in out)
    assert stub.failed == 2 and stub.served >= len(given)


def test_rays_own_http_processor_against_nanopaged_serve(cluster, server, expected):
    """ray.data.llm's HttpRequestProcessorConfig pointed at /v1/completions, as docs/14_ray_data.md shows."""
    from ray.data.llm import HttpRequestProcessorConfig
    from ray.data.llm import build_processor as ray_build_processor
    config = HttpRequestProcessorConfig(url=server.base_url + "/v1/completions", qps=50, concurrency=1, batch_size=8)
    processor = ray_build_processor(
        config,
        preprocess=lambda row: {"id": row["id"], "payload": {
            "model": "tiny", "prompt": row["prompt_token_ids"], "temperature": 0,
            "max_tokens": row["sampling_params"]["max_tokens"], "return_token_ids": True}},
        postprocess=lambda row: {"id": row["id"], "tokens": row["http_response"]["choices"][0]["token_ids"]})
    out = list(processor(ray.data.from_items(rows())).iter_rows())
    assert sorted(r["id"] for r in out) == list(range(len(PROMPTS)))
    assert all(list(r["tokens"]) == expected[r["id"]] for r in out)


def test_the_ray_benchmark_runs(cluster, tiny_model_dirs):
    """bench.py --workload ray, tiny: every run gives generate's tokens and its figures."""
    from benchmarks.ray_data import main
    result = main(["--model", tiny_model_dirs["llama"], "--dtype", "float32", "--num-rows", "6",
                   "--input-len", "4", "8", "--output-len", "2", "4", "--batch-size", "2"])
    assert [r["run"] for r in result["runs"]] == ["generate", f"ray 1 x {os.cpu_count()}", f"ray {os.cpu_count()} x 1"]
    for r in result["runs"]:
        assert r["same_tokens_as_generate"] and r["output_tokens_per_s"] > 0 and r.get("errors", 0) == 0
