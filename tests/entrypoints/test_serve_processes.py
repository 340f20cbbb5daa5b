"""`nanopaged serve` as processes: an engine core and N API servers (nanopaged/entrypoints/processes.py).

Two API servers in front of one engine core give the offline greedy answers to concurrent
streams; a storm of clients that leave mid-stream gives every block back; killing the engine
core ends every request in flight with an error, /health says 503 and the server exits non-zero
within seconds; killing an API server aborts its requests and the other serves on. Where a client's
answer is the same either way, the engine core's own counts (/metrics) show the waste: a few steps after
clients leave, or after their API server dies, the core no longer runs their requests; SIGINT and
SIGTERM exit 0 with no process left behind, and so does SIGKILL of the supervisor (its port free).
What crosses the socket is checked on its own.
"""
import asyncio
import http.client
import json
import os
import pathlib
import signal
import socket
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
from test_serve import ENGINE_ARGS, SETTINGS, metrics, runs_down_to, wait_idle  # noqa: E402

TWO = [*ENGINE_ARGS, "--api-server-count", "2"]


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc (ppid is field 4 of /proc/PID/stat)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def core_pid(server) -> int:
    line = next(x for x in server.log.read_text().splitlines() if x.startswith("nanopaged: serving "))
    return int(line.rsplit("engine core pid ", 1)[1].rstrip(")"))


def api_server_pids(server) -> set[int]:
    """The supervisor's children but the engine core and multiprocessing's resource tracker."""
    children = {p for p in descendants(server.process.pid)
                if int(pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == server.process.pid}
    return {p for p in children - {core_pid(server)}
            if b"resource_tracker" not in pathlib.Path(f"/proc/{p}/cmdline").read_bytes()}


def stream_request(server, max_tokens=400):
    """A streamed completion that runs a while; the response after its first few events."""
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": "Tell me everything", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
         "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    events = 0
    while events < 3:
        events += response.readline().startswith(b"data: ")
    return conn, response


def health(server) -> int:
    try:
        return urllib.request.urlopen(server.base_url + "/health", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.fixture(scope="module")
def two(tiny_model_dirs):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(tiny_model_dirs["llama"], TWO, served_model_name="tiny", timeout_s=120) as s:
            yield s


def test_two_api_servers_give_concurrent_streams_the_offline_answers(two, tiny_model_dirs, make_prompts):
    assert len(api_server_pids(two)) == 2
    prompts = make_prompts(512, n=24, seed=5, min_len=3, max_len=60)

    async def one(client, prompt):
        stream = await client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                 stream=True)
        text = ""
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
        return text

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=two.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, p) for p in prompts))
        finally:
            await client.close()

    got = asyncio.run(all_at_once())
    offline = LLM(tiny_model_dirs["llama"], **SETTINGS)
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert got == [e.outputs[0].text for e in expected]


def test_a_storm_of_clients_leaving_mid_stream_frees_every_block_of_the_engine_core(two):
    wait_idle(two)
    connections = [stream_request(two, max_tokens=300) for _ in range(12)]
    assert metrics(two)["nanopaged:num_requests_running"] > 0
    for conn, _ in connections:
        conn.sock.close()
        conn.close()
    # told to the core at once: it holds none of them within a few steps, far from their 300 tokens
    told, now = runs_down_to(two, 0, steps=50, per_step=len(connections))
    assert told, f"still running {now['nanopaged:num_requests_running']} after 50 steps"
    after = wait_idle(two)
    assert after["nanopaged:kv_cache_usage_perc"] == 0
    assert after["nanopaged:num_requests_running"] == after["nanopaged:num_requests_waiting"] == 0


def server_pid_of(conn, pids: set[int]) -> int | None:
    """Which API server accepted this client connection: the process holding the socket whose
    remote port is the client's (/proc/net/tcp gives its inode, /proc/PID/fd the holder)."""
    port = conn.sock.getsockname()[1]
    inodes = set()
    for line in pathlib.Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].split(":")[1], 16) == port:
            inodes.add(f"socket:[{fields[9]}]")
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    return pid
            except OSError:
                continue
    return None


def test_an_api_server_killed_loses_its_requests_and_the_other_serves_on(tiny_model_dirs):
    with start_nanopaged(tiny_model_dirs["llama"], TWO, served_model_name="tiny", timeout_s=120) as s:
        pids = api_server_pids(s)
        by_server: dict[int, list] = {pid: [] for pid in pids}
        while min(map(len, by_server.values())) == 0 and sum(map(len, by_server.values())) < 16:
            conn, response = stream_request(s, max_tokens=480)
            by_server[server_pid_of(conn, pids)].append((conn, response))
        victim, survivor = sorted(pids, key=lambda p: len(by_server[p]))   # both hold some requests
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while "running request(s) were aborted" not in s.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        log = s.log.read_text()
        assert f"its {len(by_server[victim])} running request(s) were aborted" in log, log[-2000:]
        # aborted in the core at once, not run on to max_tokens: a few steps later it runs the survivor's only
        aborted, now = runs_down_to(s, len(by_server[survivor]), steps=50, per_step=sum(map(len, by_server.values())))
        assert aborted, f"still running {now['nanopaged:num_requests_running']} after 50 steps"
        assert "1 serve on" in log
        for conn, response in by_server[survivor]:    # the other server's streams run to their end
            assert response.read().decode().rstrip().endswith("data: [DONE]")
            conn.close()
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=2, timeout=60)
        assert client.completions.create(model="tiny", prompt="Hello", max_tokens=4, temperature=0).choices
        after = wait_idle(s)
        assert after["nanopaged:kv_cache_usage_perc"] == 0 and after["nanopaged:num_requests_running"] == 0
        assert s.process.poll() is None and health(s) == 200


def test_the_engine_core_killed_ends_every_request_with_an_error_and_the_server_exits(tiny_model_dirs):
    with start_nanopaged(tiny_model_dirs["llama"], ENGINE_ARGS, served_model_name="tiny", timeout_s=120) as s:
        conn, response = stream_request(s, max_tokens=450)
        os.kill(core_pid(s), signal.SIGKILL)
        events = [line for line in response.read().decode().splitlines() if line.startswith("data: ")]
        errors = [json.loads(e[6:]) for e in events if e.startswith('data: {"error"')]
        assert errors and "engine core died" in errors[0]["error"]["message"], events[-3:]
        assert health(s) == 503
        started = time.monotonic()
        assert s.process.wait(timeout=15) == 1 and time.monotonic() - started < 15
    assert "the engine core died" in s.log.read_text()
    assert not any(alive(p) for p in descendants(s.process.pid))


def test_the_supervisor_killed_leaves_no_process_and_frees_the_port(tiny_model_dirs):
    """SIGKILL gives the supervisor no chance to stop its children: each stops itself on its parent's
    death (a parent-death signal), a stream in flight included, and a new server can bind the port."""
    with start_nanopaged(tiny_model_dirs["llama"], TWO, served_model_name="tiny", timeout_s=120) as s:
        port = int(s.base_url.rsplit(":", 1)[1])
        children = descendants(s.process.pid)
        assert len(children) >= 3                       # the engine core and two API servers
        conn, response = stream_request(s, max_tokens=450)
        try:
            s.process.kill()
            s.process.wait(timeout=10)
            deadline = time.monotonic() + 60              # guards a hang; the children stop within seconds
            while any(alive(p) for p in children) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not any(alive(p) for p in children), [p for p in children if alive(p)]
            while not port_free(port) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert port_free(port)
        finally:
            conn.close()
            try:                                         # whatever outlived its supervisor (before the fix)
                os.killpg(s.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def port_free(port: int) -> bool:
    try:
        socket.create_server(("127.0.0.1", port)).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_every_process_and_exits_0(tiny_model_dirs, sig):
    with start_nanopaged(tiny_model_dirs["llama"], TWO, served_model_name="tiny", timeout_s=120) as s:
        children = descendants(s.process.pid)
        assert len(children) >= 3                       # the engine core and two API servers
        s.process.send_signal(sig)
        assert s.process.wait(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in children)
    out = s.log.read_text(errors="replace")
    assert "nanopaged: stopped" in out and "Traceback" not in out, out[-2000:]


def test_what_crosses_the_socket_is_plain_data_and_nothing_else_is_read():
    import msgspec
    from nanopaged.entrypoints import core_messages as m
    from nanopaged.sampling_params import RequestOutputKind
    params = SamplingParams(temperature=0.5, max_tokens=7, stop=["x"], logit_bias={3: 1.5}, seed=4,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    wire = m.encode(m.AddRequest("r", [1, 2, 3], m.params_to_wire(params), None, ["a", 1, "/a"]))
    back = m.core_decoder.decode(wire)
    assert isinstance(back, m.AddRequest) and m.params_from_wire(back.params) == params
    core = m.core_params(back.params)           # the core: every step's tokens, no text work
    assert core.output_kind is RequestOutputKind.DELTA and not core.detokenize and not core.stop
    assert m.lora_from_wire(back.lora).lora_int_id == 1
    with pytest.raises(msgspec.ValidationError):                 # a type the core does not read
        m.core_decoder.decode(m.encode(m.Accepted("r")))
    with pytest.raises(msgspec.DecodeError):
        m.core_decoder.decode(b"\x93not msgpack")
    with pytest.raises(ValueError, match="unknown sampling parameters"):
        m.params_from_wire({"temperature": 0, "__reduce__": "os.system"})


@pytest.mark.parametrize("flags", [
    ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'],
    ["--tensor-parallel-size", "2", "--cpu-threads", "none"],
    ["--pipeline-parallel-size", "2", "--cpu-threads", "none"]], ids=["ngram-drafts", "tensor-parallel-2",
                                                                     "pipeline-parallel-2"])
def test_the_engine_core_drives_drafts_and_parallel_ranks(tiny_model_dirs, make_prompts, flags):
    prompts = make_prompts(512, n=3, seed=9, min_len=4, max_len=30)
    with start_nanopaged(tiny_model_dirs["llama"], [*ENGINE_ARGS, *flags], served_model_name="tiny",
                         timeout_s=180) as s:
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0).choices[0].text
               for p in prompts]
        children = descendants(s.process.pid)
        if "--speculative-config" not in flags:         # the second rank (or stage) is the engine core's child
            assert any(p in descendants(core_pid(s)) for p in children)
    offline = LLM(tiny_model_dirs["llama"], **SETTINGS)
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts],
                                SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert got == [e.outputs[0].text for e in expected]
    assert not any(alive(p) for p in children)


def test_one_api_servers_flood_does_not_starve_another_on_the_engine_cores_socket(tmp_path):
    """The engine core reads its ROUTER socket's peers in turn (ZeroMQ's fair queueing): a request that
    one API server sends after another server queued a hundred is read among the first few."""
    import zmq
    from nanopaged.entrypoints import core_messages as m
    ctx = zmq.Context.instance()
    core = ctx.socket(zmq.ROUTER)
    core.bind(f"ipc://{tmp_path}/core")
    servers = {}
    for name in ("api-0", "api-1"):
        servers[name] = ctx.socket(zmq.DEALER)
        servers[name].setsockopt(zmq.IDENTITY, name.encode())
        servers[name].connect(f"ipc://{tmp_path}/core")
    for i in range(100):
        servers["api-0"].send(m.encode(m.Abort([f"flood-{i}"])))
    servers["api-1"].send(m.encode(m.Abort(["the other one"])))
    time.sleep(0.5)                                  # everything has reached the core's queue
    order = []
    while core.poll(1000):
        client, payload = core.recv_multipart()
        order.append((client, m.core_decoder.decode(payload).request_ids[0]))
    assert len(order) == 101 and order.index((b"api-1", "the other one")) <= 2
    for s in (core, *servers.values()):
        s.close(linger=0)


def test_the_engine_core_drops_a_malformed_message_and_serves_on(tiny_model_dirs, tmp_path):
    """A peer that sends three frames, or bytes that are not one of the messages, is logged and
    skipped; the next request is answered as before."""
    import threading

    import zmq
    from nanopaged.entrypoints import core_messages as m
    from nanopaged.entrypoints.engine_core import EngineCore
    llm = LLM(tiny_model_dirs["llama"], **SETTINGS)
    core = EngineCore(llm, f"ipc://{tmp_path}/core")
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.IDENTITY, b"api-0")
    peer.connect(f"ipc://{tmp_path}/core")
    peer.send_multipart([b"one", b"two"])                       # with the name: three frames
    peer.send(b"\x93not msgpack")
    peer.send(m.encode(m.Accepted("not for the core")))
    peer.send(m.encode(m.AddRequest("r", [5, 6, 7], m.params_to_wire(SamplingParams(temperature=0, max_tokens=3)))))
    answers = []
    while peer.poll(20000):
        answers.append(m.client_decoder.decode(peer.recv()))
        if any(isinstance(a, m.Outputs) and a.deltas[0].samples[0].finish_reason for a in answers):
            break
    peer.send(m.encode(m.Shutdown()))
    loop.join(timeout=10)
    peer.close(linger=0)
    assert isinstance(answers[0], m.Accepted) and not loop.is_alive()
    tokens = [t for a in answers if isinstance(a, m.Outputs) for t in a.deltas[0].samples[0].token_ids]
    assert tokens == llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3),
                                  use_tqdm=False)[0].outputs[0].token_ids
