"""The encoder cache's rules, with the scheduler alone (plain Python, a token per sampling request).

A step encodes an image in the step whose tokens first reach its span, within the step's encoder budget
and the cache's room; a chunk stops before an image it cannot encode; two requests with one image encode it
once; a request stops reading an image when its tokens pass the span, or when it is preempted or finishes
(the article's rule: preemption frees the blocks and the encoder cache); an entry nobody reads is kept and
given up oldest first; an image's hash keys the blocks its span occupies.
"""
from nanopaged.core.block_pool import BlockPool
from nanopaged.core.encoder_cache import EncoderCache, EncoderInput
from nanopaged.core.request import Request, RequestStatus, SampledToken
from nanopaged.core.scheduler import Scheduler
from nanopaged.sampling_params import SamplingParams


def image_request(rid, prompt_len, images, max_tokens=4):
    """images: (hash, offset, length) each; every position of the span takes an encoder row."""
    request = Request(request_id=str(rid), prompt_token_ids=list(range(10, 10 + prompt_len)),
                      sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), max_tokens=max_tokens)
    request.encoder_inputs = [EncoderInput(key, offset, length, length) for key, offset, length in images]
    return request


def make_scheduler(budget=64, encoder_budget=32, cache_size=32, num_blocks=100, block_size=4, caching=False):
    pool = BlockPool(num_blocks, block_size, enable_caching=caching)
    return Scheduler(pool, 8, budget, EncoderCache(cache_size, encoder_budget))


def step(sched):
    """Schedule, then play the engine: a token for each request whose step reaches its end; finish at max_tokens."""
    out = sched.schedule()
    sched.update(out, {r: [SampledToken(1)] for r, n in out.scheduled if r.num_computed_tokens + n >= r.num_tokens})
    for request, _ in out.scheduled:
        if request.num_output_tokens >= request.max_tokens:
            sched.finish_request(request, RequestStatus.FINISHED_LENGTH)
    return out


def encoded(out):
    return [r.encoder_inputs[i].hash for r, i in out.encoder_inputs]


def test_an_image_is_encoded_in_the_step_that_first_reaches_its_span():
    sched = make_scheduler(budget=8)
    request = image_request("a", 30, [("img", 10, 12)])
    sched.add_request(request)
    assert encoded(step(sched)) == []            # tokens 0-7: not there yet
    out = step(sched)                             # 8-15 cut into the span: encoded now
    assert encoded(out) == ["img"] and out.scheduled == [(request, 8)]
    assert encoded(step(sched)) == []             # 16-23: the rest of the span, from the cache
    assert sched.encoder.num_encoded == 1


def test_a_chunk_stops_before_an_image_the_step_cannot_encode():
    sched = make_scheduler(budget=64, encoder_budget=16, cache_size=32)
    first = image_request("a", 20, [("x", 2, 12)])
    second = image_request("b", 20, [("y", 4, 12)])
    sched.add_request(first)
    sched.add_request(second)
    out = step(sched)
    # x takes 12 of the 16 rows; y's 12 do not fit: b runs up to its image, which waits for the next step
    assert encoded(out) == ["x"] and dict(out.scheduled) == {first: 20, second: 4}
    out = step(sched)
    assert encoded(out) == ["y"] and dict(out.scheduled) == {first: 1, second: 16}   # a decodes beside


def test_a_running_request_waits_whole_when_its_next_image_does_not_fit():
    sched = make_scheduler(budget=64, encoder_budget=12, cache_size=24)
    a, b = image_request("a", 14, [("x", 0, 12)]), image_request("b", 14, [("y", 0, 12)])
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert dict(out.scheduled) == {a: 14}         # b reaches its image at once: nothing of it runs this step
    assert dict(step(sched).scheduled) == {a: 1, b: 14}


def test_two_requests_with_one_image_encode_it_once():
    sched = make_scheduler()
    a, b = image_request("a", 20, [("same", 3, 10)]), image_request("b", 24, [("same", 7, 10)])
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert encoded(out) == ["same"] and len(out.scheduled) == 2
    assert (sched.encoder.num_encoded, sched.encoder.num_hits) == (1, 1)


def test_the_same_image_twice_in_one_prompt_is_encoded_once():
    sched = make_scheduler()
    sched.add_request(image_request("a", 30, [("same", 2, 8), ("same", 15, 8)]))
    assert encoded(step(sched)) == ["same"]


def test_a_request_stops_reading_an_image_once_its_tokens_pass_the_span():
    sched = make_scheduler(budget=8)
    request = image_request("a", 24, [("img", 2, 4)])
    sched.add_request(request)
    step(sched)
    assert "img" in sched.encoder.unused and "img" in sched.encoder.entries   # passed: kept, unread


def test_preemption_frees_the_requests_encoder_entries_with_its_blocks():
    sched = make_scheduler(num_blocks=8, block_size=4, budget=64)
    old = image_request("old", 14, [("x", 0, 12)], max_tokens=30)
    new = image_request("new", 14, [("y", 0, 12)], max_tokens=30)
    sched.add_request(old)
    sched.add_request(new)
    step(sched)
    # both read their image mid-prompt (the budget leaves them there)... now grow until `new` is preempted
    while new.num_preemptions == 0:
        out = step(sched)
        assert out.scheduled
    assert new.block_ids == [] and "y" not in sched.encoder.users and "y" in sched.encoder.unused


def test_an_unread_entry_is_kept_and_given_up_oldest_first_when_room_is_needed():
    sched = make_scheduler(encoder_budget=16, cache_size=16)
    for rid, key in (("a", "one"), ("b", "two")):
        sched.add_request(image_request(rid, 10, [(key, 0, 8)], max_tokens=1))
    step(sched)                                   # both encoded, both done: kept, unread
    assert set(sched.encoder.unused) == {"one", "two"}
    sched.add_request(image_request("c", 10, [("one", 0, 8)], max_tokens=1))
    out = step(sched)
    assert encoded(out) == [] and sched.encoder.num_hits == 1     # a later request with the image hits
    sched.add_request(image_request("d", 10, [("three", 0, 8)], max_tokens=1))
    out = step(sched)
    assert encoded(out) == ["three"] and out.encoder_frees == ["two"]   # "one" was read more recently


def test_an_image_keys_the_blocks_its_span_occupies():
    pool = BlockPool(20, 4, enable_caching=True)
    a = image_request("a", 16, [("cat", 5, 4)])
    b = image_request("b", 16, [("dog", 5, 4)])
    ha, hb = pool.block_hashes(a), pool.block_hashes(b)
    assert ha[0] == hb[0]                          # tokens 0-3: before the image
    assert ha[1] != hb[1] and ha[2] != hb[2]       # 4-7 and 8-11 hold the span (5-8): another image, another prefix
    assert ha[3] != hb[3]                          # chained: every later block differs too
    again = image_request("c", 16, [("cat", 5, 4)])
    assert pool.block_hashes(again) == ha
