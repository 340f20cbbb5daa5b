"""`nanopaged serve`: the real server process, driven by the official `openai` client.

One server per module (a tiny random Llama on a free loopback port), killed at the end.
Greedy answers must equal `LLM.generate`'s for the same prompt, streamed or not; every bad
request is a 400 with OpenAI's error body and the server goes on; a client that leaves
mid-stream frees its blocks; a stop string the API server finds stops the request in the engine core
(counted in the core's generated tokens, since the answer is the same either way); 64 concurrent streams all complete with the offline answers;
`/metrics` parses and its counters move. docs/08_server.md explains the server.
"""
import asyncio
import http.client
import json
import pathlib
import random
import sys
import time
import urllib.error
import urllib.request

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM, SamplingParams  # noqa: E402

# Few blocks on purpose: 64 clients at once do not fit, so the load test preempts. float32: the
# server batches its clients differently from one offline call, and in bfloat16 (the default on
# CPUs with bf16 matrix units) a different batch may round a greedy choice the other way.
SETTINGS = dict(block_size=4, num_kv_blocks=192, max_num_seqs=32, dtype="float32")
ENGINE_ARGS = ["--block-size", "4", "--num-kv-blocks", "192", "--max-num-seqs", "32", "--dtype", "float32"]
MODEL_NAME = "tiny"


@pytest.fixture(scope="module")
def server(tiny_model_dirs):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)      # this server takes no key
        with start_nanopaged(tiny_model_dirs["llama"], ENGINE_ARGS, served_model_name=MODEL_NAME,
                             timeout_s=120) as s:
            yield s
    assert s.process.poll() is not None, "the server process outlived its test module"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def offline(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], **SETTINGS)


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def metrics(server) -> dict:
    """Every sample of /metrics, parsed by prometheus-client's own parser: {name{labels}: value}."""
    from prometheus_client.parser import text_string_to_metric_families
    text = urllib.request.urlopen(server.base_url + "/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def runs_down_to(server, running: int, steps: int, per_step: int, guard_s: float = 120.0) -> tuple[bool, dict]:
    """Poll /metrics until the engine core runs at most `running` requests: (True, metrics), or (False,
    metrics) once the core generated more than `steps` steps of `per_step` tokens first. A bound counted
    in the core's work, not in seconds: a loaded machine slows both sides alike (`guard_s` only ends a hang)."""
    start, deadline = None, time.monotonic() + guard_s
    while True:
        m = metrics(server)
        start = m["nanopaged:generation_tokens_total"] if start is None else start
        if m["nanopaged:num_requests_running"] <= running:
            return True, m
        if m["nanopaged:generation_tokens_total"] - start > steps * per_step or time.monotonic() > deadline:
            return False, m


def wait_idle(server, timeout_s=20.0) -> dict:
    """/metrics once nothing runs or waits (polling: aborts land on the engine thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(server)
        idle = m["nanopaged:num_requests_running"] == 0 and m["nanopaged:num_requests_waiting"] == 0
        if (idle and m["nanopaged:kv_cache_usage_perc"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def post(server, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(server.base_url + path, data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def streamed_text(stream) -> tuple[dict, dict, object]:
    """Concatenated text and the finish reason of each choice of a completion or chat stream."""
    texts, reasons, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            piece = c.delta.content if hasattr(c, "delta") else c.text
            texts[c.index] = texts.get(c.index, "") + (piece or "")
            if c.finish_reason:
                reasons[c.index] = c.finish_reason
    return texts, reasons, usage


# ---- answers -------------------------------------------------------------------------------------
def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]


def test_greedy_completion_streamed_equals_whole_equals_offline(client, offline):
    prompt = "Once upon a time, in a land far away"
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0)
    texts, reasons, usage = streamed_text(client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    expected = offline.generate(prompt, greedy(24), use_tqdm=False)[0]
    assert whole.choices[0].text == texts[0] == expected.outputs[0].text
    assert whole.choices[0].finish_reason == reasons[0] == expected.outputs[0].finish_reason
    assert whole.object == "text_completion" and whole.id.startswith("cmpl-") and whole.model == MODEL_NAME
    n_out = len(expected.outputs[0].token_ids)
    for u in (whole.usage, usage):
        assert (u.prompt_tokens, u.completion_tokens) == (len(expected.prompt_token_ids), n_out)
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_greedy_chat_streamed_equals_whole_equals_offline(client, offline):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=20, temperature=0)
    texts, reasons, _ = streamed_text(client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_completion_tokens=20, temperature=0, stream=True))
    expected = offline.chat(messages, greedy(20), use_tqdm=False)[0]
    assert whole.choices[0].message.content == texts[0] == expected.outputs[0].text
    assert whole.choices[0].message.role == "assistant" and whole.object == "chat.completion"
    assert whole.choices[0].finish_reason == reasons[0] == expected.outputs[0].finish_reason
    assert whole.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_return_token_ids_gives_the_tokens_beside_the_text(server, offline):
    """vLLM's extra field `return_token_ids`: each choice's token ids (and the prompt's), whole or
    streamed (a stream's chunks carry the tokens new in each); the text is unchanged."""
    prompt = "Once upon a time"
    expected = offline.generate(prompt, greedy(12), use_tqdm=False)[0]
    status, body = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12,
                                                     "temperature": 0, "return_token_ids": True})
    [choice] = body["choices"]
    assert status == 200 and choice["text"] == expected.outputs[0].text
    assert choice["token_ids"] == list(expected.outputs[0].token_ids)
    assert choice["prompt_token_ids"] == list(expected.prompt_token_ids)
    messages = [{"role": "user", "content": "Name a colour."}]
    chat = offline.chat(messages, greedy(8), use_tqdm=False)[0]
    status, body = post(server, "/v1/chat/completions", {"model": MODEL_NAME, "messages": messages,
                                                          "max_tokens": 8, "temperature": 0, "return_token_ids": True})
    assert body["choices"][0]["token_ids"] == list(chat.outputs[0].token_ids)
    assert body["prompt_token_ids"] == list(chat.prompt_token_ids)
    request = urllib.request.Request(server.base_url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12,
                                                      "temperature": 0, "stream": True,
                                                      "return_token_ids": True}).encode())
    with urllib.request.urlopen(request, timeout=30) as r:
        chunks = [json.loads(line[6:]) for line in r.read().decode().splitlines()
                  if line.startswith("data: {")]
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == list(expected.outputs[0].token_ids)
    status, body = post(server, "/v1/completions", {"model": MODEL_NAME, "prompt": prompt, "return_token_ids": 1})
    assert status == 400 and body["error"]["param"] == "return_token_ids"


def test_token_id_prompts_and_several_prompts_number_the_choices(client, offline, make_prompts):
    prompts = make_prompts(512, n=2, seed=3)
    whole = client.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=12, temperature=0)
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts], greedy(12), use_tqdm=False)
    assert [c.index for c in whole.choices] == [0, 1]
    assert [c.text for c in whole.choices] == [e.outputs[0].text for e in expected]
    assert whole.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_n2_with_a_seed_is_reproducible_and_counts_usage(client, offline):
    prompt, kw = "The weather today", dict(n=2, temperature=1.0, seed=7, max_tokens=10)
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, **kw)
    again = client.completions.create(model=MODEL_NAME, prompt=prompt, **kw)
    texts, _, usage = streamed_text(client.completions.create(
        model=MODEL_NAME, prompt=prompt, stream=True, stream_options={"include_usage": True}, **kw))
    expected = offline.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0]
    answers = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert answers == [c.text for c in again.choices] == [texts[0], texts[1]] == [o.text for o in expected.outputs]
    assert answers[0] != answers[1]                    # sample i draws with seed + i
    tokens = sum(len(o.token_ids) for o in expected.outputs)
    assert first.usage.completion_tokens == usage.completion_tokens == tokens
    assert first.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_a_stop_string_cuts_the_text_streamed_or_not(client):
    prompt = "A list of words:"
    text = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    stop = text[8:11]
    cut = text[:text.find(stop)]
    whole = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=30, temperature=0, stop=[stop])
    texts, reasons, _ = streamed_text(client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=30, temperature=0, stop=stop, stream=True))
    assert whole.choices[0].text == texts[0] == cut
    assert whole.choices[0].finish_reason == reasons[0] == "stop"
    assert whole.choices[0].model_extra["stop_reason"] == stop      # vLLM's extra field


def test_logprobs_in_both_formats(client):
    whole = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=6, temperature=0, logprobs=2)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == whole.usage.completion_tokens
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert chosen == pytest.approx(max(top.values()))       # greedy: the chosen one is the likeliest
    chat = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)
    streamed = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=5, temperature=0, logprobs=True, top_logprobs=2,
                                              stream=True)
    tokens = [t.token for chunk in streamed for c in chunk.choices if c.logprobs for t in c.logprobs.content]
    assert tokens == [t.token for t in content]


# ---- bad requests ----------------------------------------------------------------------------------
BAD_COMPLETIONS = [
    (b"{not json", None),
    (b"[1, 2]", None),
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "n": 0}, "n"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ({"prompt": "hi", "stop": 5}, "stop"),
    ({"prompt": "hi", "seed": 2**70}, "seed"),
    ({"prompt": "hi", "stream": "yes"}, "stream"),
    ({"prompt": "hi", "best_of": 2}, "best_of"),
    ({"prompt": "hi", "echo": True}, "echo"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"prompt": "word " * 600}, "prompt"),                  # longer than the 512-token context
    ({"prompt": [7] * 512}, "prompt"),
    ({"prompt": [100_000]}, "prompt"),                       # outside the vocabulary
    ({"prompt": "hi", "max_tokens": 1000}, "max_tokens"),   # past the context: refused, as vLLM
    ({"prompt": "hi", "n": 33}, "n"),                        # more than max_num_seqs
]
BAD_CHATS = [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1}, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "hi"}, "prompt"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "retrieval"}]}, "tools"),
    # a request with tools asks for tool_choice "auto" (vLLM's default), which needs --enable-auto-tool-choice
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice"),
]


@pytest.mark.parametrize("path, body, param", [("/v1/completions", b, p) for b, p in BAD_COMPLETIONS]
                         + [("/v1/chat/completions", b, p) for b, p in BAD_CHATS])
def test_a_bad_request_is_a_400_with_the_error_body(server, path, body, param):
    status, answer = post(server, path, body)
    assert status == 400, answer
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["message"] and error["param"] == param


def test_an_unknown_model_is_a_404_as_in_vllm(server):
    status, answer = post(server, "/v1/completions", {"prompt": "hi", "model": "gpt-4"})
    assert status == 404 and answer["error"] == {"message": "The model `gpt-4` does not exist.",
                                                 "type": "NotFoundError", "param": "model", "code": 404}


def test_tokenize_and_detokenize_round_trip_in_vllms_shapes(server, offline):
    tokenizer = offline.get_tokenizer()
    text = "The sea is calm tonight, and the tide is full."
    status, answer = post(server, "/tokenize", {"model": MODEL_NAME, "prompt": text, "return_token_strs": True})
    assert status == 200 and answer["tokens"] == tokenizer.encode(text)
    assert answer["count"] == len(answer["tokens"]) and answer["max_model_len"] == offline.llm_engine.config.max_model_len
    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    status, back = post(server, "/detokenize", {"model": MODEL_NAME, "tokens": answer["tokens"]})
    assert status == 200 and back == {"prompt": tokenizer.decode(answer["tokens"])}
    assert post(server, "/tokenize", {"prompt": text, "add_special_tokens": False})[1]["tokens"] == \
        tokenizer.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "Hello there"}]
    status, chat = post(server, "/tokenize", {"messages": messages})
    expected = offline.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    assert status == 200 and chat["tokens"] == expected and chat["token_strs"] is None


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "prompt"),
    ("/tokenize", {}, 400, "messages"),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
    ("/tokenize", {"prompt": "x", "temperature": 0}, 400, "temperature"),
    ("/tokenize", {"prompt": "x", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [1, 10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {"tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "gpt-4"}, 404, "model")])
def test_bad_tokenize_and_detokenize_requests_name_their_field(server, path, body, status, param):
    got, answer = post(server, path, body)
    assert got == status and answer["error"]["param"] == param, answer


@pytest.mark.parametrize("path, body, where", [
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi"}', "model"),
    ("/v1/completions", '{"prompt": "hi \\udfff there", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}', "stop[0]"),
    ("/v1/completions", '{"prompt": "hi", "\\ud800": 1}', "body"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"messages": [{"role": "\\ud83d", "content": "x"}]}', "messages[0].role")])
def test_a_lone_surrogate_anywhere_is_a_400_naming_where_it_is(server, path, body, where):
    """JSON may escape half of a UTF-16 pair; Python then holds a string UTF-8 cannot encode. Every such
    request is a 400 naming the place, inside a list as in a string field, and the answer is JSON that
    encodes (never a 500 from an error message that cannot be written)."""
    status, answer = post(server, path, body.encode())
    assert status == 400 and answer["error"]["param"] == where, answer
    assert json.dumps(answer).encode()


def test_the_server_answers_after_bad_requests(server, client):
    for body, _ in BAD_COMPLETIONS[:5]:
        post(server, "/v1/completions", body)
    assert urllib.request.urlopen(server.base_url + "/health", timeout=5).status == 200
    assert client.completions.create(model=MODEL_NAME, prompt="ok", max_tokens=3, temperature=0).choices[0].text
    assert wait_idle(server)["nanopaged:kv_cache_usage_perc"] == 0


def test_the_openai_client_sees_an_unsupported_field_named(client):
    with pytest.raises(openai.BadRequestError, match="frobnicate"):
        client.completions.create(model=MODEL_NAME, prompt="hi", extra_body={"frobnicate": 1})


# ---- aborts, load, metrics ---------------------------------------------------------------------------
def test_a_client_that_leaves_mid_stream_frees_every_block(server):
    before = wait_idle(server)
    aborted = 'nanopaged:request_success_total{finished_reason=abort}'
    host, port = server.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(
        {"prompt": "Tell me everything", "max_tokens": 480, "temperature": 0, "ignore_eos": True,
         "stream": True}), {"Content-Type": "application/json"})
    response = conn.getresponse()
    events = 0
    while events < 3:                                     # a few tokens in: the request is running
        events += response.readline().startswith(b"data: ")
    assert metrics(server)["nanopaged:kv_cache_usage_perc"] > 0
    conn.sock.close()                                     # leave without a word
    conn.close()
    after = wait_idle(server)
    assert after["nanopaged:kv_cache_usage_perc"] == 0
    assert after["nanopaged:num_requests_running"] == after["nanopaged:num_requests_waiting"] == 0
    assert after.get(aborted, 0) == before.get(aborted, 0) + 1
    assert after["nanopaged:generation_tokens_total"] - before["nanopaged:generation_tokens_total"] < 480


def test_a_stop_string_the_api_server_finds_stops_the_request_in_the_engine_core(server, offline):
    """The engine core runs without stop strings (the API server detokenizes and finds them), so the API
    server must abort the request in the core; the client's answer is the same either way. Counted in
    the core's generated tokens (/metrics): within a few steps of the answer's, never on to max_tokens."""
    tokenizer = offline.get_tokenizer()
    ids = offline.generate("Tell me everything", greedy(16, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    stop = next(w for w in (tokenizer.decode(ids[10:14])[i:i + 3] for i in range(8)) if w.strip() == w and len(w) == 3)
    before = wait_idle(server)
    status, answer = post(server, "/v1/completions", {"prompt": "Tell me everything", "max_tokens": 480,
                                                      "temperature": 0, "ignore_eos": True, "stop": [stop]})
    after = wait_idle(server)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "stop", answer
    answered = answer["usage"]["completion_tokens"]
    generated = after["nanopaged:generation_tokens_total"] - before["nanopaged:generation_tokens_total"]
    assert answered < 20 and answered <= generated < answered + 100, (answered, generated)


def test_64_concurrent_streaming_clients_all_get_the_offline_answers(server, offline, make_prompts):
    rng = random.Random(0)
    prompts = make_prompts(512, n=64, seed=11, min_len=3, max_len=80)
    max_tokens = [rng.randint(2, 40) for _ in prompts]

    async def one(client, prompt, m):
        stream = await client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=m, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, ids, reason, usage = "", set(), None, None
        async for chunk in stream:
            ids.add(chunk.id)
            usage = chunk.usage or usage
            for c in chunk.choices:
                text += c.text
                reason = c.finish_reason or reason
        return ids, text, reason, usage

    async def all_at_once():
        client = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, p, m) for p, m in zip(prompts, max_tokens)))
        finally:
            await client.close()

    before = metrics(server)
    results = asyncio.run(all_at_once())
    expected = offline.generate([{"prompt_token_ids": p} for p in prompts],
                                [greedy(m) for m in max_tokens], use_tqdm=False)
    ids = [r[0] for r in results]
    assert all(len(i) == 1 for i in ids) and len(set.union(*ids)) == 64     # one id each, none shared
    assert [r[1] for r in results] == [e.outputs[0].text for e in expected]
    assert [r[2] for r in results] == [e.outputs[0].finish_reason for e in expected]
    assert [r[3].completion_tokens for r in results] == [len(e.outputs[0].token_ids) for e in expected]
    after = wait_idle(server)
    assert after["nanopaged:kv_cache_usage_perc"] == 0
    e2e = "nanopaged:e2e_request_latency_seconds_count"
    assert after[e2e] == before[e2e] + 64                                      # each finished once
    assert after["nanopaged:num_preemptions_total"] > before["nanopaged:num_preemptions_total"]   # the pool was short


def test_metrics_parse_and_their_counters_move(server, client):
    names = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
             "prefix_cache_queries_total", "prefix_cache_hits_total", "prompt_tokens_total",
             "generation_tokens_total", "time_to_first_token_seconds_count",
             "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count"]
    before = wait_idle(server)
    assert all("nanopaged:" + n in before for n in names), sorted(before)
    prompt = "Counting tokens, twice over"
    for _ in range(2):       # the second time the prompt's full blocks are prefix-cache hits
        out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True})
    after = wait_idle(server)
    delta = {n: after["nanopaged:" + n] - before["nanopaged:" + n] for n in names}
    assert delta["prompt_tokens_total"] == 2 * out.usage.prompt_tokens
    assert delta["generation_tokens_total"] == 2 * 8
    assert delta["prefix_cache_queries_total"] == 2 * out.usage.prompt_tokens
    assert delta["prefix_cache_hits_total"] >= 4 * ((out.usage.prompt_tokens - 1) // 4) > 0
    for n in ("time_to_first_token_seconds_count", "time_per_output_token_seconds_count",
              "e2e_request_latency_seconds_count"):
        assert delta[n] == 2
    assert after["nanopaged:time_to_first_token_seconds_sum"] > before["nanopaged:time_to_first_token_seconds_sum"]
    assert after["nanopaged:kv_cache_usage_perc"] == 0


def test_a_failed_step_ends_its_requests_with_an_error_and_the_loop_serves_on(offline):
    """In process: the engine loop around the offline engine, whose step fails once."""
    from nanopaged.entrypoints.openai.engine_loop import EngineLoop, Submission
    from nanopaged.entrypoints.openai.protocol import OpenAIError, parse_request
    engine, real_step, calls = offline.llm_engine, offline.llm_engine.step, []

    def failing_once(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real_step(*args)

    async def complete(rid):
        request = parse_request({"prompt": "Hi there", "max_tokens": 4, "temperature": 0}, "completion", "m")
        submission = Submission(request, [rid], asyncio.get_running_loop())
        await loop.submit(submission)
        return [o async for o in submission.results()][-1].outputs[0].text

    loop = EngineLoop(engine)
    engine.step = failing_once
    loop.start()
    try:
        with pytest.raises(OpenAIError, match="injected") as failed:
            asyncio.run(complete("first"))
        assert failed.value.status == 500
        text = asyncio.run(complete("second"))
    finally:
        loop.stop()
        del engine.step                                   # the class's step again
    assert text == offline.generate("Hi there", greedy(4), use_tqdm=False)[0].outputs[0].text
    assert engine.scheduler.block_pool.usage() == 0 and not engine.has_unfinished_requests()


# ---- the command line and the benchmark ---------------------------------------------------------------
def test_every_engine_setting_is_a_kebab_case_flag():
    from nanopaged.entrypoints.serve import engine_settings, parse_args
    args = parse_args(["serve", "/some/model", "--port", "9001", "--block-size", "8",
                       "--no-enable-prefix-caching", "--cpu-threads", "none", "--prefix-hash", "xxhash"])
    assert (args.model, args.port) == ("/some/model", 9001)
    assert engine_settings(args) == {"block_size": 8, "enable_prefix_caching": False, "cpu_threads": None,
                                     "prefix_hash": "xxhash"}
    assert parse_args([]).model is None                   # the demo model
    with pytest.raises(SystemExit):
        parse_args(["--no-such-setting", "1"])


def test_batch_invariance_is_a_flag_that_is_auto_when_not_given():
    from nanopaged.entrypoints.serve import engine_settings, parse_args
    assert "batch_invariant" not in engine_settings(parse_args(["serve"]))
    assert engine_settings(parse_args(["serve", "--batch-invariant"]))["batch_invariant"] is True
    assert engine_settings(parse_args(["serve", "--no-batch-invariant"]))["batch_invariant"] is False


def test_nanopaged_imports_without_the_serve_extra():
    """The core needs no web framework: importing nanopaged (and the CLI module) pulls none in."""
    import subprocess
    code = ("import sys, nanopaged, nanopaged.entrypoints.serve; "
            "print(sorted({'fastapi', 'uvicorn', 'prometheus_client', 'openai'} & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_the_serve_benchmark_runs(tiny_model_dirs, tmp_path):
    import bench
    out = tmp_path / "serve.json"
    result = bench.main(["--workload", "serve", "--model", tiny_model_dirs["llama"], "--num-requests", "4",
                         "--rate", "inf", "--input-len", "4", "8", "--output-len", "12", "24", "--peers", "none",
                         "--dataset", "random",     # the chat set's system prompt is longer than 512 positions
                         "--engine-args", "--block-size 4 --num-kv-blocks 64", "--json", str(out)])
    figures = result["servers"]["nanopaged"]["datasets"]["random"]["inf"]
    # up to 24 tokens each: some stream in more than one chunk (a handful of tokens could all come in one, no ITL)
    assert figures["completed"] == 4 and figures["failed"] == 0
    assert figures["output_tokens_per_s"] > 0 and figures["ttft_ms_p50"] > 0 and figures["itl_ms_p50"] > 0
    assert json.loads(out.read_text())["servers"]["nanopaged"]["datasets"]["random"]["inf"]["completed"] == 4


def test_ctrl_c_stops_the_server_without_a_traceback(tiny_model_dirs):
    """SIGINT (Ctrl-C in a terminal): uvicorn shuts down, then re-raises it; the server says
    it stopped and exits 0, with no traceback in its output."""
    import signal
    with start_nanopaged(tiny_model_dirs["llama"], ENGINE_ARGS, timeout_s=120) as s:
        s.process.send_signal(signal.SIGINT)
        assert s.process.wait(timeout=30) == 0
    out = s.log.read_text(errors="replace")
    assert "nanopaged: stopped" in out and "Traceback" not in out, out[-2000:]
