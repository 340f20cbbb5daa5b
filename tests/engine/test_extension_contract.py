"""One way in: every extension attaches through the engine's Extension interface and nothing else.

Static checks over the source (docs/00_how_to_extend.md): the core names no extension; nothing looks an
extension up by its module's name; nothing outside the engine assigns to the engine's seats or appends
to the lists it hands down; every registered extension is an Extension whose hooks keep the base
signatures. And one engine with every extension installed that only the interface wires together.
"""
import ast
import inspect
import io
import re
import tokenize
from pathlib import Path

import pytest

from nanopaged.engine.extension import Extension
from nanopaged.models.pipeline import MODEL_STAGES
from nanopaged.extensions import EXTENSIONS

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "nanopaged"
CORE = [p for folder in ("core", "engine", "worker") for p in sorted((PACKAGE / folder).glob("*.py"))]
SOURCES = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "benchmarks").rglob("*.py")) + [ROOT / "bench.py"]

# Words that name an extension or its machinery. The core may use none of them in code or strings.
EXTENSION_WORDS = re.compile(r"lora|adapter|spec_?decod|speculat|structured|grammar|pool(ing|er)|suffix.?(decod|tree|propos)|ngram|"
                             r"beam|tensor.parallel|\bray\b|kv.?disk|disk.tier", re.IGNORECASE)
# vLLM's own request vocabulary, which the core keeps so a reader can cross over to vLLM. "Draft" is no
# extension's name: vLLM's scheduler calls the tokens a request guessed ahead drafts (num_draft_tokens).
ALLOWED = {
    "spec_token_ids",        # vLLM's Request field: tokens to verify next step (the scheduler schedules them)
    "num_tokens_with_spec",  # vLLM's Request property: the target num_computed_tokens chases
    "lora_request",          # vLLM's add_request keyword: the engine passes it on as an extension field
}
# The rooms whose modules are extensions: nothing may name their modules in a string.
EXTENSION_MODULES = re.compile(r"^nanopaged\.(lora|spec_decode|structured_output|pooling|kv_disk|extras)\b")
# Strings that name such modules for another reason, each with its reason:
MODULE_STRINGS_ALLOWED = {
    # the attention backends' table: triton and flash-attn are optional packages, imported only when chosen
    PACKAGE / "attention" / "backends.py",
}
# The engine's seats, and the lists it hands the scheduler, runner, sampler and output processor.
HANDED_DOWN = {"admission_rules", "block_sources", "before_forward", "logits_processors", "stop_rules"}


def engine_seats() -> set[str]:
    """Every attribute LLMEngine.__init__ sets on itself."""
    tree = ast.parse((PACKAGE / "engine" / "llm_engine.py").read_text())
    init = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def words(path: Path):
    """(line, text) of every name and string in a file: code and strings, not comments."""
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type in (tokenize.NAME, tokenize.STRING):
            yield tok.start[0], tok.string


def test_the_core_names_no_extension():
    found = []
    for path in CORE:
        for line, text in words(path):
            cleaned = text
            for allowed in ALLOWED:
                cleaned = cleaned.replace(allowed, "")
            for m in EXTENSION_WORDS.finditer(cleaned):
                found.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r} in {text[:60]!r}")
    assert not found, "the core names an extension:\n" + "\n".join(found)


def test_the_check_sees_a_name_planted_in_the_core(tmp_path):
    """The check above can fail: a core file that names an extension is caught."""
    planted = tmp_path / "planted.py"
    planted.write_text('"""Steps."""\nx = engine.find(LoRA)\n')
    assert any(EXTENSION_WORDS.search(text) for _, text in words(planted))


def test_no_extension_module_is_looked_up_by_its_name():
    found = []
    for path in SOURCES:
        if path in MODULE_STRINGS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and EXTENSION_MODULES.match(node.value):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "import_module"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: importlib.import_module")
    assert not found, "module names used as lookups:\n" + "\n".join(found)


def test_nothing_outside_the_engine_takes_a_seat():
    """No `x.token_selection = ...`, `x.runner = ...` on another object, no `.append` to a handed-down list."""
    seats, found = engine_seats(), []
    assert {"token_selection", "input_processor", "output_processor", "runner", "scheduler", "sampler"} <= seats
    for path in SOURCES:
        if path == PACKAGE / "engine" / "llm_engine.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                       if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for t in targets:
                owner = ast.unparse(t.value) if isinstance(t, ast.Attribute) else ""
                if isinstance(t, ast.Attribute) and (t.attr in HANDED_DOWN and owner != "self"
                                                     or t.attr in seats and owner.endswith("engine")):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: assigns .{t.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("append", "extend", "insert", "remove")
                    and isinstance(node.func.value, ast.Attribute) and node.func.value.attr in HANDED_DOWN):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.func.value.attr}.{node.func.attr}")
    assert not found, "seats taken from outside the engine:\n" + "\n".join(found)


@pytest.mark.parametrize("kind", EXTENSIONS, ids=lambda k: k.__name__)
def test_every_registered_extension_keeps_the_interface(kind):
    assert issubclass(kind, Extension) and kind.name
    for name, base in vars(Extension).items():
        if callable(base) and not name.startswith("_") and name in vars(kind):
            ours, theirs = inspect.signature(getattr(kind, name)), inspect.signature(getattr(Extension, name))
            assert list(ours.parameters) == list(theirs.parameters), f"{kind.__name__}.{name}{ours}"
    assert len({k.name for k in EXTENSIONS}) == len(EXTENSIONS)


def test_model_stages_run_in_the_pipelines_order():
    from torch import nn

    from nanopaged.models.pipeline import ModelStage
    from nanopaged.models.pipeline import run_pipeline
    ran = []
    stages = [ModelStage(name, lambda m, name=name: ran.append(name) or m) for name in reversed(MODEL_STAGES)]
    model = nn.Linear(1, 1)
    assert run_pipeline(model, stages) is model
    assert ran == list(MODEL_STAGES)
    with pytest.raises(ValueError, match="model stage 'compile' is not one of"):
        run_pipeline(model, [ModelStage("compile", lambda m: m)])


def test_an_engine_with_its_extensions_installed_is_wired_through_the_interface_only(tiny_model_dirs, tmp_path):
    """LoRA and n-gram drafts with the engine, structured outputs by the first request that asks: every
    hook the scheduler, runner, sampler and output processor call is a bound method of an installed
    extension, handed over by the engine (the very lists it keeps), in the registry's order."""
    pytest.importorskip("xgrammar")
    from nanopaged import LLM, SamplingParams, StructuredOutputsParams
    from nanopaged.lora.extension import LoRA
    from nanopaged.spec_decode.extension import SpeculativeDecoding
    from nanopaged.structured_output.extension import StructuredOutputs
    llm = LLM(tiny_model_dirs["llama"], dtype="float32", num_kv_blocks=64, enable_lora=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    engine = llm.llm_engine
    assert engine.find(StructuredOutputs) is None
    llm.generate("hi", SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
                 use_tqdm=False)
    kinds = [type(e) for e in engine.extensions]
    assert [k for k in kinds if k in EXTENSIONS] == [LoRA, StructuredOutputs, SpeculativeDecoding]
    handed = {"admit": engine.scheduler.admission_rules, "before_forward": engine.runner.before_forward,
              "process_logits": engine.sampler.logits_processors, "stop": engine.output_processor.stop_rules}
    for name, hooks in handed.items():
        assert hooks is engine.hooks[name] and hooks, name
    for name, hooks in engine.hooks.items():
        for hook in hooks:
            assert hook.__self__ in engine.extensions and type(hook.__self__).overrides(name), (name, hook)
    assert type(engine.token_selection).__name__ == "RejectionSampler"     # speculative decoding's wrap


def test_a_pooling_engine_takes_its_seats_through_the_interface(tiny_model_dirs):
    from nanopaged import LLM
    from nanopaged.pooling.extension import Pooling
    from nanopaged.pooling.pooler import Pooler
    from nanopaged.pooling.processors import PoolingInputProcessor, PoolingOutputProcessor
    engine = LLM(tiny_model_dirs["llama"], runner="pooling", dtype="float32", num_kv_blocks=32).llm_engine
    pooling = engine.find(Pooling)
    assert engine.token_selection is pooling.pooler and isinstance(engine.token_selection, Pooler)
    assert isinstance(engine.input_processor, PoolingInputProcessor)
    assert isinstance(engine.output_processor, PoolingOutputProcessor)
    assert engine.output_processor.stop_rules is engine.hooks["stop"]     # handed to the processor it made
    assert type(engine.runner.model.lm_head).__name__ == "Identity"     # the pipeline's head stage
