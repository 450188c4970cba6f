"""A presized image (media.presize) gives the model the same input as the original, bit for bit,
for every family that presizes: the processor's output is compared with its output on the
original image (the reference: the processor alone, as vLLM calls it; test_media_pool_engine
compares vLLM's whole render). Also: the pixels whose identity is hashed are the ones vLLM turns
and converts (EXIF orientation, transparency)."""

from __future__ import annotations

import io
from functools import cache

import numpy as np
import pytest
from PIL import Image

from mmhandoff.media.images import content_hash, decode_image, decode_rgb
from mmhandoff.media.presize import PRESIZED, Presizer
from mmhandoff.vllm_adapter.families import FAMILIES
from tests.conftest import encode, make_image

pytestmark = pytest.mark.unit

# (model, how it is built): the real shapes' processors (CLIP at 336 px; Qwen2.5-VL's pixel
# bounds) and each tiny family's
MODELS = ["dummy:llava-1.5-7b", "dummy:qwen2.5-vl-7b", "llava", "qwen2_vl", "qwen2_5_vl",
          "qwen3_vl"]
SIZES = [(640, 480), (2000, 1500), (1500, 2000), (333, 500), (1001, 37)]


@cache
def image_processor(model: str):
    from transformers import AutoProcessor

    if model.startswith("dummy:"):
        from mmhandoff.models.dummy import ensure_dummy_model

        folder = ensure_dummy_model(model[len("dummy:"):])
    else:
        from mmhandoff.models.tiny import ensure_tiny_model

        folder = ensure_tiny_model(arch=model)
    return AutoProcessor.from_pretrained(folder).image_processor


@cache
def photo(width: int, height: int) -> Image.Image:
    """A decoded JPEG (the JPEG's noise, not a smooth gradient, is what resizing meets)."""
    return decode_rgb(encode(make_image(width, height, seed=width * 7 + height), "JPEG"))


def model_input(processor, image: Image.Image) -> dict:
    return dict(processor(images=image, return_tensors="pt"))


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        assert bool((a[k] == b[k]).all()), f"{k}: max diff {(a[k] - b[k]).abs().max()}"


def test_every_family_presizes_and_every_processor_is_one_pinned_here():
    assert all(f.presize for f in FAMILIES)
    assert {type(image_processor(m)).__name__ for m in MODELS} == PRESIZED


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("size", SIZES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_the_presized_image_is_the_same_model_input(model, size):
    processor = image_processor(model)
    image = photo(*size)
    small = Presizer(processor)(image)
    assert_same(model_input(processor, image), model_input(processor, small))
    assert "resize" not in vars(processor)  # the processor is left as it was
    if small is not image:
        assert small.width * small.height <= 0.5 * image.width * image.height


def test_a_12_mp_photo_becomes_what_clip_takes():
    processor = image_processor("dummy:llava-1.5-7b")
    image = photo(4000, 3000)
    small = Presizer(processor)(image)
    assert small.size == (448, 336)
    assert_same(model_input(processor, image), model_input(processor, small))


def test_an_image_the_processor_keeps_near_its_size_goes_on_as_it_is():
    """Qwen2.5-VL's bounds keep a 640x480 photo at 644x476: not worth a copy; its own pixels
    go on, and the processor is stopped before it resizes."""
    image = photo(640, 480)
    assert Presizer(image_processor("dummy:qwen2.5-vl-7b"))(image) is image


def test_decoding_alone_gives_the_identity_of_the_decoded_pixels():
    """Where nothing presizes (the worker's threads), the identity is of the decoded pixels."""
    data = encode(make_image(1200, 900, seed=3), "JPEG")
    loaded = decode_image(data)
    assert content_hash(decode_rgb(data)) == loaded.content_hash


def exif_rotated_jpeg(orientation: int) -> tuple[bytes, Image.Image]:
    image = make_image(320, 200, seed=orientation)
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    return buf.getvalue(), image


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_the_pixels_are_upright_as_vllm_turns_them(orientation):
    from vllm.multimodal.image import convert_image_mode, normalize_image

    data, _ = exif_rotated_jpeg(orientation)
    ours = decode_rgb(data)
    reference = Image.open(io.BytesIO(data))
    reference = convert_image_mode(normalize_image(reference), "RGB")
    assert ours.size == reference.size
    assert np.array_equal(np.asarray(ours), np.asarray(reference))
    # vLLM turns what it is given once more: ours is already upright, so nothing changes
    again = normalize_image(ours)
    assert again.size == ours.size and np.array_equal(np.asarray(again), np.asarray(ours))


def test_one_picture_stored_turned_or_upright_has_one_identity():
    data, _ = exif_rotated_jpeg(6)
    upright = decode_rgb(data)
    stored_upright = encode(upright, "PNG")  # the same picture, no EXIF
    assert decode_image(data).content_hash == decode_image(stored_upright).content_hash


def transparent(mode: str) -> bytes:
    rng = np.random.default_rng(5)
    rgba = rng.integers(0, 256, (40, 60, 4), dtype=np.uint8)
    rgba[:10, :, 3] = 0  # a band fully transparent, the rest partly
    image = Image.fromarray(rgba)
    if mode == "P":
        image = image.convert("RGB").quantize(16)
        image.info["transparency"] = 3
    elif mode != "RGBA":
        image = image.convert(mode)
    return encode(image, "PNG")


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L"])
def test_transparent_pixels_are_made_rgb_as_vllm_makes_them(mode):
    from vllm.multimodal.image import convert_image_mode, normalize_image

    data = transparent(mode)
    reference = convert_image_mode(normalize_image(Image.open(io.BytesIO(data))), "RGB")
    assert np.array_equal(np.asarray(decode_rgb(data)), np.asarray(reference))


# ---- the inexact decode (--image-decode draft): off by default, its difference measured ------

# normalised units (one step of 255 is ~0.015 after CLIP's normalisation): the largest
# difference of any input value, and the mean one (measured: up to 0.088 and 0.014)
DRAFT_BOUND, DRAFT_MEAN_BOUND = 0.1, 0.02


def test_only_a_fixed_short_side_is_drafted():
    assert Presizer(image_processor("dummy:llava-1.5-7b")).draft_size() == (672, 672)
    assert Presizer(image_processor("llava")).draft_size() == (224, 224)
    for model in ("dummy:qwen2.5-vl-7b", "qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        # pixel bounds: a smaller decode would give another grid, another count of tokens
        assert Presizer(image_processor(model)).draft_size() is None, model


@pytest.mark.parametrize("size", [(4000, 3000), (1500, 2000), (2800, 1400)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_a_drafted_jpeg_is_the_same_shape_of_input_a_little_off(size):
    """The reference is the processor on the exact decode; the draft's difference is measured
    and bounded, and is not zero (so the option stays off by default)."""
    processor = image_processor("dummy:llava-1.5-7b")
    draft = Presizer(processor).draft_size()
    data = encode(make_image(*size, seed=size[0] + 5), "JPEG")
    exact, drafted = decode_image(data), decode_image(data, draft=draft)
    assert min(drafted.image.size) >= draft[0] and drafted.image.width < exact.image.width
    a, b = model_input(processor, exact.image), model_input(processor, drafted.image)
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)
    diff = (a["pixel_values"] - b["pixel_values"]).abs()
    assert 0 < float(diff.max()) <= DRAFT_BOUND and float(diff.mean()) <= DRAFT_MEAN_BOUND
    # the identity is of the pixels the model's processor gets: the drafted ones, the same each
    # time the same bytes come
    assert drafted.content_hash == content_hash(drafted.image) != exact.content_hash
    assert decode_image(data, draft=draft).content_hash == drafted.content_hash


def test_a_draft_leaves_other_formats_and_small_jpegs_whole():
    draft = (672, 672)
    png = encode(make_image(2000, 1500, seed=8))
    assert decode_image(png, draft=draft) == decode_image(png)
    small = encode(make_image(1400, 700, seed=9), "JPEG")  # no 1/2 scale keeps 672 a side
    assert decode_image(small, draft=draft) == decode_image(small)


def test_a_media_process_hashes_what_the_model_sees():
    """media.pool's identity where it presizes: the presized pixels' hash, in their own domain
    (still an identity of the model's input: media.images), one for the same pixels sent as PNG
    or BMP, another for another picture; where the processor keeps an image near its size, the
    whole image's hash, as the worker's threads give it."""
    import pickle

    from mmhandoff.media.images import PRESIZED_DOMAIN, ImageLimits, load_image_ref
    from mmhandoff.media.pool import prepare_image
    from tests.conftest import data_uri

    llava = Presizer(image_processor("dummy:llava-1.5-7b"))
    picture = photo(2000, 1500)
    png, bmp = data_uri(encode(picture, "PNG")), data_uri(encode(picture, "BMP"), "image/bmp")
    a, b = (prepare_image(ref, ImageLimits(), pickle.dumps(llava), None) for ref in (png, bmp))
    assert a.content_hash == b.content_hash == content_hash(llava(picture), PRESIZED_DOMAIN)
    assert a.content_hash != content_hash(picture)
    other = prepare_image(data_uri(encode(photo(1500, 2000), "PNG")), ImageLimits(),
                        pickle.dumps(llava), None)
    assert other.content_hash != a.content_hash
    qwen = pickle.dumps(Presizer(image_processor("dummy:qwen2.5-vl-7b")))
    kept = data_uri(encode(photo(640, 480), "PNG"))
    assert prepare_image(kept, ImageLimits(), qwen, None) == load_image_ref(kept)
