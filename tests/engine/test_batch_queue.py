"""Batches in flight (engine/batch_queue.py) change when work runs, never what a request gets.

A runner that computes each batch only when it is collected, in the order submitted, is what a pipeline
of ranks does (every stage runs the batches in order), in one process and in milliseconds. With two
batches in flight it gives the tokens one batch at a time gives, under preemption of a request whose
batch is still in flight, chunked prefill and prefix hits on blocks a batch in flight is still computing;
no request is ever in two batches in flight. tests/extras/test_pipeline_parallel.py runs the real ranks.
"""
import pytest

from conftest import make_prompts
from nanopaged import LLM, SamplingParams
from nanopaged.worker.model_runner import ModelRunner

# preemption (24 blocks of 8), chunked prefill (20 tokens a step), prefix caching on (the default)
TIGHT = {"block_size": 8, "num_kv_blocks": 24, "max_num_batched_tokens": 20, "max_num_seqs": 6, "dtype": "float32"}
PREFIX = make_prompts(512, n=1, seed=62, min_len=40, max_len=40)[0]
PROMPTS = ([{"prompt_token_ids": p} for p in make_prompts(512, n=8, seed=61, min_len=3, max_len=50)]
           + [{"prompt_token_ids": PREFIX + p} for p in make_prompts(512, n=4, seed=63, min_len=2, max_len=9)])
PARAMS = [SamplingParams(max_tokens=12 + i % 5, temperature=0 if i % 2 else 0.8, seed=i) for i in range(len(PROMPTS))]


class DeferredRunner(ModelRunner):
    """Computes a batch when it is collected; counts what the rules above are about."""
    max_concurrent_batches = 2

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: list[tuple[set, set, set]] = []   # per batch: its requests, those sampling, blocks written
        self.in_two_batches = self.chunk_follows_chunk = self.preempted_in_flight = self.hits_in_flight = 0
        self.scheduler, self.over_share, self.shared_out = None, 0, 0     # the engine sets scheduler

    def check_share(self, out) -> None:
        """A batch takes at most ceil(unfinished sequences / 2) of them (counted before advance, as scheduled)."""
        unfinished = len(self.scheduler.running) + len(self.scheduler.waiting)
        self.over_share += len(out.scheduled) > -(-unfinished // 2)
        self.shared_out += 1 < len(out.scheduled) < unfinished

    def submit(self, out, inputs):
        self.check_share(out)
        requests = {r for r, _ in out.scheduled}
        writing = set().union(*(w for _, _, w in self.in_flight)) if self.in_flight else set()
        self.in_two_batches += sum(len(requests & sampling) for _, sampling, _ in self.in_flight)
        self.chunk_follows_chunk += sum(len(requests & rs) for rs, _, _ in self.in_flight)
        self.preempted_in_flight += sum(r in rs for r in out.preempted for rs, _, _ in self.in_flight)
        self.hits_in_flight += sum(bool(set(r.block_ids[:n // self.block_size]) & writing) for r, n in out.admitted)
        blocks = set((inputs.meta.slot_mapping // self.block_size).tolist())
        self.in_flight.append((requests, set(inputs.sample_requests), blocks))
        return out, inputs

    def collect(self, handle):
        self.in_flight.pop(0)
        return self.forward(*handle)


class DeferredLLM(LLM):
    def make_runner(self, config, stages):
        return DeferredRunner(config, stages)


def generate(llm):
    out = llm.generate(PROMPTS[:1] + PROMPTS[8:9], PARAMS[:1] + PARAMS[8:9], use_tqdm=False)   # a prefix in the cache
    out += llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in out]


@pytest.fixture(scope="module")
def runs(tiny_model_dirs):
    one, two = LLM(tiny_model_dirs["llama"], **TIGHT), DeferredLLM(tiny_model_dirs["llama"], **TIGHT)
    two.llm_engine.runner.scheduler = two.llm_engine.scheduler
    return {"one": generate(one), "two": generate(two), "llm": two, "stats": two.get_stats()}


def test_two_batches_in_flight_give_the_tokens_of_one_at_a_time(runs):
    assert runs["two"] == runs["one"]
    assert runs["llm"].llm_engine.batch_queue.max_in_flight == 2
    assert runs["stats"]["num_preemptions"] > 0 and runs["stats"]["prefix_cache_hits"] > 0
    assert len({tuple(t) for t, _ in runs["two"]}) > 8                       # not a vacuous comparison


def test_no_request_waiting_for_its_token_is_in_another_batch_in_flight(runs):
    runner = runs["llm"].llm_engine.runner
    assert runner.in_two_batches == 0
    assert runner.chunk_follows_chunk > 0       # a prompt's next chunk may follow its previous one: stages run in order


def test_each_batch_takes_its_share_of_the_unfinished_sequences(runs):
    runner = runs["llm"].llm_engine.runner
    assert runner.over_share == 0 and runner.shared_out > 0


def test_preempting_a_request_whose_batch_is_in_flight_keeps_its_tokens(runs):
    assert runs["llm"].llm_engine.runner.preempted_in_flight > 0             # it happened, and tokens held above


def test_prefix_hits_on_blocks_a_batch_in_flight_computes_keep_the_tokens(runs):
    assert runs["llm"].llm_engine.runner.hits_in_flight > 0                  # it happened, and tokens held above


def test_every_block_comes_back(runs):
    engine = runs["llm"].llm_engine
    assert not engine.batch_queue.in_flight and not engine.has_unfinished_requests()
    engine.scheduler.block_pool.check_invariants()
    assert engine.scheduler.block_pool.usage() == 0.0
