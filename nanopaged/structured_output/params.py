"""StructuredOutputsParams: the constraint one request's output must follow, with vLLM's names.

Plain data, no xgrammar: building one checks only its shape (exactly one constraint, each of the
right type), so a mistake fails where it is made; whether a schema, regex or grammar compiles is
checked when the request is processed, against the model's tokenizer (manager.py). vLLM:
vllm/sampling_params.py: StructuredOutputsParams. docs/10_structured_outputs.md.
"""
from __future__ import annotations

import json as json_module
from dataclasses import dataclass, fields

from nanopaged.validation import check_bool

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# A JSON object, as `json_object=True` asks for it (vLLM compiles the same schema).
ANY_OBJECT_SCHEMA = '{"type": "object"}'


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None          # a JSON schema (a dict, or its text)
    regex: str | None = None                # the whole output matches it
    choice: list[str] | None = None         # the output is exactly one of these strings
    grammar: str | None = None              # EBNF (GBNF, `root ::= ...`), or Lark (`start: ...`)
    json_object: bool | None = None         # any JSON object
    # options
    disable_any_whitespace: bool = False    # JSON with single spaces only, never newlines or runs of them
    disable_additional_properties: bool = False   # accepted: xgrammar never adds properties a schema leaves out
    whitespace_pattern: str | None = None   # vLLM's other backends' option: refused (xgrammar has none)
    structural_tag: str | None = None       # vLLM's tool-call tags: refused

    def __post_init__(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one constraint of {list(CONSTRAINTS[:5])}, "
                             f"got {len(given)}{': ' + ', '.join(given) if given else ''}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            check_bool(f"structured_outputs.{name}", getattr(self, name))
        for name in ("whitespace_pattern", "structural_tag"):
            if getattr(self, name) is not None:
                raise ValueError(f"structured_outputs.{name}={getattr(self, name)!r} is not supported: nanopaged's "
                                 "backend (xgrammar) has no such option; leave it at None")
        self._check_types()

    def _check_types(self) -> None:
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its text), got {self.json!r}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {value!r}")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("structured_outputs.grammar is empty; give an EBNF grammar with a root rule")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a list of strings, got {self.choice!r}")
            if not self.choice:
                raise ValueError("structured_outputs.choice is empty; give at least one string to choose from")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError(f"structured_outputs.json_object must be True (or None), got {self.json_object!r}")

    def constraint(self) -> tuple[str, str]:
        """(kind, text): what the backend compiles. The kind is "json", "regex" or "grammar" (a choice
        is a grammar of its strings); the text is the cache's key, so equal constraints compile once."""
        if self.json is not None:
            return "json", _schema_text(self.json)
        if self.json_object:
            return "json", ANY_OBJECT_SCHEMA
        if self.regex is not None:
            return "regex", self.regex
        if self.choice is not None:
            return "grammar", choice_grammar(self.choice)
        return "grammar", self.grammar

    def describe(self) -> str:
        """The constraint as an error message names it: `structured_outputs.json`, ..."""
        return "structured_outputs." + next(f.name for f in fields(self) if getattr(self, f.name) is not None)


def _schema_text(schema: str | dict) -> str:
    """The schema as compact JSON text, keys in their given order (a schema's property order is the
    order the output writes them in, so sorting them would change the grammar)."""
    try:
        value = json_module.loads(schema) if isinstance(schema, str) else schema
        return json_module.dumps(value, ensure_ascii=False, separators=(",", ":"))
    except (ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose language is exactly the choices: `root ::= "yes" | "no"`. JSON's string
    escapes are also EBNF's, so json.dumps quotes each choice safely (quotes, backslashes, newlines)."""
    return "root ::= " + " | ".join(json_module.dumps(c) for c in choices)


def check_sampling_params(params) -> None:
    """What SamplingParams checks when structured_outputs is set: its type, and no min_tokens (a grammar
    that is complete allows only EOS, which min_tokens holds back: no token would be left to draw)."""
    if not isinstance(params.structured_outputs, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got "
                         f"{type(params.structured_outputs).__name__} {params.structured_outputs!r}")
    if params.min_tokens:
        raise ValueError(f"min_tokens={params.min_tokens} cannot be combined with structured_outputs: the grammar "
                         "decides where the output ends (with EOS, which min_tokens holds back); leave it at 0")
