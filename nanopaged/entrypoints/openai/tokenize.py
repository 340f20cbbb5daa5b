"""`POST /tokenize` and `POST /detokenize`: the server's tokenizer, in vLLM's request and response shapes.

A client counts a prompt's tokens before it sends it (will it fit max_model_len?), or reads what
a chat template makes of its messages. vLLM: vllm/entrypoints/serve/tokenize/ (TokenizeRequest,
TokenizeResponse, DetokenizeRequest). Both run in the API server, never in the engine.
"""
from __future__ import annotations

from nanopaged.engine.input_processor import render_chat
from nanopaged.entrypoints.openai.protocol import OpenAIError, only_fields, shown

TOKENIZE_FIELDS = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                   "return_token_strs", "continue_final_message", "chat_template_kwargs"}
DETOKENIZE_FIELDS = {"model", "tokens"}


def tokenize(body: dict, tokenizer, max_model_len: int) -> dict:
    """{"count", "max_model_len", "tokens", "token_strs"} for a prompt, or for chat messages through the
    model's chat template (which writes its own special tokens, so none are added again)."""
    only_fields(body, TOKENIZE_FIELDS)
    if ("prompt" in body) == ("messages" in body):
        raise OpenAIError("give either 'prompt' or 'messages'", param="prompt" if "prompt" in body else "messages")
    for flag in ("add_special_tokens", "add_generation_prompt", "return_token_strs"):
        if not isinstance(body.get(flag, True), bool):
            raise OpenAIError(f"{flag} must be true or false, got {shown(body[flag])}", param=flag)
    for unsupported in ("continue_final_message", "chat_template_kwargs"):
        if body.get(unsupported):
            raise OpenAIError(f"{unsupported} is not supported by nanopaged", param=unsupported)
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise OpenAIError(f"prompt must be a string, got {shown(body['prompt'])}", param="prompt")
        ids = tokenizer.encode(body["prompt"], add_special_tokens=body.get("add_special_tokens", True))
    else:
        if body.get("add_generation_prompt", True) is False:
            raise OpenAIError("add_generation_prompt=false is not supported by nanopaged (its chat prompts "
                              "always end where the assistant begins)", param="add_generation_prompt")
        try:
            ids = render_chat(tokenizer, body["messages"])["prompt_token_ids"]
        except ValueError as e:
            raise OpenAIError(str(e), param="messages") from None
    strs = tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") else None
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body: dict, tokenizer) -> dict:
    """{"prompt": text} for a list of token ids of this vocabulary."""
    only_fields(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise OpenAIError(f"tokens must be a list of token ids, got {shown(tokens)}", param="tokens")
    bad = [t for t in tokens if not 0 <= t < len(tokenizer)]
    if bad:
        raise OpenAIError(f"token ids {bad[:5]} are outside the vocabulary of {len(tokenizer)}", param="tokens")
    return {"prompt": tokenizer.decode(tokens)}

