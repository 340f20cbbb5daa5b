"""The folder of block files: one file per block and key, shared by every engine that points at it.

- A file's name is its block hash and its key's digest (key.py), so engines with other models or settings
  share the folder without meeting, and two engines that compute the same block write the same name.
- Writes are atomic: a temporary name of this process and thread, then `os.replace`. A reader sees a whole
  file or none; two writers of one block leave one whole file (both wrote the same bytes).
- Writes bypass the page cache (O_DIRECT) where the filesystem takes it: through the cache, the kernel would
  find fresh pages for every file and write them back later in its own threads, on the cores the model runs
  on; directly, the disk reads the writer's own buffer. A filesystem that refuses it gets ordinary writes.
- Reads check the file (block_file.py); a bad one is counted by kind, deleted, and read as a miss.
- The size bound holds across processes by a scan of the folder: past it, the files used least recently
  (oldest modification time: a write, or a hit, which touches the file) are deleted until 90% of it.
  Each engine scans again after writing a tenth of the bound, so the folder overshoots by at most that much
  per engine writing.
"""
from __future__ import annotations

import errno
import mmap
import os
import threading
import time
from pathlib import Path

from nanopaged.kv_disk.block_file import KINDS, BadBlockFile, decode, layout, seal
from nanopaged.kv_disk.key import key_bytes, key_digest

SUFFIX = ".kvblock"
LOW_WATER = 0.9              # a scan past the bound deletes down to this share of it
ORPHAN_SECONDS = 3600        # a temporary file this old was left by a process that died mid-write


class DiskStore:
    def __init__(self, folder: Path, max_bytes: int, key: dict, kv_bytes: int) -> None:
        self.folder, self.max_bytes, self.key, self.kv_bytes = Path(folder), max_bytes, key, kv_bytes
        self.name_part, self.key_data = key_digest(key), key_bytes(key)
        self.direct = hasattr(os, "O_DIRECT")      # until the filesystem refuses it
        self.dropped = dict.fromkeys(KINDS, 0)     # bad files found on reading, by kind
        self.files_evicted = 0                     # deleted by this engine's scans to keep the bound
        self.bytes_since_scan = 0
        self._count = threading.Lock()             # the writer thread and the step both count

    def path(self, block_hash: bytes) -> Path:
        return self.folder / f"{block_hash.hex()}-{self.name_part}{SUFFIX}"

    def has(self, block_hash: bytes) -> bool:
        return self.path(block_hash).exists()

    def read(self, block_hash: bytes) -> memoryview | None:
        """The block's K/V bytes, checked; None for a miss (no file, or a bad one, now deleted)."""
        path = self.path(block_hash)
        try:
            data = path.read_bytes()
        except OSError:              # never written, deleted by an engine's scan, or unreadable: a miss
            return None
        try:
            kv = decode(data, self.key, block_hash, self.kv_bytes)
        except BadBlockFile as e:
            with self._count:
                self.dropped[e.kind] += 1
            remove(path)
            return None
        try:
            os.utime(path)           # a hit is a use: the least recently used files go first
        except OSError:
            pass                     # a read-only folder keeps its order
        return kv

    def layout(self, hash_len: int) -> tuple[int, int]:
        """Where a file's K/V start in its bytes, and the file's length."""
        return layout(self.key_data, hash_len, self.kv_bytes)

    def image_bytes(self, hash_len: int) -> int:
        """An image holds one file's bytes: a whole number of pages, so images laid one after another in a
        page-aligned buffer are page-aligned too, as O_DIRECT needs."""
        return -(-self.layout(hash_len)[1] // mmap.PAGESIZE) * mmap.PAGESIZE

    def write(self, block_hash: bytes, kv) -> int:
        """Write one block from any buffer of its K/V bytes (copied into a new image); its file's size."""
        image, (start, _) = mmap.mmap(-1, self.image_bytes(len(block_hash))), self.layout(len(block_hash))
        image[start:start + self.kv_bytes] = memoryview(kv).cast("B")
        return self.write_image(block_hash, image)

    def write_image(self, block_hash: bytes, image) -> int:
        """Write one block's file atomically from an image (`image_bytes`) whose K/V are in place (`layout`); its
        size in bytes. An OSError (a full disk, no permission) is the caller's to handle; no temporary file is
        left behind."""
        size = seal(image, self.key_data, block_hash, self.kv_bytes)
        final = self.path(block_hash)
        temporary = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            try:
                self._write_file(temporary, image, size, self.direct)
            except OSError as e:
                if not self.direct or e.errno != errno.EINVAL:
                    raise
                self.direct = False             # this filesystem takes no O_DIRECT: ordinary writes from now on
                self._write_file(temporary, image, size, False)
            os.replace(temporary, final)
        except OSError:
            remove(temporary)
            raise
        self.bytes_since_scan += size
        if self.bytes_since_scan * 10 >= self.max_bytes:
            self.keep_bound()
        return size

    @staticmethod
    def _write_file(path: Path, image, size: int, direct: bool) -> None:
        """O_DIRECT writes whole pages from the page-aligned image, and the file is cut to its length after."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0)
        fd = os.open(path, flags, 0o644)
        try:
            view = memoryview(image)[:len(image) if direct else size]
            while view:
                view = view[os.write(fd, view):]
            if direct:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)

    def keep_bound(self) -> None:
        """Scan every engine's files; past the bound, delete the least recently used down to LOW_WATER of it."""
        self.bytes_since_scan = 0
        files, now = [], time.time()
        with os.scandir(self.folder) as entries:
            for entry in entries:
                try:
                    st = entry.stat()
                except OSError:
                    continue         # deleted meanwhile by another engine
                if entry.name.endswith(SUFFIX):
                    files.append((st.st_mtime_ns, st.st_size, entry.path))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > ORPHAN_SECONDS:
                    remove(Path(entry.path))
        total = sum(size for _, size, _ in files)
        if total <= self.max_bytes:
            return
        for _, size, path in sorted(files):
            if total <= self.max_bytes * LOW_WATER:
                break
            if remove(Path(path)):
                with self._count:
                    self.files_evicted += 1
            total -= size


def remove(path: Path) -> bool:
    """Delete a file; False where it was gone already (another engine got there first) or cannot be."""
    try:
        path.unlink()
        return True
    except OSError:
        return False
