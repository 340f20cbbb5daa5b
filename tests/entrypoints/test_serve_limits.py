"""`nanopaged serve` against hostile clients: access control, bounded requests, no stalls.

One real server process (a tiny random Llama on a free loopback port) started with an API key
and short limits, driven over raw sockets where a client must misbehave: no key or a wrong
one is a 401, a body over the limit a 413 before it is read, deep JSON a 400, a body not sent
as JSON a 415, a hang-up mid-upload one log line; slow clients are cut off while others are
served, and a long prompt being tokenized holds up no one. The key is a made-up string.
docs/08_server.md, "Limits and access control".
"""
import asyncio
import http.client
import json
import pathlib
import select
import socket
import sys
import threading
import time

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402

KEY = "made-up-test-key-not-a-secret"
MAX_BODY = 2 * 1024 * 1024
HEAD_TIMEOUT_S, BODY_TIMEOUT_S, KEEP_ALIVE_S, CONCURRENCY = 1, 2, 2, 16
SERVER_ARGS = ["--block-size", "4", "--num-kv-blocks", "192", "--max-num-seqs", "8",
               "--api-key", KEY, "--max-request-body-bytes", str(MAX_BODY),
               "--timeout-request-header", str(HEAD_TIMEOUT_S), "--timeout-request-body", str(BODY_TIMEOUT_S),
               "--timeout-keep-alive", str(KEEP_ALIVE_S), "--limit-concurrency", str(CONCURRENCY)]
MODEL_NAME = "tiny"
COMPLETION = {"prompt": "Hello there", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        with start_nanopaged(tiny_model_dirs["llama"], SERVER_ARGS, served_model_name=MODEL_NAME,
                             timeout_s=120) as s:
            yield s
    log = s.log.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]        # nothing a client did here is a server error


def address(server) -> tuple[str, int]:
    host, port = server.base_url.removeprefix("http://").split(":")
    return host, int(port)


def request(server, method: str, path: str, body: bytes | None = None, authorization: str | None = f"Bearer {KEY}",
            content_type: str | None = "application/json") -> tuple[int, dict, bytes]:
    """One request on a connection of its own: (status, headers, body)."""
    headers = {k: v for k, v in {"Authorization": authorization, "Content-Type": content_type}.items()
               if v is not None}
    conn = http.client.HTTPConnection(*address(server), timeout=60)
    try:
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read()
    finally:
        conn.close()


def post(server, path: str, body, **kw) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, _, raw = request(server, "POST", path, data, **kw)
    return status, json.loads(raw) if raw else {}


def head_of(server, method: str, path: str, headers: dict) -> bytes:
    """A request's line and headers, as raw bytes, for clients that then misbehave."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {server.base_url.removeprefix('http://')}",
             f"Authorization: Bearer {KEY}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_response(sock: socket.socket, timeout_s: float = 30) -> tuple[int, bytes]:
    """Status and body of one response read off a raw socket (the server closes, or says the length)."""
    sock.settimeout(timeout_s)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(head.split(b" ")[1]), body


def is_closed(sock: socket.socket) -> bool:
    """The server closed this connection (it has nothing else to say on it)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def rss_bytes(pid: int) -> int:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def log_since(server, offset: int) -> str:
    return server.log.read_bytes()[offset:].decode(errors="replace")


# ---- who may ask -------------------------------------------------------------------------------
WRONG_AUTHORIZATIONS = [None, "Bearer wrong-key", f"Basic {KEY}", f"Token {KEY}", "Bearer", KEY,
                        f"Bearer {KEY}x", f"Bearer {KEY[:-1]}", f"Bearer  {KEY}"]
GUARDED = [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
           ("GET", "/v1/no-such-route"), ("GET", "/docs")]


@pytest.mark.parametrize("authorization", WRONG_AUTHORIZATIONS)
def test_without_the_right_key_every_route_is_a_401_with_the_error_body(server, authorization):
    for method, path in GUARDED:
        status, headers, raw = request(server, method, path, json.dumps(COMPLETION).encode(), authorization)
        assert status == 401, (method, path, raw)
        error = json.loads(raw)["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == "invalid_api_key"
        assert "Authorization: Bearer" in error["message"] and KEY not in raw.decode()
        assert headers["www-authenticate"] == "Bearer"


def test_the_right_key_opens_every_route_and_the_scheme_is_case_blind(server):
    for scheme in ("Bearer", "bearer", "BEARER"):
        status, _, raw = request(server, "GET", "/v1/models", authorization=f"{scheme} {KEY}")
        assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL_NAME
    status, answer = post(server, "/v1/completions", COMPLETION)
    assert status == 200 and answer["usage"]["completion_tokens"] == 4


def test_health_and_metrics_need_no_key(server):
    for path in ("/health", "/metrics"):
        status, _, raw = request(server, "GET", path, authorization=None)
        assert status == 200, (path, raw)
    assert b"nanopaged:kv_cache_usage_perc" in raw


def test_the_openai_client_with_the_key_works_end_to_end(server):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    whole = client.completions.create(model=MODEL_NAME, prompt="Once upon a time", max_tokens=6, temperature=0)
    stream = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                            max_tokens=6, temperature=0, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert whole.usage.completion_tokens == 6 and "".join(pieces)
    wrong = openai.OpenAI(base_url=server.base_url + "/v1", api_key="not-the-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=2)
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


# ---- how much one request may send ---------------------------------------------------------------
def test_a_body_over_the_limit_is_a_413_before_it_is_read(server):
    rss_before = rss_bytes(server.process.pid)
    # The length alone decides: the server answers before the client has sent a byte of the body.
    with socket.create_connection(address(server)) as sock:
        sock.sendall(head_of(server, "POST", "/v1/completions",
                             {"Content-Type": "application/json", "Content-Length": 16 * MAX_BODY}))
        start = time.monotonic()
        status, body = read_response(sock)
        assert status == 413 and time.monotonic() - start < 5
        assert "--max-request-body-bytes" in json.loads(body)["error"]["message"]
    # A client that sends all 32 MiB anyway still gets its 413; the server drops the bytes unread.
    status, answer = post(server, "/v1/completions", b"x" * (16 * MAX_BODY))
    assert status == 413 and str(MAX_BODY) in answer["error"]["message"]
    assert rss_bytes(server.process.pid) - rss_before < 8 * MAX_BODY // 2        # 32 MiB went by, not in


def test_a_chunked_body_over_the_limit_is_a_413_too(server):
    """No Content-Length to check up front: the server counts the bytes as they stream in."""
    chunks = (b"x" * 65536 for _ in range(MAX_BODY // 65536 + 8))
    conn = http.client.HTTPConnection(*address(server), timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=chunks,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 413 and "over" in json.loads(response.read())["error"]["message"]
    finally:
        conn.close()


DEEP = 10_000
TOO_DEEP_BODIES = [b"[" * DEEP + b"]" * DEEP,
                   b'{"a":' * DEEP + b"1" + b"}" * DEEP,
                   b'{"prompt": ' + b"[" * DEEP + b"1" + b"]" * DEEP + b"}",
                   b'{"prompt": ' + b"[" * 40 + b"1" + b"]" * 40 + b"}"]      # parses, but past 32 levels


@pytest.mark.parametrize("body", TOO_DEEP_BODIES, ids=["list", "object", "prompt", "40-deep"])
def test_json_nested_too_deep_is_a_400(server, body):
    offset = server.log.stat().st_size
    status, answer = post(server, "/v1/completions", body)
    assert status == 400 and "levels" in answer["error"]["message"], answer
    assert "Traceback" not in log_since(server, offset)


@pytest.mark.parametrize("content_type", [None, "text/plain", "text/plain; charset=utf-8",
                                          "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_not_sent_as_json_is_a_415(server, content_type):
    """What a browser page may POST to any address without asking first: refused."""
    status, answer = post(server, "/v1/completions", COMPLETION, content_type=content_type)
    assert status == 415 and "application/json" in answer["error"]["message"], answer


def test_json_with_a_charset_is_json(server):
    for content_type in ("application/json; charset=utf-8", "Application/JSON"):
        status, _ = post(server, "/v1/completions", COMPLETION, content_type=content_type)
        assert status == 200


def test_a_client_that_hangs_up_mid_upload_is_one_log_line(server):
    offset = server.log.stat().st_size
    for _ in range(3):
        with socket.create_connection(address(server)) as sock:
            sock.sendall(head_of(server, "POST", "/v1/completions",
                                 {"Content-Type": "application/json", "Content-Length": 1000}) + b'{"prompt":')
            time.sleep(0.05)                              # the handler is waiting for the rest
    deadline = time.monotonic() + 10
    while log_since(server, offset).count("hung up") < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    log = log_since(server, offset)
    assert log.count("hung up") == 3 and len(log.strip().splitlines()) == 3, log
    assert "Traceback" not in log and "internal" not in log
    assert post(server, "/v1/completions", COMPLETION)[0] == 200


MEGABYTE = "A" * 1_000_000
HUGE_VALUES = [
    ("/v1/chat/completions", {"messages": [{"role": MEGABYTE, "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi", "stop": [MEGABYTE, 5]}),
    ("/v1/completions", {"prompt": "hi", MEGABYTE: 1}),
    ("/v1/completions", {"prompt": "hi", "model": MEGABYTE}),
    ("/v1/completions", {"prompt": [[1, 2], MEGABYTE]}),
]


@pytest.mark.parametrize("path, body", HUGE_VALUES, ids=["role", "stop", "field", "model", "prompt"])
def test_an_error_about_a_1_mb_value_is_a_few_hundred_bytes(server, path, body):
    data = json.dumps(body).encode()
    status, _, raw = request(server, "POST", path, data)
    assert status == (404 if "model" in body else 400) and len(raw) < 2000, (status, len(raw))  # no such model
    message = json.loads(raw)["error"]["message"]
    assert "cut" in message and "characters" in message, message


def test_a_1_mb_image_on_a_text_model_is_refused_in_a_few_hundred_bytes(server):
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + MEGABYTE}}]}]}
    status, _, raw = request(server, "POST", "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and len(raw) < 2000 and "takes no images" in json.loads(raw)["error"]["message"]


# ---- no request stalls the others ---------------------------------------------------------------
def test_a_short_request_is_not_held_up_by_a_long_prompt_being_tokenized(server):
    """About a second of templating and tokenizing happens on an input thread: the short greedy
    request sent after it is queued, stepped and answered while the long one is still being
    tokenized. (A plain prompt that long is refused from its first characters, input_processor.py:
    a chat message goes through the chat template and is tokenized whole.)"""
    big = json.dumps({"messages": [{"role": "user", "content": "hello world " * 87_000}],
                      "max_tokens": 4}).encode()                                        # ~1 MB
    assert len(big) < MAX_BODY
    conn = http.client.HTTPConnection(*address(server), timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", body=big,
                     headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
        status, short = post(server, "/v1/completions", COMPLETION)          # sent after the long one
        long_answered_first = select.select([conn.sock], [], [], 0)[0] != []
        response = conn.getresponse()
        long = json.loads(response.read())
    finally:
        conn.close()
    assert status == 200 and short["usage"]["completion_tokens"] == 4
    assert response.status == 400 and "tokens" in long["error"]["message"]    # it was tokenized: too long
    assert not long_answered_first


def test_slow_clients_are_disconnected_while_others_are_served(server):
    silent = socket.create_connection(address(server))                 # connects, never says a word
    trickler = socket.create_connection(address(server))               # a header byte at a time, for ever
    trickler.sendall(b"GET /v1/models HTTP/1.1\r\nHost: test\r\nX-Slow: ")
    idle = socket.create_connection(address(server))                   # one request, then silence
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: test\r\n\r\n")
    assert read_response(idle)[0] == 200
    start, closed, served = time.monotonic(), {}, 0
    try:
        for _ in range(100):                                           # at most ~10 s (the limits: 1 and 2 s)
            for name, sock in (("silent", silent), ("trickler", trickler), ("idle", idle)):
                if name not in closed and is_closed(sock):
                    closed[name] = time.monotonic() - start
            if len(closed) == 3:
                break
            if "trickler" not in closed:
                try:
                    trickler.send(b"x")
                except OSError:
                    pass
            status, _, _ = request(server, "GET", "/v1/models")        # everyone else is served meanwhile
            assert status == 200
            served += 1
            time.sleep(0.05)
    finally:
        for sock in (silent, trickler, idle):
            sock.close()
    assert set(closed) == {"silent", "trickler", "idle"}, closed
    assert closed["trickler"] >= 0.8 * HEAD_TIMEOUT_S and closed["idle"] >= 0.8 * KEEP_ALIVE_S, closed
    assert served >= 5


def test_a_body_slower_than_its_timeout_is_a_408(server):
    with socket.create_connection(address(server)) as sock:
        sock.sendall(head_of(server, "POST", "/v1/completions",
                             {"Content-Type": "application/json", "Content-Length": 100}) + b'{"prompt":')
        start = time.monotonic()
        status, body = read_response(sock, timeout_s=BODY_TIMEOUT_S + 20)
        assert status == 408 and time.monotonic() - start >= 0.8 * BODY_TIMEOUT_S
        assert "--timeout-request-body" in json.loads(body)["error"]["message"]
        deadline = time.monotonic() + 5
        while not is_closed(sock) and time.monotonic() < deadline:     # and the connection is closed
            time.sleep(0.05)
        assert is_closed(sock) or sock.recv(1) == b""


def test_past_the_concurrency_limit_a_request_is_a_503(server):
    held = [socket.create_connection(address(server)) for _ in range(CONCURRENCY)]
    try:
        statuses = []
        for _ in range(20):                        # until the server has accepted every held connection
            statuses.append(request(server, "GET", "/v1/models")[0])
            if statuses[-1] == 503:
                break
            time.sleep(0.02)
        assert statuses[-1] == 503, statuses
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 10
    while request(server, "GET", "/v1/models")[0] != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert request(server, "GET", "/v1/models")[0] == 200


# ---- in process: where the tokenizer runs -------------------------------------------------------
def test_tokenizing_and_checking_run_on_the_input_threads_never_the_engine_thread(tiny_model_dirs):
    from nanopaged import LLM
    from nanopaged.entrypoints.openai.engine_loop import EngineLoop, Submission
    from nanopaged.entrypoints.openai.protocol import OpenAIError, parse_request
    engine = LLM(tiny_model_dirs["llama"], block_size=4, num_kv_blocks=64).llm_engine
    loop = EngineLoop(engine)                # (its one warm-up encode runs here, on this thread)
    seen: dict[str, list[str]] = {"encode": [], "apply_chat_template": [], "process_request": []}

    def recorded(name, fn):
        def wrapper(*args, **kw):
            seen[name].append(threading.current_thread().name)
            return fn(*args, **kw)
        return wrapper

    for name in ("encode", "apply_chat_template"):
        setattr(engine.tokenizer, name, recorded(name, getattr(engine.tokenizer, name)))
    engine.process_request = recorded("process_request", engine.process_request)

    async def answer(body: dict, kind: str, rid: str):
        submission = Submission(parse_request(body, kind, "m"), [rid], asyncio.get_running_loop())
        await loop.submit(submission)
        return [o async for o in submission.results()][-1].outputs[0].text

    loop.start()
    try:
        assert asyncio.run(answer(COMPLETION, "completion", "a"))
        assert asyncio.run(answer({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}, "chat", "b"))
        with pytest.raises(OpenAIError, match="tokens"):
            asyncio.run(answer({"prompt": "word " * 600}, "completion", "c"))     # too long: refused off it too
    finally:
        loop.stop()
    for name, threads in seen.items():
        assert threads and all(t.startswith("nanopaged-input") for t in threads), (name, threads)
    assert loop.thread.name not in {t for threads in seen.values() for t in threads}
    assert engine.scheduler.block_pool.usage() == 0 and not engine.has_unfinished_requests()


# ---- the command line ---------------------------------------------------------------------------
def test_the_limits_are_flags_with_defaults_and_the_key_comes_from_the_environment(monkeypatch):
    from nanopaged.entrypoints.serve import api_key, parse_args
    monkeypatch.delenv("NANOPAGED_API_KEY", raising=False)
    args = parse_args(["serve"])
    assert (args.max_request_body_bytes, args.timeout_request_header, args.timeout_request_body,
            args.timeout_keep_alive, args.limit_concurrency, args.h11_max_incomplete_event_size) == (
        8 * 1024 * 1024, 10.0, 60.0, 5.0, 512, 16384)
    assert api_key(args) is None
    monkeypatch.setenv("NANOPAGED_API_KEY", "from-the-environment")
    assert api_key(args) == "from-the-environment"
    assert api_key(parse_args(["--api-key", "from-the-flag"])) == "from-the-flag"      # the flag wins
    with pytest.raises(ValueError, match="empty"):
        api_key(parse_args(["--api-key", " "]))
    for bad in (["--max-request-body-bytes", "0"], ["--timeout-request-header", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_only_loopback_hosts_count_as_this_machine_only():
    from nanopaged.entrypoints.serve import access_warning
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert access_warning(host, 8000, api_key=None) is None
    for host in ("0.0.0.0", "::", "192.168.1.5", "myhost.example"):
        warning = access_warning(host, 8000, api_key=None)
        assert host in warning and "--api-key" in warning
        assert access_warning(host, 8000, api_key="k") is None
