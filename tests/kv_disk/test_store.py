"""The folder: atomic writes that concurrent readers never see half done, and a size bound kept least recently
used first, across every engine's files."""
import os
import threading

from nanopaged.kv_disk.store import SUFFIX, DiskStore

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
