"""An image brought ahead of time to the size the model's image processor resizes it to, so that
the processor's own work on it is a few milliseconds instead of a 12 MP resize (issue 37).

The processor (transformers' torchvision backend, the one vLLM calls) converts an image to a
uint8 tensor, resizes it once, then crops, normalises and patches the result. The presizer runs
that same processor on the image and keeps the output of its first resize, then stops it; the
kept image, given to the processor again, resizes to its own size (an identity: the bicubic or
bilinear kernel at scale 1 weighs each pixel alone, in uint8 with no rounding left) and goes on
exactly as the original would have. So the model's input is unchanged, bit for bit: the tests
compare it with vLLM's own processing of the original image for every supported family
(tests/test_presize.py, tests/test_media_pool_engine.py), and the worker checks it once more at
start on its own engine (engine.presizer) before it uses one.

Only processors known to keep that shape (`PRESIZED`) are presized, and only without per-call
processor arguments (a model's `mm_processor_kwargs` could resize differently at call time).
The kept image is used when it has at most half the original's pixels (LLaVA's CLIP: 12 MP ->
336 x 448); otherwise (Qwen-VL's bounds keep most photos near their size) the original goes on.
"""

from __future__ import annotations

from PIL import Image

# transformers' image processors whose first resize is the one the tests pin as exact
PRESIZED = frozenset({"CLIPImageProcessor", "Qwen2VLImageProcessor"})
SMALLER = 0.5  # the kept image's pixels at most this share of the original's, else not used
# processors that resize every image to a fixed short side, whatever its size: a JPEG decoded
# smaller (`--image-decode draft`) gives the same shape of input, its pixels a little off
DRAFTED = frozenset({"CLIPImageProcessor"})
DRAFT_MARGIN = 2  # the draft's short side at least this many times the processor's


class _Stop(Exception):
    def __init__(self, resized=None) -> None:
        self.resized = resized


class Presizer:
    """Picklable (sent once to each media process): the model's image processor itself."""

    def __init__(self, image_processor) -> None:
        self.image_processor = image_processor

    @staticmethod
    def supports(image_processor) -> bool:
        return type(image_processor).__name__ in PRESIZED and callable(
            getattr(image_processor, "resize", None))

    def draft_size(self) -> tuple[int, int] | None:
        """The least size a JPEG may be decoded at for the inexact decode (images.decode_rgb's
        `draft`), or None where this processor's input would change shape: only a fixed short
        side (CLIP's 336 px), and the draft keeps twice that. The model's input is then off by
        up to ~0.09, ~0.01 on average (normalised units, where one step of 255 is ~0.015;
        tests/test_presize.py measures it)."""
        proc = self.image_processor
        size = getattr(proc, "size", None)
        if type(proc).__name__ not in DRAFTED or not getattr(proc, "do_resize", False) \
                or size is None:
            return None
        fields = dict(size) if isinstance(size, dict) else dict(getattr(size, "__dict__", {}))
        side = fields.pop("shortest_edge", None)
        if not isinstance(side, int) or side < 1 or any(v is not None for v in fields.values()):
            return None  # another kind of size (pixel bounds, a fixed box): not drafted
        return DRAFT_MARGIN * side, DRAFT_MARGIN * side

    def __call__(self, image: Image.Image) -> Image.Image:
        """`image` (RGB, upright) at the processor's resize size, or itself when that would not
        make it much smaller."""
        proc = self.image_processor
        resize = proc.resize
        pixels = image.width * image.height

        def first_resize(*args, **kwargs):
            size = kwargs.get("size", args[1] if len(args) > 1 else None)
            h, w = getattr(size, "height", None), getattr(size, "width", None)
            if h and w and h * w > SMALLER * pixels:  # known ahead: no smaller, no resize
                raise _Stop()
            raise _Stop(resize(*args, **kwargs))

        proc.resize = first_resize  # this process's own copy, one image at a time
        try:
            proc(images=image, return_tensors="pt")
            return image  # it never resized
        except _Stop as stop:
            resized = stop.resized
        finally:
            del proc.resize
        if resized is None or str(resized.dtype) != "torch.uint8":
            return image
        chw = resized.reshape(resized.shape[-3:])
        if chw.shape[0] != 3 or chw.shape[1] * chw.shape[2] > SMALLER * pixels:
            return image
        return Image.fromarray(chw.permute(1, 2, 0).contiguous().numpy())
