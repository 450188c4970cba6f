import pytest

from mmhandoff.models.tiny import IMAGE_TOKENS, build_tiny_model, tree_digest

pytestmark = pytest.mark.unit


def test_build_is_byte_identical(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    build_tiny_model(a)
    build_tiny_model(b)
    assert tree_digest(a) == tree_digest(b)
    assert (a / "model.safetensors").stat().st_size > 100_000
    assert IMAGE_TOKENS == 64
