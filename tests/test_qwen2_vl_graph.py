"""The tiny Qwen2-VL, Qwen2.5-VL and Qwen3-VL served by `mmhandoff serve`
(configs/disagg_qwen2_vl.yaml): each image's grid crosses the graph in the handoff (through Dynamo), and the disagg graph
answers exactly as the agg graph does with the same model."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import yaml

from tests.conftest import data_uri, encode, make_image
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


QUESTIONS = {
    "640x480": [(640, 480, "PNG", 41)],
    "portrait jpeg": [(240, 720, "JPEG", 42)],
    "two images": [(320, 240, "PNG", 43), (300, 100, "JPEG", 44)],
}


def _answers(url: str, model: str) -> dict:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    out = {}
    for name, images in QUESTIONS.items():
        parts = [{"type": "image_url", "image_url": {"url": data_uri(
            encode(make_image(w, h, seed), fmt), "image/jpeg" if fmt == "JPEG" else "image/png")}}
            for w, h, fmt, seed in images]
        r = client.chat.completions.create(
            model=model, max_tokens=12, temperature=0, extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [*parts, {"type": "text",
                                                            "text": "What do you see?"}]}])
        out[name] = (r.choices[0].message.content, r.usage.prompt_tokens,
                     r.usage.completion_tokens, r.model_extra["mmhandoff"]["request_bytes"])
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
    # the grid sizes the prompt: the portrait image and the two images differ in length
    assert len({a[1] for a in answers["disagg"].values()}) == len(QUESTIONS)
