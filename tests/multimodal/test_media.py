"""nanopaged/multimodal/media.py: every image is decoded whole and in RGB, or refused with a ValueError that names
its field; a URL is a data: URL or a file under the allowed folder, never the network."""
import base64
import io
import os
import re
import struct
import zlib

import pytest
from PIL import Image, ImageFile

from nanopaged.multimodal import media
from nanopaged.multimodal.media import (MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_PROMPT_PIXELS, check_image_count,
                                        image_from_url, images_per_prompt, load_image, load_images, png_bytes)

FIELD = "messages[0].content[1].image_url"


def encoded(image: Image.Image, fmt: str = "PNG") -> bytes:
    out = io.BytesIO()
    image.save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height and whose pixels are a few bytes: a decompression bomb's shape."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


@pytest.fixture
def red():
    return Image.new("RGB", (7, 5), (255, 0, 0))


# ---- the good paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_encoded_bytes_decode_to_an_rgb_image_of_their_size(red, fmt):
    image = load_image(encoded(red, fmt), FIELD)
    assert image.mode == "RGB" and image.size == (7, 5)
    assert image.getpixel((3, 2))[0] > 200


def test_a_transparent_image_is_laid_over_white_and_a_gray_one_made_rgb():
    clear = load_image(encoded(Image.new("RGBA", (2, 2), (0, 0, 0, 0))), FIELD)
    assert clear.mode == "RGB" and clear.getpixel((0, 0)) == (255, 255, 255)
    gray = load_image(Image.new("L", (2, 2), 9), FIELD)
    assert gray.mode == "RGB" and gray.getpixel((1, 1)) == (9, 9, 9)


def test_a_data_url_gives_its_image(red):
    assert load_image(image_from_url(data_url(encoded(red)), None, FIELD), FIELD).size == (7, 5)


def test_a_file_url_and_a_path_under_the_allowed_folder_give_the_image(red, tmp_path):
    (tmp_path / "sub").mkdir()
    red.save(tmp_path / "sub" / "red.png")
    for url in (f"file://{tmp_path}/sub/red.png", str(tmp_path / "sub" / "red.png"), "sub/red.png"):
        assert image_from_url(url, str(tmp_path), FIELD).getpixel((0, 0)) == (255, 0, 0), url


def test_png_bytes_round_trip_through_load_image(red):
    assert load_image(png_bytes(red), FIELD).tobytes() == red.tobytes()


# ---- what an image may not be -------------------------------------------------------------------------
def refused(obj, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        load_image(obj, FIELD)
    assert FIELD in str(e.value)


def test_bytes_that_are_no_image_are_refused_by_field():
    refused(b"hello, not an image", "is not an image Pillow can read")
    refused(b"", "empty")
    refused("a string", "must be a PIL image or encoded image bytes, got str")


def test_a_truncated_png_is_refused_when_decoded(red):
    whole = encoded(Image.effect_noise((64, 64), 50).convert("RGB"))
    refused(whole[: len(whole) // 2], "truncated or corrupt")


def test_a_huge_header_is_refused_before_any_pixel_is_decoded(monkeypatch):
    bomb = png_header_only(5000, 5000)               # 25M pixels claimed, in ~70 bytes
    assert 5000 * 5000 > MAX_IMAGE_PIXELS
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded before the size check"))
    refused(bomb, r"5000x5000 pixels; at most 8192 a side and 16,777,216 pixels")


def test_a_long_strip_is_refused_by_its_side():
    refused(png_header_only(10_000, 1), r"10000x1 pixels")


def test_pillows_own_bomb_check_is_caught_and_named(monkeypatch):
    monkeypatch.setattr(media, "MAX_IMAGE_PIXELS", 10**12)
    monkeypatch.setattr(media, "MAX_IMAGE_SIDE", 10**6)
    refused(png_header_only(20_000, 20_000), "decompression bomb")     # past Pillow's 2 x 89M pixels


def test_a_zero_size_image_is_refused():
    refused(Image.new("RGB", (0, 3)), r"0x3 pixels: an image needs at least one pixel")


def test_encoded_bytes_past_the_limit_are_refused_before_decoding():
    refused(b"\0" * (MAX_IMAGE_BYTES + 1), f"at most {MAX_IMAGE_BYTES:,} are allowed")


def test_a_prompts_images_are_summed_from_their_headers_before_any_is_decoded(monkeypatch):
    monkeypatch.setattr(ImageFile.ImageFile, "load", lambda self: pytest.fail("decoded before the sum was checked"))
    bombs = [(png_header_only(4096, 4096), f"messages[0].content[{j}]") for j in range(5)]
    assert 5 * 4096 * 4096 > MAX_PROMPT_PIXELS >= 4 * 4096 * 4096
    with pytest.raises(ValueError, match=r"messages: its 5 images hold 83,886,080 pixels together; at most 67,108,864"):
        load_images(bombs, "messages")
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\] is truncated or corrupt"):
        load_images(bombs[:4], "messages")      # four fit: decoding starts (and these files hold no pixels)


def test_more_images_than_the_limit_are_refused_and_the_default_is_vllms():
    check_image_count(2, 2, "messages")
    with pytest.raises(ValueError, match=r"messages holds 3 images; at most 2 .*limit_mm_per_prompt"):
        check_image_count(3, 2, "messages")
    assert images_per_prompt(None) == images_per_prompt({}) == 999
    assert images_per_prompt({"image": 0}) == 0


# ---- what a URL may not be ------------------------------------------------------------------------------
def url_refused(url: str, allowed, match: str) -> None:
    with pytest.raises(ValueError, match=match) as e:
        image_from_url(url, allowed, FIELD)
    assert str(e.value).startswith(FIELD)


@pytest.mark.parametrize("url", ["http://example.com/a.png", "https://example.com/a.png", "HTTPS://x/y"])
def test_an_http_url_is_refused_this_engine_never_fetches(url, tmp_path):
    url_refused(url, str(tmp_path), "this engine never fetches")


def test_other_schemes_and_remote_file_hosts_are_refused(tmp_path):
    url_refused("ftp://host/a.png", str(tmp_path), "scheme 'ftp' is not supported")
    url_refused("file://otherhost/etc/a.png", str(tmp_path), "names another host")


def test_a_local_file_is_refused_when_the_flag_is_unset(red, tmp_path):
    red.save(tmp_path / "red.png")
    url_refused(str(tmp_path / "red.png"), None, "allowed_local_media_path .* which is not set")
    url_refused(f"file://{tmp_path}/red.png", None, "which is not set")


def test_a_path_outside_the_allowed_folder_is_refused(red, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir(), outside.mkdir()
    red.save(outside / "red.png")
    url_refused(str(outside / "red.png"), str(allowed), "lies outside allowed_local_media_path")
    url_refused("../outside/red.png", str(allowed), "lies outside")
    url_refused(f"file://{allowed}/../outside/red.png", str(allowed), "lies outside")


def test_a_symlink_out_of_the_allowed_folder_is_refused(red, tmp_path):
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    allowed.mkdir(), outside.mkdir()
    red.save(outside / "red.png")
    os.symlink(outside / "red.png", allowed / "link.png")
    os.symlink(outside, allowed / "dir")
    url_refused(str(allowed / "link.png"), str(allowed), "lies outside .* resolves to")
    url_refused("dir/red.png", str(allowed), "lies outside")


def test_a_folder_or_a_missing_file_is_refused(tmp_path):
    (tmp_path / "d").mkdir()
    url_refused("d", str(tmp_path), "is not a file")
    url_refused("missing.png", str(tmp_path), "is not a file")


def test_bad_base64_is_refused(red):
    url_refused("data:image/png;base64,@@@not base64@@@", None, "base64 is not valid")


@pytest.mark.parametrize("url", ["data:text/plain;base64,aGVsbG8=", "data:application/pdf;base64,aGVsbG8=",
                                 "data:image/png;base64"])
def test_a_data_url_that_is_not_image_media_is_refused(url):
    url_refused(url, None, "media type must be image/")


def test_a_data_url_not_in_base64_is_refused():
    url_refused("data:image/png,rawbytes", None, "must carry its image in base64")


def test_a_data_url_past_the_size_limit_is_refused_before_base64_is_decoded(monkeypatch):
    monkeypatch.setattr(media.base64, "b64decode", lambda *a, **k: pytest.fail("decoded before the size check"))
    url_refused("data:image/png;base64," + "A" * (MAX_IMAGE_BYTES * 4 // 3 + 8), None, "characters of base64")


def test_a_data_url_with_no_image_inside_is_refused_on_decoding():
    with pytest.raises(ValueError, match=re.escape(FIELD) + " is not an image"):
        image_from_url(data_url(b"plain text, says image/png"), None, FIELD)
