"""speculative_config is checked before anything loads, with vLLM's names and defaults; a bad one
is a ValueError that names the key and its limit."""
import json
import shutil

import pytest

from nanopaged import EngineConfig
from nanopaged.entrypoints.serve import parse_args
from nanopaged.spec_decode.config import SpeculativeConfig
from nanopaged.spec_decode.extension import SpeculativeDecoding


def config(model, spec, **kw):
    """The setting as the engine checks it when it is built, before any weight loads."""
    engine_config = EngineConfig(model=model, dtype="float32", speculative_config=spec, **kw)
    SpeculativeDecoding.check_config(engine_config)
    return engine_config.speculative_config


def test_vllm_defaults(tiny_model_dirs):
    m = tiny_model_dirs["llama"]
    assert config(m, {"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig("ngram", 3, 5, 5)
    assert config(m, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}) == \
        SpeculativeConfig("ngram", 3, 4, 4)
    assert config(m, {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}) == \
        SpeculativeConfig("ngram", 3, 2, 2)
    # a model and no method: a draft model
    assert config(m, {"model": m, "num_speculative_tokens": 2}) == SpeculativeConfig("draft_model", 2, model=m)


@pytest.mark.parametrize("spec, match", [
    ({"method": "medusa", "num_speculative_tokens": 3}, r"method 'medusa' is not supported; nanopaged has \['ngram', 'draft_model', 'suffix'\]"),
    ({"method": "magic", "num_speculative_tokens": 3}, r"method must be one of \['ngram', 'draft_model', 'suffix'\], got 'magic'"),
    ({"num_speculative_tokens": 3}, r"method must be one of .* got None"),
    ({"method": "ngram"}, r"num_speculative_tokens must be an integer, got None"),
    ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens must be in \[1, 32\], got 0"),
    ({"method": "ngram", "num_speculative_tokens": 33}, r"num_speculative_tokens must be in \[1, 32\], got 33"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     r"prompt_lookup_min=4 is above prompt_lookup_max=3"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, r"prompt_lookup_max must be in \[1, inf\]"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1}, r"unknown key 'draft_tensor_parallel_size'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, r"needs a 'model'"),
    ({"method": "draft_model", "model": "/nowhere", "num_speculative_tokens": 2}, r"model folder '/nowhere' does not exist"),
    ("ngram", r"speculative_config must be a dict, got 'ngram'"),
])
def test_bad_configs(tiny_model_dirs, spec, match):
    with pytest.raises(ValueError, match=match):
        config(tiny_model_dirs["llama"], spec)


def test_a_draft_model_must_share_the_vocabulary(tiny_model_dirs, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_model_dirs["llama"], other)
    cfg = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] + 64}))
    with pytest.raises(ValueError, match=r"vocab_size=576; the target model has 512: a draft model must share"):
        config(tiny_model_dirs["llama"], {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    (other / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 64}))
    with pytest.raises(ValueError, match=r"max_position_embeddings=64, below the engine's max_model_len=512"):
        config(tiny_model_dirs["llama"], {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2})
    assert config(tiny_model_dirs["llama"], {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2},
                  max_model_len=64).model == str(other)


def test_refused_before_any_weight_loads(tiny_model_dirs, monkeypatch):
    import nanopaged.worker.model_runner as runner
    monkeypatch.setattr(runner, "load_weights", lambda *a: pytest.fail("loaded weights"))
    from nanopaged import LLM
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(tiny_model_dirs["llama"], speculative_config={"method": "ngram", "num_speculative_tokens": 99})


def test_serve_takes_it_as_json():
    args = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'])
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3}
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", "ngram"])
