"""The reading path is what `LLM.generate` runs, counted honestly, file by file, twice.

A student first follows one request from `LLM.generate` down to the attention that reads K/V
through a block table on the reference kernels (torch everywhere: the torch attention backend,
the model's own torch ops, nn.Linear): the reference path. On a CPU with bfloat16 matrix units
(every host this project runs on) `LLM()` with default settings runs another path: the CPU
annex's fast layers (nanopaged/cpu/) replace the decoder layers, the linears and the attention,
and the C++ kernels they call are compiled and loaded: the default path. These tests generate
in a fresh interpreter both ways, list every nanopaged module each call imported, and hold the
lists to the ones docs/00_how_to_read.md (and any other page that copies them) prints, in reading order, with each
file's line count (comments and docstrings included; the C++ files the build compiles are
counted on the default path). Code `generate` never runs (beam search, tensor parallelism, the
server, the demo model's converter, the Triton and flash backends) is not imported and not
counted. `python scripts/reading_path.py --write` rewrites the tables' counts.
"""
import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# In reading order: the three parts the design card names, the engine step and `LLM`, then what
# they use, in the order a request meets it, then the packages' __init__ files (their indexes).
READING_PATH = [
    "nanopaged/core/block_pool.py", "nanopaged/core/request.py", "nanopaged/core/scheduler.py",
    "nanopaged/core/state_pages.py", "nanopaged/core/encoder_cache.py", "nanopaged/worker/model_runner.py", "nanopaged/attention/metadata.py", "nanopaged/attention/torch_backend.py",
    "nanopaged/models/llama.py", "nanopaged/engine/llm_engine.py", "nanopaged/engine/extension.py",
    "nanopaged/extensions.py", "nanopaged/llm.py",
    "nanopaged/config.py", "nanopaged/validation.py", "nanopaged/cpu/features.py", "nanopaged/cpu/choose.py",
    "nanopaged/attention/backends.py", "nanopaged/models/config.py", "nanopaged/models/loader.py",
    "nanopaged/models/pipeline.py",
    "nanopaged/sampling_params.py", "nanopaged/engine/input_processor.py",
    "nanopaged/sample/sampler.py", "nanopaged/sample/logits_processors.py", "nanopaged/sample/parallel_sampling.py",
    "nanopaged/engine/output_processor.py", "nanopaged/engine/detokenizer.py", "nanopaged/outputs.py",
    "nanopaged/engine/stats.py", "nanopaged/cpu/thread_governor.py", "nanopaged/logger.py",
    "nanopaged/__init__.py", "nanopaged/core/__init__.py", "nanopaged/engine/__init__.py",
    "nanopaged/worker/__init__.py", "nanopaged/attention/__init__.py", "nanopaged/models/__init__.py",
    "nanopaged/sample/__init__.py", "nanopaged/cpu/__init__.py",
]
# What the default path adds on a CPU with bfloat16 matrix units, in reading order: the fused
# layer loop, the packed linears, the `cpu` attention backend, the build; then the C++ it loads.
FAST_PATH = ["nanopaged/cpu/fused.py", "nanopaged/cpu/linear.py", "nanopaged/cpu/attention.py",
             "nanopaged/cpu/build.py", "nanopaged/cpu/recurrent.py"]
CPP_SOURCES = ["nanopaged/cpu/csrc/" + f for f in (
    "ops.h", "vec16.h", "row_kernels.h", "kv_layout.h", "norms.cpp", "rotary_kv.cpp", "attention_jobs.h", "attention.cpp",
    "linear_bf16.cpp", "quantized_rows.h", "linear_amx.cpp", "linear_quantized.cpp", "activations.cpp", "argmax.cpp", "recurrent.cpp", "moe.cpp", "decoder.h", "decoder.cpp",
    "bindings.cpp")]        # csrc/ops.h's order: what the kernels share, then a layer's kernels in turn
# The reference files the default path does not even import: their fast twins replace them whole.
REPLACED = ["nanopaged/attention/torch_backend.py"]        # by nanopaged/cpu/attention.py
DEFAULT_PATH = [p for p in READING_PATH if p not in REPLACED] + FAST_PATH + CPP_SOURCES
# Imported by every generate call, run only where installed, called or chosen: the registry's extensions
# (nanopaged/extensions.py imports each class, and each class's room at module level; their
# `check_config` and `wanted` run, the rest only when installed), LLM's other calls, and the model kinds
# and quantized linears a model or setting chooses. Imports say the truth: none is hidden inside a
# function to stay off this list. (cpu/choose.py imports the fast path's fused.py, linear.py and
# build.py on the reference path too: CHOOSE_IMPORTS.)
LOADED = [
    "nanopaged/lora/extension.py", "nanopaged/lora/settings.py", "nanopaged/lora/manager.py",
    "nanopaged/lora/adapter.py", "nanopaged/lora/layers.py", "nanopaged/lora/request.py", "nanopaged/lora/__init__.py",
    "nanopaged/pooling/extension.py", "nanopaged/pooling/config.py", "nanopaged/pooling/pooler.py",
    "nanopaged/pooling/processors.py", "nanopaged/pooling_params.py", "nanopaged/pooling/__init__.py",
    "nanopaged/structured_output/extension.py", "nanopaged/structured_output/manager.py",
    "nanopaged/structured_output/backend_types.py", "nanopaged/structured_output/bitmask.py",
    "nanopaged/structured_output/params.py", "nanopaged/structured_output/__init__.py",
    "nanopaged/spec_decode/extension.py", "nanopaged/spec_decode/config.py", "nanopaged/spec_decode/drafter.py",
    "nanopaged/spec_decode/draft_budget.py", "nanopaged/spec_decode/ngram_proposer.py",
    "nanopaged/spec_decode/suffix_proposer.py", "nanopaged/spec_decode/suffix_tree.py",
    "nanopaged/spec_decode/draft_model.py", "nanopaged/spec_decode/stats.py", "nanopaged/spec_decode/__init__.py",
    "nanopaged/sample/rejection_sampler.py",
    # async scheduling: the engine's step pipelined on two threads, chosen by a setting (off on a CPU)
    "nanopaged/engine/overlap.py",
    # what LLM offers beside generate (beam_search, embed, chat's tools, the demo model when no model is given,
    # vLLM's engine arguments) and the public names nanopaged/__init__.py exports
    "nanopaged/extras/beam_search.py", "nanopaged/extras/__init__.py", "nanopaged/pooling/embed.py",
    "nanopaged/pooling/outputs.py", "nanopaged/engine/chat_tools.py", "nanopaged/models/demo_model.py",
    "nanopaged/vllm_compat.py", "nanopaged/inputs.py",
    # the model kinds and fast paths a given model or setting chooses: mixtures of experts, GGUF and int4/int8 weights
    "nanopaged/models/moe.py", "nanopaged/cpu/moe.py", "nanopaged/cpu/quantized_linear.py", "nanopaged/models/gguf.py",
    "nanopaged/cpu/rotation.py", "nanopaged/models/shipped_int8.py",
    # a hybrid (linear-attention layers beside attention): its config, layers, reference rule and runner
    "nanopaged/models/hybrid.py", "nanopaged/models/qwen3_5.py", "nanopaged/models/gated_delta_rule.py",
    "nanopaged/models/granite_hybrid.py", "nanopaged/models/mamba2.py", "nanopaged/worker/hybrid_runner.py",
    # images: the extension (its input processor, the checks of an image, the runner's half of the encoder cache,
    # chat's image parts), the two vision-language models and their runner
    "nanopaged/multimodal/extension.py", "nanopaged/multimodal/input_processor.py", "nanopaged/multimodal/media.py",
    "nanopaged/multimodal/placeholders.py", "nanopaged/multimodal/encoder_outputs.py",
    "nanopaged/multimodal/chat_parts.py", "nanopaged/multimodal/__init__.py",
    "nanopaged/models/vision_config.py", "nanopaged/models/idefics3.py", "nanopaged/models/siglip.py",
    "nanopaged/models/qwen2_5_vl.py", "nanopaged/models/qwen2_5_vl_vision.py", "nanopaged/worker/vision_runner.py",
    # the other pooling tasks: a classifier's head, LLM.classify / reward / encode / score
    "nanopaged/models/classifier.py", "nanopaged/pooling/tasks.py", "nanopaged/pooling/score.py",
    # batches in flight, for a runner that computes several at once (a pipeline of ranks)
    "nanopaged/engine/batch_queue.py",
    # the prefix cache's disk tier: its key, block files, store, writer thread and extension
    "nanopaged/kv_disk/__init__.py", "nanopaged/kv_disk/key.py", "nanopaged/kv_disk/block_file.py",
    "nanopaged/kv_disk/store.py", "nanopaged/kv_disk/writer.py", "nanopaged/kv_disk/extension.py",
    # a reasoning model's thinking told from its answer: where a structured output's constraint starts
    "nanopaged/reasoning.py",
]
CHOOSE_IMPORTS = [p for p in FAST_PATH if p != "nanopaged/cpu/attention.py"]
TABLES = READING_PATH + FAST_PATH + CPP_SOURCES + LOADED   # the three tables the documents print, in order
# 3,400 until quantization, the structured-output hooks, decode grouping (issues 28, 27, 23); 3,500 until
# speculative decoding (26); 3,600 until the CPU fast paths' choice (23); 3,700 until the CPU annex's
# choose module and the token-selection room (35); 3,800 until LoRA's hooks: a request's adapter in its
# block hash, the scheduler's admission rules, the runner's before_forward (38); 3,850 until a mixture of
# experts' place in the config, the layers, the loader and the choice (39); the default path 5,800 until the
# layer loop's LoRA updates (38), 5,900 until the same (39), 5,950 until the weights' size is checked before
# they load (39), 5,975 until a mixture's experts grouped per step in C++ (39: csrc/moe.cpp, compiled
# for every model; cpu/moe.py is imported only for a mixture of experts); 3,900 and 6,100 until a model is built
# in its own dtype and a mixture's load counted per step (39: a 7B mixture built in float32 first did not fit);
# 3,925 and 6,125 until pooling's and tools' places in the config, the engine, the LLM and the chat renderer
# (41: runner and pooler_config, their check, the pooling extension's entry, LLM.embed, LLM.chat's tools)
# 4,350 and 6,600 until the extension contract and the model pipeline (52: engine/extension.py, the registry,
# models/pipeline.py, the packages' full indexes), which replaced the registries of module names, the hook lists
# and the seats taken from outside, and a server that refuses each hostile request alone (53: stop strings
# matched by one automaton, bounds at parse time, the kernels' build under a lock the kernel releases); what every
# call imports and runs only where installed, called or chosen has its own budget (52: imports say the truth);
# 4,400, 6,700 and 4,800 until async scheduling (54: a placeholder in the request and the scheduler's two
# halves of update, the runner's step cut into prepare and forward, each phase of a step timed, the GIL let go
# by the kernels; engine/overlap.py loaded by every call, run where the setting chooses it); 4,450, 7,075 and
# 5,000 until the CPU's arithmetic (56: nanopaged's AMX kernels, bfloat16 and W8A8's int8, compiled on every
# host and run on an AMX host's default path, and their choice; the W8A8 layer and the rotation it loads; a
# checkpoint's own int8 W8A8, read from config.json, its scales kept by the loader beside the codes); 4,700,
# 7,500 and 6,025 until hybrid models (57: the block manager pages a linear layer's state beside K/V, from one
# free queue, and keeps it at block boundaries for the prefix cache, given up when pages run short:
# core/state_pages.py, run for every model; two hybrids' config, layers and reference rules (Qwen3.5's gated
# DeltaNet, Granite 4.0-H's Mamba-2) and their runner loaded by every call, run only for a hybrid; their
# decode token in C++, csrc/recurrent.cpp compiled on every host and cpu/recurrent.py imported by the choice;
# the torch backend's decode gathering only the slots in use where blocks are large, as a hybrid's are; a
# vision-language checkpoint read for its language model: the config's LANGUAGE_MODEL_OF, the loader's prefixes);
# 4,975, 7,775 and 7,575 until images and the other pooling tasks (58: the encoder cache, core's half, run for
# every model: which images a step encodes within its budget, which it keeps, an image's hash in the block hash,
# a chunk cut before an image it cannot encode; a model taking inputs_embeds; the config's encoder and media
# settings and its vision-language and classifier readings; LLM's classify, reward, encode and score; the
# images' extension, two vision-language models with their runner, and a classifier's head loaded by every call);
# 5,050, 7,840 and 8,450 until pipeline parallelism, the disk tier and reasoning output (59: the scheduler's
# micro-batch share and its rule for a token still computing, the engine's batches in flight (engine/batch_queue.py,
# loaded by every call), LLM.make_runner's pipeline runner; 60: the supply_blocks hook (the scheduler asks block
# sources after the pool's hits and fills their blocks) and the disk tier's six files, an extension of the registry;
# 61: the reasoning parsers the structured-output manager imports, the setting's check; a chat template's own error
# made a ValueError); loaded 8,450 until the disk tier's writes left the model's cores alone (60: the writer's
# reused page-aligned images made ahead, O_DIRECT with its fallback, the idle scheduling class, the queued
# blocks copied once, its end with the engine)
LINE_BUDGET = 5050
DEFAULT_LINE_BUDGET = 7840
LOADED_BUDGET = 8530
# The design card's three parts: the block manager, the scheduler, the model runner with the
# torch attention it calls (the metadata it builds, the reference backend).
THREE_PARTS = {
    "block manager": ["nanopaged/core/block_pool.py", "nanopaged/core/request.py"],
    "scheduler": ["nanopaged/core/scheduler.py"],
    "model runner + torch attention": ["nanopaged/worker/model_runner.py", "nanopaged/attention/metadata.py",
                                       "nanopaged/attention/torch_backend.py"],
}
THREE_PARTS_BUDGET = 1125     # 1,000 until async scheduling's placeholder token (54): the request counts one, and
                              # the scheduler's update in two halves, so a step can be scheduled between them; 1,025
                              # until a hybrid's state pages (57): the request's pages, a block's snapshot and
                              # the pool's count of snapshot pages it can take back, the scheduler's calls into
                              # core/state_pages.py, the metadata's pages per request; the torch backend's
                              # decode reading only the slots in use of a large block; 1,090 until images (58):
                              # the request's encoder inputs, the scheduler's calls into core/encoder_cache.py
                              # and the block hash's image keys, the runner's inputs_embeds; 1,115 until batches
                              # in flight (59: a step's share of sequences, a request whose token still computes
                              # waits, one placeholder retired per sampled step) and block sources (60: the blocks
                              # after the pool's hits, filled from a tier beyond it)
# Words of every extension: a name holding one in the block pool, the scheduler, the runner or the
# engine step means an extension's logic lives there instead of behind a hook.
EXTENSION_WORDS = ("beam", "graph", "stats", "statistic", "bench", "triton", "flash", "demo", "fuse", "quant",
                   "pack", "spec", "draft", "lora", "grammar", "structured", "governor", "tensor_parallel", "rank",
                   "dpbf16", "amx", "onednn", "mkldnn", "kernel", "expert", "moe")
# The core's own names that hold such a word, each with the reason it is the core's.
CORE_VOCABULARY = {
    "spec_token_ids": "drafts are new tokens to the core: the one list the scheduler computes beside the real ones "
                      "(vLLM's Request.spec_token_ids)",
    "num_tokens_with_spec": "the target num_computed_tokens chases when a request has drafts (vLLM's name)",
    "lora_request": "vLLM's name for the adapter a request runs with: add_request takes it, the request carries "
                    "it, and the prefix cache keys blocks by its id (vLLM's extra keys); the adapters themselves live "
                    "behind hooks in nanopaged/lora/",
}
CORE_STEP = ["nanopaged/core/block_pool.py", "nanopaged/core/request.py", "nanopaged/core/scheduler.py",
             "nanopaged/engine/llm_engine.py", "nanopaged/worker/model_runner.py"]

REFERENCE_SETTINGS = 'attention_backend="torch", cpu_kernels="reference", cpu_linear="reference",'
PROGRAM = """
import json, sys
from nanopaged import LLM, SamplingParams
llm = LLM(sys.argv[1], device="cpu", {settings} num_kv_blocks=16)
llm.generate(["Hello", {{"prompt_token_ids": [1, 2, 3]}}], SamplingParams(max_tokens=3), use_tqdm=False)
fast = llm.llm_engine.runner.fast_path
print(json.dumps({{"files": sorted(m.__file__ for name, m in sys.modules.items() if name.split(".")[0] == "nanopaged"),
                  "fast_path": [fast.linear, fast.layers, fast.attention_backend]}}))
"""


def lines(path: str) -> int:
    return len((ROOT / path).read_text().splitlines())


def total(paths: list[str]) -> int:
    return sum(lines(p) for p in paths)


def run_generate(model_dir: str, settings: str) -> dict:
    """The nanopaged files a generate call imports in a fresh interpreter, and the fast path it ran."""
    done = subprocess.run([sys.executable, "-c", PROGRAM.format(settings=settings), model_dir], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    result["files"] = sorted(str(Path(f).resolve().relative_to(ROOT)) for f in result["files"])
    return result


def test_the_reading_path_is_exactly_what_generate_imports_on_the_reference_kernels(tiny_model_dirs):
    result = run_generate(tiny_model_dirs["llama"], REFERENCE_SETTINGS)
    assert result["fast_path"] == ["reference", "reference", "torch"]
    assert result["files"] == sorted(READING_PATH + LOADED + CHOOSE_IMPORTS)


def test_the_default_path_is_what_generate_imports_with_the_default_settings(tiny_model_dirs):
    """On a CPU with bfloat16 units where the kernels build (AMX: oneDNN's packed linear; AVX512-BF16
    alone: nanopaged's dpbf16; both in cpu/linear.py): the fused path, and the C++ it builds.
    Elsewhere `auto` runs the reference path, which this test then holds it to."""
    result = run_generate(tiny_model_dirs["llama"], "")
    linear, layers, attention = result["fast_path"]
    if layers == "fused" and linear != "reference":
        assert result["files"] == sorted([p for p in DEFAULT_PATH if p.endswith(".py")] + LOADED)
    elif linear == "reference":
        assert (layers, result["files"]) == ("reference", sorted(READING_PATH + LOADED + CHOOSE_IMPORTS))
        pytest.skip("this host's default is the reference path (no bfloat16 units, or no compiler)")
    else:
        pytest.skip(f"packed linears without the C++ kernels here: {result['fast_path']}")


def test_the_default_path_counts_every_cpp_file_the_build_compiles():
    """The build compiles every .cpp of csrc/ into the one module it loads (the headers they
    include copied beside them), so the default path counts every file there: the 4- and 8-bit
    linears too, which run only with quantization=."""
    from nanopaged.cpu import build
    built = sorted(str(Path(p).relative_to(ROOT)) for p in build.SOURCES + build.HEADERS)
    assert built == sorted(CPP_SOURCES)
    assert built == sorted(str(p.relative_to(ROOT)) for p in (ROOT / "nanopaged/cpu/csrc").iterdir())


def test_the_paths_hold_at_most_their_budgets():
    counts = {p: lines(p) for p in READING_PATH}
    assert sum(counts.values()) <= LINE_BUDGET, f"the reading path holds {sum(counts.values())} lines: {counts}"
    assert total(DEFAULT_PATH) <= DEFAULT_LINE_BUDGET, f"the default path holds {total(DEFAULT_PATH)} lines"
    assert total(LOADED) <= LOADED_BUDGET, f"the loaded extensions hold {total(LOADED)} lines"


def test_the_three_parts_hold_about_1000_lines():
    counts = {part: sum(lines(p) for p in files) for part, files in THREE_PARTS.items()}
    assert sum(counts.values()) <= THREE_PARTS_BUDGET, counts


def table_rows(text: str) -> list[tuple[str, int]]:
    """The rows `| n | `nanopaged/...` | lines | ...` of a document's reading-path tables, in order."""
    return [(m.group(1), int(m.group(2)))
            for m in re.finditer(r"^\|\s*\d+\s*\|\s*`(nanopaged/[\w/]+\.(?:py|cpp|h))`\s*\|\s*(\d+)\s*\|", text,
                                 re.MULTILINE)]


def expected_tables() -> str:
    rows = [f"| {i} | `{p}` | {lines(p)} |" for i, p in enumerate(TABLES, 1)]
    return "\n".join(rows) + (f"\nreference {total(READING_PATH)}, default {total(DEFAULT_PATH)}, "
                              f"loaded {total(LOADED)}")


def documents_printing_the_paths() -> list[str]:
    """Chapter 0, where the reading path is printed in full, and any other page (the README, a docs
    page) that prints a row of its tables: a copy is held to the same counts, never left to drift."""
    pages = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    copies = [str(p.relative_to(ROOT)) for p in pages if table_rows(p.read_text())]
    return sorted(set(copies) | {"docs/00_how_to_read.md"})


@pytest.mark.parametrize("doc", documents_printing_the_paths())
def test_every_page_that_prints_the_paths_prints_each_files_count(doc):
    text = (ROOT / doc).read_text()
    hint = f"{doc}: the reading-path tables should read (python scripts/reading_path.py --write)\n{expected_tables()}"
    assert table_rows(text) == [(p, lines(p)) for p in TABLES], hint
    assert f"reference path: {total(READING_PATH):,} lines in {len(READING_PATH)} files" in text, hint
    assert f"default path: {total(DEFAULT_PATH):,} lines in {len(DEFAULT_PATH)} files" in text, hint
    assert f"loaded, run only when installed: {total(LOADED):,} lines in {len(LOADED)} files" in text, hint
    parts = sum(lines(p) for files in THREE_PARTS.values() for p in files)
    assert f"the three parts: {parts:,} lines" in text, f"{doc} should say: the three parts: {parts:,} lines"


def identifiers(path: Path) -> set[str]:
    """The names the code defines, imports or keeps on `self` (not comments, not other libraries' API)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias):
            names.add(node.name)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def extension_names(path: Path) -> list[str]:
    return sorted(n for n in identifiers(path) - set(CORE_VOCABULARY)
                  if any(w in n.lower() for w in EXTENSION_WORDS))


def test_no_extension_logic_in_the_core_step():
    found = {path: bad for path in CORE_STEP if (bad := extension_names(ROOT / path))}
    assert not found, f"extension code in the core step: {found}"


def test_the_extension_check_sees_what_it_looks_for(tmp_path):
    """The check is not blind: a fast-path branch or an adapter slot in a core file is caught."""
    planted = tmp_path / "runner.py"
    planted.write_text("def load_model(self):\n    if self.config.cpu_kernels == 'fused':\n"
                       "        fuse_layers(self.model)\n    self.lora_slots = quantize_linears(self.model)\n")
    assert extension_names(planted) == ["fuse_layers", "lora_slots", "quantize_linears"]


def test_every_cpp_file_holds_one_concern_in_a_few_hundred_lines():
    """The C++ is split by concern (csrc/ops.h lists the files): a file past ~450 lines holds more
    than one idea a reader can name."""
    long = {p: lines(p) for p in CPP_SOURCES if lines(p) > 450}
    assert not long, f"split these by concern: {long}"
