"""Input processing: a user's prompt and SamplingParams become validated Requests.

Every check a request can fail happens here, before it touches the scheduler (vLLM:
v1/engine/processor.py): a request that can never run is a ValueError naming the limit,
and the engine goes on serving the others. `max_tokens` past the context is clipped, not
refused, as vLLM does: the request then finishes with finish_reason "length". Why every
admitted request must fit the pool alone: docs/04_scheduler.md, "Why nothing deadlocks".
Here too the prompt is truncated (`truncate_prompt_tokens`) and `bad_words` become token ids.
"""
from __future__ import annotations

import copy

from nanopaged.config import EngineConfig
from nanopaged.core.block_pool import cdiv
from nanopaged.core.request import Request
from nanopaged.sampling_params import SamplingParams
from nanopaged.validation import encodes_as_utf8

# A tokenizer makes at least one token of every this many characters of text (real vocabularies
# average 3-5; the longest tokens of English BPE vocabularies run to about 30).
MAX_CHARS_PER_TOKEN = 32
PromptType = str | dict   # a string, {"prompt_token_ids": [...]} or {"prompt": "..."}, maybe with "cache_salt"
# What a prompt dict may hold (nanopaged/inputs.py: vLLM's TextPrompt, TokensPrompt); others are refused by name.
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


class InputProcessor:
    prefill_only = False          # True: requests only prefill (no token is generated after the prompt)

    def __init__(self, config: EngineConfig, tokenizer, num_kv_blocks: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.num_kv_blocks = num_kv_blocks
        self.eos_token_ids = frozenset(config.model_config.eos_token_ids)

    def process(self, request_id: str, prompt: PromptType,
                params: SamplingParams | None = None) -> list[Request]:
        """The n sequences of one request (n = params.n), validated; ValueError if it can never run."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        cfg = self.config
        if params.n > cfg.max_num_seqs:
            raise ValueError(f"n={params.n} samples cannot run at once with max_num_seqs={cfg.max_num_seqs}")
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > cfg.max_logprobs:
                raise ValueError(f"{name}={getattr(params, name)} is more than max_logprobs={cfg.max_logprobs}")
        text, ids = self._tokenize(prompt, params.truncate_prompt_tokens is not None)
        ids = self._truncate(ids, params.truncate_prompt_tokens)
        self._check_prompt(ids)
        params = self._with_bad_words(params)
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            self._check_in_vocabulary(name, getattr(params, name) or ())
        self._check_in_vocabulary("bad_words", [t for word in params.bad_words_token_ids or () for t in word])
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {type(cache_salt).__name__}")
        if cache_salt is not None and not encodes_as_utf8(cache_salt):
            raise ValueError(f"cache_salt must encode as UTF-8, got {cache_salt!r}")
        room = cfg.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        if self.prefill_only:            # its one placeholder token is never computed: no room needed
            max_tokens = 1
        # The last sampled token never needs K/V: a request stores at most prompt + max_tokens - 1.
        need = cdiv(len(ids) + max_tokens - 1, cfg.block_size)
        if need > self.num_kv_blocks:
            raise ValueError(
                f"request {request_id!r} needs {need} KV blocks (prompt {len(ids)} + max_tokens "
                f"{max_tokens} tokens, block_size {cfg.block_size}) but the whole cache has "
                f"{self.num_kv_blocks} blocks; lower max_tokens or raise num_kv_blocks")
        return [Request(request_id=request_id if i == 0 else f"{request_id}#{i}", prompt_token_ids=ids,
                        sampling_params=_sample_params(params, i), max_tokens=max_tokens,
                        eos_token_ids=self.eos_token_ids, prompt=text, cache_salt=cache_salt)
                for i in range(params.n)]

    def _tokenize(self, prompt: PromptType, whole: bool = False) -> tuple[str | None, list[int]]:
        """The prompt's text (None if given as ids) and tokens; `whole`: tokenize all of a long text
        (it is to be truncated, so its length is no reason to refuse it)."""
        if isinstance(prompt, str):
            if not encodes_as_utf8(prompt):
                raise ValueError("the prompt must encode as UTF-8 (it holds a lone surrogate)")
            return prompt, self.tokenizer.encode(prompt) if whole else self._encode(prompt)
        unknown = sorted(k for k, v in prompt.items() if k not in PROMPT_KEYS and v is not None
                         ) if isinstance(prompt, dict) else []
        if "multi_modal_data" in unknown:
            raise ValueError(f"multi_modal_data: {self.config.model_config.architecture} is a text-only model and "
                             "takes no images (a vision-language model's folder does)")
        if unknown:                      # vLLM's other multimodal keys: never silently dropped
            raise ValueError(f"a prompt dict may hold {list(PROMPT_KEYS)}; {unknown} are not supported "
                             "(nanopaged runs text-only models)")
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, (list, tuple)) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return prompt.get("prompt"), list(ids)
        if isinstance(prompt, dict) and "prompt" in prompt:
            return self._tokenize(prompt["prompt"], whole)
        raise ValueError(f"a prompt is a string or a dict with 'prompt_token_ids', got {type(prompt).__name__}")

    def _encode(self, text: str) -> list[int]:
        """The text's tokens. A text far longer than the context is refused after tokenizing only
        its start (a 20 MB prompt would otherwise take seconds and a gigabyte to be refused)."""
        head = self.config.max_model_len * MAX_CHARS_PER_TOKEN
        if len(text) > head:
            n = len(self.tokenizer.encode(text[:head]))
            if n > self.longest_prompt():
                raise ValueError(f"the prompt has at least {n} tokens (its first {head:,} of {len(text):,} "
                                 f"characters alone); {self._why_limit()}")
        return self.tokenizer.encode(text)

    def _truncate(self, ids: list[int], keep: int | None) -> list[int]:
        """truncate_prompt_tokens=k keeps the last k tokens (vLLM truncates on the left); -1 keeps as
        many as leave room for one generated token, the longest prompt nanopaged runs."""
        if keep is None:
            return ids
        limit = self.config.max_model_len
        if keep > limit:
            raise ValueError(f"truncate_prompt_tokens={keep} is larger than max_model_len={limit}")
        return ids[-(self.longest_prompt() if keep == -1 else keep):]

    def _with_bad_words(self, params: SamplingParams) -> SamplingParams:
        """A copy whose bad_words_token_ids hold each word's tokens, alone and after a space, as vLLM
        tokenizes them (vllm/sampling_params.py: update_from_tokenizer), so the word is blocked at the
        start of the text and inside it."""
        if not params.bad_words:
            return params
        words = []
        for word in params.bad_words:
            ids = self.tokenizer.encode(word.lstrip(), add_special_tokens=False)
            if not ids:
                raise ValueError(f"bad_words entry {word!r} makes no tokens")
            words.append(ids)
            spaced = self.tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != ids[0] and len(spaced) == len(ids):   # vLLM's rule for the spaced form
                words.append(spaced)
        params = copy.copy(params)
        params.bad_words_token_ids = words
        return params

    def _check_in_vocabulary(self, name: str, token_ids) -> None:
        vocab = self.config.model_config.vocab_size
        bad = [t for t in token_ids if t >= vocab]
        if bad:
            raise ValueError(f"{name} holds {bad[0]}, outside the vocabulary [0, {vocab})")

    def longest_prompt(self) -> int:
        """A generating request needs room for one token after its prompt; a prefill-only one does not."""
        return self.config.max_model_len - (not self.prefill_only)

    def _why_limit(self) -> str:
        limit = self.config.max_model_len
        if self.prefill_only:
            return f"max_model_len={limit} (a prompt may be at most {limit} tokens)"
        return (f"max_model_len={limit} leaves no room for a generated token (a prompt may be at most "
                f"{limit - 1} tokens)")

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token")
        if len(ids) > self.longest_prompt():
            raise ValueError(f"the prompt has {len(ids)} tokens; {self._why_limit()}")
        vocab = self.config.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})")


def load_tokenizer(folder: str):
    """The model folder's tokenizer, or a ValueError that names the folder and the problem."""
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:   # a broken file surfaces as whatever its parser raises
        raise ValueError(f"cannot load the tokenizer in {folder!r}: {type(e).__name__}: {e}") from e


CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")


def render_chat(tokenizer, conversation, chat_template: str | None = None) -> dict:
    """One conversation as a prompt, through the model's chat template, after checking it. With tools it
    comes as {"messages", "tools"}: OpenAI's function tools, for the template to show (openai/tools.py).

    A message is {"role", "content"}; content is a string or, as vLLM (and OpenAI) accept,
    a list of parts of which the text parts ({"type": "text", "text": ...}) are joined.
    """
    tools = conversation.get("tools") if isinstance(conversation, dict) else None
    conversation = conversation.get("messages") if isinstance(conversation, dict) else conversation
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"a conversation is a non-empty list of messages, got {conversation!r}")
    messages = [_message(m) for m in conversation]
    try:
        text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True,
                                             chat_template=chat_template)
    except Exception as e:     # jinja's TemplateError (a template's raise_exception), TypeError, ...: these messages
        raise ValueError(f"messages: the chat template cannot render them: {type(e).__name__}: {e}") from None
    # The template already wrote the special tokens; do not add a BOS again.
    return {"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}


def _message(m) -> dict:
    if not isinstance(m, dict) or "role" not in m or "content" not in m:
        raise ValueError(f"a chat message is a dict with 'role' and 'content', got {m!r}")
    if m["role"] not in CHAT_ROLES:
        raise ValueError(f"a chat message's role must be one of {list(CHAT_ROLES)}, got {m['role']!r}")
    content = m["content"]
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in content):
            raise ValueError(f"only text parts ({{'type': 'text', 'text': ...}}) are supported, got {content!r}")
        content = "\n".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ValueError(f"a chat message's content must be a string or a list of text parts, got {content!r}")
    if not encodes_as_utf8(content):
        raise ValueError(f"a chat message's content must encode as UTF-8, got {content!r}")
    return {**m, "content": content}


def _sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample i of n: one sequence, with its own seed (seed + i) so the n samples differ. A copy, not
    `replace`, so what the input processor added (bad_words_token_ids) stays."""
    if params.n == 1:
        return params
    params = copy.copy(params)
    params.n, params.seed = 1, None if params.seed is None else params.seed + index
    return params
