"""A block file is read back only whole, unchanged, for its own key and block: every other file says why not."""
import pytest

from nanopaged.kv_disk.block_file import HEADER, BadBlockFile, decode, layout, seal
from nanopaged.kv_disk.key import key_bytes

KEY = {"format": 1, "model_path": "/models/a", "weights": "w1", "dtype": "float32"}
KV = bytes(range(256)) * 4
HASH = b"\x01" * 32


def encode(key, block_hash, kv) -> bytes:
    """A file's bytes as the writer makes them: K/V put in place, then sealed around them."""
    start, size = layout(key_bytes(key), len(block_hash), len(kv))
    image = bytearray(size)
    image[start:start + len(kv)] = kv
    assert seal(image, key_bytes(key), block_hash, len(kv)) == size
    return bytes(image)


def test_a_file_reads_back_its_own_bytes():
    assert bytes(decode(encode(KEY, HASH, KV), KEY, HASH, len(KV))) == KV


@pytest.mark.parametrize("change, kind", [
    (lambda data: data[:HEADER.size + 40] + bytes([data[HEADER.size + 40] ^ 0xFF]) + data[HEADER.size + 41:],
     "corrupt"),                                                   # one flipped byte in the key or K/V
    (lambda data: data[:-1] + bytes([data[-1] ^ 1]), "corrupt"),   # the checksum itself
    (lambda data: b"XXXX" + data[4:], "corrupt"),                  # not a block file
    (lambda data: data + b"\0", "corrupt"),                        # bytes past the end
    (lambda data: data[:len(data) // 2], "truncated"),
    (lambda data: data[:7], "truncated"),
    (lambda data: data[:4] + (99).to_bytes(2, "little") + data[6:], "stale"),   # another format version
])
def test_a_changed_file_is_refused_by_kind(change, kind):
    with pytest.raises(BadBlockFile) as e:
        decode(change(encode(KEY, HASH, KV)), KEY, HASH, len(KV))
    assert e.value.kind == kind


def test_another_models_file_is_foreign_and_this_folders_old_weights_are_stale():
    other_model = {**KEY, "model_path": "/models/b", "weights": "w2"}
    old_weights = {**KEY, "weights": "w0"}
    for key, kind in ((other_model, "foreign"), (old_weights, "stale")):
        with pytest.raises(BadBlockFile) as e:
            decode(encode(key, HASH, KV), KEY, HASH, len(KV))
        assert e.value.kind == kind


def test_a_copy_of_the_model_folder_reads_the_same_files():
    """The path is not part of what K/V depend on: the same weights elsewhere compute the same bytes."""
    assert bytes(decode(encode({**KEY, "model_path": "/copy/a"}, HASH, KV), KEY, HASH, len(KV))) == KV


def test_another_blocks_file_under_this_name_is_foreign():
    with pytest.raises(BadBlockFile) as e:
        decode(encode(KEY, b"\x02" * 32, KV), KEY, HASH, len(KV))
    assert e.value.kind == "foreign"
