"""The benchmark arm in which decode receives the media and re-processes them, as P/D stacks do
today (`--full-media`; decode's side is mmhandoff.decode.full_media). Not part of the product's
path: prefill runs as always and answers with the prompt text and the images' and videos'
bytes instead of a handoff; decode samples the first token from them."""

from __future__ import annotations

from mmhandoff.engine import Rendered, Step
from mmhandoff.media.images import ImageLimits, data_uri_bytes
from mmhandoff.prefill.worker import PrefillError, PrefillWorker
from mmhandoff.wire.messages import (
    FirstToken,
    FullMediaRequest,
    PrefillAnswer,
    PrefillRequest,
    PrefillStats,
    PromptLogprobs,
    VideoPart,
)


class FullMediaPrefillWorker(PrefillWorker):
    first_token_here = False  # decode samples it, from the media

    def _for_decode(self, request: PrefillRequest, rendered: Rendered, final: Step,
                    first: FirstToken | None, stats: PrefillStats,
                    prompt_lps: PromptLogprobs | None, hashes: list) -> PrefillAnswer:
        """Decode gets the media, not a handoff: nothing to build or sign."""
        video_bytes = ImageLimits(max_bytes=self.prompts.video_limits.max_bytes)
        return PrefillAnswer(stats=stats, prompt_logprobs=prompt_lps, full_media=FullMediaRequest(
            request_id=request.request_id, prompt=self.prompts.text(request),
            images=[data_uri_bytes(u, self.prompts.limits) for u in request.image_urls()],
            videos=[data_uri_bytes(p.video_url.url, video_bytes) for p in request.media()
                    if isinstance(p, VideoPart)],
            kv_transfer_params=final.kv_transfer_params, sampling=request.sampling))

    async def _bypass(self, request: PrefillRequest, rendered: Rendered) -> None:
        return None  # its decode has no handoff to take without prefill

    async def _render(self, request: PrefillRequest, media) -> Rendered:
        if request.continuation:  # its decode renders the prompt text again: it would be lost
            raise PrefillError("the full-media arm does not continue an answer")
        return await super()._render(request, media)
