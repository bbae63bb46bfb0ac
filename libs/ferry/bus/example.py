"""A tiny ferry service: the entry-point pattern in full, and the process the runner tests signal.

    FERRY_NATS_URL=nats://127.0.0.1:4222 python -m ferry.bus.example [subject]

Reads `subject` (default `ferry.example.lookup`): request KvLookup, reply KvLookupReply with
`num_cached_blocks = len(block_hashes)`. A namespace starting with 'sleep:' makes the handler
sleep that many seconds first (to show that SIGTERM lets an in-flight request finish); 'raise'
makes it raise (answered with an ErrorReply). Writes nothing else.
"""

from __future__ import annotations

import asyncio
import sys

from ferry.bus import Service, connect, run_service
from ferry.logs import setup_logging
from ferry.protocol import KvLookup, KvLookupReply
from ferry.settings import ServiceSettings, load_settings

DEFAULT_SUBJECT = "ferry.example.lookup"


async def lookup(req: KvLookup) -> KvLookupReply:
    if req.kv_namespace.startswith("sleep:"):
        await asyncio.sleep(float(req.kv_namespace.removeprefix("sleep:")))
    if req.kv_namespace == "raise":
        raise RuntimeError("asked to fail")
    return KvLookupReply(num_cached_blocks=len(req.block_hashes))


async def serve(settings: ServiceSettings, subject: str) -> int:
    nc = await connect(settings.nats_url, name="ferry-example")
    svc = Service("ferry-example", version="0.1.0", description="example lookup service")
    svc.endpoint(subject, KvLookup, lookup, name="lookup")
    return await run_service(nc, svc)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    settings = load_settings(ServiceSettings)
    setup_logging(settings.log_level, json=settings.log_json)
    return asyncio.run(serve(settings, argv[0] if argv else DEFAULT_SUBJECT))


if __name__ == "__main__":
    sys.exit(main())
