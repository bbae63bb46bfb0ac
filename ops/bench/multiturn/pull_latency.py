"""How long after a publish does a worker's waiting JetStream pull (`fetch(batch=N, timeout=1 s)`, as the
pull loop issues it) return the message? On a fresh nats-server; 12 messages published at staggered
times into one long poll each, for batch 1 and 32. A check that no fetch window or batch wait sits on a
request's path (the multi-turn README cites it).

    /work/tools/cpu-run python ops/bench/multiturn/pull_latency.py
"""

import asyncio
import time

from ferry.bus import connect
from ferry.bus.workqueue import ensure_work_consumer, ensure_work_stream
from ferry.launcher import servers
from ferry.protocol import subjects


async def main(url: str) -> None:
    nc = await connect(url, "pull-latency")
    js = nc.jetstream()
    await ensure_work_stream(js)
    consumer = await ensure_work_consumer(js, "prefill", "w1")
    subject = subjects.work("prefill", "w1")
    for batch in (1, 32):
        latencies = []
        for i in range(12):

            async def publish(delay_s: float) -> float:
                await asyncio.sleep(delay_s)
                sent = time.perf_counter()
                await js.publish(subject, b"x")
                return sent

            task = asyncio.create_task(publish(0.05 + 0.037 * i))
            msgs = await consumer._psub.fetch(batch=batch, timeout=1.0)
            got = time.perf_counter()
            for msg in msgs:
                await msg.ack()
            latencies.append((got - await task) * 1000)
        print(f"batch {batch}: publish -> fetch returned, ms: {' '.join(f'{x:.1f}' for x in latencies)}")
    await nc.close()


if __name__ == "__main__":
    with servers.start_nats() as nats:
        asyncio.run(main(nats.url))
