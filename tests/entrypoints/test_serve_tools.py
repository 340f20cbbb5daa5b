"""`nanopaged serve` with tool calling, driven by the official `openai` client.

Two servers per module. The demo model (SmolLM2-135M-Instruct, whose template ignores tools) in the
default layout (an engine core and an API server), with `--tool-call-parser llama3_json`; a tiny random
Qwen2 whose template is Qwen's, with tools and tool messages (written into its folder here), in one
process (`--engine-in-process`), with `--tool-call-parser hermes`. `required` and a named function are
constrained by the structured-output backend, so their arguments validate against the tool's schema; a
random model's free text never holds a call, so `auto` is shown on an output forced, by a regex, into the
parser's format. Streamed tool calls add up to the whole response's; LLM.chat(tools=...) renders as the
server does. docs/08_server.md, "Tool calling".
"""
import json
import pathlib
import re
import shutil
import sys

import pytest

for module in ("fastapi", "uvicorn", "prometheus_client"):
    pytest.importorskip(module, reason="the serve extra: pip install -e '.[serve]'")
pytest.importorskip("xgrammar", reason="the structured extra: pip install -e '.[structured]'")
openai = pytest.importorskip("openai", reason="the test extra: pip install -e '.[test]'")
jsonschema = pytest.importorskip("jsonschema", reason="the test extra: pip install -e '.[test]'")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM, SamplingParams  # noqa: E402
from test_serve import post  # noqa: E402

SETTINGS = dict(block_size=16, num_kv_blocks=64, max_num_seqs=8, dtype="float32")
ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "64", "--max-num-seqs", "8", "--dtype", "float32"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city", "days"],
                   "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now"}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": {"type": "object", "properties": {}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next three days?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CALL_TOKENS = {"demo": 300, "qwen": 200}          # room for the calls

# Qwen2.5's chat template, its instructions shortened (the tiny model has 512 positions): tools in the
# system message, an assistant's calls as <tool_call> JSON, tool results as <tool_response> in a user turn.
QWEN_TOOLS_TEMPLATE = """\
{%- if tools %}{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
{{- '\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\nCall one as <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}{%- set call = tool_call.function %}
{{- '\\n<tool_call>\\n{"name": "' + call.name + '", "arguments": ' }}{{- call.arguments | tojson }}{{- '}\\n</tool_call>' }}
{%- endfor %}{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


@pytest.fixture(scope="module")
def qwen_dir(tiny_model_dirs, tmp_path_factory):
    """The tiny Qwen2 with Qwen's tool-calling template, and 1024 positions (the tools take 400 tokens)."""
    folder = tmp_path_factory.mktemp("qwen_tools") / "qwen2"
    shutil.copytree(tiny_model_dirs["qwen2"], folder)
    model_config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**model_config, "max_position_embeddings": 1024}))
    (folder / "chat_template.jinja").unlink(missing_ok=True)     # transformers 5 keeps the template here
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TOOLS_TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return str(folder)


def started(model_dir, name, extra):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        return start_nanopaged(model_dir, ENGINE_ARGS + extra, served_model_name=name, timeout_s=180)


@pytest.fixture(scope="module")
def demo_server(demo_model_dir):
    with started(demo_model_dir, "demo", ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]) as s:
        yield s


@pytest.fixture(scope="module")
def qwen_server(qwen_dir):
    with started(qwen_dir, "qwen", ["--engine-in-process", "--enable-auto-tool-choice",
                                    "--tool-call-parser", "hermes"]) as s:
        yield s


def client_of(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def chat(server, **kw):
    return client_of(server).chat.completions.create(**{
        "model": server.model_name,
        "messages": ASK, "tools": TOOLS, "max_tokens": 100, "temperature": 0, **kw})


def stream(server, **kw) -> tuple[str | None, list[dict], str]:
    """(content, tool calls, finish reason) of a stream, assembled from its deltas as a client does."""
    content, calls, reason = "", [], None
    for chunk in chat(server, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for piece in choice.delta.tool_calls or []:
                if piece.id is not None:                 # a call's first delta: its id, type and name
                    assert piece.index == len(calls) and piece.type == "function"
                    calls.append({"id": piece.id, "name": piece.function.name, "arguments": ""})
                calls[piece.index]["arguments"] += piece.function.arguments or ""
            reason = choice.finish_reason or reason
    return content or None, calls, reason


def calls_of(message) -> list[dict]:
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]


def check_calls(calls: list[dict]) -> None:
    assert calls
    for call in calls:
        assert call["id"].startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def without_ids(calls):
    return [(c["name"], c["arguments"]) for c in calls]


# ---- required and a named function: the arguments follow the schema ----------------------------------
@pytest.mark.parametrize("which", ["demo", "qwen"])
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_constrained_tool_calls_validate_streamed_and_whole_alike(request, which, tool_choice):
    server = request.getfixturevalue(f"{which}_server")
    # Greedy, a small model writes the same call again and again (vLLM's array has no maxItems): a
    # repetition penalty lets it close the array, as a client of such a model would set it.
    kw = dict(tool_choice=tool_choice, max_tokens=CALL_TOKENS[which], extra_body={"repetition_penalty": 1.5})
    whole = chat(server, **kw).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content is None, whole
    calls = calls_of(whole.message)
    check_calls(calls)
    if tool_choice == NAMED:
        assert [c["name"] for c in calls] == ["get_weather"]
    content, streamed, reason = stream(server, **kw)
    assert (content, reason) == (None, "tool_calls")
    assert without_ids(streamed) == without_ids(calls)


# ---- auto: the parser reads the model's own format ---------------------------------------------------
HERMES_CALL = (r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
               r'"days": [1-3]\}\}</tool_call>')
LLAMA_CALLS = (r'\{"name": "get_weather", "parameters": \{"city": "(Paris|Oslo)", "days": 3\}\}; '
               r'\{"name": "get_time", "parameters": \{\}\}')


@pytest.mark.parametrize("which, regex, content, names", [
    ("qwen", HERMES_CALL, "Checking. ", ["get_weather"]),
    ("demo", LLAMA_CALLS, None, ["get_weather", "get_time"])], ids=["hermes", "llama3_json"])
def test_auto_finds_the_calls_in_the_models_format_streamed_and_whole(request, which, regex, content, names):
    server = request.getfixturevalue(f"{which}_server")
    forced = {"structured_outputs": {"regex": regex}}
    whole = chat(server, tool_choice="auto", extra_body=forced).choices[0]
    calls = calls_of(whole.message)
    assert (whole.message.content, [c["name"] for c in calls], whole.finish_reason) == (content, names, "tool_calls")
    check_calls(calls)
    streamed_content, streamed, reason = stream(server, extra_body=forced)          # auto: the default
    assert (streamed_content, without_ids(streamed), reason) == (content, without_ids(calls), "tool_calls")


def test_auto_text_without_a_call_is_the_content(qwen_server):
    whole = chat(qwen_server, max_tokens=12).choices[0]
    assert whole.message.tool_calls is None and whole.message.content
    content, calls, _ = stream(qwen_server, max_tokens=12)
    assert (content, calls) == (whole.message.content, [])


# ---- rendering: the template shows the tools; a tool result comes back --------------------------------
@pytest.fixture(scope="module")
def offline_qwen(qwen_dir):
    return LLM(qwen_dir, **SETTINGS)


def test_tool_choice_none_renders_the_tools_as_llm_chat_does(qwen_server, offline_qwen):
    answer = chat(qwen_server, tool_choice="none", max_tokens=16)
    expected = offline_qwen.chat(ASK, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False, tools=TOOLS)[0]
    assert answer.choices[0].message.content == expected.outputs[0].text
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert '"name": "get_weather"' in expected.prompt and "# Tools" in expected.prompt       # shown to the model
    plain = offline_qwen.chat(ASK, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert "# Tools" not in plain.prompt


def test_a_multi_turn_exchange_with_a_tool_result(qwen_server, offline_qwen):
    """As an agent does it: a required call, its message sent back with the tool's result, then text."""
    first = chat(qwen_server, tool_choice=NAMED, max_tokens=CALL_TOKENS["qwen"]).choices[0].message
    call = first.tool_calls[0]
    messages = ASK + [first.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "22 C and sunny"}]
    answer = chat(qwen_server, messages=messages, tool_choice="none", max_tokens=16)
    expected = offline_qwen.chat(messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False,
                                 tools=TOOLS)[0]
    assert answer.choices[0].message.content == expected.outputs[0].text
    assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
    arguments = json.dumps(json.loads(call.function.arguments), ensure_ascii=False)   # an object, not a string
    assert f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>' in expected.prompt
    assert "<tool_response>\n22 C and sunny\n</tool_response>" in expected.prompt


def test_the_demo_model_takes_tool_messages_too(demo_server):
    call = {"id": "chatcmpl-tool-0", "type": "function",
            "function": {"name": "get_time", "arguments": "{}"}}
    messages = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "chatcmpl-tool-0", "content": "It is noon."}]
    answer = chat(demo_server, messages=messages, tool_choice="none", max_tokens=8).choices[0]
    assert answer.message.content and answer.message.tool_calls is None


# ---- bad input: a 400 naming the field; offline, a ValueError; at start, an exit --------------------------
MESSAGES = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body, param, match", [
    ({"tools": "get_weather"}, "tools", r"tools must be a list"),
    ({"tools": [{"type": "retrieval"}]}, "tools", r"tools\[0\] must be"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools", r"JSON Schema"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]}, "tools",
     r"schema of an object"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}}, "tool_choice",
     r"not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", r"needs tools"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice", r'must be "none", "auto", "required"'),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     r"not both"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}}}}],
      "tool_choice": "required"}, "tools", r"tools' parameters schema"),
    ({"messages": MESSAGES + [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]},
     "messages", r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be JSON"),
])
def test_bad_tools_are_a_400_naming_the_field(demo_server, body, param, match):
    status, answer = post(demo_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, **body})
    assert status == 400 and answer["error"]["param"] == param, answer
    assert re.search(match, answer["error"]["message"]), answer
    assert post(demo_server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})[0] == 200


def test_llm_chat_refuses_bad_tools_before_any_work(offline_qwen):
    with pytest.raises(ValueError, match=r"tools\[0\]\.function\.parameters must be the schema of an object"):
        offline_qwen.chat(ASK, tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}])
    assert not offline_qwen.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("argv, message", [
    (["--tool-call-parser", "mistral"], "'mistral' is not a tool parser; choose from ['hermes', 'llama3_json']"),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser")])
def test_a_bad_tool_flag_stops_the_server_at_start(capsys, argv, message):
    from nanopaged.entrypoints.serve import parse_args
    with pytest.raises(SystemExit):
        parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


def test_anthropic_tool_use_and_tool_result_ride_the_same_path(qwen_server, offline_qwen):
    """/v1/messages with the anthropic client: tool_choice naming a tool gives a tool_use block whose input
    fits the schema; the tool_result sent back renders as the chat route's tool message does."""
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=qwen_server.base_url, api_key="none", max_retries=0, timeout=120)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": SCHEMAS[t["function"]["name"]]} for t in TOOLS]
    as_openai = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                   "parameters": t["input_schema"]}} for t in tools]
    asked = [{"role": "user", "content": ASK[-1]["content"]}]
    first = client.messages.create(model="qwen", max_tokens=CALL_TOKENS["qwen"], messages=asked, tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"},
                                   extra_body={"temperature": 0})
    assert first.stop_reason == "tool_use" and [b.type for b in first.content] == ["tool_use"]
    use = first.content[0]
    jsonschema.validate(use.input, WEATHER["function"]["parameters"])
    follow = asked + [{"role": "assistant", "content": [use.model_dump()]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                    "content": "22 C and sunny"}]}]
    answer = client.messages.create(model="qwen", max_tokens=16, messages=follow, tools=tools,
                                    tool_choice={"type": "none"}, extra_body={"temperature": 0})
    openai_messages = asked + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": json.dumps(use.input)}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "22 C and sunny"}]
    expected = offline_qwen.chat(openai_messages, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False,
                                 tools=as_openai)[0]
    assert answer.content[0].text == expected.outputs[0].text
    assert answer.usage.input_tokens == len(expected.prompt_token_ids)
