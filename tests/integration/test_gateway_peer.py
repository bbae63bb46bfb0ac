"""The gateway against a real nats-server, with a small test peer playing balancer + worker.

The peer is plain nats-py in its own thread: it answers `ferry.submit`, streams `OutputBatch`es to
`ferry.out.<gateway>`, publishes load reports, and records every submit and cancel. A marker in the
prompt picks its behaviour (`mode:hang`, `mode:dup`, `mode:error`, `mode:overloaded`,
`mode:noworkers`). The gateway runs as `python -m ferry_services.gateway`, as in production.
The fixtures here serve test_gateway_http.py too (imported there).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from collections.abc import Iterator

import httpx
import nats
import pytest
from reports import load_report
from waiting import wait_until_sync

from ferry.launcher.servers import free_port, start_nats
from ferry.model.make_model import make_model
from ferry.model.tokenizer import Tokenizer
from ferry.protocol import (
    Cancel,
    ErrorEvent,
    GenerateRequest,
    OutputBatch,
    SubmitReply,
    SubmitRequest,
    TokenEvent,
    TokenLogprob,
    decode,
    encode,
    subjects,
)

GATEWAY_ID = "gw-itest"
REPLY = "The ferry boat crossed the river at night, and the harbor light was green and small."
MAX_INFLIGHT = 3
TIMEOUT_S = 2.0


class Peer:
    """Balancer + worker stand-in on its own event loop thread."""

    def __init__(self, nats_url: str, tokenizer: Tokenizer) -> None:
        self.nats_url = nats_url
        self.tokenizer = tokenizer
        self.reply_ids = tokenizer.encode(REPLY, add_special_tokens=False)
        self.submits: list[GenerateRequest] = []
        self.cancels: list[Cancel] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._nc = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def cancelled_ids(self) -> set[str]:
        return {rid for c in list(self.cancels) for rid in c.request_ids}

    def cancel_reason(self, request_id: str) -> str | None:
        return next((c.reason for c in list(self.cancels) if request_id in c.request_ids), None)

    async def _close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await self._nc.close()

    async def _start(self) -> None:
        self._nc = await nats.connect(self.nats_url)
        await self._nc.subscribe(subjects.SUBMIT, queue=subjects.SUBMIT_QUEUE, cb=self._on_submit)
        await self._nc.subscribe(subjects.CANCEL, cb=self._on_cancel)
        self._spawn(self._report_load())
        await self._nc.flush()

    def _spawn(self, coro) -> None:
        task = self._loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _report_load(self) -> None:
        while True:
            for role in ("prefill", "decode"):
                report = load_report(
                    f"{role}-peer", role, model="tiny", interval_s=0.2, kv_blocks_total=64, max_running=8
                )
                await self._nc.publish(f"ferry.load.{role}.{role}-peer", encode(report))
            await asyncio.sleep(0.2)

    async def _on_cancel(self, msg) -> None:
        self.cancels.append(decode(msg.data, Cancel))

    async def _on_submit(self, msg) -> None:
        request = decode(msg.data, SubmitRequest).request
        self.submits.append(request)
        mode = self._mode(request)
        if mode in ("overloaded", "noworkers"):
            reason = "overloaded" if mode == "overloaded" else "no_workers"
            await msg.respond(encode(SubmitReply(request.request_id, False, reason=reason, retry_after_s=3)))
            return
        await msg.respond(encode(SubmitReply(request.request_id, True, worker_id="prefill-peer")))
        self._spawn(self._stream(request, mode))

    def _mode(self, request: GenerateRequest) -> str:
        prompt = self.tokenizer.decode(request.prompt_token_ids, skip_special_tokens=True)
        return next((m for m in ("hang", "dup", "error", "overloaded", "noworkers") if f"mode:{m}" in prompt), "normal")

    async def _publish(self, gateway_id: str, tokens=(), errors=()) -> None:
        batch = OutputBatch(worker_id="decode-peer", tokens=list(tokens), errors=list(errors))
        await self._nc.publish(subjects.out(gateway_id), encode(batch))

    async def _stream(self, request: GenerateRequest, mode: str) -> None:
        rid, sampling = request.request_id, request.sampling
        if mode == "hang":
            return
        if mode == "error":
            await self._publish(request.gateway_id, errors=[ErrorEvent(rid, "internal", "decode worker crashed")])
            return
        stop_at = self._stop_position(sampling.stop)
        text = ""
        for i, token_id in enumerate(self.reply_ids[: sampling.max_tokens]):
            if rid in self.cancelled_ids():
                return
            piece, finish = self.tokenizer.decode([token_id]), None
            if len(text) + len(piece) > stop_at:  # a worker never emits a stop string
                piece, finish = piece[: stop_at - len(text)], "stop"
            elif i + 1 == sampling.max_tokens:
                finish = "length"
            elif i + 1 == len(self.reply_ids):
                finish = "stop"
            text += piece
            event = TokenEvent(
                rid,
                index=i,
                token_ids=[token_id],
                text=piece,
                finish_reason=finish,
                logprobs=self._logprobs(token_id, sampling.logprobs),
                num_prompt_tokens=len(request.prompt_token_ids),
            )
            await self._publish(request.gateway_id, tokens=[event, event] if mode == "dup" else [event])
            if finish:
                return
            await asyncio.sleep(0.005)

    def _stop_position(self, stops: list[str]) -> int:
        """Where the reply is cut by the first stop string it contains (its length if none)."""
        return min([REPLY.find(s) for s in stops if s in REPLY] or [len(REPLY)])

    @staticmethod
    def _logprobs(token_id: int, k: int | None) -> list[TokenLogprob] | None:
        if k is None:
            return None
        return [TokenLogprob(token_id, -0.25, [token_id, token_id + 1][:k], [-0.25, -1.75][:k])]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("tiny"), "llama", "tiny")


@pytest.fixture(scope="module")
def peer(nats_url, model_dir) -> Iterator[Peer]:
    p = Peer(nats_url, Tokenizer.from_dir(model_dir))
    p.start()
    yield p
    p.stop()


class GatewayProcess:
    """`python -m ferry_services.gateway` on a free port, as in production."""

    def __init__(self, nats_url: str, model_dir, log_path, **env: str) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = log_path
        env = {
            **os.environ,
            "FERRY_NATS_URL": nats_url,
            "FERRY_MODEL": str(model_dir),
            "FERRY_SERVED_MODEL_NAME": "tiny",
            "FERRY_HTTP_HOST": "127.0.0.1",
            "FERRY_HTTP_PORT": self.url.rsplit(":", 1)[1],
            **env,
        }
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ferry_services.gateway"], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def wait_until_answering(self, path: str, status: int = 200) -> None:
        wait_until_sync(
            lambda: self.proc.poll() is not None or _status(self.url + path) == status, f"{path} answers", timeout_s=60
        )
        assert self.proc.poll() is None, self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM; the exit status (0: graceful stop, bus drained or closed)."""
        self.proc.terminate()
        try:
            return self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def _status(url: str) -> int | None:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return None


@pytest.fixture(scope="module")
def gateway_url(nats_url, model_dir, peer, tmp_path_factory) -> Iterator[str]:
    gateway = GatewayProcess(
        nats_url,
        model_dir,
        tmp_path_factory.mktemp("gw") / "gateway.log",
        FERRY_GATEWAY_ID=GATEWAY_ID,
        FERRY_REQUEST_TIMEOUT_S=str(TIMEOUT_S),
        FERRY_MAX_INFLIGHT=str(MAX_INFLIGHT),
        FERRY_RETRY_AFTER_S="2",
    )
    try:
        gateway.wait_until_answering("/ready")
        yield gateway.url
    finally:
        assert gateway.stop() == 0, gateway.log_path.read_text()


pytestmark = pytest.mark.integration


@pytest.mark.slow  # its own nats-server and gateway process
def test_no_workers_then_no_bus_are_503s_and_the_gateway_still_stops_cleanly(model_dir, tmp_path):
    with start_nats() as server:
        gateway = GatewayProcess(server.url, model_dir, tmp_path / "gateway.log")
        try:
            gateway.wait_until_answering("/health")
            assert httpx.get(f"{gateway.url}/ready").json()["bus_connected"] is True
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            refused = httpx.post(f"{gateway.url}/v1/chat/completions", json=body)
            error = refused.json()["error"]
            assert error["code"] == "no_workers" and "prefill or decode" in error["message"]  # nobody reports load
            assert int(refused.headers["Retry-After"]) >= 1  # clients (the openai SDK) wait that long and retry
            server.stop()
            wait_until_sync(
                lambda: httpx.get(f"{gateway.url}/ready").json()["bus_connected"] is False, "bus_connected false", 5
            )
            response = httpx.post(f"{gateway.url}/v1/chat/completions", json=body)
            assert response.status_code == 503 and response.json()["error"]["code"] == "bus_unavailable"
        finally:
            assert gateway.stop() == 0, gateway.log_path.read_text()
