"""Prompts as token ids, logprobs of the output and of the prompt, and the sampling controls that
work on token ids: allowed_token_ids, bad_words, logit_bias, and no detokenizing at all.

Written for vLLM; only the imports change to run it on nanopaged.
"""
import argparse

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="Qwen/Qwen3-0.6B")
    args = parser.parse_args()

    llm = LLM(model=args.model, max_model_len=256, enable_prefix_caching=True)
    tokenizer = llm.get_tokenizer()
    prompt = TokensPrompt(prompt_token_ids=tokenizer.encode("The quick brown fox jumps over the"))

    # greedy, with the 3 most likely tokens at each generated position and the prompt's logprobs
    [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, logprobs=3, prompt_logprobs=1))
    completion = out.outputs[0]
    print("text:", repr(completion.text), "ids:", completion.token_ids)
    print("cumulative logprob:", round(completion.cumulative_logprob, 3))
    for token_id, top in zip(completion.token_ids, completion.logprobs):
        chosen = top[token_id]
        print(f"  {token_id:6d} {chosen.logprob:8.3f} rank {chosen.rank}  {chosen.decoded_token!r}")
    scored = [entry for entry in out.prompt_logprobs if entry is not None]
    print("prompt tokens scored:", len(scored), "of", len(out.prompt_token_ids))

    # the same, with the first generated token forbidden as a word, and steered by a bias
    first = tokenizer.decode([completion.token_ids[0]]).strip()
    bias = {completion.token_ids[1]: 5.0}
    params = SamplingParams(temperature=0, max_tokens=8, bad_words=[first] if first else None, logit_bias=bias)
    print("without", repr(first), "->", repr(llm.generate(prompt, params)[0].outputs[0].text))

    # only a few tokens allowed, and only ids wanted: no text is made
    allowed = sorted(set(completion.token_ids))[:3]
    params = SamplingParams(temperature=0, max_tokens=6, allowed_token_ids=allowed, detokenize=False)
    ids_only = llm.generate(prompt, params)[0].outputs[0]
    assert set(ids_only.token_ids) <= set(allowed) and ids_only.text == ""
    print("allowed", allowed, "->", ids_only.token_ids)


if __name__ == "__main__":
    main()
