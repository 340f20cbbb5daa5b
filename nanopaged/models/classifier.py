"""A sequence-classification checkpoint: a causal LM's layers under a `score` head (runner="pooling" only).

`LlamaForSequenceClassification`, `Qwen2ForSequenceClassification` and `Qwen3ForSequenceClassification`
are their causal LM's decoder; where the LM has its lm_head, the checkpoint ships `score.weight`,
(num_labels, hidden), no bias. models/config.py reads the decoder as the LM's and the labels here;
models/loader.py gives the model this head in place of its lm_head before loading; the pooling extension
hands it to the pooler, which applies it after pooling (pooling/extension.py; vLLM: as_seq_cls_model).
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

# architecture -> the causal LM whose layers it has
CLASSIFICATION_ARCHITECTURES = {"LlamaForSequenceClassification": "LlamaForCausalLM",
                                "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
                                "Qwen3ForSequenceClassification": "Qwen3ForCausalLM"}


def labels(cfg: dict) -> dict:
    """num_labels and id2label as transformers reads config.json: num_labels, else id2label's size, else 2."""
    id2label = cfg.get("id2label") or {}
    if not isinstance(id2label, dict) or not all(str(k).isdigit() for k in id2label):
        raise ValueError(f"'id2label' must map class indices to names, got {id2label!r}")
    num_labels = cfg.get("num_labels", len(id2label) or 2)
    if not isinstance(num_labels, int) or isinstance(num_labels, bool) or num_labels < 1:
        raise ValueError(f"field 'num_labels' must be a positive integer, got {num_labels!r}")
    names = {int(k): str(v) for k, v in id2label.items()} or {i: f"LABEL_{i}" for i in range(num_labels)}
    return {"num_labels": num_labels, "id2label": names}


class ScoreHead(nn.Module):
    """The head, (num_labels, hidden), no bias. Float32, as vLLM keeps it (its logits decide a softmax);
    not an nn.Linear, so no fast path packs it into the model's dtype."""

    def __init__(self, hidden_size: int, num_labels: int, device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_labels, hidden_size, dtype=torch.float32, device=device))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:      # (..., hidden) -> (..., num_labels)
        return F.linear(hidden.float(), self.weight)


def classification_head(model: nn.Module) -> None:
    """A classifier's model (its config's num_labels set) takes the score head in place of its lm_head,
    which the checkpoint does not ship; any other model is left as it is."""
    cfg = getattr(model, "config", None)
    if getattr(cfg, "num_labels", None) is None or hasattr(model, "score"):
        return
    model.score = ScoreHead(cfg.hidden_size, cfg.num_labels, model.model.embed_tokens.weight.device)
    model.lm_head = nn.Identity()
