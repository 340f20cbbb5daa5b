"""A request body's checks before any handler reads it (nanopaged/entrypoints/openai/protocol.py: parse_body),
without a server: a lone UTF-16 surrogate is a 400 naming where it is, in a string field or inside a list
or an object, the same answer either way (the server's own test, tests/entrypoints/test_serve.py, sends
the same bodies through HTTP)."""
import pytest

from nanopaged.entrypoints.openai.protocol import OpenAIError, parse_body

LONE_SURROGATES = [
    ('{"prompt": "hi", "stop": "\\ud800"}', "stop"),
    ('{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 2}', "stop[0]"),
    ('{"prompt": "hi", "stop": ["a", "\\udfff"]}', "stop[1]"),
    ('{"prompt": ["ok", "hi \\udfff there"]}', "prompt[1]"),
    ('{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
     "messages[0].content[0].text"),
    ('{"prompt": "hi", "structured_outputs": {"choice": ["a", "\\ud800"]}}', "structured_outputs.choice[1]"),
]


@pytest.mark.parametrize("raw, where", LONE_SURROGATES)
def test_a_lone_surrogate_in_a_list_is_a_400_like_one_in_a_string_field(raw, where):
    with pytest.raises(OpenAIError) as refused:
        parse_body(raw.encode())
    assert refused.value.status == 400 and refused.value.param == where
    assert "lone UTF-16 surrogate" in refused.value.message
