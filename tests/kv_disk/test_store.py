"""The folder: atomic writes that concurrent readers never see half done, and a size bound kept least recently
used first, across every engine's files."""
import errno
import os
import threading
import time

import pytest

from nanopaged.kv_disk.store import SUFFIX, DiskStore
from nanopaged.kv_disk.writer import BlockWriter

KEY = {"format": 1, "model_path": "/models/a", "weights": "w1"}
KV = bytes(range(256)) * 16


def block(i: int) -> bytes:
    return i.to_bytes(32, "little")


def file_bytes(tmp_path) -> int:
    return sum(p.stat().st_size for p in tmp_path.iterdir() if p.name.endswith(SUFFIX))


def test_the_bound_drops_the_least_recently_used_files_and_a_hit_counts_as_a_use(tmp_path):
    probe = DiskStore(tmp_path, 1 << 30, KEY, len(KV))
    size = probe.write(block(99), KV)
    probe.path(block(99)).unlink()
    store = DiskStore(tmp_path, 5 * size, KEY, len(KV))
    for i in range(5):
        store.write(block(i), KV)
        os.utime(store.path(block(i)), ns=(10**18 + i * 10**9,) * 2)   # written one second apart, long ago
    assert store.read(block(0)) is not None           # a hit: block 0 is now the most recently used
    store.write(block(5), KV)                         # six files: past the bound
    kept = [i for i in range(6) if store.path(block(i)).exists()]
    assert kept == [0, 3, 4, 5] and store.files_evicted == 2      # 1 and 2 were the least recently used
    assert file_bytes(tmp_path) <= 5 * size


def test_the_bound_counts_another_engines_files_too(tmp_path):
    mine = DiskStore(tmp_path, 1 << 30, KEY, len(KV))
    size = mine.write(block(0), KV)
    theirs = DiskStore(tmp_path, 1 << 30, {**KEY, "weights": "w2"}, len(KV))      # another model, same folder
    for i in range(1, 4):
        theirs.write(block(i), KV)
    DiskStore(tmp_path, 2 * size, KEY, len(KV)).keep_bound()
    assert file_bytes(tmp_path) <= 2 * size


def test_concurrent_writers_of_one_block_never_show_a_reader_a_partial_file(tmp_path):
    """Threads write the same block again and again (as two engines computing one prompt do) while others read
    it: every read is a whole, checked file or a miss, never a bad one; no temporary file is left."""
    store = DiskStore(tmp_path, 1 << 30, KEY, len(KV))
    stop, reads, errors = threading.Event(), [], []

    def write():
        for _ in range(200):
            store.write(block(7), KV)

    def read():
        while not stop.is_set():
            kv = store.read(block(7))
            if kv is not None:
                reads.append(bytes(kv) == KV)

    writers = [threading.Thread(target=write) for _ in range(3)]
    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert reads and all(reads) and not errors
    assert sum(store.dropped.values()) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [store.path(block(7)).name]


def test_a_missing_file_is_a_miss_and_a_bad_one_is_deleted(tmp_path):
    store = DiskStore(tmp_path, 1 << 30, KEY, len(KV))
    assert store.read(block(1)) is None and sum(store.dropped.values()) == 0
    store.write(block(1), KV)
    path = store.path(block(1))
    path.write_bytes(path.read_bytes()[:100])
    assert store.read(block(1)) is None and store.dropped["truncated"] == 1 and not path.exists()


def test_a_filesystem_that_refuses_o_direct_gets_ordinary_writes(tmp_path, monkeypatch):
    """O_DIRECT is tried first (the page cache is left alone); EINVAL, a filesystem's no, means ordinary writes
    from then on, the same bytes."""
    store = DiskStore(tmp_path, 1 << 30, KEY, len(KV))
    if not store.direct:
        pytest.skip("no O_DIRECT on this system: ordinary writes are the only kind")
    real_open, flags = os.open, []

    def open_without_direct(path, flag, mode=0o777):
        flags.append(flag)
        if flag & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flag, mode)
    monkeypatch.setattr(os, "open", open_without_direct)
    size = store.write(block(1), KV)
    store.write(block(2), KV)
    assert [bool(f & os.O_DIRECT) for f in flags] == [True, False, False] and not store.direct
    monkeypatch.undo()
    assert bytes(store.read(block(1))) == KV and store.path(block(1)).stat().st_size == size
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(store.path(block(i)).name for i in (1, 2))


def test_direct_writes_cut_the_file_to_its_length(tmp_path):
    """An O_DIRECT write sends whole pages; the file keeps only its own bytes, and reads back checked."""
    store = DiskStore(tmp_path, 1 << 30, KEY, 1000)               # not a multiple of any page
    size = store.write(block(3), bytes(range(250)) * 4)
    assert store.path(block(3)).stat().st_size == size == store.layout(32)[1]
    assert bytes(store.read(block(3))) == bytes(range(250)) * 4


def test_the_writer_reuses_its_images_within_its_bound(tmp_path):
    """The writer's buffers are made once and given back after each write: a hundred blocks through a writer
    bounded at three images never make a fourth; a block that finds none free is counted, not written."""
    store = DiskStore(tmp_path, 1 << 30, KEY, len(KV))
    image_bytes = store.image_bytes(32)
    writer = BlockWriter(store, 32, 3 * image_bytes)
    made, refused = set(), 0
    for i in range(100):
        image = writer.take()
        if image is None:
            refused += 1
            assert writer.drain(10)
            continue
        made.add(id(image))
        start = store.layout(32)[0]
        image[start:start + len(KV)] = KV
        writer.submit(block(i), image)
    assert writer.drain(10)
    assert len(made) <= 3 and writer.images_made <= 3
    assert writer.blocks_written == 100 - refused and writer.blocks_not_written == refused
    assert all(bytes(store.read(block(i))) == KV for i in range(100) if store.has(block(i)))
    writer.close(10)


def test_the_writer_makes_its_first_images_ahead_in_its_own_thread(tmp_path):
    """`ready_bytes` of images are made (their pages touched) by the writer's thread before any block needs
    one: the step takes them instead of making its own."""
    store = DiskStore(tmp_path, 1 << 30, KEY, len(KV))
    image_bytes = store.image_bytes(32)
    writer = BlockWriter(store, 32, 10 * image_bytes, ready_bytes=4 * image_bytes)
    deadline = time.monotonic() + 10
    while len(writer.free) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    ahead = {id(image) for image in writer.free}
    assert len(ahead) == writer.images_made == 4
    assert id(writer.take()) in ahead and writer.images_made == 4
    writer.close(10)
