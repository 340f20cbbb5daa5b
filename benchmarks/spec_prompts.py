"""The spec workload's prompts: answers that repeat their input, and the agent-like ones, one
tool-using task asked again and again with small changes. The words are data:
benchmarks/data/spec_prompts.json."""
from __future__ import annotations

import datetime
import json
import random
import re
from dataclasses import dataclass

from benchmarks.quality import DATA, TEXTS

PROMPTS = json.loads((DATA / "spec_prompts.json").read_text())
MIN_PASSAGE_TOKENS = 100        # a passage ends at the first sentence end past this (demo tokenizer: 100-143)
MAX_TOKENS_SLACK = 16           # max_tokens = the passage's tokens + this: room to copy it and stop
NUM_TYPOS = 3
INSTRUCTIONS = PROMPTS["instructions"]           # kind -> the instruction, the passage at {}


@dataclass
class SpecPrompt:
    kind: str                    # a key of INSTRUCTIONS
    passage_index: int
    passage: str                 # the passage as the text has it (what a faithful answer writes)
    shown: str                   # the passage as the prompt shows it (fix_typos: with its typos)
    prompt_token_ids: list[int]
    passage_tokens: int
    max_tokens: int


def split_passages(text: str, tokenizer, min_tokens: int = MIN_PASSAGE_TOKENS) -> list[str]:
    """The text's prose (headings, lines with no final stop, left out) as one run of sentences, cut
    into passages at the first sentence end at or past `min_tokens` tokens; a short tail is dropped."""
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    prose = " ".join(p for p in paragraphs if p[-1:] in ".!?\"'")
    passages, current = [], []
    for sentence in re.split(r"(?<=[.!?])\s+", prose):
        current.append(sentence)
        if num_tokens(tokenizer, " ".join(current)) >= min_tokens:
            passages.append(" ".join(current))
            current = []
    return passages


def all_passages(tokenizer) -> list[str]:
    """Every text's passages, the texts in turn (none runs across from one text to the next): 27 in the
    demo tokenizer, so 54 prompts at most, enough for 32 at once."""
    return [p for text in TEXTS for p in split_passages(text.read_text(), tokenizer)]


def num_tokens(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def add_typos(text: str, seed: int, count: int = NUM_TYPOS) -> str:
    """`count` words of five letters or more, each with one typo (two letters swapped, one dropped or
    one doubled); which words and which typo follow `seed` alone, so a prompt is the same every run."""
    rng = random.Random(seed)
    words = text.split(" ")
    candidates = [i for i, w in enumerate(words) if w.isalpha() and len(w) >= 5]
    for i in sorted(rng.sample(candidates, min(count, len(candidates)))):
        words[i] = typo(words[i], rng)
    return " ".join(words)


def typo(word: str, rng: random.Random) -> str:
    j = rng.randrange(1, len(word) - 2)          # inside the word: its first and last letters stay
    kind = rng.choice(("swap", "drop", "double"))
    if kind == "swap" and word[j] != word[j + 1]:
        return word[:j] + word[j + 1] + word[j] + word[j + 2:]
    if kind == "double":
        return word[:j + 1] + word[j:]
    return word[:j] + word[j + 1:]               # drop (and a swap of two equal letters)


def chat_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """The token ids of a conversation in the tokenizer's chat template, its generation prompt added."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def build_workload(tokenizer, num_prompts: int, max_tokens: int | None = None, seed: int = 0) -> list[SpecPrompt]:
    """`num_prompts` prompts, every passage once under each instruction at most: prompt j asks for
    passage j mod P, under the instructions in turn, shifted by one each time round the passages."""
    passages = all_passages(tokenizer)
    kinds = list(INSTRUCTIONS)
    if not 1 <= num_prompts <= len(kinds) * len(passages):
        raise ValueError(f"--num-prompts {num_prompts}: the text gives {len(passages)} passages in this tokenizer, "
                         f"so 1 to {len(kinds) * len(passages)} prompts")
    items = []
    for j in range(num_prompts):
        index = j % len(passages)
        kind = kinds[(index + j // len(passages)) % len(kinds)]
        passage = passages[index]
        shown = add_typos(passage, seed * 10_007 + index) if kind == "fix_typos" else passage
        n = num_tokens(tokenizer, passage)
        ids = chat_prompt(tokenizer, [{"role": "user", "content": INSTRUCTIONS[kind].format(shown)}])
        items.append(SpecPrompt(kind, index, passage, shown, ids, n, max_tokens or n + MAX_TOKENS_SLACK))
    return items


# ==== the agent-like prompts ===============================================================

AGENT = PROMPTS["agent"]
TOOL, SYSTEM, REQUEST, ANSWER = AGENT["tool"], AGENT["system"], AGENT["request"], AGENT["answer"]
EXAMPLE = tuple(AGENT["example"])          # the worked exchange every prompt shows
CITIES, UNITS = tuple(AGENT["cities"]), tuple(AGENT["units"])
TOOL_CALL_SCHEMA = AGENT["tool_call_schema"]     # the call as JSON: fixed keys, two enums, a date pattern
MAX_TOKENS = 96          # an answer is about 66 tokens in the demo tokenizer: room to finish and stop


@dataclass
class AgentPrompt:
    city: str
    date: str
    unit: str
    expected_answer: str           # the worked exchange's answer with this request's values
    prompt_token_ids: list[int]
    max_tokens: int


def tool_call(city: str, date: str, unit: str) -> str:
    return json.dumps({"name": TOOL["name"], "arguments": {"city": city, "date": date, "unit": unit}})


def expected_answer(city: str, date: str, unit: str) -> str:
    return ANSWER.format(call=tool_call(city, date, unit), city=city, date=date, unit=unit)


def conversation(city: str, date: str, unit: str) -> list[dict]:
    """The chat messages of one request: system, the worked exchange, the request."""
    return [{"role": "system", "content": SYSTEM.format(tool=json.dumps(TOOL))},
            {"role": "user", "content": REQUEST.format(city=EXAMPLE[0], date=EXAMPLE[1], unit=EXAMPLE[2])},
            {"role": "assistant", "content": expected_answer(*EXAMPLE)},
            {"role": "user", "content": REQUEST.format(city=city, date=date, unit=unit)}]


def requests(num_prompts: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """(city, date, unit) of each request: the cities in turn, a seeded date in 2025 and unit each."""
    if not 1 <= num_prompts <= len(CITIES):
        raise ValueError(f"--agent-prompts {num_prompts}: 1 to {len(CITIES)} (one request per city)")
    rng = random.Random(seed)
    out = []
    for city in CITIES[:num_prompts]:
        day = datetime.date(2025, 1, 1) + datetime.timedelta(days=rng.randrange(365))
        out.append((city, day.isoformat(), rng.choice(UNITS)))
    return out


def build_agent_workload(tokenizer, num_prompts: int, seed: int = 0,
                         max_tokens: int = MAX_TOKENS) -> list[AgentPrompt]:
    items = []
    for city, date, unit in requests(num_prompts, seed):
        items.append(AgentPrompt(city, date, unit, expected_answer(city, date, unit),
                                 chat_prompt(tokenizer, conversation(city, date, unit)), max_tokens))
    return items


def answer_tokens(tokenizer, items: list[AgentPrompt]) -> list[int]:
    """Each expected answer's tokens: [min, max]."""
    n = [num_tokens(tokenizer, it.expected_answer) for it in items]
    return [min(n), max(n)]
