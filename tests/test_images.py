import base64
import binascii

import pytest
from blake3 import blake3
from hypothesis import example, given, settings
from hypothesis import strategies as st

from mmhandoff.media.images import (
    HASH_DOMAIN,
    HEAD_BYTES,
    ImageError,
    ImageLimits,
    ImageTooLarge,
    InvalidBase64,
    content_hash,
    data_uri_bytes,
    decode_image,
    load_image_ref,
    peek_data_uri,
)
from tests.conftest import data_uri, encode, make_image

pytestmark = pytest.mark.unit


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


def test_the_identity_is_blake3_of_the_size_and_the_rgb_bytes():
    """The contract replicas of one version share (media.images): a change of it needs a new
    HASH_DOMAIN, or two versions would give one identity to different inputs."""
    image = make_image(640, 480, seed=7)
    expected = blake3(HASH_DOMAIN + b"640x480\0" + image.tobytes()).hexdigest()
    assert content_hash(image) == decode_image(encode(image, "PNG")).content_hash == expected


@pytest.mark.parametrize("ref, error", [
    ("data:image/png;base64,!!!notbase64", InvalidBase64),
    ("data:image/png;base64,0000=", InvalidBase64),  # a stray "=" Python's decoder would take
    ("data:image/png;base64,AAA", InvalidBase64),  # not a multiple of 4
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


_B64ISH = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=\n $é"


def _rules(body: str) -> bytes | None:
    """The base64 rules spelled out apart from pybase64: ASCII, a whole number of quanta, the
    standard alphabet, at most two "=" and only at the end (binascii's strict mode checks the
    alphabet and the padding's place, and takes "0000=" and "AAAA====": refused here first)."""
    try:
        raw = body.encode("ascii")
    except UnicodeEncodeError:
        return None
    if len(raw) % 4 or raw.endswith(b"==="):
        return None
    try:
        return binascii.a2b_base64(raw, strict_mode=True)
    except binascii.Error:
        return None


def _with_stray(b64: str, at: int, char: str) -> str:
    return b64[:at % (len(b64) + 1)] + char + b64[at % (len(b64) + 1):]


@settings(max_examples=600, deadline=None)
@example(body="0000=")  # binascii's strict mode took it; the rules do not
@example(body="0000====")
@example(body="AAAA====")
@example(body="===")
@example(body="AR==")  # non-zero bits under the padding: taken, as Python's decoder takes it
@given(st.one_of(
    st.text(alphabet=_B64ISH, max_size=24),
    st.binary(max_size=200).map(lambda b: base64.b64encode(b).decode()),
    st.builds(_with_stray, st.binary(min_size=1, max_size=60).map(
        lambda b: base64.b64encode(b).decode()), st.integers(0, 200), st.sampled_from("=\n -_$"))))
def test_data_uris_are_decoded_by_the_rules(body):
    """The full decode and the frontend's peek accept and refuse exactly what the rules say,
    with the rules' bytes."""
    ref = "data:image/png;base64," + body
    expected = _rules(body)
    if expected is None:
        for check in (data_uri_bytes, peek_data_uri):
            with pytest.raises(InvalidBase64):
                check(ref)
        return
    assert data_uri_bytes(ref) == expected
    assert peek_data_uri(ref) == (len(expected), expected[:HEAD_BYTES])
    assert expected == base64.b64decode(body, validate=True)  # Python's own decoder agrees


@pytest.mark.parametrize("ref", ["data:image/png;x=\u00e9;base64,AAAA",  # not ASCII before it
                                 "data:image/png;a=b;base64,AA=A", "data:image/png;base64,=AAA"])
def test_peek_and_the_full_decode_refuse_alike(ref):
    for check in (peek_data_uri, data_uri_bytes):
        with pytest.raises(InvalidBase64):
            check(ref)
    assert peek_data_uri("data:image/png;a=b;base64,AA==") == (1, b"\0")  # "=" in the header


def test_peek_of_a_large_image_returns_its_head():
    data = bytes(range(256)) * 1000  # 256 KB
    size, head = peek_data_uri("data:image/png;base64," + base64.b64encode(data).decode())
    assert size == len(data) and head == data[:HEAD_BYTES] and len(head) < len(data)
    with pytest.raises(ImageTooLarge):
        peek_data_uri("data:image/png;base64," + base64.b64encode(data).decode(),
                      ImageLimits(max_bytes=len(data) - 1))
