"""A tiny byte-level BPE tokenizer, trained in-process in well under a second."""
from __future__ import annotations

import inspect
import json
import random
import textwrap
from pathlib import Path

UNK_TOKEN, BOS_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [UNK_TOKEN, BOS_TOKEN, EOS_TOKEN]     # ids 0, 1, 2, as in SmolLM2
EOS_TOKEN_ID = 2
# The chat template of SmolLM2-Instruct, without its default system prompt (the file's last newline is not its).
CHAT_TEMPLATE = (Path(__file__).resolve().parent / "data" / "chat_template.jinja").read_text().rstrip("\n")


def train_tokenizer(vocab_size: int = 512, model_max_length: int = 512):
    """A PreTrainedTokenizerFast of `vocab_size` tokens (specials included)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [inspect.getsource(m) for m in (textwrap, json, random)]   # any English-ish text
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=UNK_TOKEN, bos_token=BOS_TOKEN,
                                        eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                        model_max_length=model_max_length)
    tokenizer.chat_template = CHAT_TEMPLATE
    assert tokenizer.convert_tokens_to_ids(EOS_TOKEN) == EOS_TOKEN_ID
    return tokenizer
