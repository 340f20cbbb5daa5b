"""bfloat16 is close to Hugging Face by vLLM's rule; float32 stays token-exact (test_hf_equality.py).

In bfloat16 two correct engines round differently (another summation order, another kernel), so
greedy tokens may part at a near tie. vLLM's `check_logprobs_close` accepts that and nothing
more: identical tokens until the first difference, where each side's token is among the other's
top-5 logprobs. Both sides run in bfloat16 here; nanopaged with the kernels `auto` picks on this
CPU (oneDNN's packed linears on a CPU with bfloat16 matrix units)."""
import pytest

from conftest import check_logprobs_close, hf_greedy_logprobs, make_prompts, nanopaged_greedy
from nanopaged import LLM


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_models_in_bf16_are_close_to_hugging_face(tiny_model_dirs, arch):
    prompts = make_prompts(512, n=8, seed=21, min_len=4, max_len=60)
    ours = nanopaged_greedy(LLM(tiny_model_dirs[arch], dtype="bfloat16"), prompts, 20)
    check_logprobs_close(ours, hf_greedy_logprobs(tiny_model_dirs[arch], prompts, 20, "bfloat16"))


def test_the_demo_model_in_bf16_is_close_to_hugging_face(demo_model_dir):
    llm = LLM(demo_model_dir, dtype="bfloat16")
    tok = llm.get_tokenizer()
    questions = ("What is the capital of France?", "Name three colours.", "Write a haiku about the sea.")
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True), add_special_tokens=False)
               for q in questions]
    ours = nanopaged_greedy(llm, prompts, 24)
    check_logprobs_close(ours, hf_greedy_logprobs(demo_model_dir, prompts, 24, "bfloat16"))
    assert "Paris" in tok.decode(ours[0][0])
