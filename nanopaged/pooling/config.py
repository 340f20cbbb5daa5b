"""How a pooling engine pools: `runner="pooling"` and `pooler_config`, checked once, with vLLM's rules.

The pooling type and the normalisation come, in this order, from the `pooler_config` setting, the
model folder's sentence-transformers files (modules.json names a Pooling module whose config.json
sets one `pooling_mode_*`, and maybe a Normalize module), or vLLM's default for a decoder LLM (the
last token, normalised: vllm/model_executor/models/adapters.py, as_embedding_model). A sequence-
classification model (models/config.py: num_labels) pools the same way and adds its head's activations,
read from config.json as vLLM reads them (vllm/model_executor/layers/pooler.py). No torch.
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from nanopaged.validation import check_bool, check_choice

logger = logging.getLogger(__name__)
RUNNERS = ("auto", "generate", "pooling")      # vLLM's; auto: pooling for a classifier, else generate
POOLING_TYPES = ("LAST", "MEAN", "CLS")
# sentence-transformers' Pooling modes -> vLLM's pooling types (vllm/transformers_utils/config.py)
ST_POOLING_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN",
                    "pooling_mode_cls_token": "CLS"}
# the tasks a pooling model runs (vLLM's supported_tasks): the first is a request's without one
EMBEDDING_TASKS = ("embed", "token_embed")
CLASSIFIER_TASKS = ("classify", "token_classify", "score")
ST_POOLING, ST_NORMALIZE = "sentence_transformers.models.Pooling", "sentence_transformers.models.Normalize"
ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# a classifier's activation for classify and reward, by config.json's problem_type (transformers' loss for it);
# "classify": softmax over two or more labels, sigmoid over one (vLLM: PoolerClassify)
PROBLEM_TYPES = {None: "classify", "single_label_classification": "classify",
                 "multi_label_classification": "sigmoid", "regression": "identity"}
# a cross-encoder's activation for score, named as sentence-transformers names it (default: sigmoid)
CROSS_ENCODER_ACTIVATIONS = {"torch.nn.modules.activation.Sigmoid": "sigmoid",
                             "torch.nn.modules.linear.Identity": "identity"}


@dataclass
class PoolerConfig:
    pooling_type: str = "LAST"             # LAST | MEAN | CLS (the first token)
    normalize: bool = True                 # L2-normalise the pooled vector, unless a request says otherwise
    matryoshka_dimensions: list[int] | None = None   # None: no Matryoshka training; []: any size
    classify_activation: str | None = None   # a classifier's, for classify and reward: classify | sigmoid | identity
    score_activation: str | None = None      # a classifier's, for score: sigmoid | identity


def model_tasks(model_config) -> tuple[str, ...]:
    return EMBEDDING_TASKS if model_config.num_labels is None else CLASSIFIER_TASKS


def check_task(task: str, model_config) -> None:
    """A ValueError naming the task and the model's kind, for a task this model does not run (vLLM refuses
    the same: an embedding model classifies nothing, a classifier embeds nothing)."""
    tasks, arch = model_tasks(model_config), model_config.architecture
    if task not in tasks:
        kind = ("an embedding model (a causal LM with runner='pooling')" if model_config.num_labels is None
                else "a sequence-classification model")
        wanted = ("a sequence-classification model (*ForSequenceClassification)" if task in CLASSIFIER_TASKS
                  else "an embedding model (a *ForCausalLM with runner='pooling')")
        raise ValueError(f"task={task!r} needs {wanted}; {arch} is {kind} and runs {list(tasks)} "
                         f"(vLLM: this task's API is not supported by this model)")
    if task == "score" and model_config.num_labels != 1:
        raise ValueError(f"task='score' needs a cross-encoder, a classifier of num_labels=1; {arch} has "
                         f"num_labels={model_config.num_labels} (vLLM: the Scoring API is only enabled for "
                         "num_labels == 1)")


def check_pooling(config) -> None:
    """Resolve `runner` and `pooler_config` of an EngineConfig (called from its __post_init__)."""
    check_choice("runner", config.runner, RUNNERS)
    classifier = config.model_config.num_labels is not None
    if config.runner == "auto":
        config.runner = "pooling" if classifier else "generate"
    if classifier and config.runner == "generate":
        raise ValueError(f"{config.model_config.architecture} is a sequence-classification model: it runs with "
                         "runner='pooling' only (LLM.classify, LLM.reward, LLM.score; vLLM: --runner pooling), "
                         "not runner='generate'")
    if config.runner == "generate":
        if config.pooler_config is not None:
            raise ValueError(f"pooler_config={config.pooler_config!r} needs runner='pooling'")
        return
    for name, value, off in (("tensor_parallel_size", config.tensor_parallel_size, 1),
                             ("speculative_config", config.speculative_config, None),
                             ("enable_lora", config.enable_lora, False)):
        if value != off:
            raise ValueError(f"runner='pooling' runs with {name}={off!r} only (got {value!r})")
    given = config.pooler_config or {}
    if not isinstance(given, dict) or not set(given) <= {"pooling_type", "normalize"}:
        raise ValueError(f"pooler_config must be a dict with 'pooling_type' and/or 'normalize', got {given!r}")
    folder = sentence_transformers_pooling(Path(config.model)) or {}
    pooler = PoolerConfig(**{**folder, **given}, matryoshka_dimensions=matryoshka(Path(config.model)),
                          **(classifier_activations(Path(config.model)) if classifier else {}))
    pooler.pooling_type = str(pooler.pooling_type).upper()
    check_choice("pooler_config's pooling_type", pooler.pooling_type, POOLING_TYPES)
    check_bool("pooler_config's normalize", pooler.normalize)
    config.pooler_config = pooler
    if pooler.pooling_type != "LAST" and config.enable_prefix_caching:
        # A cached prefix's hidden states are not kept, only its K/V: MEAN needs every position's, CLS
        # the first's. vLLM turns the cache off for them too; LAST always recomputes the last token.
        logger.info("runner='pooling' with %s pooling: prefix caching off (it needs every position's hidden "
                    "state, and the cache keeps only K/V)", pooler.pooling_type)
        config.enable_prefix_caching = False


def sentence_transformers_pooling(folder: Path) -> dict | None:
    """{"pooling_type", "normalize"} from a sentence-transformers folder, or None if it is none.
    A module nanopaged does not run (a Dense projection, ...) or an unknown mode is refused by name."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    modules = _read_json(modules_file)
    types = [m.get("type") for m in modules] if isinstance(modules, list) else None
    if types is None or not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_file} must be a list of modules ({{'type': ..., 'path': ...}})")
    unknown = [t for t in types if t not in (ST_TRANSFORMER, ST_POOLING, ST_NORMALIZE)]
    if unknown:
        raise ValueError(f"{modules_file} lists {unknown}: nanopaged runs only {ST_TRANSFORMER}, {ST_POOLING} "
                         f"and {ST_NORMALIZE}, and would give other embeddings than sentence-transformers")
    normalize = ST_NORMALIZE in types
    pooling = next((m for m in modules if m["type"] == ST_POOLING), None)
    if pooling is None:
        return {"normalize": normalize}
    pooling_file = folder / pooling.get("path", "") / "config.json"
    modes = [k for k, v in _read_json(pooling_file).items() if k.startswith("pooling_mode_") and v is True]
    if len(modes) != 1 or modes[0] not in ST_POOLING_MODES:
        raise ValueError(f"{pooling_file} sets {modes or 'no pooling mode'}; nanopaged pools with exactly one "
                         f"of {list(ST_POOLING_MODES)}")
    return {"pooling_type": ST_POOLING_MODES[modes[0]], "normalize": normalize}


def matryoshka(folder: Path) -> list[int] | None:
    """The sizes config.json says the model was trained to embed in (vLLM reads the same keys)."""
    cfg = _read_json(folder / "config.json")
    dims = cfg.get("matryoshka_dimensions")
    if dims is not None:
        return list(dims)
    return [] if cfg.get("is_matryoshka") else None


def classifier_activations(folder: Path) -> dict:
    """classify_activation and score_activation from config.json (vLLM: get_classification_activation_function,
    get_cross_encoder_activation_function); one nanopaged does not run is refused by name."""
    cfg = _read_json(folder / "config.json")
    problem_type = cfg.get("problem_type")
    if problem_type not in PROBLEM_TYPES:
        raise ValueError(f"problem_type={problem_type!r} in {folder / 'config.json'}: nanopaged runs "
                         f"{[t for t in PROBLEM_TYPES if t]}")
    name = (cfg.get("sentence_transformers") or {}).get("activation_fn") or cfg.get(
        "sbert_ce_default_activation_function") or "torch.nn.modules.activation.Sigmoid"
    if name not in CROSS_ENCODER_ACTIVATIONS:
        raise ValueError(f"the cross-encoder activation {name!r} in {folder / 'config.json'}: nanopaged runs "
                         f"{list(CROSS_ENCODER_ACTIVATIONS)}")
    return {"classify_activation": PROBLEM_TYPES[problem_type], "score_activation": CROSS_ENCODER_ACTIVATIONS[name]}


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None
