"""The prompt dicts of vLLM's `vllm.inputs`, as TypedDicts: `from nanopaged import TokensPrompt`.

At run time they are plain dicts, which is what `LLM.generate` reads (engine/input_processor.py);
the keys vLLM has for multimodal input are refused there unless None (nanopaged runs text only).
"""
from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str                                # tokenized with the model's tokenizer
    cache_salt: NotRequired[str]               # mixed into the first block's hash: no sharing across salts


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]                # used as given
    prompt: NotRequired[str]                   # the text, if the caller has it (RequestOutput.prompt)
    cache_salt: NotRequired[str]
