"""Engine inputs and outputs on both sides of the handoff.

Prefill: render a prompt with images and videos through the engine's own renderer (so token ids,
placeholder ranges and identifiers are exactly what the engine uses), with each item's identifier
set to its content hash.

Decode: a metadata-only request. vLLM's input processor builds and validates the token-only
request (sampling defaults, eos, vocabulary range); the image features are then attached with no
data (for an M-RoPE model: with the item's grid alone, from which vLLM computes positions).
This path skips the processor's encoder-capacity check on purpose: the decode engine has no
encoder, and a KV-only item never reaches one (the fail-closed scheduler guarantees it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams
from vllm.inputs import tokens_input
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

from mmhandoff.vllm_adapter.core.scheduler import KV_COVERAGE_STOP_REASON, KV_STATS_KEY
from mmhandoff.vllm_adapter.positions import grid_feature_data
from mmhandoff.wire.handoff import Features, Handoff, Sampling, Span


# In a decode request's kv_transfer_params: how many prompt tokens prefill computed, which is all
# the connector may pull (connector.MMHandoffNixlConnector); absent: the whole prompt.
PULLED_TOKENS_KEY = "mmhandoff_pulled_tokens"


@dataclass
class RenderedPrompt:
    engine_input: Any  # vLLM's EngineInput, passed to `generate` as is
    token_ids: list[int]
    features: Features


async def render_prompt(engine, prompt: str,
                        media: dict[str, tuple[list, list[str]]]) -> RenderedPrompt:
    """`media`: per modality, each item's data (None: sent by hash alone) and identifier."""
    item: dict[str, Any] = {"prompt": prompt}
    media = {m: v for m, v in media.items() if v[0]}
    if media:
        item["multi_modal_data"] = {m: list(data) for m, (data, _) in media.items()}
        item["multi_modal_uuids"] = {m: list(ids) for m, (_, ids) in media.items()}
    (engine_input,) = await engine.renderer.render_cmpl_async([item])
    token_ids = list(engine_input["prompt_token_ids"])
    hashes = {m: list(v) for m, v in (engine_input.get("mm_hashes") or {}).items()}
    spans = {
        m: [Span(offset=r.offset, length=r.length,
                 is_embed=None if r.is_embed is None else [bool(x) for x in r.is_embed.tolist()])
            for r in ranges]
        for m, ranges in (engine_input.get("mm_placeholders") or {}).items()
    }
    return RenderedPrompt(engine_input, token_ids, Features(mm_hashes=hashes, mm_placeholders=spans))


def not_yet_sent(engine, identifiers: list[str]) -> tuple[str, ...]:
    """The images vLLM's frontend-side processor cache does not yet record as sent to the engine
    core. That cache mirrors the core's cache of processed images: an image it records is sent
    as its hash alone, and rendering records it."""
    cache = engine.renderer.mm_processor_cache
    if cache is None:
        return ()
    return tuple(h for h in dict.fromkeys(identifiers) if not cache.is_cached_item(h))


def processed(engine, identifiers: list[str]) -> set[str]:
    """The images whose pixels a render may leave out: those vLLM's processor cache records as
    sent (it then sends the hash alone, and needs no data for them); none without that cache."""
    cache = engine.renderer.mm_processor_cache
    if cache is None:
        return set()
    return {h for h in identifiers if cache.is_cached_item(h)}


def forget_sent(engine, identifiers: tuple[str, ...]) -> None:
    """Undo the record rendering left for images of a prompt that is never submitted: else the
    next request with one of them would send its hash alone, and the core, which never got it,
    would fail that request (vLLM 0.31 answers it with a retryable error; 0.26 asserts)."""
    cache = engine.renderer.mm_processor_cache
    if cache is None or not identifiers:
        return
    forget = getattr(cache, "invalidate", None)  # vLLM 0.31
    if forget is None:  # vLLM 0.26: the mirror's own LRU store
        store = getattr(cache, "_cache", None)
        if store is None:  # a cache that always sends the data (shared memory): nothing to undo
            return
        forget = lambda h: store.pop(h, None)  # noqa: E731
    for h in identifiers:
        forget(h)


def sampling_params(s: Sampling, *, max_tokens: int | None = None,
                    kv_transfer_params: dict[str, Any] | None = None,
                    done: int = 0) -> SamplingParams:
    """vLLM's parameters for the part of the answer this engine samples: `max_tokens` of it,
    after the `done` tokens another engine sampled (decode after prefill's first token).
    `min_tokens` counts the whole answer, so this part's share is what is left of it."""
    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params is not None else None
    max_tokens = s.max_tokens if max_tokens is None else max_tokens
    return SamplingParams(
        max_tokens=max_tokens, min_tokens=min(max(s.min_tokens - done, 0), max_tokens),
        temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, seed=s.seed,
        stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos, logprobs=s.logprobs,
        prompt_logprobs=s.prompt_logprobs, repetition_penalty=s.repetition_penalty,
        presence_penalty=s.presence_penalty, frequency_penalty=s.frequency_penalty,
        stop=list(s.stop), include_stop_str_in_output=s.include_stop_str_in_output,
        structured_outputs=None if s.structured is None else StructuredOutputsParams(
            json=s.structured.json, json_object=s.structured.json_object or None,
            regex=s.structured.regex, choice=s.structured.choice),
        logit_bias=None if s.logit_bias is None else {int(t): b for t, b in s.logit_bias.items()},
        extra_args=extra,
    )


def kv_only_request(engine, h: Handoff, request_id: str, supported_tasks: tuple):
    """The decode engine's request for `h`: token ids plus data-less image and video features.
    `supported_tasks` is `await engine.get_supported_tasks()` (asked once: it is an engine RPC).

    With prefill's first token (v2), the prompt is the handoff's followed by that token, and the
    request asks for the rest of the answer; the connector pulls the KV of the handoff's tokens
    only (PULLED_TOKENS_KEY) and the engine computes the first token's position itself."""
    kv_params = dict(h.kv_transfer_params)
    ids, max_tokens = list(h.token_ids), None
    if h.first_token is not None:
        kv_params[PULLED_TOKENS_KEY] = len(ids)
        ids.append(h.first_token)
        max_tokens = h.sampling.max_tokens - 1
    params = sampling_params(h.sampling, max_tokens=max_tokens, kv_transfer_params=kv_params,
                             done=0 if h.first_token is None else 1)
    prompt = tokens_input(ids)
    if h.cache_salt is not None:
        prompt["cache_salt"] = h.cache_salt
    request = engine.input_processor.process_inputs(
        request_id, prompt, params, supported_tasks=supported_tasks)
    request.mm_features = [
        MultiModalFeatureSpec(
            data=None if grid is None else grid_feature_data(modality, grid), modality=modality,
            identifier=digest, mm_hash=digest,
            mm_position=PlaceholderRange(offset=span.offset, length=span.length,
                                         is_embed=_mask(span.is_embed)),
        )
        for modality, digest, span, grid in h.items_with_grids()
    ]
    return request


def _mask(is_embed: list[bool] | None):
    if is_embed is None:
        return None
    import torch

    return torch.tensor(is_embed, dtype=torch.bool)


def model_fingerprint(engine) -> str:
    """Identity of what an engine computes: architecture config, tokenizer vocabulary, dtype.
    Prefill and decode must agree on it, or the pulled KV means nothing to decode."""
    mc = engine.model_config
    config = {k: v for k, v in mc.hf_config.to_dict().items() if k != "_name_or_path"}
    tokenizer = engine.renderer.get_tokenizer() if hasattr(engine.renderer, "get_tokenizer") else None
    vocab = sorted(tokenizer.get_vocab().items()) if tokenizer is not None else []
    blob = json.dumps(
        {"config": config, "dtype": str(mc.dtype), "vocab": vocab},
        sort_keys=True, default=str,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def kv_coverage_cause(output) -> str | None:
    """The fail-closed scheduler's cause if `output` (a RequestOutput) ended on it."""
    completion = output.outputs[0] if output.outputs else None
    if completion is None or completion.finish_reason != "error":
        return None
    reason = completion.stop_reason
    if isinstance(reason, str) and reason.startswith(KV_COVERAGE_STOP_REASON):
        return reason[len(KV_COVERAGE_STOP_REASON):].strip()
    return "kv_load_failed: the KV transfer failed or its blocks were unavailable"


def kv_stats(output) -> dict[str, int]:
    """Where a finished KV-only request's prompt came from (see the scheduler's KV_STATS_KEY)."""
    return dict((output.kv_transfer_params or {}).get(KV_STATS_KEY) or {})
