"""Engine statistics, gathered by watching the steps: `LLM.get_stats()` and the progress bar.

`EngineStats`, installed on an engine (an extension that observes: engine/extension.py), reads each
`StepRecord`, taken while the step's blocks are still held, and asks every other extension for its
figures (`Extension.stats`). KV utilization is the paper's measure of how much
reserved KV memory holds real tokens (Fig. 2): tokens with K/V stored / slots of the blocks
held, summed over steps; the sharing saving is its section 6.3 measure. docs/07_benchmarks.md
explains every figure.
"""
from __future__ import annotations

import time

from tqdm.auto import tqdm

from nanopaged.cpu.features import bf16_matrix_units
from nanopaged.engine.extension import Extension
from nanopaged.engine.llm_engine import LLMEngine, StepRecord
from nanopaged.models.hybrid import memory_figures
from nanopaged.models.moe import expert_load


class EngineStats(Extension):
    def __init__(self) -> None:
        self.engine: LLMEngine | None = None

    def attach(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.reset()

    def reset(self) -> None:
        """Start counting afresh (the bench does, after its warm-up)."""
        self.num_steps = self.num_preemptions = 0
        self.prefix_cache_queries = self.prefix_cache_hits = 0      # tokens looked up / found
        self.num_prompt_tokens_computed = self.num_generated_tokens = 0
        self.peak_kv_blocks_used = self.kv_blocks_in_use = 0        # blocks taken from the pool
        self.kv_tokens_stored = self.kv_slots_held = 0              # tokens with K/V / slots of the tables
        self.max_num_running = 0
        self.model_time_s = self.schedule_time_s = 0.0
        self.step_time_s: dict[str, float] = {}       # per phase of the step (StepRecord.phases)
        self.step_wall_s = 0.0                        # the steps' wall time, end to end
        self.discarded_base = self._discarded_rows(0)
        for ext in self.engine.extensions:        # each extension's counters count from here too
            ext.reset_stats()
        self._moe(reset=True)

    def _moe(self, reset: bool = False) -> dict | None:
        """A mixture of experts' load per expert (models/moe.py: expert_load); None for a dense model."""
        if self.engine.config.model_config.moe is None:
            return None
        return expert_load(self.engine.runner.model, reset)

    def _hybrid(self) -> dict | None:
        """A hybrid's memory (models/hybrid.py: memory_figures) and its state snapshots; None for other models."""
        engine = self.engine
        m = engine.config.model_config
        if m.hybrid is None:
            return None
        pool, states = engine.scheduler.block_pool, engine.scheduler.states
        figures = memory_figures(m.hybrid, m.num_key_value_heads, m.head_dim, engine.runner.kv_cache_dtype.itemsize,
                                 pool.block_size, pool.num_blocks)
        return {**figures, "state_snapshots_taken": states.snapshots_taken,
                "state_snapshots_restored": states.snapshots_restored,
                "snapshot_pages_held": sum(len(b.state_snapshot) for b in pool.blocks)}

    def extension_stats(self) -> dict:
        """Every registered extension's figures since the last reset, under its name; None where the
        engine does not have it."""
        figures = {kind.name: None for kind in self.engine.extension_kinds}
        figures.update({ext.name: ext.stats() for ext in self.engine.extensions if ext.name})
        return figures

    def observe(self, step: StepRecord) -> None:
        out, pool = step.scheduler_output, self.engine.scheduler.block_pool
        self.num_steps += 1
        self.num_preemptions += len(out.preempted)
        if pool.enable_caching:   # tokens looked up: the count at admission, before this step's token
            self.prefix_cache_queries += sum(r.num_tokens - (r in step.sampled) for r, _ in out.admitted)
            self.prefix_cache_hits += sum(num_cached for _, num_cached in out.admitted)
        # prompt tokens among this step's [computed - n, computed): prefill work, recompute included
        self.num_prompt_tokens_computed += sum(
            max(0, min(r.num_computed_tokens, r.num_prompt_tokens) - (r.num_computed_tokens - n))
            for r, n in out.scheduled)
        self.num_generated_tokens += step.num_tokens
        phases = step.phases
        for name, seconds in phases.items():
            self.step_time_s[name] = self.step_time_s.get(name, 0.0) + seconds
        self.step_wall_s += time.perf_counter() - step.times[0]
        self.model_time_s += phases["prepare"] + phases["forward"] + phases["sample"]
        self.schedule_time_s += phases["schedule"] + phases["update"]
        self._memory(step)

    def _memory(self, step: StepRecord) -> None:
        """KV figures of the requests that held blocks during the step (samples forked
        off a parent in this very step join the next one)."""
        pool = self.engine.scheduler.block_pool
        forked = {r for r, tokens in step.sampled.items() if tokens[0].parent is not None}
        held = [r for r in step.running if r not in forked]
        in_use = pool.num_blocks - pool.num_free_blocks
        self.peak_kv_blocks_used = max(self.peak_kv_blocks_used, in_use)
        self.kv_blocks_in_use += in_use
        self.kv_tokens_stored += sum(r.num_computed_tokens for r in held)
        self.kv_slots_held += sum(len(r.block_ids) for r in held) * pool.block_size
        self.max_num_running = max(self.max_num_running, len(held))

    def as_dict(self) -> dict:
        pool, scheduler = self.engine.scheduler.block_pool, self.engine.scheduler
        fast, steps = self.engine.runner.fast_path, self.num_steps
        return {
            "num_steps": steps,
            "num_preemptions": self.num_preemptions,
            "dtype": self.engine.config.dtype,
            "kv_cache_dtype": str(self.engine.runner.kv_cache_dtype).removeprefix("torch."),
            # what runs in place of the reference (cpu/choose.py: FastPath)
            "cpu_linear": fast.linear,                            # the linear kernel (cpu/linear.py)
            "cpu_kernels": fast.layers,                           # the decoder layers: fused C++ or torch (cpu/fused.py)
            "state_steps": fast.state_steps,                      # a hybrid's decode token: cpp or torch (cpu/recurrent.py)
            "attention_backend": fast.attention_backend,
            "batch_invariant": fast.batch_invariant,              # a request's tokens independent of its batch
            "cpu_bf16_matrix_units": bf16_matrix_units(),         # what dtype="auto" read (cpu/features.py)
            "quantization": fast.quantized,                       # quantization=: what and how much
            "kv_cache_usage": pool.usage(),
            "peak_kv_cache_usage": self.peak_kv_blocks_used / pool.num_blocks,
            "peak_kv_blocks_used": self.peak_kv_blocks_used,
            "num_kv_blocks": pool.num_blocks,
            "block_size": pool.block_size,
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "num_evicted_blocks": pool.num_evicted_blocks,
            "kv_utilization": self.kv_tokens_stored / self.kv_slots_held if self.kv_slots_held else 0.0,
            "mean_kv_blocks_used": self.kv_blocks_in_use / steps if steps else 0.0,
            # Blocks saved by sharing (fork, beams, prefix hits) / blocks the same block tables
            # would hold without it: the paper's measure of sharing (section 6.3).
            "kv_sharing_saving": (1 - self.kv_blocks_in_use * pool.block_size / self.kv_slots_held
                                  if self.kv_slots_held else 0.0),
            "max_num_running": self.max_num_running,
            "num_prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_generated_tokens": self.num_generated_tokens,
            "model_time_s": self.model_time_s,
            "schedule_time_s": self.schedule_time_s,
            "async_scheduling": self.engine.overlap is not None,     # steps pipelined (engine/overlap.py)
            "step_time_s": dict(self.step_time_s),                 # schedule, prepare, forward, sample, update, output
            "step_wall_s": self.step_wall_s,
            # the share of the steps' wall time the model's forward pass ran (with async scheduling, beside the rest)
            "model_busy_share": self.step_time_s.get("forward", 0.0) / self.step_wall_s if self.step_wall_s else 0.0,
            "num_discarded_rows": self._discarded_rows(self.discarded_base),   # computed for stopped requests
            "moe": self._moe(),                                   # a mixture of experts: tokens per expert
            "hybrid": self._hybrid(),                             # a hybrid's state pages beside its K/V
            **self.extension_stats(),                             # e.g. spec_decode, lora (docs/07_benchmarks.md)
        }

    def _discarded_rows(self, base: int) -> int:
        """Rows async scheduling computed for requests that had stopped (the extra step), since `base`."""
        overlap = self.engine.overlap
        return overlap.num_discarded_rows - base if overlap is not None else 0

    def prefix_cache_hit_rate(self) -> float:
        q = self.prefix_cache_queries
        return self.prefix_cache_hits / q if q else 0.0


class ProgressBar(Extension):
    """The bar of one generate call, with the figures a user watches after every step:
    output tokens/s, KV cache usage, prefix-cache hit rate, preemptions, and each extension's own."""

    def __init__(self, stats: EngineStats, total: int, enabled: bool) -> None:
        self.stats, self.enabled = stats, enabled
        self.bar = tqdm(total=total, desc="Processed prompts", disable=not enabled, dynamic_ncols=True)
        self.start, self.tokens = time.perf_counter(), 0

    def __enter__(self) -> "ProgressBar":
        self.stats.engine.install(self)
        return self

    def __exit__(self, *exc) -> None:
        self.stats.engine.remove(self)
        self.bar.close()

    def update(self, n: int) -> None:
        self.bar.update(n)

    def observe(self, step: StepRecord) -> None:
        self.tokens += step.num_tokens
        if self.enabled:
            s = self.stats
            self.bar.set_postfix_str(
                f"out {self.tokens / (time.perf_counter() - self.start):.1f} tok/s, "
                f"KV {s.engine.scheduler.block_pool.usage():.1%}, "
                f"prefix hit {s.prefix_cache_hit_rate():.0%}, "
                f"preempted {s.num_preemptions}"
                + "".join(f", {figure}" for ext in s.engine.extensions if (figure := ext.progress())),
                refresh=False)
