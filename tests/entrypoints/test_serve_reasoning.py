"""Reasoning output (--reasoning-parser; nanopaged/reasoning.py) on a server and in the engine.

A tiny random Qwen3 with Qwen3's chat template, as it renders with thinking turned off (the
generation prompt ends `<think>\\n\\n</think>\\n\\n`: the chat route takes no chat_template_kwargs).
A random model never writes a tag of its own, so its output is forced by a regex into
`<think>...</think>answer`; the prompt closed the reasoning, so the constraint holds from the first
token. The server's chat answer then carries the thinking as `reasoning_content`, whole and streamed
(the deltas add up to the whole); a tool call is read from the answer alone; offline, LLM.chat returns
the raw text. The engine's side: tests/structured_output/test_reasoning_constraint.py.
docs/08_server.md, "Reasoning output".
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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
from benchmarks.serve import start_nanopaged  # noqa: E402
from nanopaged import LLM, SamplingParams, StructuredOutputsParams  # noqa: E402

ENGINE_ARGS = ["--block-size", "16", "--num-kv-blocks", "64", "--max-num-seqs", "8", "--dtype", "float32"]
SETTINGS = dict(block_size=16, num_kv_blocks=64, max_num_seqs=8, dtype="float32")
# Qwen3's template, shortened: its generation prompt as `enable_thinking=False` renders it.
QWEN3_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}{{- '<|im_start|>assistant\\n' + (message.content or '') }}
{%- for tool_call in message.tool_calls %}{{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' + (tool_call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- else %}{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"""
THINK_THEN_ANSWER = r"<think>[a-z ]{4,24}</think>[A-Za-z ]{2,30}"
ASK = [{"role": "user", "content": "Why is the sky blue?"}]


@pytest.fixture(scope="session")
def qwen3_dir(tiny_model_dirs, tmp_path_factory):
    """The tiny Qwen3 with Qwen3's template (thinking off in the prompt)."""
    folder = tmp_path_factory.mktemp("qwen3_reasoning") / "qwen3"
    shutil.copytree(tiny_model_dirs["qwen3"], folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)     # transformers 5 keeps the template here
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": QWEN3_TEMPLATE}))
    return str(folder)


def start(model_dir, *extra):
    with pytest.MonkeyPatch.context() as env:
        env.delenv("NANOPAGED_API_KEY", raising=False)
        return start_nanopaged(model_dir, ENGINE_ARGS + list(extra), served_model_name="qwen3", timeout_s=180)


@pytest.fixture(scope="module")
def server(qwen3_dir):
    with start(qwen3_dir, "--engine-in-process", "--reasoning-parser", "qwen3") as s:
        yield s


def client_of(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0, timeout=120)


def forced(**kw) -> dict:
    return dict(model="qwen3", messages=ASK, max_tokens=60, temperature=0,
                extra_body={"structured_outputs": {"regex": THINK_THEN_ANSWER}}, **kw)


def test_the_chat_answer_carries_the_thinking_as_reasoning_content(server):
    message = client_of(server).chat.completions.create(**forced()).choices[0].message
    reasoning, content = message.reasoning_content, message.content
    assert reasoning and content and "<think>" not in content + reasoning
    assert re.fullmatch(THINK_THEN_ANSWER, f"<think>{reasoning}</think>{content}")


def test_streamed_reasoning_content_adds_up_to_the_whole(server):
    whole = client_of(server).chat.completions.create(**forced()).choices[0].message
    reasoning, content, deltas = "", "", 0
    for chunk in client_of(server).chat.completions.create(**forced(stream=True)):
        for choice in chunk.choices:
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            deltas += 1
    assert deltas > 3                                # token by token, not one piece
    assert (reasoning, content) == (whole.reasoning_content, whole.content)


def test_completions_stay_raw_text(server):
    text = client_of(server).completions.create(model="qwen3", prompt="Hi\n<think>\n\n</think>\n\n", max_tokens=30,
                                                temperature=0,
                                                extra_body={"structured_outputs": {"regex": THINK_THEN_ANSWER}})
    assert re.fullmatch(THINK_THEN_ANSWER, text.choices[0].text)


def test_an_unknown_reasoning_parser_stops_the_server_at_start(qwen3_dir):
    with pytest.raises(RuntimeError, match=r"'granite' is not a reasoning parser; choose from \['deepseek_r1', 'qwen3'\]"):
        start(qwen3_dir, "--engine-in-process", "--reasoning-parser", "granite")


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tool_server(qwen3_dir):
    """The default layout (an engine core and an API server), with hermes reading "auto" tool calls."""
    with start(qwen3_dir, "--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser",
               "hermes") as s:
        yield s


@pytest.mark.parametrize("regex, reasoning, calls", [
    ("<think>[a-z]{3,8}</think>" + re.escape(CALL), True, 1),          # a call in the answer: read
    ("<think>" + re.escape(CALL) + "</think>[a-z]{3,8}", True, 0),     # a call in the thinking: not a call
])
def test_tool_calls_are_read_from_the_answer_only(tool_server, regex, reasoning, calls):
    kw = dict(model="qwen3", messages=ASK, tools=[WEATHER], max_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"regex": regex}})
    message = client_of(tool_server).chat.completions.create(**kw).choices[0].message
    assert len(message.tool_calls or []) == calls and bool(message.reasoning_content) == reasoning
    if calls:
        assert json.loads(message.tool_calls[0].function.arguments) == {"city": "Paris"} and message.content is None
    else:
        assert "<tool_call>" in message.reasoning_content and message.content
    thinking, content, streamed_calls = "", "", []
    for chunk in client_of(tool_server).chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            thinking += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            streamed_calls += [c for c in choice.delta.tool_calls or [] if c.id]
    assert (thinking, content or None, len(streamed_calls)) == (message.reasoning_content, message.content, calls)


def test_llm_chat_returns_the_raw_text_with_its_tags(qwen3_dir):
    llm = LLM(qwen3_dir, reasoning_parser="qwen3", **SETTINGS)
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams(regex=THINK_THEN_ANSWER))
    assert re.fullmatch(THINK_THEN_ANSWER, llm.chat(ASK, params)[0].outputs[0].text)
