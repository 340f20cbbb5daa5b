"""What a request's outputs show of its text while a stop string may still be on its way.

The engine cuts a matched stop string out of the text, but text already sent cannot be taken back.
So DELTA outputs (SamplingParams.output_kind) and the server's stream hold back the last
len(longest stop string) - 1 characters while the request runs (vLLM: stop_buffer_length in
v1/engine/detokenizer.py): with several stop strings the longest sets the hold-back, since any of
them may be the one that is completing. Held back by the shortest, the first characters of a
longer stop string go out before it completes, and the deltas joined no longer equal the text.
Here a token-selection rule spells TEXT token by token, one token a step, through the engine.
"""
import pytest

from nanopaged import LLM, SamplingParams
from nanopaged.core.request import SampledToken
from nanopaged.entrypoints.openai.protocol import ParsedRequest
from nanopaged.entrypoints.openai.responses import ResponseBuilder
from nanopaged.sampling_params import RequestOutputKind

TEXT = "The plan is set. Stop the engine now, then say more."
LONG_STOP = " Stop the engine now"          # 20 characters, several tokens
SHORT_STOPS = ["#", "!?"]                   # never in TEXT: held back by one of them, LONG_STOP leaks
FINAL = TEXT[:TEXT.index(LONG_STOP)]        # "The plan is set."
STOP_LISTS = [SHORT_STOPS + [LONG_STOP], [LONG_STOP] + SHORT_STOPS]   # the longest last, and first


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(tiny_model_dirs["llama"], num_kv_blocks=16)


def spelled_outputs(llm, params: SamplingParams):
    """Every RequestOutput of one request whose tokens spell TEXT."""
    ids = llm.get_tokenizer().encode(TEXT, add_special_tokens=False)
    assert len(llm.get_tokenizer().encode(LONG_STOP, add_special_tokens=False)) > 2
    engine = llm.llm_engine
    engine.add_request("s", {"prompt_token_ids": [5, 6, 7]}, params)
    spell = lambda out: {r: [SampledToken(ids[r.num_output_tokens])] for r in out.requests}  # noqa: E731
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step(spell)
    return outputs


def params(stop: list[str], kind: RequestOutputKind) -> SamplingParams:
    return SamplingParams(max_tokens=64, ignore_eos=True, stop=stop, output_kind=kind)


@pytest.mark.parametrize("stop", STOP_LISTS, ids=["longest_last", "longest_first"])
def test_delta_outputs_hold_back_by_the_longest_stop_string(llm, stop):
    """The deltas joined are the final text; no delta ever shows a character of LONG_STOP."""
    whole = spelled_outputs(llm, params(stop, RequestOutputKind.CUMULATIVE))[-1].outputs[0]
    assert (whole.text, whole.finish_reason, whole.stop_reason) == (FINAL, "stop", LONG_STOP)
    deltas = [o.outputs[0].text for o in spelled_outputs(llm, params(stop, RequestOutputKind.DELTA))]
    sent = ""
    for delta in deltas:
        sent += delta
        assert FINAL.startswith(sent), f"sent {sent!r}: past the text the stop string leaves"
    assert sent == FINAL


@pytest.mark.parametrize("stop", STOP_LISTS, ids=["longest_last", "longest_first"])
def test_a_stream_holds_back_by_the_longest_stop_string(llm, stop):
    """The server's stream (ResponseBuilder.chunks over the engine's cumulative outputs): the
    chunks joined are the whole response's text, and no chunk runs past it."""
    sampling = params(stop, RequestOutputKind.CUMULATIVE)
    request = ParsedRequest(kind="completion", prompts=[[5, 6, 7]], params=sampling, max_tokens_given=True,
                            stream=True, include_usage=False, top_logprobs=None)
    builder = ResponseBuilder(request, "cmpl-1", "tiny", ["s"])
    sent = ""
    for output in spelled_outputs(llm, sampling):
        for chunk in builder.chunks(output):
            sent += chunk["choices"][0]["text"]
            assert FINAL.startswith(sent), f"streamed {sent!r}: past the text the stop string leaves"
    assert sent == FINAL
