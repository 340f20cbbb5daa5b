"""The disk tier: full KV blocks kept in files named by their chained hash, beyond the process's life.

    key.py         what makes a block's K/V differ besides its tokens (model, weights, dtypes, sizes, kernels)
    block_file.py  one block's file: its key, its hash, the K/V bytes and a checksum; every check on reading
    store.py       the folder: atomic writes past the page cache, checked reads, least recently used files dropped
    writer.py      an idle-class thread that writes blocks as they fill, from reused images: no step waits or pays
    extension.py   KVDisk: supplies blocks after the pool's prefix misses, writes new full blocks, counts

Engine settings `kv_cache_disk_dir` and `kv_cache_disk_gb`. docs/03_prefix_caching.md, "The disk tier".
"""
