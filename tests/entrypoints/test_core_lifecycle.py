"""What the engine core does when a peer goes, counted in steps (nanopaged/entrypoints/engine_core.py and
openai/core_client.py), without a server process.

A client sees the right answer whether or not the engine core goes on generating for nobody; only the
core's own counts show the waste. So these tests drive an EngineCore by hand, one receive or one step
at a time, and count: the requests it still holds right after it read a message, its free blocks, the
tokens its next step makes. An API server that dies (the supervisor's ClientGone) or a client that
leaves (Abort) ends its requests before the core's next step. The API server's side is driven against
a stand-in engine core played by the test: a stop string it finds, or a client that leaves, is an
Abort to the core at once. The same rules through real processes: tests/entrypoints/test_serve_processes.py.
"""
import asyncio
import multiprocessing
import threading

import pytest

for module in ("fastapi", "zmq", "msgspec"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")

import zmq  # noqa: E402

from nanopaged import LLM, SamplingParams  # noqa: E402
from nanopaged.entrypoints import core_messages as m  # noqa: E402
from nanopaged.entrypoints.engine_core import EngineCore  # noqa: E402
from nanopaged.entrypoints.openai.core_client import CoreClient  # noqa: E402
from nanopaged.entrypoints.openai.engine_loop import Submission  # noqa: E402
from nanopaged.entrypoints.openai.protocol import parse_request  # noqa: E402

SETTINGS = dict(block_size=4, num_kv_blocks=64, max_num_seqs=8, dtype="float32")
LONG = m.params_to_wire(SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
WAIT_MS = 30_000          # only guards a hang: every wait below ends on a message


def dealer(address: str, name: str):
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, name.encode())
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


@pytest.fixture
def core(tiny_model_dirs, tmp_path):
    """(an EngineCore nobody runs: the test calls its receive and step, {peer name: DEALER socket})."""
    address = f"ipc://{tmp_path}/core"
    engine_core = EngineCore(LLM(tiny_model_dirs["llama"], **SETTINGS), address)
    peers = {name: dealer(address, name) for name in ("api-0", "api-1", "supervisor")}
    yield engine_core, peers
    for sock in peers.values():
        sock.close(linger=0)
    engine_core.checks.shutdown(wait=True)
    engine_core.socket.close(linger=0)


def take(engine_core, done) -> None:
    """Receive and queue what the peers sent until `done()`: one receive per message that arrives."""
    while not done():
        assert engine_core.socket.poll(WAIT_MS), "no message came"
        engine_core.receive()
        for _, _, future in engine_core.checking:
            future.result(timeout=WAIT_MS / 1000)
        engine_core.queue_checked()


def running_ids(engine_core) -> set[str]:
    return {r.request_id for r in engine_core.engine.scheduler.running}


def start_two(engine_core, peers) -> None:
    """A long request from each API server, both running a few steps."""
    for name in ("api-0", "api-1"):
        peers[name].send(m.encode(m.Hello()))
        peers[name].send(m.encode(m.AddRequest(f"{name}-r", [5, 6, 7, 8, 9], LONG)))
    take(engine_core, lambda: len(engine_core.owner) == 2)
    for _ in range(3):
        engine_core.step()
    assert running_ids(engine_core) == {"api-0-r", "api-1-r"}


@pytest.mark.parametrize("leaving", ["server died", "client left"])
def test_a_peer_that_goes_has_its_requests_ended_before_the_cores_next_step(core, leaving):
    """The supervisor's ClientGone (an API server died) or the server's Abort (its client left): right
    after the core read it, the request is not running and its blocks are free; the next step makes
    a token for the other request only."""
    engine_core, peers = core
    start_two(engine_core, peers)
    pool = engine_core.engine.scheduler.block_pool
    free_before = pool.num_free_blocks
    if leaving == "server died":
        peers["supervisor"].send(m.encode(m.ClientGone("api-0")))
    else:
        peers["api-0"].send(m.encode(m.Abort(["api-0-r"])))
    assert engine_core.socket.poll(WAIT_MS), "the message never came"
    engine_core.receive()                                          # what the core does with it, and no step
    assert running_ids(engine_core) == {"api-1-r"}                  # at once, not after max_tokens
    assert pool.num_free_blocks > free_before
    generated = engine_core.llm.stats.num_generated_tokens
    engine_core.step()
    assert engine_core.llm.stats.num_generated_tokens - generated == 1


# ---- the API server's side, against a stand-in engine core ------------------------------------------
@pytest.fixture
def client(tiny_model_dirs, tmp_path):
    """(a CoreClient connected to a ROUTER socket the test plays the engine core on, its tokenizer)."""
    llm = LLM(tiny_model_dirs["llama"], **SETTINGS)
    address = f"ipc://{tmp_path}/core"
    stand_in = zmq.Context.instance().socket(zmq.ROUTER)
    stand_in.setsockopt(zmq.LINGER, 0)
    stand_in.bind(address)
    lifeline, keep = multiprocessing.Pipe(duplex=False)           # `keep` open: the core is alive
    core_client = CoreClient("api-0", address, llm.llm_engine.config, llm.get_tokenizer(),
                             llm.llm_engine.runner.num_kv_blocks, lifeline)
    core_client.start()
    yield core_client, stand_in, llm.get_tokenizer()
    core_client.stop()
    stand_in.close(linger=0)
    keep.close()


def next_message(stand_in):
    """The next message an API server sends the stand-in core (its name frame dropped)."""
    assert stand_in.poll(WAIT_MS), "the API server sent nothing"
    _, payload = stand_in.recv_multipart()
    return m.core_decoder.decode(payload)


def play_core(stand_in, tokens: list[int], heard: list) -> None:
    """On a thread: accept the request, send its tokens one step at a time, then record what the API
    server says next."""
    assert isinstance(next_message(stand_in), m.Hello)
    add = next_message(stand_in)
    stand_in.send_multipart([b"api-0", m.encode(m.Accepted(add.request_id))])
    for token in tokens:
        delta = m.RequestDelta(add.request_id, [m.SampleDelta(0, [token], None, None, None)], 0)
        stand_in.send_multipart([b"api-0", m.encode(m.Outputs([delta]))])
    heard.append(next_message(stand_in))


def submit(core_client, body: dict):
    """The handler's side: submit a completion, return its last output."""
    async def run():
        submission = Submission(parse_request(body, "completion", "m"), ["r"], asyncio.get_running_loop())
        await core_client.submit(submission)
        return [o async for o in submission.results()][-1]
    return asyncio.run(asyncio.wait_for(run(), WAIT_MS / 1000))


def test_a_stop_string_the_api_server_finds_is_an_abort_to_the_engine_core(client):
    """The engine core runs without stop strings (the API server detokenizes): once the text holds the
    stop string, the client's answer ends there and the very next word to the core is the request's
    Abort, so the core stops generating it instead of running on to max_tokens."""
    core_client, stand_in, tokenizer = client
    tokens = tokenizer.encode("the cat sat on the mat and then a dog ran far away from home",
                              add_special_tokens=False)
    stop = "dog"
    heard: list = []
    core = threading.Thread(target=play_core, args=(stand_in, tokens, heard))
    core.start()
    out = submit(core_client, {"prompt": [5, 6, 7], "max_tokens": 100, "stop": [stop], "temperature": 0})
    core.join(WAIT_MS / 1000)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert stop not in out.outputs[0].text and len(out.outputs[0].token_ids) < len(tokens)
    assert [type(x) for x in heard] == [m.Abort] and heard[0].request_ids == ["r"]
    assert "r" not in core_client.in_core


def test_a_client_that_leaves_is_an_abort_to_the_engine_core_at_once(client):
    """The handler's abort (the client closed its connection) is the next message the core hears."""
    core_client, stand_in, _ = client

    async def leave():
        submission = Submission(parse_request({"prompt": [5, 6, 7], "max_tokens": 100}, "completion", "m"),
                                ["r"], asyncio.get_running_loop())
        sending = asyncio.ensure_future(core_client.submit(submission))
        await asyncio.to_thread(accept, stand_in)
        await sending
        core_client.abort(["r"])
        return await asyncio.to_thread(next_message, stand_in)

    heard = asyncio.run(asyncio.wait_for(leave(), WAIT_MS / 1000))
    assert isinstance(heard, m.Abort) and heard.request_ids == ["r"]
    assert "r" not in core_client.in_core


def accept(stand_in) -> None:
    assert isinstance(next_message(stand_in), m.Hello)
    add = next_message(stand_in)
    stand_in.send_multipart([b"api-0", m.encode(m.Accepted(add.request_id))])
