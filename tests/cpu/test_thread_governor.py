"""cpu_threads="auto" (the default on CPU): torch's CPU threads follow the cores other
processes leave free."""
import pytest
import torch

from nanopaged import LLM, SamplingParams
from nanopaged.cpu.thread_governor import ThreadGovernor, read_cpu_times, threads_for

TICK = 100


def test_threads_are_the_free_cores_rounded_within_bounds():
    assert threads_for(2, 0.0, 2) == 2
    assert threads_for(2, 0.71, 2) == 1        # measured: a busy neighbour beside 2 threads
    assert threads_for(2, 1.02, 2) == 1        # ... and beside 1 thread: it stays at 1
    assert threads_for(2, 2.0, 2) == 1         # never 0
    assert threads_for(8, 0.2, 4) == 4         # never more than it started with
    assert threads_for(8, 3.4, 8) == 5


class FakeMachine:
    """/proc readings as the governor sees them: wall seconds, machine busy ticks, own ticks."""
    def __init__(self):
        self.t, self.busy, self.mine = 0.0, 0, 0

    def run(self, seconds, other_cores, own_cores=1.0):
        self.t += seconds
        self.busy += int(TICK * seconds * (other_cores + own_cores))
        self.mine += int(TICK * seconds * own_cores)

    def read(self):
        return self.t, self.busy, self.mine


def test_the_governor_follows_a_neighbour_that_comes_and_goes(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    machine, calls = FakeMachine(), []
    gov = ThreadGovernor(read=machine.read, num_cores=2, set_threads=calls.append,
                         clock=lambda: machine.t)
    gov.tick = TICK
    machine.run(0.2, other_cores=1.0)
    gov.observe()
    assert calls == []                          # less than half a second: no reading yet
    machine.run(0.4, other_cores=0.8)
    gov.observe()
    assert calls == [1] and gov.threads == 1    # a neighbour took a core
    machine.run(0.6, other_cores=1.0)
    gov.observe()
    assert calls == [1]                         # still there: no change, no call
    machine.run(0.6, other_cores=0.0)
    gov.observe()
    assert calls == [1, 2]                      # gone: both threads back
    machine.run(0.6, other_cores=1.0)
    gov.observe()
    gov.restore()
    assert calls == [1, 2, 1, 2] and gov.threads == 2


def test_start_fits_the_threads_before_the_first_step(monkeypatch):
    """A call's first step is often a long prefill: the count is fitted before it, over the
    time since the last reading, without waiting; a window too short keeps the last decision."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    machine, calls = FakeMachine(), []
    gov = ThreadGovernor(read=machine.read, num_cores=2, set_threads=calls.append,
                         clock=lambda: machine.t)
    gov.tick = TICK
    machine.run(1.0, other_cores=1.0)            # the model loads beside a busy neighbour
    gov.start()
    assert calls == [1]
    gov.restore()                                # the call ends: torch's count given back
    assert calls == [1, 2]
    machine.run(0.01, other_cores=1.0)           # the next call right away: too short to measure
    gov.start()
    assert calls == [1, 2, 1]                    # the last decision holds
    gov.restore()
    machine.run(2.0, other_cores=0.0)            # later, on a quiet machine
    gov.start()
    assert calls == [1, 2, 1, 2] and gov.threads == 2


def test_without_proc_it_does_nothing():
    calls = []
    gov = ThreadGovernor(read=lambda: None, num_cores=2, set_threads=calls.append)
    gov.start()
    gov.observe()
    gov.restore()
    assert calls == []


def test_proc_readings_here_are_sane():
    first = read_cpu_times()
    if first is None:
        pytest.skip("no /proc on this system")
    sum(i * i for i in range(200_000))
    second = read_cpu_times()
    assert second[0] > first[0] and second[1] >= first[1] and second[2] >= first[2]


def test_auto_threads_give_the_same_tokens_and_give_the_threads_back(tiny_model_dirs):
    before = torch.get_num_threads()
    prompts = [{"prompt_token_ids": list(range(5 + i, 25 + i))} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fixed = LLM(tiny_model_dirs["llama"], num_kv_blocks=32, cpu_threads=None)
    assert fixed.thread_governor is None
    plain = fixed.generate(prompts, params, use_tqdm=False)
    llm = LLM(tiny_model_dirs["llama"], num_kv_blocks=32)              # "auto" is the default
    assert llm.llm_engine.find(ThreadGovernor) is llm.thread_governor
    auto = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in auto] == [o.outputs[0].token_ids for o in plain]
    assert torch.get_num_threads() == before


def test_cpu_threads_takes_auto_or_none(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"cpu_threads must be one of \[None, 'auto'\], got 2"):
        LLM(tiny_model_dirs["llama"], cpu_threads=2)
