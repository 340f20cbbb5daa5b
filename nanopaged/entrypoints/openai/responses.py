"""RequestOutputs as OpenAI response bodies: one whole response, or a stream of chunks.

The engine's outputs are cumulative (each holds all the text so far, vLLM's default), so a
stream sends what is new since the last chunk of each choice. One exception: while a stop
string could still be completing, the last len(longest stop) - 1 characters are held
back, because the engine cuts a matched stop string out of the text; sent text is never
taken back, so the concatenated stream equals the whole response. Shapes follow OpenAI's
API reference and vLLM's vllm/entrypoints/openai/serving_completion.py and serving_chat.py.
A chat request with tools has its output read for tool calls (tools.py, tool_parsers.py): a
message's `tool_calls`, a stream's `delta.tool_calls`, and finish_reason "tool_calls". With a
reasoning parser (--reasoning-parser; nanopaged/reasoning.py), a chat's thinking is its message's
`reasoning_content` (a stream's `delta.reasoning_content`), and tool calls are read from the answer only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from nanopaged.entrypoints.openai.protocol import ParsedRequest
from nanopaged.entrypoints.openai.tool_parsers import ToolCallStream
from nanopaged.outputs import CompletionOutput, Logprob, RequestOutput
from nanopaged.reasoning import REASONING_PARSERS, ReasoningStream, split_reasoning

MIN_LOGPROB = -9999.0


@dataclass
class ChoiceState:
    """What a stream has sent of one choice."""
    chars: int = 0
    tokens: int = 0
    text_offset: int = 0         # completions' logprobs: where the next token's text starts
    done: bool = False
    tools: ToolCallStream | None = None     # a chat with tools: what the stream has sent of its calls
    reasoning: ReasoningStream | None = None   # a reasoning parser: the thinking and the answer so far


class ResponseBuilder:
    def __init__(self, request: ParsedRequest, response_id: str, model: str, request_ids: list[str],
                 reasoning_parser: str | None = None) -> None:
        self.request, self.id, self.model = request, response_id, model
        self.chat = request.kind == "chat"
        self.reasoning_parser = reasoning_parser if self.chat else None    # completions stay raw text, as vLLM's
        self.created = int(time.time())
        self.n = request.params.n
        self.prompt_index = {rid: i for i, rid in enumerate(request_ids)}
        self.holdback = max((len(s) for s in request.params.stop), default=1) - 1
        self.tool_calling = request.tool_calling
        self.choices: dict[int, ChoiceState] = {}       # made as each choice first streams, not per n up front
        self.prompt_tokens: dict[int, int] = {}          # prompt index -> its tokens
        self.completion_tokens: dict[int, int] = {}      # choice index -> tokens generated

    def _index(self, output: RequestOutput, c: CompletionOutput) -> int:
        """Choice i * n + j: sample j of prompt i (vLLM's numbering for several prompts)."""
        return self.prompt_index[output.request_id] * self.n + c.index

    def _count(self, output: RequestOutput) -> None:
        self.prompt_tokens[self.prompt_index[output.request_id]] = len(output.prompt_token_ids)
        for c in output.outputs:
            self.completion_tokens[self._index(output, c)] = len(c.token_ids)

    def usage(self) -> dict:
        prompt, completion = sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    # ---- a whole response ----------------------------------------------------------------------
    def response(self, finals: list[RequestOutput]) -> dict:
        choices = []
        for output in finals:
            self._count(output)
            for c in output.outputs:
                choice = {"index": self._index(output, c),
                          "logprobs": self._logprobs(c, 0, len(c.token_ids), 0),
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if self.chat:
                    choice["message"] = self._message(c.text)
                    choice["finish_reason"] = finish_reason(c.finish_reason, "tool_calls" in choice["message"])
                else:
                    choice["text"] = c.text
                if self.request.return_token_ids:
                    choice["token_ids"] = list(c.token_ids)
                    if not self.chat:
                        choice["prompt_token_ids"] = list(output.prompt_token_ids)
                choices.append(choice)
        choices.sort(key=lambda ch: ch["index"])
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage()}
        if self.chat and self.request.return_token_ids:      # vLLM: the chat's prompt, once, beside the choices
            body["prompt_token_ids"] = list(finals[0].prompt_token_ids)
        return body

    def _message(self, text: str) -> dict:
        """The assistant's message: its text, or the text before its tool calls (null if none) and the calls;
        with a reasoning parser, its thinking apart (`reasoning_content`) and only the answer read for calls."""
        thinking = {}
        if self.reasoning_parser is not None:
            reasoning, text = split_reasoning(self.reasoning_parser, text)
            thinking = {"reasoning_content": reasoning}
        if self.tool_calling is None:
            return {"role": "assistant", "content": text, **thinking}
        content, calls = self.tool_calling.extract(text) if text is not None else (None, [])
        return {"role": "assistant", "content": content, **thinking, **({"tool_calls": calls} if calls else {})}

    # ---- a stream ------------------------------------------------------------------------------
    def first_chunks(self) -> list[dict]:
        """Chat opens every choice with the assistant's role, before any text (as OpenAI)."""
        if not self.chat:
            return []
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None}) for i in range(len(self.prompt_index) * self.n)]

    def chunks(self, output: RequestOutput) -> list[dict]:
        """One chunk per choice that has something new: text, tokens (logprobs), or its end."""
        self._count(output)
        chunks = []
        for c in output.outputs:
            index = self._index(output, c)
            state = self._state(index)
            if state.done:
                continue
            finished = c.finish_reason is not None
            end = len(c.text) if finished else max(state.chars, len(c.text) - self.holdback)
            text = c.text[state.chars:end]
            new_tokens = len(c.token_ids) > state.tokens and c.logprobs is not None
            delta = {"content": text} if text or not finished else {}
            if state.reasoning is not None:      # the thinking apart; the answer goes on as the text
                delta = self._reasoning_delta(state, c.text, end, finished)
            elif state.tools is not None:        # a chat with tools: the text read for calls as far as it goes
                delta = state.tools.delta(c.text, finished, end)
            if not ((delta if state.tools is not None or state.reasoning is not None else text)
                    or new_tokens or finished):
                continue
            logprobs = self._logprobs(c, state.tokens, len(c.token_ids), state.text_offset)
            if logprobs is not None and not self.chat:
                state.text_offset += sum(len(t) for t in logprobs["tokens"])
            choice = {"index": index, "logprobs": logprobs, "finish_reason": c.finish_reason}
            if self.request.return_token_ids:          # the tokens new in this chunk
                choice["token_ids"] = list(c.token_ids[state.tokens:])
            state.chars, state.tokens, state.done = end, len(c.token_ids), finished
            if self.chat:
                choice["delta"] = delta
                choice["finish_reason"] = finish_reason(c.finish_reason, state.tools is not None and state.tools.called)
            else:
                choice["text"], choice["stop_reason"] = text, c.stop_reason
            chunks.append(self._chunk(choice))
        return chunks

    def _reasoning_delta(self, state: ChoiceState, text: str, end: int, finished: bool) -> dict:
        """What text[:end] adds: new thinking as `reasoning_content`; the new answer as `content`, or, with
        tools, read for calls (the parser sees the answer alone, as it grows)."""
        reasoning, answer = state.reasoning.feed(text, end, finished)
        if state.tools is not None:
            delta = state.tools.delta(state.reasoning.content, finished)
        else:
            delta = {"content": answer} if answer else {}
        return {"reasoning_content": reasoning, **delta} if reasoning else delta

    def _state(self, index: int) -> ChoiceState:
        if index not in self.choices:
            reasoning = self.reasoning_parser and ReasoningStream(REASONING_PARSERS[self.reasoning_parser])
            self.choices[index] = ChoiceState(tools=None if self.tool_calling is None else self.tool_calling.stream(),
                                              reasoning=reasoning)
        return self.choices[index]

    def usage_chunk(self) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return {**self._chunk(None), "choices": [], "usage": self.usage()}

    def _chunk(self, choice: dict | None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.model, "choices": [choice] if choice else []}
        if self.request.include_usage:
            chunk["usage"] = None            # OpenAI: null in every chunk but the last
        return chunk

    # ---- logprobs ------------------------------------------------------------------------------
    def _logprobs(self, c: CompletionOutput, start: int, end: int, text_offset: int) -> dict | None:
        """Tokens [start, end) of a choice in OpenAI's two logprobs formats, or None if not asked."""
        if c.logprobs is None:
            return None
        steps = [(c.token_ids[i], c.logprobs[i]) for i in range(start, end)]
        k = self.request.top_logprobs
        if self.chat:
            return {"content": [_chat_entry(entries[token], entries, k) for token, entries in steps]}
        tokens = [entries[token].decoded_token or "" for token, entries in steps]
        offsets, at = [], text_offset
        for t in tokens:
            offsets.append(at)
            at += len(t)
        return {"tokens": tokens, "token_logprobs": [finite(entries[token].logprob) for token, entries in steps],
                # the chosen token and the k most likely (vLLM's completions: up to k + 1 entries)
                "top_logprobs": [{(lp.decoded_token or ""): finite(lp.logprob) for lp in _by_rank(entries)}
                                 for _, entries in steps],
                "text_offset": offsets}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that ended with tool calls says so (OpenAI's "tool_calls"); one cut by max_tokens stays "length"."""
    return "tool_calls" if called and reason == "stop" else reason


def finite(logprob: float) -> float:
    """JSON has no -Infinity: a token a grammar forbids (logprob -inf) is reported as -9999.0, as vLLM does."""
    return max(logprob, MIN_LOGPROB)


def _by_rank(entries: dict[int, Logprob]) -> list[Logprob]:
    return sorted(entries.values(), key=lambda lp: lp.rank)


def _chat_entry(chosen: Logprob, entries: dict[int, Logprob], k: int) -> dict:
    """OpenAI's chat format: the token, its logprob and UTF-8 bytes, and exactly the top k."""
    def one(lp: Logprob) -> dict:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": finite(lp.logprob), "bytes": list(text.encode("utf-8", "replace"))}
    return {**one(chosen), "top_logprobs": [one(lp) for lp in _by_rank(entries) if lp.rank <= k]}
