import base64

import pytest

from components.images import (
    ImageError, ImageLimits, ImageTooLarge, decode_image, load_image_ref,
)
from tests.conftest import data_uri, encode, make_image


def test_identity_is_the_pixels_not_the_container(tmp_path):
    img = make_image(64, 48, 1)
    png, bmp = encode(img, "PNG"), encode(img, "BMP")
    path = tmp_path / "x.png"
    path.write_bytes(png)
    hashes = {decode_image(png).content_hash, decode_image(bmp).content_hash,
              load_image_ref(data_uri(png)).content_hash, load_image_ref(str(path)).content_hash,
              load_image_ref(f"file://{path}").content_hash}
    assert len(hashes) == 1
    assert decode_image(encode(make_image(64, 48, 2))).content_hash not in hashes


@pytest.mark.parametrize("ref, error", [
    ("data:image/png;base64,!!!notbase64", ImageError),
    ("data:image/png," + "abc", ImageError),
    ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), ImageError),
    ("/no/such/file.png", ImageError),
    ("http://example.invalid/x.png", ImageError),
])
def test_bad_refs_get_typed_errors(ref, error):
    with pytest.raises(error):
        load_image_ref(ref)


def test_limits():
    png = encode(make_image(100, 100, 3))
    with pytest.raises(ImageTooLarge):
        decode_image(png, ImageLimits(max_bytes=len(png) - 1))
    with pytest.raises(ImageTooLarge):
        decode_image(png, ImageLimits(max_pixels=100 * 100 - 1))
    with pytest.raises(ImageError):
        decode_image(png[: len(png) // 2])  # truncated
