"""A component's command line -> the EngineSpec it starts (no engine is started here)."""

from __future__ import annotations

import pytest

from mmhandoff.plane.handoff_keys import KEY_ENV, KEY_FILE_ENV, handoff_keys
from mmhandoff.process.engine_worker import engine_spec, parser
from mmhandoff.vllm_adapter.engine import engine_env

pytestmark = pytest.mark.unit


def side_channel_host(argv: list[str]) -> str:
    args = parser("prefill").parse_args(["--model", "m", *argv])
    return engine_env(engine_spec(args, "prefill"))["VLLM_NIXL_SIDE_CHANNEL_HOST"]


def test_the_nixl_side_channel_host_is_loopback_unless_told(monkeypatch):
    monkeypatch.delenv("POD_IP", raising=False)
    assert side_channel_host([]) == "127.0.0.1"
    assert side_channel_host(["--nixl-host", "10.1.2.3"]) == "10.1.2.3"


def test_in_a_pod_the_side_channel_host_is_the_pods_ip(monkeypatch):
    monkeypatch.setenv("POD_IP", "10.4.0.17")
    assert side_channel_host([]) == "10.4.0.17"
    assert side_channel_host(["--nixl-host", "fd00::5"]) == "fd00::5"  # the flag wins


@pytest.mark.parametrize("bad", ["decode-0.svc", "", "10.0.0.256"])
def test_a_side_channel_host_that_is_not_an_ip_is_refused(monkeypatch, capsys, bad):
    monkeypatch.delenv("POD_IP", raising=False)
    with pytest.raises(SystemExit) as exit_:
        parser("decode").parse_args(["--nixl-host", bad])
    assert exit_.value.code == 2 and "not an IP address" in capsys.readouterr().err


def keys_of(argv: list[str]) -> tuple[bytes, ...]:
    return handoff_keys(parser("decode").parse_args(argv))


def test_the_handoff_keys_come_from_a_file_or_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(KEY_ENV, raising=False)
    monkeypatch.delenv(KEY_FILE_ENV, raising=False)
    assert keys_of([]) == ()  # no key: handoffs unsigned (in-process use)
    monkeypatch.setenv(KEY_ENV, "k" * 32)
    assert keys_of([]) == (b"k" * 32,)
    secret = tmp_path / "key"
    secret.write_bytes(b"s" * 40 + b"\n")  # as `kubectl create secret --from-file` mounts it
    assert keys_of(["--handoff-key-file", str(secret)]) == (b"s" * 40,)  # the file wins
    monkeypatch.setenv(KEY_FILE_ENV, str(secret))
    assert keys_of([]) == (b"s" * 40,)
    secret.write_bytes(b"n" * 32 + b"\n" + b"s" * 40 + b"\n\n")  # a rotation: new first
    assert keys_of([]) == (b"n" * 32, b"s" * 40)


@pytest.mark.parametrize("content, message", [
    (b"short\n", "at least 16"),
    (b"k" * 32 + b"\nshort\n", "at least 16"),  # every key, not only the first
    (b"\n\n", "at least 16"),  # a file with no key is a mistake, not "no signing"
    (None, "No such file"),
])
def test_a_bad_handoff_key_stops_the_component(monkeypatch, tmp_path, content, message):
    monkeypatch.delenv(KEY_ENV, raising=False)
    if content is not None:
        (tmp_path / "key").write_bytes(content)
    with pytest.raises(SystemExit, match=message):
        keys_of(["--handoff-key-file", str(tmp_path / "key")])


def test_engine_arguments_pass_through_typed():
    args = parser("prefill").parse_args([
        "--model", "m", "--engine-arg", "gpu_memory_utilization=0.3",
        "--engine-arg", "max_num_batched_tokens=4096", "--engine-arg", "tokenizer_mode=slow",
        "--engine-arg", 'limit_mm_per_prompt={"image": 2}'])
    assert engine_spec(args, "prefill").extra == {
        "gpu_memory_utilization": 0.3, "max_num_batched_tokens": 4096,
        "tokenizer_mode": "slow", "limit_mm_per_prompt": {"image": 2}}


@pytest.mark.parametrize("bad", ["no-equals", "=1", "two words=1"])
def test_an_engine_argument_that_is_not_name_value_is_refused(capsys, bad):
    with pytest.raises(SystemExit):
        parser("decode").parse_args(["--engine-arg", bad])
    assert "expected NAME=VALUE" in capsys.readouterr().err


def test_a_built_in_tiny_model_is_named_and_a_folder_of_that_name_wins(monkeypatch, tmp_path):
    import mmhandoff.models.tiny as tiny
    from mmhandoff.process.engine_worker import model_folder

    built = []
    monkeypatch.setattr(tiny, "ensure_tiny_model",
                        lambda path=None, arch="llava": built.append(arch) or f"/cache/{arch}")
    assert model_folder(None) == "/cache/llava"
    assert model_folder("tiny-qwen2-vl") == "/cache/qwen2_vl"
    assert model_folder("/models/Qwen2-VL-2B") == "/models/Qwen2-VL-2B"
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-qwen2-vl").mkdir()
    assert model_folder("tiny-qwen2-vl") == "tiny-qwen2-vl"
    assert built == ["llava", "qwen2_vl"]


def test_a_dummy_shape_is_a_model_name_with_random_bf16_weights(monkeypatch):
    import mmhandoff.models.dummy as dummy

    monkeypatch.setattr(dummy, "ensure_dummy_model", lambda shape: f"/cache/dummy-{shape}")
    args = parser("prefill").parse_args(["--model", "dummy:llava-1.5-7b"])
    spec = engine_spec(args, "prefill")
    assert spec.model == "/cache/dummy-llava-1.5-7b"
    assert spec.extra == {"load_format": "dummy", "dtype": "bfloat16"}
    args = parser("prefill").parse_args(["--model", "dummy:llava-1.5-7b",
                                         "--engine-arg", "dtype=float16"])
    assert engine_spec(args, "prefill").extra["dtype"] == "float16"  # the user's word wins
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="unknown model shape 'nope'"):
        engine_spec(parser("decode").parse_args(["--model", "dummy:nope"]), "decode")


def test_the_kv_layout_of_a_graphs_engines_is_one_environment_setting(monkeypatch):
    from mmhandoff.process.engine_worker import KV_PER_LAYER_ENV

    args = parser("decode").parse_args([])
    monkeypatch.setattr("mmhandoff.process.engine_worker.model_folder", lambda model: "/m")
    monkeypatch.delenv(KV_PER_LAYER_ENV, raising=False)
    assert engine_spec(args, "decode").kv_blocks_across_layers  # one descriptor per block
    monkeypatch.setenv(KV_PER_LAYER_ENV, "1")
    assert not engine_spec(args, "prefill").kv_blocks_across_layers


def test_media_workers_are_a_count_or_auto_on_the_image_processing_roles(monkeypatch, capsys):
    from mmhandoff.media import pool
    from mmhandoff.process.engine_worker import media_workers

    for role in ("agg", "prefill"):
        assert media_workers(parser(role).parse_args(["--media-workers", "0"])) == 0
        assert media_workers(parser(role).parse_args(["--media-workers", "3"])) == 3
        monkeypatch.setattr(pool, "host_cores", lambda: 16)
        assert media_workers(parser(role).parse_args([])) == 8  # auto, the default
        monkeypatch.setattr(pool, "host_cores", lambda: 2)
        assert media_workers(parser(role).parse_args([])) == 0
        for bad in ("-1", "many", "1.5"):
            with pytest.raises(SystemExit):
                parser(role).parse_args(["--media-workers", bad])
            assert "expected an integer of at least 0, or auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # decode prepares no media
        parser("decode").parse_args(["--media-workers", "2"])
    assert media_workers(parser("decode").parse_args([])) == 0


def test_the_image_decode_is_exact_unless_draft_is_asked_for(capsys):
    for role in ("agg", "prefill"):
        assert parser(role).parse_args([]).image_decode == "exact"
        assert parser(role).parse_args(["--image-decode", "draft"]).image_decode == "draft"
        with pytest.raises(SystemExit):
            parser(role).parse_args(["--image-decode", "fast"])
        assert "invalid choice: 'fast'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser("decode").parse_args(["--image-decode", "draft"])


def test_media_workers_auto_starts_none_on_a_small_host_and_half_the_cores_on_a_large_one():
    from mmhandoff.media.pool import MediaPool, auto_workers

    assert auto_workers(2) == auto_workers(4) == 0
    assert auto_workers(8) == 4 and auto_workers(16) == 8 and auto_workers(128) == 8
    with pytest.raises(ValueError):
        MediaPool(0)
