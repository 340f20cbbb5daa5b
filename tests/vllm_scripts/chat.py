"""Chat with a model through its chat template: one conversation, then a batch of them.

Written for vLLM (the style of its examples/offline_inference/basic/chat.py); only the import
changes to run it on nanopaged.
"""
import argparse

from vllm import LLM, SamplingParams


def show(outputs) -> None:
    for output in outputs:
        print(f"answer: {output.outputs[0].text!r} ({output.outputs[0].finish_reason})")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    llm = LLM(model=args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    conversation = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hello! How can I help you today?"},
        {"role": "user", "content": "Write a haiku about the sea."},
    ]
    show(llm.chat(conversation, params, use_tqdm=False))
    # many conversations in one call: they are batched together
    show(llm.chat([conversation] * 3, params, use_tqdm=False))
    # a chat template of one's own
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    show(llm.chat(conversation, params, use_tqdm=False, chat_template=template))


if __name__ == "__main__":
    main()
