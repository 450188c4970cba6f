import pytest

from mmhandoff.models.build import tree_digest
from mmhandoff.models.tiny import IMAGE_TOKENS, build_tiny_model

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


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_the_qwen_vl_builds_are_byte_identical(tmp_path, arch):
    import json

    from mmhandoff.models.tiny import builder

    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        builder(arch)(folder)
    assert tree_digest(a) == tree_digest(b)
    assert not any("transformers_version" in p.read_text() for p in a.glob("*.json"))
    assert json.loads((a / "config.json").read_text())["model_type"] == arch


def test_an_unknown_architecture_is_named():
    from mmhandoff.models.tiny import ensure_tiny_model

    with pytest.raises(ValueError, match="unknown tiny model architecture 'gemma'.*llava"):
        ensure_tiny_model(arch="gemma")
