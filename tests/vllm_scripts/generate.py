"""Generate with engine arguments and sampling parameters from the command line.

Written for vLLM (the style of its examples/offline_inference/basic/generate.py, with the engine
arguments a script typically passes); only the import changes to run it on nanopaged.
"""
import argparse

from vllm import LLM


def parse_args() -> dict:
    parser = argparse.ArgumentParser()
    engine = parser.add_argument_group("engine arguments")
    engine.add_argument("--model", default="meta-llama/Llama-3.2-1B-Instruct")
    engine.add_argument("--dtype", default="auto")
    engine.add_argument("--max-model-len", type=int)
    engine.add_argument("--max-num-seqs", type=int)
    engine.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    engine.add_argument("--enforce-eager", action="store_true")
    engine.add_argument("--seed", type=int, default=0)
    engine.add_argument("--trust-remote-code", action="store_true")
    sampling = parser.add_argument_group("sampling parameters")
    sampling.add_argument("--max-tokens", type=int)
    sampling.add_argument("--temperature", type=float)
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    return vars(parser.parse_args())


def main(args: dict) -> None:
    sampling = {name: args.pop(name) for name in ("max_tokens", "temperature", "top_p", "top_k")}
    llm = LLM(**args, quantization=None, enable_lora=False, tokenizer_mode="auto")
    # start from the model's defaults, then apply what was given
    params = llm.get_default_sampling_params()
    for name, value in sampling.items():
        if value is not None:
            setattr(params, name, value)
    prompts = ["Hello, my name is", "The president of the United States is",
               "The capital of France is", "The future of AI is"]
    for output in llm.generate(prompts, params, use_tqdm=False):
        print(f"{output.prompt!r} -> {output.outputs[0].text!r}")
    print("context length:", llm.llm_engine.model_config.max_model_len)


if __name__ == "__main__":
    main(parse_args())
