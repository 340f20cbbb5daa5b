"""The writer: blocks handed over by the step are written by one background thread, so no step waits on the disk.

The step copies a new full block's K/V out of the KV cache (a memory copy) and hands it over; the thread turns it
into a file, at the lowest priority the system gives a thread: it writes on the cores the model leaves idle.
The queue is bounded in bytes: past `max_pending_bytes` a block is not written (counted), and the step goes on.
The first OSError (a full disk, a read-only folder) stops writing for good and is reported once
through `on_error`.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque
from typing import Callable

import numpy as np

from nanopaged.kv_disk.store import DiskStore


class BlockWriter:
    def __init__(self, store: DiskStore, max_pending_bytes: int, on_error: Callable[[OSError], None]) -> None:
        self.store, self.max_pending_bytes, self.on_error = store, max_pending_bytes, on_error
        self.pending: deque[tuple[bytes, np.ndarray, int]] = deque()
        self.pending_bytes = 0
        self.changed = threading.Condition()
        self.stopped = False                 # writing failed once: nothing more is written
        self.blocks_written = self.bytes_written = 0
        self.blocks_not_written = 0          # the queue was full, or writing had stopped
        self.write_seconds = 0.0
        threading.Thread(target=self._run, name="nanopaged-kv-disk-writer", daemon=True).start()

    def submit(self, block_hash: bytes, kv: np.ndarray) -> bool:
        """Queue one block's K/V bytes (a copy the cache no longer shares); False where it will not be written."""
        size = kv.nbytes
        with self.changed:
            if self.stopped or self.pending_bytes + size > self.max_pending_bytes:
                self.blocks_not_written += 1
                return False
            self.pending.append((block_hash, kv, size))
            self.pending_bytes += size
            self.changed.notify_all()
        return True

    def drain(self, timeout: float = 60.0) -> bool:
        """Wait until every queued block is written (or dropped); False if the time ran out first."""
        with self.changed:
            return self.changed.wait_for(lambda: not self.pending, timeout)

    def _run(self) -> None:
        try:       # Linux: a thread's own nice value; torch's threads, which wait for their slowest, come first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            with self.changed:
                self.changed.wait_for(lambda: self.pending)
                block_hash, kv, size = self.pending[0]
            self._write(block_hash, kv)
            with self.changed:
                self.pending.popleft()
                self.pending_bytes -= size
                self.changed.notify_all()

    def _write(self, block_hash: bytes, kv: np.ndarray) -> None:
        if self.stopped or self.store.has(block_hash):      # another request or engine wrote it already
            return
        start = time.perf_counter()
        try:
            written = self.store.write(block_hash, kv)
        except OSError as e:
            with self.changed:
                self.stopped = True
                self.blocks_not_written += len(self.pending)     # this one and the queued ones
                current = self.pending.popleft()                  # the loop pops it when this returns
                self.pending.clear()
                self.pending.append(current)
                self.pending_bytes = current[2]
            self.on_error(e)
            return
        self.blocks_written += 1
        self.bytes_written += written
        self.write_seconds += time.perf_counter() - start
