"""Images a user hands the engine: read, checked, decoded to RGB, or refused with a ValueError naming the field.

Every image of a prompt passes `load_image` before any processor sees it: a PIL image, or encoded bytes
(PNG, JPEG, WebP, ... whatever Pillow reads). Its size is read from the header and checked before a pixel is
decoded, so a small file that claims a huge image (a decompression bomb) costs nothing; then it is decoded
whole, so a truncated file fails here, not in a processor. `load_images` does the same for a prompt's images
together, their headers summed first. `image_from_url` reads what a chat message's image_url names: a data:
URL, or a local file under the one folder the server allows; never the network.
vLLM: vllm/multimodal/image.py and vllm/multimodal/utils.py (MediaConnector). docs/08_server.md.
"""
from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from urllib.parse import unquote, urlparse

from PIL import Image, UnidentifiedImageError

MAX_IMAGE_PIXELS = 4096 * 4096        # a decoded image holds at most 48 MiB of RGB
MAX_IMAGE_SIDE = 8192                 # a 1 x 16M strip passes the pixel limit; no vision processor wants it
MAX_IMAGE_BYTES = 20 * 1024 * 1024    # encoded, checked before decoding (OpenAI's own limit per image)
# A prompt's images together: a few dozen well-compressed images fit a request body, and each could decode to
# MAX_IMAGE_PIXELS; their headers are summed before any is decoded.
MAX_PROMPT_PIXELS = 4 * MAX_IMAGE_PIXELS
# vLLM V1's default (vLLM V0 had 1): a vLLM script that sends several images in one prompt runs unchanged.
DEFAULT_IMAGES_PER_PROMPT = 999
# What a file too large to be an image could cost, read before it is refused: one byte past the limit.
_READ_LIMIT = MAX_IMAGE_BYTES + 1


# ---- an image -------------------------------------------------------------------------------------
def load_image(obj, field: str) -> Image.Image:
    """`obj` (a PIL image or encoded bytes) decoded whole, in RGB; a ValueError naming `field` if it is
    not an image, is truncated or corrupt, or is too large."""
    image = open_image(obj, field)
    try:
        image.load()                        # a lazily opened image (Image.open) is decoded now
    except Image.DecompressionBombError as e:
        raise ValueError(f"{field} is refused by Pillow as a decompression bomb: {e}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:    # what Pillow's decoders raise on bad data
        raise ValueError(f"{field} is truncated or corrupt: {type(e).__name__}: {e}") from None
    return to_rgb(image)


def load_images(items: list[tuple[object, str]], field: str) -> list[Image.Image]:
    """One prompt's images, given as (image, its field): every header is read and their pixels summed before
    any is decoded, so a prompt of many small files that each claim a large image costs nothing."""
    opened = [(open_image(obj, where), where) for obj, where in items]
    total = sum(image.width * image.height for image, _ in opened)
    if total > MAX_PROMPT_PIXELS:
        raise ValueError(f"{field}: its {len(opened)} images hold {total:,} pixels together; at most "
                         f"{MAX_PROMPT_PIXELS:,} per prompt are allowed")
    return [load_image(image, where) for image, where in opened]


def open_image(obj, field: str) -> Image.Image:
    """`obj` as a PIL image whose size, read from its header, is checked; no pixel decoded yet."""
    if isinstance(obj, Image.Image):
        image = obj
    elif isinstance(obj, (bytes, bytearray, memoryview)):
        image = _open(bytes(obj), field)
    else:
        raise ValueError(f"{field} must be a PIL image or encoded image bytes, got {type(obj).__name__}")
    check_image_size(image.size, field)
    return image


def _open(data: bytes, field: str) -> Image.Image:
    """The image's header read (its format and size), no pixel decoded yet."""
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{field} is {len(data):,} bytes encoded; at most {MAX_IMAGE_BYTES:,} are allowed")
    if not data:
        raise ValueError(f"{field} is empty (0 bytes): not an image")
    try:
        return Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as e:
        raise ValueError(f"{field} is refused by Pillow as a decompression bomb: {e}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as e:
        raise ValueError(f"{field} is not an image Pillow can read ({len(data):,} bytes starting "
                         f"{data[:8]!r}): {type(e).__name__}") from None


def check_image_size(size: tuple[int, int], field: str) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise ValueError(f"{field} is {width}x{height} pixels: an image needs at least one pixel")
    if max(width, height) > MAX_IMAGE_SIDE or width * height > MAX_IMAGE_PIXELS:
        raise ValueError(f"{field} is {width}x{height} pixels; at most {MAX_IMAGE_SIDE} a side and "
                         f"{MAX_IMAGE_PIXELS:,} pixels in all are allowed")


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, as vision processors read it; a transparent image over white, as vLLM composes it."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or "transparency" in image.info:
        white = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


def png_bytes(image: Image.Image) -> bytes:
    """A decoded image as plain bytes for a socket (the engine core decodes them with load_image);
    the fastest compression: the bytes cross one machine's loopback, not a network."""
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=1)
    return out.getvalue()


def check_image_count(n: int, limit: int, field: str) -> None:
    """vLLM's limit_mm_per_prompt={"image": limit}: a prompt with more images is refused."""
    if n > limit:
        raise ValueError(f"{field} holds {n} images; at most {limit} per prompt are allowed "
                         f"(limit_mm_per_prompt={{'image': {limit}}})")


def images_per_prompt(limit_mm_per_prompt: dict | None) -> int:
    """The image limit the setting gives (config.py checks its shape); unnamed: DEFAULT_IMAGES_PER_PROMPT."""
    return (limit_mm_per_prompt or {}).get("image", DEFAULT_IMAGES_PER_PROMPT)


# ---- where an image_url points --------------------------------------------------------------------
def image_from_url(url: str, allowed_local_media_path: str | None, field: str) -> Image.Image:
    """The image a chat message's image_url names, decoded (load_image)."""
    return load_image(image_bytes_from_url(url, allowed_local_media_path, field), field)


def image_bytes_from_url(url: str, allowed_local_media_path: str | None, field: str) -> bytes:
    """The encoded bytes of a data: URL, a file:// URL or a local path (only under allowed_local_media_path);
    http(s) and every other scheme are refused by name: this engine never fetches."""
    if not isinstance(url, str) or not url:
        raise ValueError(f"{field}.url must be a non-empty string, got {_shown(url)}")
    scheme = urlparse(url[:256]).scheme.lower()      # the scheme is in the start; a data URL may be megabytes
    if scheme == "data":
        return _data_url(url, field)
    if scheme in ("http", "https"):
        raise ValueError(f"{field}: {_shown(url)} is an {scheme} URL; this engine never fetches: send the image "
                         "inline as a data: URL (data:image/png;base64,...)")
    if scheme == "file":
        parts = urlparse(url)
        if parts.netloc not in ("", "localhost"):
            raise ValueError(f"{field}: {_shown(url)} names another host ({parts.netloc!r}); a file:// URL "
                             "names a file on this machine (file:///path)")
        return _local_file(unquote(parts.path), allowed_local_media_path, field)
    if scheme:
        raise ValueError(f"{field}: the URL scheme {scheme!r} is not supported; send a data: URL, or a file:// URL "
                         "or path under allowed_local_media_path")
    return _local_file(url, allowed_local_media_path, field)


def _data_url(url: str, field: str) -> bytes:
    """data:image/...;base64,<payload> -> its bytes; its size bounded before base64 is decoded."""
    header, comma, payload = url.partition(",")
    params = [p.strip().lower() for p in header.removeprefix("data:").split(";")]
    if not comma or params[0].partition("/")[0] != "image":
        raise ValueError(f"{field}: a data URL's media type must be image/* (data:image/png;base64,...), "
                         f"got {_shown(header + comma)}")
    if "base64" not in params[1:]:
        raise ValueError(f"{field}: a data URL must carry its image in base64 (data:{params[0]};base64,...), "
                         f"got {_shown(header + comma)}")
    if len(payload) > (MAX_IMAGE_BYTES + 2) // 3 * 4:
        raise ValueError(f"{field}: the data URL holds {len(payload):,} characters of base64; at most "
                         f"{MAX_IMAGE_BYTES:,} bytes of image are allowed")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{field}: the data URL's base64 is not valid: {e}") from None


def _local_file(path: str, allowed_local_media_path: str | None, field: str) -> bytes:
    """A file's bytes if its real path (every symlink and .. resolved) lies under the allowed folder."""
    if not allowed_local_media_path:
        raise ValueError(f"{field}: the local file {_shown(path)} is refused: local files are read only under "
                         "allowed_local_media_path (--allowed-local-media-path), which is not set")
    root = Path(allowed_local_media_path).resolve()
    target = (root / path).resolve()      # relative paths are under the folder; an absolute one stays itself
    if not target.is_relative_to(root):
        raise ValueError(f"{field}: {_shown(path)} lies outside allowed_local_media_path {str(root)!r} "
                         f"(it resolves to {str(target)!r})")
    if not target.is_file():              # a folder, a missing file, a device or a pipe (which would block)
        raise ValueError(f"{field}: {_shown(path)} is not a file under allowed_local_media_path {str(root)!r}")
    with open(target, "rb") as f:
        data = f.read(_READ_LIMIT)
    if len(data) > MAX_IMAGE_BYTES:
        raise ValueError(f"{field}: {_shown(path)} is more than {MAX_IMAGE_BYTES:,} bytes; at most "
                         f"{MAX_IMAGE_BYTES:,} are allowed")
    return data


def _shown(value) -> str:
    """A value as an error quotes it: a 20 MB data URL shows its start."""
    text = repr(value)
    return text if len(text) <= 120 else f"{text[:100]}... [{len(text):,} characters]"
