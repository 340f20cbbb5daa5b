"""A `vllm` package made of nanopaged, for lm-evaluation-harness's `vllm` backend: test-only.

lm-eval 0.4.13's lm_eval/models/vllm_causallms.py imports LLM, SamplingParams and TokensPrompt
from vllm (nanopaged's, here), three helpers of vLLM's (its tokenizer loader and the chat-template
resolver: thin stand-ins here; LoRARequest: nanopaged's), and reads the installed vllm's version. This writes
such a package, with its version metadata, into a folder; put the folder first on the path:

    python tests/lm_eval_shim.py /tmp/vllm_shim
    PYTHONPATH=/tmp/vllm_shim lm_eval --model vllm --model_args pretrained=MODEL_FOLDER,dtype=float32 ...

tests/test_lm_eval.py does the same in-process. Nothing of it is in the nanopaged package.
"""
import sys
import textwrap
from pathlib import Path

FAKE_VLLM = {
    "vllm/__init__.py": """
        from nanopaged import LLM, SamplingParams, TokensPrompt, TextPrompt, RequestOutput, CompletionOutput
        """,
    "vllm/lora/__init__.py": "",
    "vllm/lora/request.py": """
        from nanopaged.lora.request import LoRARequest   # lm-eval makes one with lora_local_path
        """,
    "vllm/tokenizers/__init__.py": """
        from transformers import AutoTokenizer

        def get_tokenizer(name, *args, tokenizer_mode="auto", trust_remote_code=False, revision=None, **kwargs):
            # vLLM's loader: the Hugging Face tokenizer, truncating on the left
            return AutoTokenizer.from_pretrained(name, *args, trust_remote_code=trust_remote_code,
                                                 revision=revision, truncation_side="left", **kwargs)
        """,
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/chat_utils.py": """
        def resolve_hf_chat_template(tokenizer, chat_template, tools, model_config):
            assert model_config.max_model_len > 0 and model_config.get_vocab_size() > 0   # what vLLM reads
            return chat_template or tokenizer.chat_template
        """,
    # lm-eval reads importlib.metadata.version("vllm"): >= 0.9 takes the paths above
    "vllm-0.10.2.dist-info/METADATA": "Metadata-Version: 2.1\nName: vllm\nVersion: 0.10.2\n",
}


def write_shim(folder) -> Path:
    folder = Path(folder)
    for path, text in FAKE_VLLM.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(textwrap.dedent(text))
    return folder


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python tests/lm_eval_shim.py FOLDER")
    print(write_shim(sys.argv[1]))
