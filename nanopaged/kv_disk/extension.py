"""KVDisk: the extension that keeps full KV blocks on disk, so a restarted engine, or another one, reads them back.

Installed with the engine when `kv_cache_disk_dir` is set. Through the contract:
- `supply_blocks`: after the pool's prefix hits, a waiting request's next blocks are read from their files
  (checked) before anything is computed; the scheduler gives them new blocks, and `before_forward` writes the
  K/V into them;
- `observe`: the blocks that became full and named in the step are copied into the writer's images and
  handed to its thread (write-through: a block is on disk as soon as it is full, so a crash or a restart,
  which evicts nothing, loses nothing written; writing on eviction would write only what memory pressure
  pushes out);
- `stats` / `counters`: `get_stats()["kv_disk"]` and /metrics.
A failed write (full disk, read-only folder) stops writing with one warning; reads go on. A request never
fails for the tier: a file that cannot be read is a miss, and the block is computed. The writer holds
nothing of the engine: when the engine is collected (or the process exits) it finishes its queue and ends.
docs/03_prefix_caching.md, "The disk tier".
"""
from __future__ import annotations

import logging
import math
import os
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from nanopaged.core.block_pool import HASH_FUNCTIONS
from nanopaged.engine.extension import Extension
from nanopaged.kv_disk.block_file import KINDS
from nanopaged.kv_disk.key import tier_key
from nanopaged.kv_disk.store import DiskStore
from nanopaged.kv_disk.writer import BlockWriter
from nanopaged.validation import check_range

logger = logging.getLogger(__name__)
MAX_PENDING_BYTES = 256 << 20     # the writer's images (K/V waiting for it); past it, new blocks are not written
READY_BYTES = 64 << 20            # images the writer makes before the first block needs them
EXIT_SECONDS = 30.0               # at exit (or the engine's end), the writer may finish its queue for this long


class KVDisk(Extension):
    name = "kv_disk"

    @classmethod
    def check_config(cls, config) -> None:
        folder = config.kv_cache_disk_dir
        if folder is None:
            return
        if not isinstance(folder, (str, os.PathLike)) or not str(folder):
            raise ValueError(f"kv_cache_disk_dir must be a folder's path, got {folder!r}")
        check_range("kv_cache_disk_gb", config.kv_cache_disk_gb, 0, lo_open=True)
        refused = {"enable_prefix_caching=False (the tier extends the prefix cache)": not config.enable_prefix_caching,
                   f"tensor_parallel_size={config.tensor_parallel_size} (each rank's cache lives in its own process)":
                       config.tensor_parallel_size != 1,
                   f"pipeline_parallel_size={config.pipeline_parallel_size} (each stage's layers live in their own "
                   "process)": config.pipeline_parallel_size != 1,
                   "a hybrid model (its state pages have no files)": config.model_config.hybrid is not None}
        for what, is_set in refused.items():
            if is_set:
                raise ValueError(f"kv_cache_disk_dir={str(folder)!r} cannot run with {what}")

    @classmethod
    def wanted(cls, config) -> bool:
        return config.kv_cache_disk_dir is not None

    def attach(self, engine) -> None:
        self.runner, config = engine.runner, engine.config
        shape = self.runner.kv_cache_shape(1)
        self.block_shape = (*shape[:2], *shape[3:-1], shape[-1] * self.runner.kv_cache_dtype.itemsize)   # in bytes
        self.lookups = self.hits = self.blocks_read = self.bytes_read = self.warnings = 0
        self.read_seconds = 0.0
        self.base: dict = {}
        self.named: dict = {}                    # request -> its blocks already handed to the writer (or skipped)
        self.held: tuple = (None, [], [])        # (request, hashes, K/V) read for a request that waits for room
        self.store = self.writer = None
        folder = Path(config.kv_cache_disk_dir)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            self.store = DiskStore(folder, int(config.kv_cache_disk_gb * 2**30), tier_key(config, self.runner),
                                   math.prod(self.block_shape))
            self.store.keep_bound()
        except OSError as e:
            self.store = None
            self._warn(f"kv_cache_disk_dir={str(folder)!r} cannot be used ({e}): no disk tier")
            return
        hash_len, writable = len(HASH_FUNCTIONS[config.prefix_hash](b"")), os.access(folder, os.W_OK)
        self.kv_start = self.store.layout(hash_len)[0]     # where an image holds the K/V
        self.writer = BlockWriter(self.store, hash_len, MAX_PENDING_BYTES, READY_BYTES if writable else 0)
        self.error_reported = False
        if not writable:
            self.writer.stopped = True
            self._warn(f"kv_cache_disk_dir={str(folder)!r} is not writable: blocks are read from it, none written")
        weakref.finalize(self, self.writer.close, EXIT_SECONDS)     # also at exit; it holds the writer, not self
        self.base = self._totals()

    def _warn(self, message: str) -> None:
        self.warnings += 1
        logger.warning(message)

    def _report_write_error(self) -> None:
        """The writer thread's first failed write: one warning (it writes no more)."""
        if self.writer is not None and self.writer.error is not None and not self.error_reported:
            self.error_reported = True
            self._warn(f"kv_cache_disk_dir={str(self.store.folder)!r}: a block could not be written "
                       f"({self.writer.error}); the disk tier writes nothing more (what is there is still read)")

    # ---- reading: after the pool's misses -------------------------------------------------------------
    def supply_blocks(self, request, block_hashes: list[bytes]) -> list[np.ndarray]:
        """The K/V bytes of the first of these blocks that have good files, each shaped as a block of the cache's
        bytes: (layers, K/V, block_size, heads, bytes of a row)."""
        if self.store is None or not block_hashes:
            return []
        request_held, hashes_held, kv_held = self.held
        if request_held is request and hashes_held == block_hashes:
            return kv_held               # read when it was last asked, and it waited for free blocks since
        start, found = time.perf_counter(), []
        for block_hash in block_hashes:
            kv = self.store.read(block_hash)
            if kv is None:
                break
            found.append(np.frombuffer(kv, dtype=np.uint8).reshape(self.block_shape))
        self.lookups += 1
        self.hits += bool(found)
        self.blocks_read += len(found)
        self.bytes_read += len(found) * self.store.kv_bytes
        self.read_seconds += time.perf_counter() - start
        self.held = (request, block_hashes, found)
        return found

    def before_forward(self, scheduler_output, model_input) -> None:
        """Write the K/V read at admission into the blocks the scheduler gave them, before the model reads them."""
        pairs, cache = scheduler_output.blocks_to_fill, self.runner.kv_cache.view(torch.uint8)
        if pairs and cache.device.type == "cpu":
            host = cache.numpy()                  # the cache's own memory
            for block, kv in pairs:
                host[:, :, block] = kv
        elif pairs:
            blocks = torch.tensor([block for block, _ in pairs], device=cache.device)
            cache[:, :, blocks] = torch.from_numpy(np.stack([kv for _, kv in pairs], axis=2)).to(cache.device)
        if any(request is self.held[0] for request, _ in scheduler_output.admitted):
            self.held = (None, [], [])

    # ---- writing: as blocks fill ------------------------------------------------------------------------
    def observe(self, record) -> None:
        """Copy each block named in the cache this step that has no file yet into an image for the writer."""
        self._report_write_error()
        if self.writer is None or self.writer.stopped:
            return
        new: dict[bytes, int] = {}               # block hash -> its block: two requests may name one block
        for request, _ in record.scheduler_output.scheduled:
            done = self.named.get(request, 0)
            for i in range(done, request.num_cached_blocks):
                block_hash = request.block_hashes[i]
                if block_hash not in new and block_hash not in self.writer.queued and not self.store.has(block_hash):
                    new[block_hash] = request.block_ids[i]
            self.named[request] = max(done, request.num_cached_blocks)
        if not new:
            return
        cache = self.runner.kv_cache.view(torch.uint8)      # its bytes: (layers, K/V, blocks, block_size, heads, bytes)
        ids = list(new.values())
        if cache.device.type != "cpu":
            cache, ids = cache[:, :, torch.tensor(ids, device=cache.device)].cpu(), range(len(ids))
        host = cache.numpy()
        for block_hash, i in zip(new, ids):
            image = self.writer.take()
            if image is None:
                continue
            # numpy copies a block on this thread alone: torch would split each small copy over its threads
            np.copyto(np.frombuffer(image, np.uint8, self.store.kv_bytes, self.kv_start).reshape(self.block_shape),
                      host[:, :, i])
            self.writer.submit(block_hash, image)

    def forget(self, request) -> None:
        self.named.pop(request, None)
        if request is self.held[0]:
            self.held = (None, [], [])

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until the blocks handed to the writer are on disk (a test, the bench, before a process ends)."""
        return self.writer is None or self.writer.drain(timeout)

    # ---- figures ------------------------------------------------------------------------------------------
    def _totals(self) -> dict:
        store, writer = self.store, self.writer
        return {"lookups": self.lookups, "hits": self.hits, "blocks_read": self.blocks_read,
                "bytes_read": self.bytes_read, "read_seconds": self.read_seconds,
                "blocks_written": writer.blocks_written if writer else 0,
                "bytes_written": writer.bytes_written if writer else 0,
                "write_seconds": writer.write_seconds if writer else 0.0,
                "blocks_not_written": writer.blocks_not_written if writer else 0,
                **{f"dropped_{kind}": store.dropped[kind] if store else 0 for kind in KINDS},
                "files_evicted": store.files_evicted if store else 0}

    def stats(self) -> dict:
        """Since the last reset: lookups after a pool miss, those that found blocks, blocks and bytes read and
        written, seconds, bad files dropped by kind, files evicted by the bound; and the tier's state now."""
        self._report_write_error()
        totals, base = self._totals(), self.base
        return {**{name: value - base.get(name, 0) for name, value in totals.items()},
                "reading": self.store is not None, "writing": self.writer is not None and not self.writer.stopped,
                "warnings": self.warnings}

    def reset_stats(self) -> None:
        self.base = self._totals()

    def counters(self) -> dict:
        totals = self._totals()
        helps = {"hits": "lookups after a prefix-cache miss that found blocks on disk",
                 "blocks_read": "KV blocks read from disk", "bytes_read": "bytes of K/V read from disk",
                 "read_seconds": "seconds spent reading KV blocks", "blocks_written": "KV blocks written to disk",
                 "bytes_written": "bytes of block files written", "write_seconds": "seconds the writer spent writing",
                 **{f"dropped_{kind}": f"{kind} block files found, deleted and recomputed" for kind in KINDS}}
        return {f"kv_disk_{name}": (text, totals[name]) for name, text in helps.items()}

    def progress(self) -> str:
        return f"disk {self.blocks_read}r/{self._totals()['blocks_written']}w" if self.store else ""
