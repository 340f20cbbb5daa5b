"""The spec workload's agent-like prompts: one tool-using task asked again and again with small changes.
(In full: docs/07_benchmarks.md, "The benchmark modules in full".)
"""
from __future__ import annotations

import datetime
import json
import random
from dataclasses import dataclass

from benchmarks.spec_prompts import num_tokens

TOOL = {"name": "get_weather", "description": "The weather forecast for a city on a date.",
        "parameters": {"type": "object",
                       "properties": {"city": {"type": "string"},
                                      "date": {"type": "string", "description": "YYYY-MM-DD"},
                                      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "date", "unit"]}}
SYSTEM = ("You are a helpful assistant with one tool:\n{tool}\nTo use it, answer with the tool call as JSON on "
          "one line, then one short sentence saying what you asked for.")
REQUEST = "What will the weather be in {city} on {date}, in {unit}?"
ANSWER = "{call}\nI asked for the weather in {city} on {date} in {unit}."
EXAMPLE = ("Oslo", "2025-01-09", "celsius")          # the worked exchange every prompt shows
CITIES = ("Paris", "Tokyo", "Lima", "Cairo", "Denver", "Madrid", "Nairobi", "Seoul", "Dublin", "Perth",
          "Toronto", "Lisbon", "Bangkok", "Santiago", "Vienna", "Mumbai", "Helsinki", "Havana", "Quito",
          "Prague", "Dakar", "Osaka", "Calgary", "Athens", "Manila", "Bogota", "Zurich", "Hanoi", "Accra",
          "Chicago", "Warsaw", "Jakarta")
UNITS = ("celsius", "fahrenheit")
MAX_TOKENS = 96          # an answer is about 66 tokens in the demo tokenizer: room to finish and stop
TOOL_CALL_SCHEMA = {
    "type": "object", "additionalProperties": False, "required": ["name", "arguments"],
    "properties": {"name": {"type": "string", "enum": [TOOL["name"]]},
                   "arguments": {"type": "object", "additionalProperties": False, "required": ["city", "date", "unit"],
                                 "properties": {"city": {"type": "string"},
                                                "date": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
                                                "unit": {"type": "string", "enum": list(UNITS)}}}}}


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
        text = tokenizer.apply_chat_template(conversation(city, date, unit), add_generation_prompt=True,
                                             tokenize=False)
        items.append(AgentPrompt(city, date, unit, expected_answer(city, date, unit),
                                 tokenizer.encode(text, add_special_tokens=False), max_tokens))
    return items


def answer_tokens(tokenizer, items: list[AgentPrompt]) -> list[int]:
    """Each expected answer's tokens: [min, max]."""
    n = [num_tokens(tokenizer, it.expected_answer) for it in items]
    return [min(n), max(n)]
