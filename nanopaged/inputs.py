"""The prompt dicts of vLLM's `vllm.inputs`, as TypedDicts: `from nanopaged import TokensPrompt`.

At run time they are plain dicts, which is what `LLM.generate` reads (engine/input_processor.py);
`multi_modal_data` ({"image": PIL image(s)}) goes with a text prompt to a vision-language model
(multimodal/input_processor.py); a text-only model refuses it by name, and vLLM's other multimodal keys too.
"""
from __future__ import annotations

from typing import TypedDict

from typing_extensions import NotRequired


class TextPrompt(TypedDict):
    prompt: str                                # tokenized with the model's tokenizer
    cache_salt: NotRequired[str]               # mixed into the first block's hash: no sharing across salts
    multi_modal_data: NotRequired[dict]        # {"image": an image or a list}: one placeholder each in the prompt


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]                # used as given
    prompt: NotRequired[str]                   # the text, if the caller has it (RequestOutput.prompt)
    cache_salt: NotRequired[str]
