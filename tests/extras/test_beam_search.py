"""Beam search on shared blocks: the best beam equals Hugging Face's beam search token for token."""
import json
import shutil

import pytest
import torch

from conftest import make_prompts
from nanopaged import LLM, BeamSearchParams, SamplingParams


def hf_beam(model_dir, prompts, width, max_tokens, eos=2, length_penalty=1.0):
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    refs = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), num_beams=width, do_sample=False, max_new_tokens=max_tokens,
                          length_penalty=length_penalty, early_stopping=False, pad_token_id=eos,
                          eos_token_id=eos)[0, len(p):].tolist()
        refs.append(out[:out.index(eos) + 1] if eos in out else out)
    return refs


@pytest.mark.parametrize("arch, width", [("llama", 2), ("llama", 4), ("qwen3", 3)])
def test_best_beam_equals_hugging_face(tiny_model_dirs, arch, width):
    prompts = make_prompts(512, n=4, seed=30, min_len=4, max_len=40)
    expected = hf_beam(tiny_model_dirs[arch], prompts, width, 12)
    llm = LLM(tiny_model_dirs[arch], dtype="float32", num_kv_blocks=100)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=12))
    for p, o, want in zip(prompts, outs, expected):
        assert len(o.sequences) == width
        assert o.sequences[0].tokens == p + want
        scores = [s.score for s in o.sequences]
        assert scores == sorted(scores, reverse=True)
    assert llm.get_stats()["kv_cache_usage"] == 0.0        # every beam gave its blocks back


def test_beam_search_survives_preemption(tiny_model_dirs):
    prompts = make_prompts(512, n=4, seed=31, min_len=20, max_len=40)
    params = BeamSearchParams(beam_width=4, max_tokens=10)
    roomy = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=200, block_size=8)
    tight = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=24, block_size=8)
    a = roomy.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    b = tight.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    assert tight.get_stats()["num_preemptions"] > 0
    assert [[s.tokens for s in o.sequences] for o in a] == [[s.tokens for s in o.sequences] for o in b]


def test_beams_share_blocks(tiny_model_dirs):
    """4 beams over a 160-token prompt hold far fewer blocks than 4 separate sequences would."""
    prompt, width, max_tokens, bs = make_prompts(512, n=1, seed=32, min_len=160, max_len=160)[0], 4, 8, 16
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=100, enable_prefix_caching=False)
    llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    separate = width * -(-(len(prompt) + max_tokens - 1) // bs)
    peak = llm.get_stats()["peak_kv_blocks_used"]
    assert peak <= len(prompt) // bs + width * 2 < separate


def test_demo_model_beam_search_equals_hugging_face(demo_model_dir):
    llm = LLM(demo_model_dir, dtype="float32", num_kv_blocks=256)
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": q}] for q in ("What is the capital of France?",
                                                         "Give me one word for happy.")]
    prompts = [tok.encode(tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True),
                          add_special_tokens=False) for c in convs]
    expected = hf_beam(demo_model_dir, prompts, 3, 20)
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=3, max_tokens=20))
    for p, o, want in zip(prompts, outs, expected):
        assert o.sequences[0].tokens == p + want
    assert outs[0].sequences[0].finish_reason == "stop" and "Paris" in outs[0].sequences[0].text


@pytest.mark.parametrize("kwargs, match", [
    ({"beam_width": 0, "max_tokens": 4}, r"beam_width must be in \[1, inf\], got 0"),
    ({"beam_width": 2, "max_tokens": 0}, r"max_tokens must be in \[1, inf\], got 0"),
])
def test_bad_beam_search_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        BeamSearchParams(**kwargs)


def test_beam_wider_than_max_num_seqs_is_refused(tiny_model_dirs):
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=32, max_num_seqs=2)
    with pytest.raises(ValueError, match=r"beam_width=3 is larger than max_num_seqs=2"):
        llm.beam_search("x", BeamSearchParams(beam_width=3, max_tokens=4))


def test_length_penalty_ranks_hypotheses_as_hugging_face_does(tiny_model_dirs, tmp_path):
    """length_penalty matters once hypotheses end at different lengths: with a token the
    model often picks as its EOS, beams finish early or late, and each penalty must pick
    Hugging Face's best sequence (which differs from one penalty to another)."""
    prompts = make_prompts(512, n=6, seed=34, min_len=4, max_len=20)
    greedy = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False)
    counts = {}
    for o in greedy:
        for t in o.outputs[0].token_ids[1:]:
            counts[t] = counts.get(t, 0) + 1
    eos = max(counts, key=counts.get)            # a token the model often says: hypotheses end at it
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dirs["llama"], folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
    best = {}
    for penalty in (-2.0, 0.0, 0.5, 2.0):
        expected = hf_beam(str(folder), prompts, 3, 12, eos=eos, length_penalty=penalty)
        llm = LLM(str(folder), dtype="float32", num_kv_blocks=100)
        outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                               BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=penalty))
        best[penalty] = [o.sequences[0].tokens for o in outs]
        assert best[penalty] == [p + e for p, e in zip(prompts, expected)], penalty
    assert len({tuple(map(tuple, b)) for b in best.values()}) > 1     # the penalty did change the ranking
