"""Reasoning parsers: a thinking model's reasoning told apart from its answer, whole or as it streams.

A model trained to think writes its reasoning between tags, then its answer. `reasoning_parser`
(vLLM's `--reasoning-parser NAME`, an engine setting there and here) names how:

    qwen3        Qwen3's `<think>...</think>`: the reasoning is what explicit tags enclose; the text
                 outside them is the answer (an output without `<think>` has no reasoning)
    deepseek_r1  DeepSeek-R1's: everything before `</think>` is reasoning, with or without a leading
                 `<think>` (R1's template puts it in the prompt); the text after it is the answer

A `<think>` never closed (max_tokens cut it) leaves the rest reasoning. The server reads each output's
text with it (chat's `reasoning_content`, the Responses API's reasoning items); the engine holds a
structured-output constraint back until the answer starts (structured_output/manager.py). Offline,
LLM.generate and LLM.chat return the raw text, as vLLM's do.

`ReasoningStream` reads a growing text once, holding back a tail that may be the start of the tag it
waits for; the whole output is one feed of the final text, so a stream's pieces add up to it however
the text was cut. vLLM: vllm/reasoning/. docs/08_server.md, "Reasoning output".
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    start: str                  # the tag that opens the reasoning
    end: str                    # the tag that closes it; the answer follows
    implicit_start: bool        # True: the output starts inside the reasoning (the prompt opened it)


REASONING_PARSERS = {"qwen3": ReasoningFormat("<think>", "</think>", implicit_start=False),
                     "deepseek_r1": ReasoningFormat("<think>", "</think>", implicit_start=True)}

# Where a ReasoningStream is: before the reasoning (answer text), at the output's first characters
# (a leading start tag is skipped), inside the reasoning, or in the answer after it.
BEFORE, OPENING, REASONING, ANSWER = "before", "opening", "reasoning", "answer"


def check_reasoning_parser(name: str | None) -> str | None:
    """`name` if it is a reasoning parser's (or None: none); a ValueError listing the known ones."""
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser {name!r:.100} is not a reasoning parser; choose from "
                         f"{sorted(REASONING_PARSERS)}")
    return name


def split_reasoning(name: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a whole output; None for a part that is empty."""
    stream = ReasoningStream(REASONING_PARSERS[name])
    stream.feed(text, len(text), final=True)
    return stream.reasoning or None, stream.content or None


def partial_tag_at_end(text: str, start: int, end: int, tag: str) -> int:
    """Where text[start:end] must stop so that no start of `tag` is cut off at its end."""
    for n in range(min(len(tag) - 1, end - start), 0, -1):
        if text.startswith(tag[:n], end - n):
            return end - n
    return end


class ReasoningStream:
    """One output's text, read as it grows: `feed` says what is new of the reasoning and of the answer;
    `reasoning` and `content` hold all of each so far (the tool parser reads the answer's)."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.phase = OPENING if fmt.implicit_start else BEFORE
        self.at = 0                      # text[:at] has been read
        self.reasoning = ""
        self.content = ""

    def feed(self, text: str, end: int, final: bool) -> tuple[str, str]:
        """(new reasoning, new answer) of text[:end]; `final`: the text is complete (nothing held back)."""
        reasoning, content = len(self.reasoning), len(self.content)
        while self.at < end:
            if self.phase == OPENING and not self._opened(text, end, final):
                break
            tag = {BEFORE: self.fmt.start, REASONING: self.fmt.end}.get(self.phase)
            found = -1 if tag is None else text.find(tag, self.at, end)
            stop = found if found >= 0 else end if final or tag is None else partial_tag_at_end(text, self.at, end, tag)
            self._take(text[self.at:stop])
            self.at = stop
            if found < 0:
                break
            self.at += len(tag)
            self.phase = REASONING if self.phase == BEFORE else ANSWER
        return self.reasoning[reasoning:], self.content[content:]

    def _opened(self, text: str, end: int, final: bool) -> bool:
        """The output's first characters: a start tag there is skipped. False: they may still be one."""
        head = text[self.at:end]
        if not final and self.fmt.start.startswith(head) and head != self.fmt.start:
            return False
        if head.startswith(self.fmt.start):
            self.at += len(self.fmt.start)
        self.phase = REASONING
        return True

    def _take(self, piece: str) -> None:
        if self.phase == REASONING:
            self.reasoning += piece
        else:
            self.content += piece


class AnswerStart:
    """Where a request's answer starts among its output tokens, for the engine: a structured-output
    constraint holds from there (vLLM's reasoner in its structured-output manager). The answer starts
    after the token that completes the end tag, or at the first token if the prompt closed the
    reasoning already (its last tag is the end tag: a template that turned thinking off)."""

    def __init__(self, name: str, tokenizer) -> None:
        self.fmt = REASONING_PARSERS[name]
        self.decode = tokenizer.decode

    def closed_in_prompt(self, prompt_token_ids: list[int]) -> bool:
        text = self.decode(prompt_token_ids)
        return text.rfind(self.fmt.end) > max(-1, text.rfind(self.fmt.start))

    def scan(self, tail: str, token_id: int) -> tuple[bool, str]:
        """(whether this token completes the end tag, the text to keep for the next token's scan).
        Tokens are decoded one at a time: the tags are plain ASCII, so no token's neighbours change them."""
        tail += self.decode([token_id])
        return self.fmt.end in tail, tail[-(len(self.fmt.end) - 1):]
