"""The writer: blocks handed over by the step are written by one background thread, so no step waits on the disk.

The step copies a new full block's K/V out of the KV cache into an image (one file's bytes, store.py) taken
from this writer's images, and hands it over; the thread seals it into a file and gives the image back.
The images are reused, never more than `max_pending_bytes` of them: a block that finds none free is not
written (counted), and the step goes on. The thread makes `ready_bytes` of them first, in idle time, and the
step makes more as it needs them: a fresh buffer makes the kernel find and clear fresh pages, a reused one
costs the step only its copy.
The thread runs in the idle scheduling class (else at the lowest nice value): it writes on the cores the
model leaves idle and never takes one from it. The first OSError (a full disk, a read-only folder) stops
writing for good; `error` keeps it for the extension to report once. `close` (when the engine is gone, or at
exit) lets the thread finish its queue for a while and end.
"""
from __future__ import annotations

import mmap
import os
import threading
import time
from collections import deque

from nanopaged.kv_disk.store import DiskStore

GROW_BYTES = 16 << 20       # images the step makes at once when none is free (one mapping for many blocks)


class BlockWriter:
    def __init__(self, store: DiskStore, hash_len: int, max_pending_bytes: int, ready_bytes: int = 0) -> None:
        self.store, self.image_bytes = store, store.image_bytes(hash_len)
        self.max_images = max(1, max_pending_bytes // self.image_bytes)
        self.ready = min(self.max_images, ready_bytes // self.image_bytes)
        self.pending: deque[tuple[bytes, memoryview]] = deque()
        self.queued: set[bytes] = set()      # the pending blocks' hashes: a later request naming one copies nothing
        self.free: list[memoryview] = []     # images made ahead, or written and given back
        self.images_made = 0
        self.changed = threading.Condition()
        self.stopped = self.closing = False  # stopped: writing failed once, nothing more is written
        self.error: OSError | None = None
        self.blocks_written = self.bytes_written = 0
        self.blocks_not_written = 0          # no free image, or writing had stopped
        self.write_seconds = 0.0
        self.thread = threading.Thread(target=self._run, name="nanopaged-kv-disk-writer", daemon=True)
        self.thread.start()

    def take(self) -> memoryview | None:
        """An image to copy one block's K/V into (at `store.layout(hash_len)[0]`), or None where the block will
        not be written (counted)."""
        with self.changed:
            if not self.free and not self.stopped and self.images_made < self.max_images:
                self.free += self._images(min(max(1, GROW_BYTES // self.image_bytes),
                                              self.max_images - self.images_made))
            if self.stopped or self.closing or not self.free:
                self.blocks_not_written += 1
                return None
            return self.free.pop()

    def _images(self, count: int) -> list[memoryview]:
        """`count` new images, laid one after another in one buffer (one mapping, however small the blocks)."""
        if not count:
            return []
        self.images_made += count
        arena = memoryview(mmap.mmap(-1, count * self.image_bytes))
        return [arena[i * self.image_bytes:(i + 1) * self.image_bytes] for i in range(count)]

    def submit(self, block_hash: bytes, image: memoryview) -> None:
        """Queue an image from `take` whose K/V are in place."""
        with self.changed:
            self.pending.append((block_hash, image))
            self.queued.add(block_hash)
            self.changed.notify_all()

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued block is written (or dropped); False if the time ran out first."""
        with self.changed:
            return self.changed.wait_for(lambda: not self.pending, timeout)

    def close(self, timeout: float) -> None:
        """Write what is queued (for at most `timeout` seconds), then end the thread."""
        self.drain(timeout)
        with self.changed:
            self.closing = True
            self.changed.notify_all()

    def _run(self) -> None:
        lowest_priority()
        with self.changed:
            # the step may have made some first: the bound holds for both
            ready = self._images(min(self.ready, self.max_images - self.images_made))
        for image in ready:
            image[::mmap.PAGESIZE] = bytes(len(image) // mmap.PAGESIZE)     # its pages, found now
        with self.changed:
            self.free += ready
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.pending or self.closing)
                if not self.pending:
                    return
                block_hash, image = self.pending[0]
            self._write(block_hash, image)
            with self.changed:
                self.pending.popleft()
                self.queued.discard(block_hash)
                self.free.append(image)
                self.changed.notify_all()

    def _write(self, block_hash: bytes, image: memoryview) -> None:
        if self.stopped:
            with self.changed:
                self.blocks_not_written += 1
            return
        if self.store.has(block_hash):       # another request or engine wrote it already
            return
        start = time.perf_counter()
        try:
            written = self.store.write_image(block_hash, image)
        except OSError as e:
            with self.changed:
                self.stopped, self.error = True, e
                self.blocks_not_written += 1
            return
        self.blocks_written += 1
        self.bytes_written += written
        self.write_seconds += time.perf_counter() - start


def lowest_priority() -> None:
    """This thread runs only where no other wants the core (Linux's SCHED_IDLE); else at nice 19."""
    tid = threading.get_native_id()
    try:
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, tid, 19)
        except (AttributeError, OSError):
            pass
