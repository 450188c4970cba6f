"""Image intake for the encode/prefill worker: decode, limit, and give each image its identity.

An image's identity is a hash of its decoded pixels (mode, size, RGB bytes), not of the bytes it
arrived as: the same picture sent as PNG, as a data URI or from a file gets one identity, so its
KV blocks are shared across requests and the router can find them. The pixels are the ones the
model sees: turned upright by their EXIF orientation and made RGB as vLLM's own media parsing
does (transparent pixels onto white), so two pictures with one identity are one model input.
The hash is BLAKE3 (the `blake3` package, already a dependency for the decode memo): about half
SHA-256's time on a 12 MP image's 36 MB on one core, and it spreads over the host's cores.

Where a media process presizes an image (media.presize: brought exactly to the size the model's
processor resizes it to, so the model's input is that of the original, bit for bit), the
identity hashes the presized pixels instead, in a domain of their own (`PRESIZED_DOMAIN`): a
12 MP photo's 36 MB become LLaVA's 336 x 448 (0.4 MB; ~30 ms of a media process's ~250 on the
GPU host, before). It stays an identity of the model's input: two images with one presized form
are one model input (the processor goes on from that form alone), so sharing their KV blocks is
right; the same picture sent as JPEG or PNG still gets one identity. A worker that loads an
image in its own threads (no media processes, or after one died) hashes the whole image (the
other domain): the same picture then has two identities across those paths, which costs a cache
miss between them, never a wrong hit.
"""

from __future__ import annotations

import binascii
import io
from dataclasses import dataclass
from pathlib import Path

import pybase64
from blake3 import blake3
from PIL import Image, ImageOps, UnidentifiedImageError

# v3: the pixels upright by their EXIF orientation, transparency on white (v2: as stored; v1:
# SHA-256). Another domain each time, so that no identity of one scheme equals one of another:
# replicas of two versions only miss each other's cache.
HASH_DOMAIN = b"mmhandoff.image.v3\0"
PRESIZED_DOMAIN = b"mmhandoff.image.presized.v1\0"  # an image at its processor's resize size


class ImageError(ValueError):
    """An image that cannot be used; the message is safe to show to a client."""

    code = "invalid_image"
    fault = "client"


class ImageTooLarge(ImageError):
    code = "image_too_large"


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 32 * 1024 * 1024
    max_pixels: int = 50_000_000  # a 12 MP photo fits; decompression bombs do not


@dataclass(frozen=True)
class LoadedImage:
    # RGB; None: not decoded, because the engine holds it processed (engine.prompt's memo)
    image: Image.Image | None
    content_hash: str
    source_bytes: int
    modality = "image"

    @property
    def data(self) -> Image.Image | None:
        return self.image


def content_hash(image: Image.Image, domain: bytes = HASH_DOMAIN) -> str:
    rgb = image if image.mode == "RGB" else image.convert("RGB")
    h = blake3(domain, max_threads=blake3.AUTO)
    h.update(f"{rgb.width}x{rgb.height}\0".encode())
    h.update(rgb.tobytes())
    return h.hexdigest()


def decode_image(data: bytes, limits: ImageLimits = ImageLimits(),
                 draft: tuple[int, int] | None = None) -> LoadedImage:
    image = decode_rgb(data, limits, draft)
    return LoadedImage(image=image, content_hash=content_hash(image), source_bytes=len(data))


def decode_rgb(data: bytes, limits: ImageLimits = ImageLimits(),
               draft: tuple[int, int] | None = None) -> Image.Image:
    """The image's pixels, fully decoded, in RGB; an ImageError for anything else. `draft`
    (the inexact decode, media.presize.Presizer.draft_size): a JPEG is decoded at the smallest
    of 1/2, 1/4 or 1/8 of its size that is still at least this large (libjpeg's own DCT
    scaling, PIL's `draft`); other formats are decoded whole. Its pixels, and so its identity,
    are those of the smaller image."""
    if len(data) > limits.max_bytes:
        raise ImageTooLarge(f"image is {len(data)} bytes; the limit is {limits.max_bytes}")
    try:
        with Image.open(io.BytesIO(data)) as probe:
            width, height = probe.size
            if width * height > limits.max_pixels:
                raise ImageTooLarge(
                    f"image is {width}x{height} pixels; the limit is {limits.max_pixels}")
            if draft is not None:
                probe.draft(None, draft)  # (no-op for anything but a JPEG)
            probe.load()  # decodes fully; truncated files fail here
            # an RGB image (most JPEGs) as decoded: convert() would copy it (a third of the
            # decode's time at 12 MP)
            return as_rgb(upright(probe))
    except ImageTooLarge:
        raise
    except (UnidentifiedImageError, OSError, Image.DecompressionBombError, ValueError) as e:
        raise ImageError(f"data is not a readable image: {e}") from None


EXIF_ORIENTATION = 0x0112


def upright(image: Image.Image) -> Image.Image:
    """The image turned as its EXIF orientation says, as vLLM turns every image it is given
    (`normalize_image`): the identity must hash what the model sees. An image already upright
    (most) is not copied; an unreadable EXIF block leaves it as it is, as there."""
    try:
        if image.getexif().get(EXIF_ORIENTATION, 1) == 1:
            return image
        return ImageOps.exif_transpose(image)
    except Exception:
        return image


def as_rgb(image: Image.Image) -> Image.Image:
    """RGB as vLLM's `convert_image_mode(image, "RGB")` makes it: transparent pixels composited
    onto white (PIL's own convert would keep the colours under them)."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        white = Image.new("RGB", rgba.size, (255, 255, 255))
        white.paste(rgba, mask=rgba.split()[3])
        return white
    return image.convert("RGB")


class InvalidBase64(ImageError):
    code = "invalid_base64"


HEAD_BYTES = 48 * 1024  # an image's header (what PIL reads before the pixels) fits, in practice


def _data_uri_body_at(ref: str, limits: ImageLimits) -> int:
    """Where the base64 body of a data URI starts, its header and size checked."""
    comma = ref.find(",")
    if not ref.startswith("data:") or comma < 0 or ";base64" not in ref[:comma]:
        raise ImageError("image data URI must be base64: data:image/<type>;base64,<data>")
    if len(ref) - comma - 1 > limits.max_bytes * 4 // 3 + 4:
        raise ImageTooLarge(f"image is over the {limits.max_bytes}-byte limit")
    return comma + 1


def data_uri_bytes(ref: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The bytes of a `data:image/...;base64,...` URI: padded base64 in the standard alphabet
    (a whole number of quanta, at most two "=" and only at the end), size-checked before and
    after decoding. pybase64 (vLLM's own, SIMD) refuses any other character or padding in its
    `validate` mode: a 12 MP JPEG's 7.8 MB in 0.3 ms on the 2-core host, against 18 ms with
    binascii's strict mode (the same rules: tests/test_images.py checks them)."""
    body_at = _data_uri_body_at(ref, limits)
    try:
        raw = memoryview(ref.encode("ascii"))[body_at:]
    except UnicodeEncodeError:
        raise InvalidBase64("the data URI holds invalid base64") from None
    if len(raw) % 4:  # (pybase64 refuses it too; said here, where the rules are)
        raise InvalidBase64("the data URI holds invalid base64")
    try:
        data = pybase64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidBase64("the data URI holds invalid base64") from None
    if len(data) > limits.max_bytes:
        raise ImageTooLarge(f"image is {len(data)} bytes; the limit is {limits.max_bytes}")
    return data


def peek_data_uri(ref: str, limits: ImageLimits = ImageLimits()) -> tuple[int, bytes]:
    """The decoded size of a data URI's image and its first HEAD_BYTES, the whole base64
    checked as `data_uri_bytes` checks it: for the frontend, which only reads the header.
    Checking is decoding here (pybase64 validates as it decodes, faster than scanning without
    it did: a 12 MP JPEG's 7.8 MB in ~0.3 ms against 3.2), the bytes past the head dropped."""
    data = data_uri_bytes(ref, limits)
    return len(data), data[:HEAD_BYTES]


def load_image_ref(ref: str, limits: ImageLimits = ImageLimits(),
                   draft: tuple[int, int] | None = None) -> LoadedImage:
    """A data URI (`data:image/...;base64,...`) or a local file path (`file://` or plain);
    `draft`: as `decode_rgb`'s."""
    image, size = read_image_ref(ref, limits, draft)
    return LoadedImage(image=image, content_hash=content_hash(image), source_bytes=size)


def read_image_ref(ref: str, limits: ImageLimits = ImageLimits(),
                   draft: tuple[int, int] | None = None) -> tuple[Image.Image, int]:
    """`load_image_ref`'s image and the size it arrived as, without its identity."""
    if ref.startswith("data:"):
        data = data_uri_bytes(ref, limits)
        return decode_rgb(data, limits, draft), len(data)
    if ref.startswith(("http://", "https://")):
        raise ImageError("image URLs are fetched by the frontend; the worker takes data URIs "
                         "and local files")
    path = Path(ref[len("file://"):] if ref.startswith("file://") else ref)
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ImageError(f"cannot read image file {str(path)!r}: {e.strerror}") from None
    if size > limits.max_bytes:
        raise ImageTooLarge(f"image file is {size} bytes; the limit is {limits.max_bytes}")
    data = path.read_bytes()
    return decode_rgb(data, limits, draft), len(data)
