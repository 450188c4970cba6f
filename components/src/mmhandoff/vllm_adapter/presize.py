"""The engine's presizer (media.presize) from the image processor vLLM's renderer itself calls,
checked on this engine before it is used."""

from __future__ import annotations

import copy
import logging

import numpy as np
from PIL import Image

from mmhandoff.media.presize import Presizer
from mmhandoff.vllm_adapter.families import family

log = logging.getLogger(__name__)

CHECK_SIZE = (2000, 1500)  # the check's picture: presized by every supported family's defaults


def engine_presizer(llm) -> Presizer | None:
    """None unless the model's family is one whose presizing the tests pin as exact, its
    processor is called without per-call arguments (`mm_processor_kwargs` could resize
    otherwise), and a check picture's model input here is the same presized or not."""
    mc = llm.model_config
    mm = mc.multimodal_config
    fam = family(getattr(mc.hf_config, "model_type", None))
    if fam is None or not fam.presize or mm is None or mm.get_limit_per_prompt("image") == 0 \
            or mm.mm_processor_kwargs:
        return None
    processor = getattr(llm.renderer.get_mm_processor().info.get_hf_processor(),
                        "image_processor", None)
    if processor is None or not Presizer.supports(processor):
        return None
    # a copy: vLLM's renderer threads call its own processor
    presizer = Presizer(copy.deepcopy(processor))
    if not same_input(presizer, processor):
        log.warning(f"[mmhandoff] {type(processor).__name__} gives another input for a presized "
                    "image: images go to vLLM at their own size")
        return None
    return presizer


def same_input(presizer: Presizer, processor) -> bool:
    """The processor's output for a noise picture and for its presized form are equal."""
    pixels = np.random.default_rng(0).integers(0, 256, (*CHECK_SIZE[::-1], 3), dtype=np.uint8)
    image = Image.fromarray(pixels)
    small = copy.deepcopy(processor)(images=presizer(image), return_tensors="pt")
    full = copy.deepcopy(processor)(images=image, return_tensors="pt")
    return full.keys() == small.keys() and all(
        full[k].shape == small[k].shape and bool((full[k] == small[k]).all()) for k in full)
