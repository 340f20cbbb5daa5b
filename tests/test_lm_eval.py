"""lm-evaluation-harness runs on nanopaged through its own `vllm` backend, unchanged, and scores what
its `hf` backend scores on the same model.

lm-eval 0.4.13's `lm_eval/models/vllm_causallms.py` imports `vllm`. Here, and only here, that name
is a folder put first on sys.path for the run: a `vllm` package made of nanopaged's names
(tests/lm_eval_shim.py writes it; nothing of it is in nanopaged). Three small local tasks
(dataset_path: json) exercise the three ways lm-eval asks a model: multiple choice (loglikelihood
of each choice: prompt_logprobs), rolling loglikelihood (perplexity of whole texts) and
generate-until (greedy text up to a stop string). Both backends run the tiny Llama in float32.
"""
import json
import math
import sys
import textwrap

import pytest

from lm_eval_shim import write_shim

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed: pip install -e '.[test]'")

# ---- three tasks, each a JSON-lines file and a task config ---------------------------------
WORDS = ("the value of a list is returned when the string is split into words and each line "
         "of text is wrapped to the width given by the caller").split()


def documents(seed):
    import random
    rng = random.Random(seed)
    words = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    return {
        "mc": [{"question": words(4, 8), "choices": [words(1, 3) for _ in range(4)], "answer": rng.randrange(4)}
               for _ in range(8)],
        "rolling": [{"text": words(20, 60)} for _ in range(6)],
        "gen": [{"question": words(4, 8), "answer": rng.choice(WORDS)} for _ in range(8)],
    }


TASKS = {
    "mc": """
        output_type: multiple_choice
        doc_to_text: "Question: {{question}}\\nAnswer:"
        doc_to_choice: "{{choices}}"
        doc_to_target: answer
        metric_list: [{metric: acc}, {metric: acc_norm}]
        """,
    "rolling": """
        output_type: loglikelihood_rolling
        doc_to_text: ""
        doc_to_target: "{{text}}"
        metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]
        """,
    "gen": """
        output_type: generate_until
        doc_to_text: "Question: {{question}}\\nAnswer:"
        doc_to_target: "{{answer}}"
        generation_kwargs: {until: ["\\n", "."], max_gen_toks: 10, do_sample: false}
        metric_list: [{metric: exact_match}]
        """,
}


def write_tasks(folder):
    for name, docs in documents(seed=0).items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        head = (f"task: nanopaged_{name}\ndataset_path: json\n"
                f"dataset_kwargs: {{data_files: {{test: {data}}}, cache_dir: {folder / 'cache'}}}\n"
                "test_split: test\n")
        (folder / f"{name}.yaml").write_text(head + textwrap.dedent(TASKS[name]))
    return [f"nanopaged_{name}" for name in TASKS]


def evaluate(model, model_args, task_folder, tasks, batch_size):
    from lm_eval.tasks import TaskManager
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True,
                                   task_manager=TaskManager(include_path=str(task_folder), include_defaults=False),
                                   batch_size=batch_size)


@pytest.fixture(scope="module")
def runs(tiny_model_dirs, tmp_path_factory):
    """lm-eval's results for both backends: {"hf": ..., "vllm": ...}."""
    root = tmp_path_factory.mktemp("lm_eval")
    write_shim(root)
    tasks = write_tasks(root)
    model = tiny_model_dirs["llama"]
    # hf: one request at a time, so no padding differs; vllm: all at once ("auto"), as lm-eval's vllm users run it
    out = {"hf": evaluate("hf", {"pretrained": model, "dtype": "float32", "device": "cpu"}, root, tasks, 1)}
    # lm-eval's own arguments, plus two of nanopaged's that it passes through to LLM(...)
    out["vllm"] = evaluate_on_nanopaged({"pretrained": model, "dtype": "float32", "num_kv_blocks": 256,
                                         "max_num_batched_tokens": 1024}, root, tasks)
    return out


def evaluate_on_nanopaged(model_args, root, tasks):
    """lm-eval's vllm backend, its `vllm` the shim in `root`, gone from sys.modules afterwards."""
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(root))
        try:
            return evaluate("vllm", model_args, root, tasks, "auto")
        finally:
            for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")
                         or m == "lm_eval.models.vllm_causallms"]:
                del sys.modules[name]


def samples(run, task):
    return sorted(run["samples"][task], key=lambda s: s["doc_id"])


def test_the_vllm_backend_ran_on_nanopaged(runs):
    assert runs["vllm"]["config"]["model"] == "vllm"
    assert "vllm" not in sys.modules        # the redirect is gone after the run


def test_multiple_choice_loglikelihoods_and_accuracy_equal_hugging_face(runs):
    hf, npg = (r["results"]["nanopaged_mc"] for r in (runs["hf"], runs["vllm"]))
    assert (npg["acc,none"], npg["acc_norm,none"]) == (hf["acc,none"], hf["acc_norm,none"])
    for a, b in zip(samples(runs["hf"], "nanopaged_mc"), samples(runs["vllm"], "nanopaged_mc"), strict=True):
        for (ll_a, greedy_a), (ll_b, greedy_b) in zip(a["filtered_resps"], b["filtered_resps"], strict=True):
            assert ll_b == pytest.approx(ll_a, abs=1e-3) and greedy_a == greedy_b


def test_rolling_loglikelihoods_and_perplexities_equal_hugging_face(runs):
    hf, npg = (r["results"]["nanopaged_rolling"] for r in (runs["hf"], runs["vllm"]))
    for metric in ("word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"):
        assert math.isfinite(hf[metric]) and npg[metric] == pytest.approx(hf[metric], rel=1e-4), metric
    for a, b in zip(samples(runs["hf"], "nanopaged_rolling"), samples(runs["vllm"], "nanopaged_rolling"), strict=True):
        assert b["filtered_resps"][0] == pytest.approx(a["filtered_resps"][0], abs=1e-2)


def test_greedy_generations_are_the_same_text(tiny_model_dirs, runs):
    """The same text, but for one difference that is lm-eval's own: its vllm backend asks for
    skip_special_tokens=False (vllm_causallms.py: modify_gen_kwargs), its hf backend decodes with
    skip_special_tokens=True, so a special token the random model draws mid-text shows in one only."""
    from transformers import AutoTokenizer
    specials = AutoTokenizer.from_pretrained(tiny_model_dirs["llama"]).all_special_tokens
    hf, npg = (r["results"]["nanopaged_gen"] for r in (runs["hf"], runs["vllm"]))
    assert npg["exact_match,none"] == hf["exact_match,none"]
    texts = [[s["filtered_resps"][0] for s in samples(run, "nanopaged_gen")] for run in (runs["hf"], runs["vllm"])]
    for special in specials:
        texts[1] = [t.replace(special, "") for t in texts[1]]
    assert texts[0] == texts[1] and all(texts[0])


def test_lora_local_path_scores_as_hugging_face_with_the_peft_adapter(tiny_model_dirs, tiny_adapters, runs, tmp_path):
    """lm-eval's vllm backend with `lora_local_path` (it sets enable_lora and sends a LoRARequest with every
    request) against its hf backend with `peft=` the same folder: the same loglikelihoods."""
    write_shim(tmp_path)
    write_tasks(tmp_path)
    model, adapter = tiny_model_dirs["llama"], tiny_adapters["llama"]["all"]
    hf = evaluate("hf", {"pretrained": model, "dtype": "float32", "device": "cpu", "peft": adapter}, tmp_path,
                  ["nanopaged_mc"], 1)
    npg = evaluate_on_nanopaged({"pretrained": model, "dtype": "float32", "num_kv_blocks": 256,
                                 "lora_local_path": adapter}, tmp_path, ["nanopaged_mc"])
    lls = {name: [[ll for ll, _ in s["filtered_resps"]] for s in samples(run, "nanopaged_mc")]
           for name, run in (("hf", hf), ("lora", npg), ("base", runs["vllm"]))}
    assert lls["lora"] != lls["base"]
    for a, b in zip(lls["hf"], lls["lora"], strict=True):
        assert b == pytest.approx(a, abs=1e-3)
