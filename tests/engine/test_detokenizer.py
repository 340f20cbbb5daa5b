"""Incremental detokenization: text grows a few tokens at a time and never shows half a character.

Byte-level BPE splits a multi-byte UTF-8 character (é, 😀, 日) over several tokens; decoding
after each token would show U+FFFD for the half that has arrived. The detokenizer waits for
the rest, so every streamed text is a prefix of the final one.
"""
from conftest import make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.core.request import SampledToken
from nanopaged.engine.detokenizer import IncrementalDetokenizer, find_stop_string

TEXT = "naïve café 😀 — 日本語, déjà vu ü"


def test_multibyte_characters_never_show_half_of_themselves(tiny_model_dirs):
    tok = LLM(tiny_model_dirs["llama"], num_kv_blocks=8).get_tokenizer()
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > len(TEXT)                        # characters really are split over tokens
    detok = IncrementalDetokenizer(tok, [5, 6, 7], skip_special_tokens=True)
    seen = []
    for t in ids:
        before = detok.text
        delta = detok.add(t)
        assert "\ufffd" not in delta and delta == detok.text[len(before):]   # what add returns is what grew
        seen.append(detok.text)
    detok.flush()
    assert detok.text == TEXT
    assert all(TEXT.startswith(s) for s in seen)
    assert len(set(seen)) < len(ids)                   # some tokens had to wait for the next one


def test_streamed_outputs_never_show_half_a_character(tiny_model_dirs):
    """Through the engine: a token-selection rule that spells TEXT token by token."""
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=16)
    ids = llm.get_tokenizer().encode(TEXT, add_special_tokens=False)
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=len(ids), ignore_eos=True))
    spell = lambda out: {r: [SampledToken(ids[r.num_output_tokens])] for r in out.requests}  # noqa: E731
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.outputs[0].text for o in engine.step(spell)]
    assert texts[-1] == TEXT and all("\ufffd" not in t and TEXT.startswith(t) for t in texts)


def test_a_stop_string_spanning_a_multibyte_character(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=16)
    ids = llm.get_tokenizer().encode(TEXT, add_special_tokens=False)
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": make_prompts(512, n=1, seed=80)[0]},
                       SamplingParams(max_tokens=len(ids), stop=["😀 —"], ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for o in engine.step(lambda out: {r: [SampledToken(ids[r.num_output_tokens])] for r in out.requests}):
            final = o.outputs[0]
    assert final.finish_reason == "stop" and final.text == "naïve café "


def test_find_stop_string_looks_only_at_what_the_new_characters_complete():
    assert find_stop_string("abc stop", 2, ["stop"], include=False) == ("stop", 4)
    assert find_stop_string("abc stop", 2, ["stop"], include=True) == ("stop", 8)
    assert find_stop_string("stop abc", 3, ["stop"], include=False) is None   # completed earlier, not now
    assert find_stop_string("stop", 4, ["stop"], include=False) == ("stop", 0)  # at the very start
    assert find_stop_string("x a b a", 6, ["a"], include=False) == ("a", 2)   # twice in the new text: the first
    # two complete at the same place: the first in the list
    assert find_stop_string("xab", 2, ["b", "ab"], include=False) == ("b", 2)
    assert find_stop_string("xab", 2, ["ab", "b"], include=False) == ("ab", 1)


def metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama 2, Mistral): words carry their space as a
    leading "▁", which decoding drops at the start of a text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "▁the": 1, "▁cat": 2, "▁sat": 3, "▁on": 4, "▁mat": 5, "▁a": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_the_first_output_word_keeps_its_space_after_a_short_prompt():
    """Decoded alone, "▁cat" is "cat"; after the prompt it is " cat". The window that starts
    inside the prompt gives the output its space, whatever the prompt's length."""
    tok = metaspace_tokenizer()
    for prompt in ([1], [1, 2], [6, 2, 3, 4, 1, 5, 1, 2]):
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
        for t in (2, 3, 4, 1, 5):
            detok.add(t)
        assert detok.text == " cat sat on the mat", prompt
        assert tok.decode([2]) == "cat"                      # what decoding the token alone would give
