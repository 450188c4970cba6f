"""`python -m mmhandoff.prefill`: the encode/prefill worker (or, with `--full-media`, the
benchmark arm's prefill: mmhandoff.prefill.full_media)."""

from mmhandoff.plane.endpoints import CLAIM
from mmhandoff.prefill.claims import ClaimBook
from mmhandoff.prefill.full_media import FullMediaPrefillWorker
from mmhandoff.prefill.worker import ENDPOINT, ERRORS, PrefillWorker, handoff_ttl
from mmhandoff.wire.handoff import Claim


def main(argv: list[str] | None = None) -> int:
    """The worker process: its engine, its endpoint, until stopped."""
    from mmhandoff.process.engine_worker import run

    async def make_worker(engine, context):
        args = context.args
        key = args.handoff_keys[0] if args.handoff_keys else None  # the first key signs
        router = None
        if args.router != "none" and args.bypass_max_tokens > 0:
            from mmhandoff.plane.endpoints import HELD, beside
            from mmhandoff.prefill.bypass import RouterLookup

            router = RouterLookup(await (
                context.rt.endpoint(f"{args.namespace}.{beside(args.router, HELD)}").client()))
        arm = FullMediaPrefillWorker if args.full_media else PrefillWorker
        claims = ClaimBook(lambda: Claim(endpoint=f"{context.component}.{CLAIM}",
                                         instance=context.instance_id()))
        return arm(engine, key=key, router=router, ttl_s=handoff_ttl(args.kv_lease_s),
                   bypass_max_tokens=args.bypass_max_tokens,
                   publish_prefixes=context.publish_prefixes, claims=claims,
                   release_unclaimed_s=args.release_unclaimed_s,
                   pool=context.media_pool, image_decode=args.image_decode)

    return run("prefill", "prefill", ENDPOINT, make_worker, ERRORS, argv,
               side_endpoints=(CLAIM,))


# Guarded: vLLM's engine processes are spawned, and a spawned child imports this module again.
if __name__ == "__main__":
    raise SystemExit(main())
