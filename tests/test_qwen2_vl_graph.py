"""The tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL served by `mmhandoff serve`
(configs/disagg_qwen2_vl.yaml): each image's and video's grid crosses the graph in the handoff
(through Dynamo), and the disagg graph answers exactly as the agg graph does with the same
model, streamed or not."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import yaml

from tests.conftest import data_uri, encode, make_image, make_video
from tests.graph_runner import Graph

pytestmark = pytest.mark.graph

FP32 = ["--engine-arg", "dtype=float32"]  # greedy parity without bf16 rounding between engines


def _config(source: str, tmp: Path, model: str) -> str:
    """`source` serving the tiny `model` in fp32."""
    spec = yaml.safe_load(Path(source).read_text())
    spec["model"] = model
    for name, component in spec["components"].items():
        args = component.setdefault("args", [])
        if name == "frontend":
            args[args.index("--model-name") + 1] = model
        else:
            args += FP32
    out = tmp / f"{model}-{Path(source).name}"
    out.write_text(yaml.safe_dump(spec))
    return str(out)


IMAGE_QUESTIONS = {
    "640x480": [(640, 480, "PNG", 41)],
    "portrait jpeg": [(240, 720, "JPEG", 42)],
    "two images": [(320, 240, "PNG", 43), (300, 100, "JPEG", 44)],
}
VIDEO_QUESTIONS = {  # (width, height, frames, fps, seed): an 8 s clip; an image then a 2 s clip
    "a video": [("video", (64, 48, 8, 1.0, 45))],
    "an image then a video": [("image", (320, 240, "PNG", 46)), ("video", (96, 64, 12, 6.0, 47))],
}
QUESTIONS = {**{k: [("image", spec) for spec in v] for k, v in IMAGE_QUESTIONS.items()},
             **VIDEO_QUESTIONS}


def _part(kind: str, spec: tuple) -> dict:
    if kind == "video":
        return {"type": "video_url", "video_url": {"url": data_uri(make_video(*spec),
                                                                   "video/mp4")}}
    w, h, fmt, seed = spec
    return {"type": "image_url", "image_url": {"url": data_uri(
        encode(make_image(w, h, seed), fmt), "image/jpeg" if fmt == "JPEG" else "image/png")}}


def _answers(url: str, model: str) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = {}
    for name, items in QUESTIONS.items():
        ask = dict(model=model, max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
                   messages=[{"role": "user", "content": [
                       *(_part(*item) for item in items),
                       {"type": "text", "text": "What do you see?"}]}])
        r = client.chat.completions.create(**ask)
        out[name] = (r.choices[0].message.content, r.usage.prompt_tokens,
                     r.usage.completion_tokens, r.model_extra["mmhandoff"]["request_bytes"])
        if name in VIDEO_QUESTIONS:  # streamed too: the same text
            chunks = client.chat.completions.create(**ask, stream=True)
            out[f"{name}, streamed"] = "".join(c.choices[0].delta.content or "" for c in chunks
                                               if c.choices)
    return out


@pytest.mark.parametrize("model", ["tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl"])
def test_the_disagg_graph_serves_qwen_vl_as_the_agg_graph(tmp_path, model):
    answers = {}
    for graph_name, source in (("agg", "configs/agg.yaml"),
                               ("disagg", "configs/disagg_qwen2_vl.yaml")):
        tmp = tmp_path / graph_name
        tmp.mkdir()
        graph = Graph(f"graphs.{graph_name}:Frontend", _config(source, tmp, model), tmp)
        with graph.failing_loudly():
            answers[graph_name] = _answers(graph.url, model)
            graph.stop()
    for name in QUESTIONS:
        agg, disagg = answers["agg"][name], answers["disagg"][name]
        assert disagg[:3] == agg[:3], name  # text, prompt tokens, completion tokens
        assert disagg[2] == 12 and agg[3] == 0 < disagg[3] < 4096, (name, disagg)
    for name in VIDEO_QUESTIONS:
        for graph_name in ("agg", "disagg"):
            assert answers[graph_name][f"{name}, streamed"] == answers[graph_name][name][0]
    # the grid sizes the prompt: the portrait image and the two images differ in length
    assert len({answers["disagg"][name][1] for name in IMAGE_QUESTIONS}) == len(IMAGE_QUESTIONS)
