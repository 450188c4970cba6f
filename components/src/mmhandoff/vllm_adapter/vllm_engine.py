"""mmhandoff.engine.Engine on a vLLM AsyncLLM: the one object the workers hold."""

from __future__ import annotations

import shutil
from typing import Any, AsyncIterator, Sequence

import msgspec

from mmhandoff.engine import Capabilities, EngineInputError, PixelsNeeded, Rendered, Step
from mmhandoff.media.images import LoadedImage
from mmhandoff.media.videos import LoadedVideo
from mmhandoff.vllm_adapter.inputs import (
    forget_sent,
    kv_coverage_cause,
    kv_only_request,
    kv_stats,
    model_fingerprint,
    not_yet_sent,
    processed,
    render_prompt,
    sampling_params,
)
from mmhandoff.vllm_adapter.logprobs import prompt_logprobs, token_logprobs
from mmhandoff.vllm_adapter.positions import GridMemo, grid_rules, rendered_grids
from mmhandoff.vllm_adapter.video import load_video
from mmhandoff.wire.handoff import Handoff, KVMismatch, Sampling


# How long the engine core may take to stop (its model worker first) before vLLM kills it: more
# than vLLM's 5 s for a loaded 2-core host; a core killed in its teardown leaks its shared
# memory. (The early "force killing" at some CI graph stops was not the grace running out but
# two threads reaping the core: see reaping.)
SHUTDOWN_GRACE_S = 15.0


def _client_errors() -> tuple[type[BaseException], ...]:
    """What vLLM raises for a request it refuses as given. Its own validation error is not a
    ValueError (vLLM 0.31); older versions raise ValueError only."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def check_blocks(handoff: Handoff, block_size: int) -> None:
    """The NIXL connector's `remote_block_ids` must be exactly the blocks of the handoff's
    prompt, in every KV-cache group. vLLM trusts them: more tokens than blocks fails an
    assertion in its pull worker, which kills the engine; fewer tokens pulls the prompt's last
    blocks into its first positions (wrong KV, wrong answers)."""
    ids = handoff.kv_transfer_params.get("remote_block_ids")
    if ids is None:  # nothing to pull: the fail-closed scheduler decides
        return
    groups = ids if isinstance(ids, list) and ids and isinstance(ids[0], list) else [ids]
    expected = -(-len(handoff.token_ids) // block_size)
    if any(not isinstance(g, list) or len(g) != expected for g in groups):
        sizes = [len(g) if isinstance(g, list) else None for g in groups]
        raise KVMismatch(f"the handoff names {sizes} KV blocks for {len(handoff.token_ids)} "
                         f"tokens; blocks of {block_size} tokens need {expected}")


class VllmEngine:
    def __init__(self, llm, ipc_dir: str | None = None, block_hash_seed: int = 0) -> None:
        self.llm = llm  # vLLM's AsyncLLM: for the adapter and the engine-tier tests only
        self.ipc_dir = ipc_dir  # its sockets' files: the engine's own (start_engine)
        mc = llm.model_config
        mm = mc.multimodal_config
        self.capabilities = Capabilities(
            mrope=bool(mc.uses_mrope), encoder_decoder=bool(mc.is_encoder_decoder),
            vision=mm is not None and mm.get_limit_per_prompt("image") > 0,
            grid_rules=grid_rules(mc))
        # prefill of an M-RoPE model: each rendered item's grid, for the handoff
        self._grids = GridMemo() if self.capabilities.grid_rules and self.capabilities.vision \
            else None
        self.fingerprint = model_fingerprint(llm)
        self._tokenizer = llm.renderer.get_tokenizer()
        self._tasks: tuple | None = None  # vLLM's supported tasks: an engine RPC, asked once
        self.block_size = llm.vllm_config.cache_config.block_size
        self._block_hash_seed = block_hash_seed  # its core's PYTHONHASHSEED (engine_env)
        self._hasher = None  # BlockHasher, made on first use (block_hashes)
        self._refused = _client_errors()

    def chat_prompt(self, conversation: list[dict[str, Any]]) -> str:
        return self._tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True)

    async def render(self, prompt: str, media: Sequence[LoadedImage | LoadedVideo]) -> Rendered:
        identifiers = [i.content_hash for i in media]
        bare = {i.content_hash for i in media if i.data is None}
        if bare - processed(self.llm, list(bare)):
            raise PixelsNeeded(f"{len(bare)} item(s) no longer processed in the engine's cache")
        fresh = not_yet_sent(self.llm, identifiers)
        by_modality: dict[str, tuple[list, list[str]]] = {}
        for item in media:
            data, ids = by_modality.setdefault(item.modality, ([], []))
            data.append(item.data)
            ids.append(item.content_hash)
        try:
            r = await render_prompt(self.llm, prompt, by_modality)
            if self._grids is not None:
                grids = self._resolve_grids(by_modality, r)
                missing = {d for m, g in grids.items() for d, x in zip(by_modality[m][1], g)
                           if x is None}
                if missing:  # sent by hash alone and no longer in the memo: render anew
                    if bare & missing:
                        raise PixelsNeeded("an item's grid is no longer in the memo")
                    again = tuple(d for d in identifiers if d in missing)
                    forget_sent(self.llm, again)
                    fresh = tuple(dict.fromkeys((*fresh, *again)))  # sent with data once more
                    r = await render_prompt(self.llm, prompt, by_modality)
                    grids = self._resolve_grids(by_modality, r)
                if any(None in g for g in grids.values()):
                    raise RuntimeError("vLLM rendered an item without its grid")
                r.features.mm_grids = grids
        except Exception as e:
            if bare:  # evicted since the check above, or a vLLM that cannot: data decides
                forget_sent(self.llm, fresh)  # the retry sends these with their data again
                raise PixelsNeeded(f"a render without data failed: {e!r}") from e
            if isinstance(e, self._refused):
                raise EngineInputError(str(e)) from None
            raise
        return Rendered(r.token_ids, r.features, r.engine_input, first_sent=fresh)

    def _resolve_grids(self, by_modality, r) -> dict[str, list]:
        rendered = rendered_grids(r.engine_input)
        return {m: self._grids.resolve(ids, rendered.get(m) or [None] * len(ids))
                for m, (_, ids) in by_modality.items()}

    def presizer(self):
        from mmhandoff.vllm_adapter.presize import engine_presizer

        return engine_presizer(self.llm)

    def load_video(self, data_uri: str):
        return load_video(self.llm, data_uri)

    def block_hashes(self, rendered: Rendered, cache_salt: str | None, upto: int) -> list:
        if self._hasher is None:
            from mmhandoff.vllm_adapter.block_hashes import BlockHasher

            self._hasher = BlockHasher(
                self.block_size, seed=self._block_hash_seed,
                hash_algo=self.llm.vllm_config.cache_config.prefix_caching_hash_algo)
        items = [(digest, span.offset, span.length)
                 for _modality, digest, span in rendered.features.items() if span.offset < upto]
        return self._hasher.hashes(rendered.token_ids[:upto], items, cache_salt=cache_salt)

    def discard(self, rendered: Rendered) -> None:
        forget_sent(self.llm, rendered.first_sent)

    def request(self, rendered: Rendered, sampling: Sampling, *, max_tokens: int | None = None,
                kv_transfer_params: dict[str, Any] | None = None,
                cache_salt: str | None = None, continued: int = 0,
                prompt_logprobs: int | None = None) -> Any:
        if prompt_logprobs is not None:  # vLLM then computes the whole prompt: no cache reads
            sampling = msgspec.structs.replace(sampling, prompt_logprobs=prompt_logprobs)
        try:
            params = sampling_params(sampling, max_tokens=max_tokens,
                                     kv_transfer_params=kv_transfer_params)
        except self._refused as e:  # e.g. a negative temperature
            raise EngineInputError(str(e)) from None
        engine_input = rendered.engine_input
        if cache_salt is not None:  # vLLM's input processor reads it from the engine input
            engine_input = dict(engine_input, cache_salt=cache_salt)
        if continued:
            return engine_input, params, self._continued_text(rendered.token_ids, params,
                                                              continued)
        return engine_input, params

    def extend(self, rendered: Rendered, token_ids: list[int]) -> Rendered:
        if self.capabilities.encoder_decoder:
            raise EngineInputError("an encoder-decoder prompt cannot be continued")
        ids = [*rendered.token_ids, *token_ids]
        engine_input = dict(rendered.engine_input, prompt_token_ids=ids)
        for stale in ("prompt", "prompt_token_offsets"):  # they describe the shorter prompt
            engine_input.pop(stale, None)
        return Rendered(ids, rendered.features, engine_input, rendered.first_sent)

    async def kv_only(self, handoff: Handoff, request_id: str) -> Any:
        if self._tasks is None:
            self._tasks = tuple(await self.llm.get_supported_tasks())
        try:
            request = kv_only_request(self.llm, handoff, request_id, self._tasks)
        except self._refused as e:  # vLLM's input checks, e.g. longer than max_model_len
            raise EngineInputError(str(e)) from None
        check_blocks(handoff, self.block_size)  # before the engine sees it
        # answer tokens in the prompt: a migration's, and prefill's first token
        sent = handoff.continued + (handoff.first_token is not None)
        if sent:
            return request, request.sampling_params, self._continued_text(
                request.prompt_token_ids, request.sampling_params, sent)
        return request, request.sampling_params

    def _continued_text(self, prompt_token_ids, params, sent: int):
        from mmhandoff.vllm_adapter.continued_text import ContinuedText

        return ContinuedText(self._tokenizer, prompt_token_ids, params, sent)

    async def generate(self, request: Any, request_id: str) -> AsyncIterator[Step]:
        engine_input, params, *continued = request
        text_of = continued[0].next if continued else None  # an answer going on
        stream = self.llm.generate(engine_input, params, request_id)
        sent_ids = sent_text = 0
        started = False
        try:
            while True:
                try:
                    output = await anext(stream)
                except StopAsyncIteration:
                    return
                except self._refused as e:
                    if started:  # a refusal is raised before the first output, never after
                        raise
                    raise EngineInputError(str(e)) from None
                started = True
                completion = output.outputs[0] if output.outputs else None
                # vLLM hands out its live token list (it keeps growing while the caller is
                # suspended): take the counts now.
                ids = list(completion.token_ids) if completion else []
                text = completion.text if completion else ""
                step = Step(ids[sent_ids:], text[sent_text:],
                            prompt_tokens=len(output.prompt_token_ids or ()))
                if params.prompt_logprobs is not None and output.prompt_logprobs is not None \
                        and not sent_ids:  # the first output carries them
                    step.prompt_logprobs = prompt_logprobs(
                        output.prompt_token_ids, output.prompt_logprobs, params.prompt_logprobs,
                        lambda tid: self._tokenizer.decode([tid]))
                if params.logprobs is not None and completion is not None:
                    step.logprobs = token_logprobs(
                        completion.logprobs[sent_ids:len(ids)], step.token_ids,
                        params.logprobs, lambda tid: self._tokenizer.decode([tid]))
                sent_ids, sent_text = len(ids), len(text)
                if output.finished:
                    reason = completion.finish_reason if completion else None
                    step.finish_reason = reason or "stop"
                    step.kv_transfer_params = output.kv_transfer_params
                    step.kv_failure = kv_coverage_cause(output)
                    step.kv_stats = kv_stats(output)
                    step.cached_tokens = output.num_cached_tokens or 0
                if text_of is not None:
                    # a stop token, not a stop string (vLLM's stop_reason: an id, or None: EOS)
                    stop_token = step.finish_reason == "stop" and not isinstance(
                        completion.stop_reason if completion else None, str)
                    step.text, matched = text_of(step.token_ids, step.finish_reason, stop_token)
                    if matched is not None:
                        # a stop string, perhaps one that began in the tokens already sent,
                        # which vLLM could not see: the answer ends here (closing vLLM's stream
                        # below aborts the request if it goes on)
                        step.finish_reason = "stop"
                        yield step
                        return
                yield step
                if output.finished:
                    return
        finally:
            await stream.aclose()  # closing vLLM's stream early aborts the request there

    async def warm_up(self) -> None:
        """One short sampled answer before the worker reports ready, so that no client request
        pays a one-time cost: vLLM's CPU sampler compiles its random-sampling kernel with
        torch.compile at its first use, whatever `enforce_eager` says (a client's first
        unseeded request at temperature > 0 took 15-17 s on 2 cores, the next ones 50 ms)."""
        import uuid

        params = sampling_params(Sampling(max_tokens=2, temperature=1.0, ignore_eos=True))
        async for _ in self.llm.generate({"prompt": "Warm up."}, params,
                                         f"warm-up-{uuid.uuid4().hex[:8]}"):
            pass

    async def abort(self, request_id: str) -> None:
        await self.llm.abort(request_id)

    async def release_kv(self, held) -> int:
        """Through the model workers' connector (core.release: vLLM frees a finished request's
        blocks only on a consumer's notice or at its lease's end)."""
        from mmhandoff.vllm_adapter.core.release import RELEASE_METHOD

        ids = [p["remote_request_id"] for p in held if p.get("remote_request_id")]
        if not ids:
            return 0
        return sum(await self.llm.collective_rpc(RELEASE_METHOD, args=(ids,)))

    def dead_cause(self) -> str | None:
        from mmhandoff.vllm_adapter.engine_core import engine_dead_cause

        return engine_dead_cause(self.llm)

    def core_pids(self) -> list[int]:
        """The engine core processes (each one's model workers are its children)."""
        from mmhandoff.vllm_adapter.engine_core import engine_core_pids

        return engine_core_pids(self.llm)

    def shutdown(self) -> None:
        self.llm.shutdown(timeout=SHUTDOWN_GRACE_S)
        if self.ipc_dir is not None:  # the core is gone: nothing uses them now
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
