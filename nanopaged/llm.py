"""LLM: vLLM's offline API. `LLM(model).generate(prompts, params)` -> list[RequestOutput].

A thin loop over LLMEngine: validate every prompt (all of them before any work, so one bad
prompt fails the call before anything runs), queue them, then step until all are done.
The engine installs the registered extensions its settings ask for (nanopaged/extensions.py); an LLM
adds these, each through the engine's public ways in:

    LLM()                    no model given: the demo model (models/demo_model.py)
    get_stats, the bar       extensions that observe steps: statistics and live figures (engine/stats.py)
    cpu_threads="auto"       an extension that observes steps: torch's threads follow the free cores
                             (cpu/thread_governor.py)
    tensor_parallel_size=N   `make_runner`: N ranks behind the runner (extras/tensor_parallel/)
    pipeline_parallel_size=P `make_runner`: P stages of layers behind it (extras/pipeline_parallel/)
    beam_search              a token-selection rule for `LLMEngine.step` (extras/beam_search.py)

docs/00_how_to_read.md walks one call from here down to the attention kernels.
"""
from __future__ import annotations

import copy
import itertools
import logging
import threading
import weakref
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

from nanopaged.config import EngineConfig
from nanopaged.cpu.features import bf16_matrix_units
from nanopaged.cpu.thread_governor import ThreadGovernor
from nanopaged.engine.chat_tools import chat_with_tools
from nanopaged.engine.input_processor import PromptType
from nanopaged.engine.llm_engine import LLMEngine
from nanopaged.engine.stats import EngineStats, ProgressBar
from nanopaged.extras.beam_search import BeamSearchOutput, BeamSearchParams, beam_search
from nanopaged.models.demo_model import DEMO_MODEL, demo_model_path, gguf_folder
from nanopaged.models.pipeline import ModelStage
from nanopaged.multimodal.chat_parts import chat_prompt
from nanopaged.outputs import RequestOutput
from nanopaged.pooling.embed import embed
from nanopaged.pooling.score import score
from nanopaged.pooling.tasks import classify, encode, reward
from nanopaged.sampling_params import RequestOutputKind, SamplingParams
from nanopaged.validation import per_prompt
from nanopaged.vllm_compat import check_priority
from nanopaged.worker.hybrid_runner import HybridModelRunner
from nanopaged.worker.vision_runner import VisionLanguageModelRunner
from nanopaged.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, **config) -> None:
        """`config`: nanopaged's settings and vLLM's engine arguments (nanopaged/vllm_compat.py)."""
        governor = ThreadGovernor()          # made first: the model's loading is its first window
        self.runner_extensions = []          # what a runner across ranks adds to the engine (make_runner)
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model_folder(model), **config), self.make_runner)
        for ext in self.runner_extensions:
            self.llm_engine.install(ext)
        self._request_ids = itertools.count()
        self._default_params = None
        self._busy = threading.Lock()
        self.stats = self.llm_engine.install(EngineStats())
        self.thread_governor = None
        cfg = self.llm_engine.config
        one_process = cfg.tensor_parallel_size * cfg.pipeline_parallel_size == 1
        if cfg.cpu_threads == "auto" and cfg.device == "cpu" and one_process:
            self.thread_governor = self.llm_engine.install(governor)
        fast = self.llm_engine.runner.fast_path
        logger.info("%s: %s on %s, linear kernels %s, layer kernels %s, attention %s, batch-invariant %s (CPU "
                    "bfloat16 matrix units: %s); %d KV blocks of %d tokens, in %s", cfg.model_config.architecture,
                    cfg.dtype, cfg.device, fast.linear, fast.layers, fast.attention_backend, fast.batch_invariant,
                    ", ".join(bf16_matrix_units()) or "none", self.llm_engine.runner.num_kv_blocks, cfg.block_size,
                    str(self.llm_engine.runner.kv_cache_dtype).removeprefix("torch."))
        quantized = fast.quantized
        if quantized:
            logger.info("quantization=%s: %d linears hold %.1f MB of quantized weights (kernel: %s)%s",
                        quantized["quantization"], quantized["quantized_linears"], quantized["quantized_bytes"] / 1e6,
                        quantized.get("kernel", "none"),
                        f"; left dense: {', '.join(quantized['left_dense'])}" if quantized["left_dense"] else "")

    def make_runner(self, config: EngineConfig, stages: list[ModelStage]) -> ModelRunner:
        """The engine's runner. tensor_parallel_size > 1: the driver's runner with N ranks behind
        it (each rank has cores // N threads, so no governor); the workers stop when this LLM is deleted.
        pipeline_parallel_size > 1: stage 0 here, the other stages (each with T ranks) behind it.
        No extension that rewrites the model runs across ranks (each refuses tensor parallelism)."""
        if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
            m = config.model_config
            kind = HybridModelRunner if m.hybrid else VisionLanguageModelRunner if m.vision else ModelRunner
            return kind(config, stages)
        from nanopaged.extras.tensor_parallel import TensorParallelRunner   # torch.distributed only when used
        from nanopaged.extras.pipeline_parallel.extension import PipelineParallel
        from nanopaged.extras.pipeline_parallel.runner import PipelineParallelRunner
        if config.pipeline_parallel_size > 1:
            PipelineParallel.check_config(config)      # its refusals, before any weight loads or process starts
            self.runner_extensions.append(PipelineParallel(config))   # its figures in get_stats()
        assert not stages, f"model stages {[s.name for s in stages]} across ranks"
        runner = (PipelineParallelRunner if config.pipeline_parallel_size > 1 else TensorParallelRunner)(config)
        weakref.finalize(self, runner.shutdown)
        return runner

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` uses when given none: SamplingParams' defaults, overridden by the sampling
        fields of the model's generation_config.json, as in vLLM (its generation_config="auto")."""
        if self._default_params is None:
            self._default_params = self.llm_engine.model_config.get_diff_sampling_param()
        return SamplingParams(**self._default_params)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None) -> list[RequestOutput]:
        """Generate for one prompt or many; outputs come back in the order of the prompts. `lora_request`:
        one LoRARequest for all, or one per prompt (None: the base model); `priority`: None or zeros."""
        if priority is not None:
            check_priority(priority, len(prompts) if isinstance(prompts, (list, tuple)) else 1)
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a prompt or a list of them, got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if not isinstance(sampling_params, (SamplingParams, list, tuple)):
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                             f"got {type(sampling_params).__name__}")
        params = final_only(per_prompt("SamplingParams", sampling_params, len(prompts)))
        loras = per_prompt("lora_request", lora_request, len(prompts))
        with self.one_call_at_a_time():
            engine = self.llm_engine
            requests = [engine.process_request(self._new_request_id(), p, sp, lora_request=lora)
                        for p, sp, lora in zip(prompts, params, loras)]   # all checked before any is queued
            for samples in requests:
                engine.queue(samples)
            return self._run([samples[0].request_id for samples in requests], use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them; the arguments
        in vLLM's order (`lora_request` as in generate; `tools`: OpenAI's function tools, for the template).
        A content may be a list of parts, images among them (multimodal/chat_parts.py)."""
        one = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if one else messages
        if not isinstance(conversations, (list, tuple)):
            raise ValueError(f"messages must be a conversation or a list of them, got {type(messages).__name__}")
        if tools is not None:            # checked, with each assistant's tool calls (engine/chat_tools.py)
            conversations = [chat_with_tools(conv, tools) for conv in conversations]
        engine = self.llm_engine
        prompts = [chat_prompt(engine.tokenizer, conv, engine.config, chat_template) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request is done; their final outputs, in the order of request_ids.
        If anything fails meanwhile (a step, Ctrl-C), these requests are aborted, so the
        engine holds nothing of this call when the error reaches the caller."""
        engine, wanted, finished = self.llm_engine, set(request_ids), {}
        try:
            with self.progress_bar(len(request_ids), use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for output in engine.step():
                        if output.finished and output.request_id in wanted:
                            finished[output.request_id] = output
                            bar.update(1)
        except BaseException:
            for request_id in request_ids:
                engine.abort_request(request_id)
            raise
        return [finished[i] for i in request_ids]

    def _new_request_id(self) -> str:
        """An id no queued request has (a user may queue their own through llm_engine)."""
        request_id = str(next(self._request_ids))
        while request_id in self.llm_engine.output_processor.requests:
            request_id = str(next(self._request_ids))
        return request_id

    @contextmanager
    def one_call_at_a_time(self):
        """An LLM is not thread-safe (nor is vLLM's): a second concurrent call is an error,
        not a silent corruption of the engine's state. With cpu_threads="auto", the thread
        count is fitted before the call and given back after it (torch's count is process-wide)."""
        if not self._busy.acquire(blocking=False):
            raise RuntimeError("this LLM is already running a call in another thread; an LLM is not "
                               "thread-safe: use one LLM per thread, or a lock around each call")
        try:
            if self.thread_governor is not None:
                self.thread_governor.start()
            yield
        finally:
            if self.thread_governor is not None:
                self.thread_governor.restore()
            self._busy.release()

    # ---- the extensions' entry points -----------------------------------------------------
    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams,
                    lora_request=None) -> list[BeamSearchOutput]:
        """Beam search with Hugging Face's rule; beams share blocks (extras/beam_search.py)."""
        with self.one_call_at_a_time():
            return beam_search(self.llm_engine, prompts, params, lora_request)

    def embed(self, prompts, pooling_params=None, use_tqdm: bool = True, lora_request=None) -> list:
        """vLLM's EmbeddingRequestOutput per prompt, with runner="pooling" (nanopaged/pooling/embed.py)."""
        return embed(self, prompts, pooling_params, use_tqdm, lora_request)

    def classify(self, prompts, pooling_params=None, use_tqdm: bool = True, lora_request=None) -> list:
        """vLLM's ClassificationRequestOutput per prompt, from a *ForSequenceClassification (pooling/tasks.py)."""
        return classify(self, prompts, pooling_params, use_tqdm, lora_request)

    def reward(self, prompts, pooling_params=None, use_tqdm: bool = True, lora_request=None) -> list:
        """vLLM's PoolingRequestOutput per prompt: a classifier's scores for every token (pooling/tasks.py)."""
        return reward(self, prompts, pooling_params, use_tqdm, lora_request)

    def encode(self, prompts, pooling_params=None, use_tqdm: bool = True, lora_request=None, pooling_task=None) -> list:
        """vLLM's PoolingRequestOutput per prompt, for any task the model runs (pooling/tasks.py)."""
        return encode(self, prompts, pooling_params, use_tqdm, lora_request, pooling_task)

    def score(self, data_1, data_2, truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params=None, lora_request=None) -> list:
        """vLLM's ScoringRequestOutput per pair: a cross-encoder's, or embeddings' cosine (pooling/score.py)."""
        return score(self, data_1, data_2, truncate_prompt_tokens, use_tqdm, pooling_params, lora_request)

    def get_stats(self) -> dict:
        return self.stats.as_dict()

    def reset_stats(self) -> None:
        self.stats.reset()

    def progress_bar(self, total: int, enabled: bool) -> ProgressBar:
        """A bar over the prompts, with the figures a user watches (tokens/s, KV usage, ...)."""
        return ProgressBar(self.stats, total, enabled)


def final_only(params: list) -> list:
    """Copies that report only when finished, as vLLM's LLM asks (generate reads nothing else; it
    saves building an output every step); one copy per distinct object, the caller's left as it is."""
    copies = {}
    for p in params:
        if isinstance(p, SamplingParams) and id(p) not in copies:
            copies[id(p)] = copy.copy(p)
            copies[id(p)].output_kind = RequestOutputKind.FINAL_ONLY
    return [copies.get(id(p), p) for p in params]


def model_folder(model: str | None) -> str:
    """The folder to load: `model` itself; for a .gguf file, the folder converted once from it;
    the demo model's when no model (or the demo model's name) is given."""
    if model is not None and Path(model).is_dir():
        return str(model)
    if model is not None and str(model).endswith(".gguf") and Path(model).is_file():
        return str(gguf_folder(Path(model)))
    return str(demo_model_path()) if model is None or model == DEMO_MODEL else str(model)
