"""Incremental detokenization: the text of a growing token list, a few tokens at a time.

Decoding token by token is wrong for byte-level tokenizers (a character can span
several tokens) and for tokenizers that merge spaces with the previous token; decoding
the whole list every step is quadratic. The usual fix (vLLM: detokenizer_utils.py, and
Hugging Face TGI) keeps two offsets: text is decoded from a short window that starts a
few tokens back (`prefix_offset`), and only what the newest tokens add beyond the
window's old text is emitted; while that would end in an incomplete character (U+FFFD)
nothing is emitted and the tokens wait for the next one. Stop strings are found in this
text (`find_stop_string`, used by output_processor.py's `check_stop`; docs/00_how_to_read.md).
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        # how to decode, as SamplingParams says (a fast tokenizer ignores the second, as vLLM's path does)
        self.decode_args = {"skip_special_tokens": skip_special_tokens,
                            "spaces_between_special_tokens": spaces_between_special_tokens}
        # Start the window inside the prompt so the first output token decodes with the
        # right leading space, as it would in the whole text (SentencePiece-style decoders
        # drop the space of a text's first word).
        self.tokens = list(prompt_token_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode_args)

    def add(self, token_id: int) -> str:
        """Append one token; returns the text it completed (may be '')."""
        self.tokens.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        """The sequence ends: emit what is pending even if it ends in an incomplete character,
        so the text equals decoding all tokens at once."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            self.text += delta
            return delta
        return ""


def find_stop_string(text: str, new_chars: int, stops: list[str],
                     include: bool) -> tuple[str, int] | None:
    """The stop string that the last `new_chars` characters completed, and where to cut.

    Only the tail can hold a new match: a stop string ends inside the new characters, so it
    starts at most len(stop) - 1 characters before them; this finds a stop string that spans
    several tokens. If several complete in the same step, the one whose match ends first in
    the text wins (on a tie, the first in the list). The text is cut before the stop string,
    or after it with include_stop_str_in_output (vLLM: v1/engine/detokenizer.py,
    `check_stop_strings`).
    """
    best = None                     # (end of the match, its start, the stop string)
    for stop in stops:
        start = text.find(stop, max(0, len(text) - new_chars - len(stop) + 1))
        if start != -1 and (best is None or start + len(stop) < best[0]):
            best = (start + len(stop), start, stop)
    if best is None:
        return None
    end, start, stop = best
    return stop, end if include else start
