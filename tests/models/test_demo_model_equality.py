"""The real demo model (SmolLM2-135M-Instruct, float32): greedy chat answers equal Hugging Face's."""
from nanopaged import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",      # a short answer that ends at EOS
    "Write a haiku about the sea.",        # a long one that runs to max_tokens
]


def test_demo_model_chat_answers_equal_hugging_face(demo_model_dir, hf_greedy):
    llm = LLM(demo_model_dir, dtype="float32", num_kv_blocks=256, max_num_batched_tokens=32)   # prompts chunked too
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                    SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    expected = hf_greedy(demo_model_dir, [o.prompt_token_ids for o in outs], 32)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert "Paris" in outs[0].outputs[0].text
    assert [o.outputs[0].finish_reason for o in outs] == ["stop", "length"]
