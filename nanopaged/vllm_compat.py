"""vLLM's engine arguments and SamplingParams fields by vLLM's names, and its ModelConfig as clients read it.

A script written for vLLM calls `LLM(model, **engine_args)` with any of vLLM's engine arguments
(vllm/engine/arg_utils.py: EngineArgs), and a client such as lm-evaluation-harness passes a dozen
of them on every call, most of them at their "off" value. Each is handled in one of four ways,
so none is silently dropped:

    honoured    nanopaged has the setting: under vLLM's name (an EngineConfig field) or under its
                own (RENAMED); None means the default, as vLLM reads it (NONE_IS_DEFAULT)
    no effect   any value is accepted, since none can change what nanopaged computes (a
                permission, a log switch, the size of something nanopaged does not have)
    off only    the off or default value is accepted; any other asks for something nanopaged
                does not do, and is a ValueError that says so ("load_format='pt' is not supported")
    unknown     a name vLLM does not have either: a ValueError listing the known ones

SamplingParams' fields that vLLM has and nanopaged does not implement are checked the same way
(NOT_IMPLEMENTED_SAMPLING). Read only when such an argument or field is given
(`EngineConfig.from_kwargs`, `SamplingParams`) or a client asks for `llm.llm_engine.model_config`;
docs/api.md and docs/settings.md list them.
"""
from __future__ import annotations

import difflib
from functools import cached_property

ANY = None   # in NOT_IMPLEMENTED: any value is accepted

# (vLLM's names, the values accepted (ANY: all), why: what nanopaged does instead)
NOT_IMPLEMENTED = [
    # ---- the model and its files
    (("calculate_kv_scales",), (False,), "keeps k_scale = v_scale = 1.0 in an fp8 KV cache (kv_cache_dtype)"),
    (("load_format",), ("auto", "safetensors"), "loads *.safetensors weights only"),
    (("config_format",), ("auto", "hf"), "reads a Hugging Face config.json"),
    (("tokenizer_mode",), ("auto", "hf"), "loads the tokenizer with transformers' AutoTokenizer"),
    (("skip_tokenizer_init",), (False,), "always loads the tokenizer"),
    (("revision", "code_revision", "tokenizer_revision", "download_dir", "hf_config_path"), (None,),
     "loads local folders only, and never reaches a model hub"),
    (("hf_token",), (None, False), "never reaches a model hub"),
    (("trust_remote_code",), (False, True), "runs no code from a model folder (its models are its own code)"),
    (("hf_overrides", "rope_scaling", "override_generation_config", "model_loader_extra_config",
      "additional_config"), (None, {}), "reads the model folder's config as it is"),
    (("rope_theta",), (None,), "reads the model folder's config as it is"),
    (("generation_config",), ("auto",), "reads the EOS ids of the model folder's generation_config.json"),
    (("model_impl",), ("auto",), "has one implementation of each model (models/llama.py)"),
    (("convert", "task"), (None, "auto", "generate", "none"),
     "generates or pools (runner='pooling'; task='embed', 'classify', 'score' or 'reward' and convert='embed' or "
     "'classify' say the same), no other task"),
    (("override_pooler_config",), (None,), "takes pooler_config (vLLM's newer name)"),
    (("override_attention_dtype",), (None,), "computes attention in the model's dtype"),
    (("logprobs_mode",), ("raw_logprobs",), "reports logprobs of the raw model distribution (vLLM's default)"),
    (("max_parallel_loading_workers", "safetensors_load_strategy", "pt_load_map_location", "use_tqdm_on_load"),
     ANY, "reads the safetensors weights in one pass"),
    (("ignore_patterns",), (None, [], "original/**/*", ["original/**/*"]),
     "loads every *.safetensors file of the model folder"),
    (("cpu_offload_gb",), (0,), "keeps all the weights on the device"),
    (("served_model_name",), ANY, "names the model only in `nanopaged serve` (its --served-model-name)"),
    (("disable_log_stats", "aggregate_engine_logging"), ANY, "logs no periodic statistics (llm.get_stats() has them)"),
    # ---- memory, graphs, compilation
    (("swap_space",), ANY, "preempts by recompute and never swaps (vLLM's V1 engine ignores it too)"),
    (("kv_offloading_size",), (None, 0), "keeps no CPU tier of KV blocks; its tier beyond the pool is on disk "
     "(kv_cache_disk_dir, kv_cache_disk_gb)"),
    (("kv_offloading_backend",), ANY, "offloads nothing to CPU memory (the setting acts only with kv_offloading_size)"),
    (("cuda_graph_sizes", "cudagraph_capture_sizes", "max_cudagraph_capture_size", "max_seq_len_to_capture"),
     (None, 8192), "chooses its own CUDA-graph batch sizes (attention/cuda_graphs.py)"),
    (("compilation_config",), (None, 0, {}), "does not compile the model (no torch.compile)"),
    (("enable_sleep_mode",), (False,), "has no sleep mode"),
    (("kv_sharing_fast_prefill",), (False,), "shares no KV cache across layers"),
    (("disable_sliding_window",), (False, True), "refuses models with a sliding window: there is none to turn off"),
    (("disable_hybrid_kv_cache_manager", "use_v2_block_manager", "disable_async_output_proc",
      "multi_step_stream_outputs"), ANY, "has no hybrid KV cache or V0 engine to switch"),
    # ---- scheduling
    (("enable_chunked_prefill",), (None, True), "always chunks long prompts into a step's token budget (as vLLM V1)"),
    (("scheduling_policy",), ("fcfs",), "schedules first come, first served"),
    (("scheduler_cls", "worker_cls", "worker_extension_cls"), (None, "auto", ""),
     "has one scheduler and one worker (core/scheduler.py, worker/model_runner.py)"),
    (("preemption_mode",), (None, "recompute"), "preempts by recompute only"),
    (("max_num_partial_prefills", "max_long_partial_prefills", "num_scheduler_steps"), (1,),
     "has one scheduling rule: one token budget per step (core/scheduler.py)"),
    (("long_prefill_token_threshold", "num_lookahead_slots", "scheduler_delay_factor"), (0,),
     "has one scheduling rule: one token budget per step (core/scheduler.py)"),
    (("external_parameters",), (None,), "has no scheduler plugins"),
    (("tokenizer_pool_size",), (0,), "tokenizes in the calling thread"),
    (("tokenizer_pool_type", "tokenizer_pool_extra_config"), ANY, "tokenizes in the calling thread"),
    # ---- parallelism
    # pipeline_parallel_size is a setting (extras/pipeline_parallel/)
    (("decode_context_parallel_size",), (1,),
     "splits a model across ranks by tensor and pipeline parallelism only (no context parallelism)"),
    (("data_parallel_size",), (1,), "runs one engine in LLM: data parallelism is `nanopaged serve "
     "--data-parallel-size N` (engine-core processes behind a router), or Ray Data offline (docs/14_ray_data.md)"),
    (("data_parallel_rank", "data_parallel_start_rank", "data_parallel_size_local", "data_parallel_address",
      "data_parallel_rpc_port"), (None,), "splits a model across ranks by tensor parallelism only"),
    (("data_parallel_hybrid_lb", "enable_dbo", "disable_nccl_for_dp_synchronization"), (False,),
     "splits a model across ranks by tensor parallelism only"),
    (("data_parallel_backend",), ("mp",), "splits a model across ranks by tensor parallelism only"),
    (("dbo_decode_token_threshold", "dbo_prefill_token_threshold"), ANY, "has no dual-batch overlap"),
    (("distributed_executor_backend",), (None, "mp"), "runs tensor-parallel ranks as processes of its own"),
    (("disable_custom_all_reduce",), ANY, "all-reduces with torch.distributed"),
    (("ray_workers_use_nsight",), (False,), "does not use Ray"),
    # enable_expert_parallel is a setting (extras/tensor_parallel/layers.py: ExpertParallelMoeBlock)
    (("enable_eplb",), (False,), "has no expert load balancer (each rank keeps its contiguous share of the experts)"),
    (("eplb_config",), (None, {}), "has no expert load balancer (each rank keeps its contiguous share of the experts)"),
    (("all2all_backend",), (None, {}), "sums the ranks' experts with the MoE block's one all-reduce (no all-to-all)"),
    (("expert_placement_strategy",), ("linear",), "places experts contiguously only (rank r: [r E/N, (r+1) E/N))"),
    (("num_redundant_experts",), (0,), "has no expert load balancer, so no redundant experts"),
    (("eplb_window_size", "eplb_step_interval", "eplb_log_balancedness"), ANY, "has no expert load balancer"),
    # ---- LoRA: enable_lora, max_loras, max_lora_rank and max_cpu_loras are settings (lora/)
    (("enable_lora_bias",), (False,), "refuses adapters with trained biases"),
    (("fully_sharded_loras",), (False,), "runs adapters in one process (no tensor-parallel adapters)"),
    (("enable_prompt_adapter",), (False,), "has no prompt adapters"),
    (("lora_dtype",), ("auto", None), "runs adapters in the model's dtype"),
    (("qlora_adapter_name_or_path", "default_mm_loras", "long_lora_scaling_factors"), (None,),
     "reads PEFT LoRA folders of text models only"),
    (("lora_extra_vocab_size", "max_prompt_adapters", "max_prompt_adapter_token"), ANY,
     "has no extra-vocabulary or prompt adapters for these to size"),
    # ---- multimodal input: limit_mm_per_prompt, allowed_local_media_path, max_num_encoder_input_tokens and
    #      encoder_cache_size are settings (multimodal/, core/encoder_cache.py)
    (("media_io_kwargs", "mm_processor_kwargs"), (None, {}), "processes images at the model folder's own processor "
     "settings"),
    (("mm_processor_cache_type", "mm_encoder_attn_backend", "io_processor_plugin"), (None,),
     "caches encoder outputs only (core/encoder_cache.py), and encodes with the model's own attention"),
    (("allowed_media_domains",), (None,), "never fetches a URL: images come as data, data: URLs or allowed local files"),
    (("enable_mm_embeds", "interleave_mm_strings", "enable_multimodal_encoder_data_parallel"), (False,),
     "takes images as images, in one encoder process"),
    (("mm_processor_cache_gb", "mm_shm_cache_max_object_size_mb", "mm_encoder_tp_mode", "skip_mm_profiling",
      "video_pruning_rate", "disable_chunked_mm_input", "disable_mm_preprocessor_cache"), ANY,
     "reads images only (no video), caches encoder outputs only, and always lets a chunk cut through an image"),
    # ---- decoding
    (("speculative_model", "num_speculative_tokens", "speculative_model_quantization",
      "speculative_draft_tensor_parallel_size", "speculative_max_model_len", "speculative_disable_by_batch_size",
      "ngram_prompt_lookup_max", "ngram_prompt_lookup_min"), (None,),
     "takes speculative decoding as speculative_config={...} (vLLM's current form) only"),
    (("structured_outputs_config",), (None, {}, {"backend": "auto"}, {"backend": "xgrammar"}),
     "runs structured outputs on xgrammar, with each request's own options (StructuredOutputsParams)"),
    (("guided_decoding_backend",), (None, "auto", "xgrammar"), "runs structured outputs on xgrammar only"),
    (("guided_decoding_disable_fallback",), ANY, "has one structured-output backend, so nothing to fall back to"),
    (("guided_decoding_disable_additional_properties",), ANY,
     "never generates JSON properties a schema leaves out (xgrammar's strict mode), whatever this says"),
    (("guided_decoding_disable_any_whitespace",), (None, False),
     "takes disable_any_whitespace per request (StructuredOutputsParams), not for the whole engine"),
    (("logits_processors",), (None, []), "has no logits-processor plugins (logit_bias, allowed_token_ids "
                                         "and bad_words are SamplingParams fields)"),
    (("logits_processor_pattern",), (None,), "has no logits-processor plugins"),
    (("mamba_cache_dtype", "mamba_ssm_cache_dtype"), ("auto",), "runs transformers only (no state-space models)"),
    (("mamba_block_size",), (None,), "runs transformers only (no state-space models)"),
    (("otlp_traces_endpoint", "collect_detailed_traces", "show_hidden_metrics_for_version"), (None,),
     "has no tracing"),
    (("kv_transfer_config", "kv_events_config"), (None,), "keeps its KV cache to itself (no transfer, no events)"),
]
NOT_IMPLEMENTED_BY_NAME = {name: (accepted, why) for names, accepted, why in NOT_IMPLEMENTED for name in names}
# vLLM's name -> (nanopaged's setting, vLLM's value -> nanopaged's; None: the same value)
RENAMED = {"prefix_caching_hash_algo": ("prefix_hash", {"sha256": "sha256", "xxhash": "xxhash"}),
           "num_gpu_blocks_override": ("num_kv_blocks", None)}
# Settings that vLLM types as optional, None meaning the default (EngineConfig wants the value itself).
NONE_IS_DEFAULT = ("max_num_seqs", "block_size", "enable_prefix_caching", "enforce_eager", "seed")


# SamplingParams' fields that vLLM has and nanopaged does not implement (sampling_params.py: VLLM_ONLY):
# name -> (the values accepted (ANY: all), the first being the default; what the field asks for)
NOT_IMPLEMENTED_SAMPLING = {
    "best_of": ((None, 1), "best-of-n selection (generate n and pick, or use LLM.beam_search)"),
    "use_beam_search": ((False,), "beam search through SamplingParams (use LLM.beam_search)"),
    "guided_decoding": ((None,), "guided_decoding field (vLLM renamed it: give structured_outputs="
                                 "StructuredOutputsParams(json=..., regex=..., choice=..., grammar=...))"),
    "logits_processors": ((None, []), "logits processors (logit_bias, allowed_token_ids and bad_words are fields)"),
    "logprob_token_ids": ((None,), "logprobs of chosen token ids"),
    "prompt_logprob_token_ids": ((None,), "prompt logprobs of chosen token ids"),
    "prompt_logprob_start": ((None, 0), "prompt logprobs from a later position"),
    "flat_logprobs": ((False,), "logprobs in vLLM's flat layout"),
    "stream_interval": ((None, 1), "outputs every k tokens (LLMEngine.step returns every step)"),
    "skip_reading_prefix_cache": ((None, False), "requests that skip the prefix cache (prompt_logprobs "
                                                 "already recompute what it holds)"),
    "thinking_token_budget": ((None, -1), "budget of reasoning tokens"),
    "repetition_detection": ((None,), "stopping at repeated n-grams"),
    "trace_decode_token_ids": ((None,), "replaying of given tokens"),
    "routed_experts_prompt_start": ((0,), "expert routing data per token (get_stats()[\"moe\"] counts per expert)"),
    "extra_args": (ANY, "code that reads them: no built-in sampling does (nor vLLM's)"),
    "skip_clone": (ANY, "copies to skip: it never clones SamplingParams"),
}


def check_sampling_fields(params) -> None:
    """A ValueError for a vLLM SamplingParams field set to what nanopaged does not do."""
    for name, (accepted, asks_for) in NOT_IMPLEMENTED_SAMPLING.items():
        value = getattr(params, name)
        if accepted is not ANY and not _among(value, accepted):
            raise ValueError(f"{name}={value!r} is not supported: nanopaged has no {asks_for}; "
                             f"leave it at {accepted[0]!r}")


def _among(value, accepted: tuple) -> bool:
    """`value` is one of `accepted`; True == 1 in Python, so a bool matches only a bool."""
    return any(isinstance(value, bool) == isinstance(a, bool) and value == a for a in accepted)


POOLING_TASKS = ("embed", "embedding", "classify", "score", "reward")   # vLLM's tasks that mean runner='pooling'


def engine_settings(kwargs: dict, own: set[str]) -> dict:
    """The EngineConfig settings that `kwargs` (nanopaged's settings and vLLM's engine arguments) ask
    for; a ValueError for an argument that asks for what nanopaged does not do, or that nobody knows."""
    settings, unknown = {}, []
    if kwargs.get("task") in POOLING_TASKS or kwargs.get("convert") in ("embed", "classify"):   # vLLM's other names
        kwargs = {**kwargs, "task": None, "convert": None, "runner": kwargs.get("runner") or "pooling"}
    for name, value in kwargs.items():
        if name in own:
            if not (value is None and name in NONE_IS_DEFAULT):
                settings[name] = value
        elif name in RENAMED:
            setting, values = RENAMED[name]
            if setting in kwargs:
                raise ValueError(f"give {setting} or vLLM's {name}, not both")
            if values is not None and not (isinstance(value, str) and value in values):
                raise ValueError(f"{name}={value!r} is not supported; nanopaged's {setting} takes {sorted(values)}")
            settings[setting] = value if values is None else values[value]
        elif name in NOT_IMPLEMENTED_BY_NAME:
            check_not_implemented(name, value)
        else:
            unknown.append(name)
    if unknown:
        raise ValueError(f"unknown engine setting(s) {sorted(unknown)}{_did_you_mean(unknown, own)}; known: "
                         f"{sorted(own)}, and vLLM's {sorted(set(NOT_IMPLEMENTED_BY_NAME) | set(RENAMED))}")
    return settings


def check_not_implemented(name: str, value) -> None:
    accepted, why = NOT_IMPLEMENTED_BY_NAME[name]
    if accepted is not ANY and not _among(value, accepted):
        raise ValueError(f"{name}={value!r} is not supported: nanopaged {why}; leave it at {accepted[0]!r}")


def _did_you_mean(unknown: list[str], own: set[str]) -> str:
    known = sorted(own | set(NOT_IMPLEMENTED_BY_NAME) | set(RENAMED))
    close = sorted({m for name in unknown for m in difflib.get_close_matches(name, known, n=2)})
    return f" (did you mean {close}?)" if close else ""


def check_priority(priority, num_prompts: int) -> None:
    """`LLM.generate`'s per-request priorities: nanopaged schedules first come, first served, so only
    None, or a list of zeros, is accepted."""
    if priority is not None and (not isinstance(priority, (list, tuple)) or any(x != 0 for x in priority)):
        raise ValueError(f"priority={priority!r} is not supported: nanopaged schedules first come, first "
                         "served (vLLM too, unless scheduling_policy='priority'); give None or zeros")
    if priority is not None and len(priority) != num_prompts:
        raise ValueError(f"got {len(priority)} priorities for {num_prompts} prompts")


class VllmModelConfig:
    """vLLM's ModelConfig (vllm/config/model.py) with the attributes and methods its clients read,
    from nanopaged's settings: `llm.llm_engine.model_config`. (nanopaged's own record of config.json
    is `llm.llm_engine.config.model_config`.)"""

    def __init__(self, config) -> None:     # an EngineConfig
        import torch
        self._config, m = config, config.model_config
        self.model, self.tokenizer, self.served_model_name = config.model, config.tokenizer, config.model
        self.max_model_len, self.seed, self.max_logprobs = config.max_model_len, config.seed, config.max_logprobs
        self.dtype = getattr(torch, config.dtype)
        self.architectures = [m.architecture]
        self.tokenizer_mode, self.trust_remote_code, self.generation_config = "auto", False, "auto"
        self.revision = self.tokenizer_revision = None
        self.quantization = config.quantization
        self.runner_type, self.is_multimodal_model = config.runner, m.vision is not None

    @cached_property
    def hf_config(self):
        """The model's config.json as transformers reads it (read when first asked for)."""
        from transformers import AutoConfig
        return AutoConfig.from_pretrained(self.model, local_files_only=True)

    @property
    def hf_text_config(self):
        return self.hf_config

    def get_vocab_size(self) -> int:
        return self._config.model_config.vocab_size

    def get_hidden_size(self) -> int:
        return self._config.model_config.hidden_size

    def get_head_size(self) -> int:
        return self._config.model_config.head_dim

    def get_num_layers(self, parallel_config=None) -> int:
        return self._config.model_config.num_hidden_layers

    def get_num_attention_heads(self, parallel_config=None) -> int:
        """Per rank, as vLLM counts them."""
        return self._config.model_config.num_attention_heads // self._config.tensor_parallel_size

    def get_sliding_window(self) -> None:
        return None                          # nanopaged refuses models with a sliding window

    def get_diff_sampling_param(self) -> dict:
        """The sampling defaults the model folder's generation_config.json sets (those that differ
        from transformers' own defaults), as vLLM reads them for `LLM.get_default_sampling_params`."""
        from transformers import GenerationConfig
        try:
            config = GenerationConfig.from_pretrained(self.model, local_files_only=True).to_diff_dict()
        except OSError:                       # no generation_config.json
            return {}
        names = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                 "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
        return {ours: config[theirs] for theirs, ours in names.items() if config.get(theirs) is not None}
