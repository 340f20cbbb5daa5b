"""Adapters made with peft on the tiny models, and Hugging Face's greedy output with each applied.

The LoRA tests import these helpers from here."""
import pytest
import torch

peft = pytest.importorskip("peft")     # a test dependency ([test] in pyproject.toml)

# Three adapters of different ranks and targets, so a step mixes updates of different shapes.
ADAPTERS = {
    "attn": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "mlp": {"r": 16, "lora_alpha": 8, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "all": {"r": 8, "lora_alpha": 32, "use_rslora": True,
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
}


def make_adapter(model_dir, folder, seed=0, scale=1.0, dtype=torch.float32, **lora):
    """A peft LoRA adapter on the model with a random, non-zero B (peft starts B at zero), saved as peft saves
    it; `scale` multiplies B, so the update moves greedy tokens without drowning the base model."""
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    torch.manual_seed(seed)
    model = peft.get_peft_model(base, peft.LoraConfig(init_lora_weights=False, **lora))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(folder)
    return model


def make_tiny_adapters(tiny_model_dirs, root) -> dict:
    """{model name: {adapter name: folder}}: the ADAPTERS on the tiny Llama and Qwen3 (the `tiny_adapters`
    fixture in tests/conftest.py)."""
    out = {}
    for model in ("llama", "qwen3"):
        out[model] = {}
        for i, (name, lora) in enumerate(ADAPTERS.items()):
            make_adapter(tiny_model_dirs[model], root / model / name, seed=i, **lora)
            out[model][name] = str(root / model / name)
    return out


def peft_greedy(model_dir, adapter_dir, prompts, max_tokens, merged=False, dtype=torch.float32):
    """Hugging Face's greedy tokens with the adapter applied by peft (unmerged, or merged into the weights),
    one prompt at a time; adapter_dir None: the base model."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
        if merged:
            model = model.merge_and_unload()
    model.eval()
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0)
        outs.append(out[0, len(p):].tolist())
    return outs


def hf_top_logprobs(model_dir, adapter_dir, prompt, max_tokens, top=5):
    """(greedy tokens, top logprobs per position) from Hugging Face in bfloat16 with the adapter applied
    by peft, for check_logprobs_close."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, local_files_only=True)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.eval().generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=max_tokens, min_new_tokens=max_tokens, output_logits=True,
                                    return_dict_in_generate=True, pad_token_id=0)
    tops = []
    for logits in out.logits:
        values, tokens = torch.log_softmax(logits[0].float(), dim=-1).topk(top)
        tops.append(dict(zip(tokens.tolist(), values.tolist())))
    return out.sequences[0, len(prompt):].tolist(), tops
