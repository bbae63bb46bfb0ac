"""The balancers as processes: `ferry serve <name>` and `python -m ferry_services.<name>` answer on
the bus, register with NATS micro, and exit 0 on SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import pytest

from ferry.protocol import (
    BlockRef,
    GenerateRequest,
    Handoff,
    HandoffReply,
    SamplingParams,
    SubmitReply,
    SubmitRequest,
    decode,
    encode,
    subjects,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REQUEST = GenerateRequest(
    request_id="r1", gateway_id="gw", model="m", prompt_token_ids=[1, 2, 3], sampling=SamplingParams()
)
CASES = {
    "prefill-balancer": (
        ["-m", "ferry.cli", "serve", "prefill-balancer"],
        subjects.SUBMIT,
        SubmitRequest(REQUEST),
        SubmitReply,
    ),
    "decode-balancer": (
        ["-m", "ferry_services.decode_balancer"],
        subjects.HANDOFF,
        Handoff(REQUEST, "p", "ns", [BlockRef(bytes(16), 3)], 3),
        HandoffReply,
    ),
}


async def ask_until_answered(nc, subject: str, data: bytes, timeout_s: float = 30.0):
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            return await nc.request(subject, data, timeout=1)
        except Exception:  # no responders yet: the process is still starting
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.2)


@pytest.mark.parametrize("name", sorted(CASES))
async def test_balancer_process_answers_registers_and_stops_on_sigterm(nc, nats_url, name):
    argv, subject, message, reply_type = CASES[name]
    env = {**os.environ, "FERRY_NATS_URL": nats_url}
    process = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        reply = decode((await ask_until_answered(nc, subject, encode(message))).data, reply_type)
        ping = json.loads((await nc.request(f"$SRV.PING.{name}", b"", timeout=2)).data)
    finally:
        process.send_signal(signal.SIGTERM)
        exit_code = await asyncio.to_thread(process.wait, 30)
    assert (reply.accepted, reply.reason) == (False, "no_workers")
    assert ping["name"] == name
    assert exit_code == 0, process.stdout.read().decode()[-2000:]
