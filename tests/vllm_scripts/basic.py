"""Offline generation in a dozen lines: a few prompts, one SamplingParams, one generate call.

Written for vLLM (in the style of its examples/offline_inference/basic/basic.py); the only line
that changes to run it on nanopaged is the import.
"""
import argparse

from vllm import LLM, SamplingParams

PROMPTS = [
    "My favourite colour is",
    "The best way to learn a language is",
    "Once upon a time, in a small village,",
    "The three laws of thermodynamics are",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    args = parser.parse_args()

    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, seed=0)
    llm = LLM(model=args.model)
    outputs = llm.generate(PROMPTS, params)
    print("-" * 60)
    for output in outputs:
        print(f"prompt: {output.prompt!r}")
        print(f"output: {output.outputs[0].text!r}")
        print("-" * 60)


if __name__ == "__main__":
    main()
