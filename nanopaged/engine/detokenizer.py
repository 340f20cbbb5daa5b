"""Incremental detokenization: the text of a growing token list, a few tokens at a time.

Decoding token by token is wrong for byte-level tokenizers (a character can span
several tokens) and for tokenizers that merge spaces with the previous token; decoding
the whole list every step is quadratic. The usual fix (vLLM: detokenizer_utils.py, and
Hugging Face TGI) keeps two offsets: text is decoded from a short window that starts a
few tokens back (`prefix_offset`), and only what the newest tokens add beyond the
window's old text is emitted; while that would end in an incomplete character (U+FFFD)
nothing is emitted and the tokens wait for the next one. Stop strings are found in this
text as it grows (`StopMatcher`, used by output_processor.py's `check_stop`; docs/00_how_to_read.md).
"""
from __future__ import annotations

from collections import deque


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
        self.matcher: StopMatcher | None = None      # the request's stop strings, made on first use

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

    def find_stop(self, new_chars: int, stops: list[str], include: bool) -> tuple[str, int] | None:
        """find_stop_string of the text, with the matcher's state kept from call to call, so that
        each character is looked at once, whatever the number of stop strings. Call it with every
        new text (even where a hit would not count yet), so the state follows the text."""
        if self.matcher is None:
            self.matcher = StopMatcher(stops)
            old = len(self.text) - new_chars
            self.matcher.feed(self.text[max(0, old - self.matcher.longest + 1):old])
        return self.matcher.hit(self.text, new_chars, include)


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
    matcher = StopMatcher(stops)
    old = len(text) - new_chars
    matcher.feed(text[max(0, old - matcher.longest + 1):old])
    return matcher.hit(text, new_chars, include)


class StopMatcher:
    """The stop strings as one automaton (Aho-Corasick): a trie of them, where each node also knows
    the longest proper suffix of its path that is again a path (`fail`) and the first stop string
    in the list that ends there. Fed a text one character at a time, it is at the node of the
    longest stop-string prefix the text ends with: O(1) amortized per character, for any number
    of stop strings, instead of one search per stop string per token."""

    def __init__(self, stops: list[str]) -> None:
        self.stops, self.longest = stops, max(map(len, stops))
        self.goto: list[dict[str, int]] = [{}]
        self.ends: list[int | None] = [None]       # node -> index of the first stop string ending here
        for i, stop in enumerate(stops):
            node = 0
            for ch in stop:
                if ch not in self.goto[node]:
                    self.goto[node][ch] = len(self.goto)
                    self.goto.append({})
                    self.ends.append(None)
                node = self.goto[node][ch]
            if self.ends[node] is None:
                self.ends[node] = i
        self.fail = [0] * len(self.goto)
        self._link()
        self.state = 0

    def fork(self) -> StopMatcher:
        """A matcher at the start of a text, sharing this one's tables (a request's n samples)."""
        twin = object.__new__(StopMatcher)
        twin.__dict__.update(self.__dict__, state=0)
        return twin

    def _link(self) -> None:
        """Failure links, breadth first (a node's link is shallower, so already known), and each node's
        first ending stop string among those its suffixes end."""
        queue = deque(self.goto[0].values())
        while queue:
            node = queue.popleft()
            ends = self.ends[self.fail[node]]
            if ends is not None and (self.ends[node] is None or ends < self.ends[node]):
                self.ends[node] = ends
            for ch, child in self.goto[node].items():
                self.fail[child] = self._step(self.fail[node], ch)
                queue.append(child)

    def _step(self, node: int, ch: str) -> int:
        while node and ch not in self.goto[node]:
            node = self.fail[node]
        return self.goto[node].get(ch, 0)

    def feed(self, text: str) -> tuple[int, int] | None:
        """Advance over `text`; (where in it the first match ends, which stop string), or None."""
        node, hit = self.state, None
        for i, ch in enumerate(text):
            node = self._step(node, ch)
            if hit is None and self.ends[node] is not None:
                hit = (i + 1, self.ends[node])
        self.state = node
        return hit

    def hit(self, text: str, new_chars: int, include: bool) -> tuple[str, int] | None:
        """Feed the last `new_chars` characters of `text`: (the stop string, where to cut) or None."""
        old = len(text) - new_chars
        found = self.feed(text[old:])
        if found is None:
            return None
        end, stop = old + found[0], self.stops[found[1]]
        return stop, end if include else end - len(stop)
