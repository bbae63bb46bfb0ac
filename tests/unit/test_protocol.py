"""The wire contract: every message round-trips, golden bytes pin the schema, bad bytes are named."""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack
import pytest

from ferry.protocol import (
    PROTOCOL_VERSION,
    BlockRef,
    Cancel,
    ErrorEvent,
    ErrorReply,
    GenerateRequest,
    Handoff,
    HandoffReply,
    KvEvent,
    KvLookup,
    KvLookupReply,
    KvPrefetch,
    KvResync,
    KvStats,
    KvStatsRequest,
    KvWarm,
    LoadReport,
    OutputBatch,
    PrefillWork,
    ProtocolError,
    RankLoad,
    SamplingParams,
    SubmitReply,
    SubmitRequest,
    TokenEvent,
    TokenLogprob,
    TrafficForecast,
    decode,
    encode,
    hash_block,
    hash_full_blocks,
    message_types,
    subjects,
)

pytestmark = pytest.mark.unit

GOLDEN = Path(__file__).parent / "golden" / "protocol.json"

_SAMPLING = SamplingParams(
    max_tokens=32,
    min_tokens=2,
    temperature=0.7,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=7,
    presence_penalty=0.5,
    frequency_penalty=0.25,
    repetition_penalty=1.1,
    stop=["\n\n"],
    stop_token_ids=[2],
    ignore_eos=False,
    logprobs=3,
)
_REQUEST = GenerateRequest(
    request_id="req-1",
    gateway_id="gw-a",
    model="demo",
    prompt_token_ids=[1, 5, 9],
    sampling=_SAMPLING,
    output_token_ids=[11],
    arrival_time=1700000000.5,
    attempt=1,
)
_HASHES = hash_full_blocks(list(range(48)), 16)

SAMPLES = {
    "submit": SubmitRequest(request=_REQUEST),
    "submit_reply": SubmitReply(request_id="req-1", accepted=False, reason="overloaded", retry_after_s=1.5),
    "prefill_work": PrefillWork(
        request=_REQUEST, routed_at=1700000000.75, num_cached_blocks_hint=2, num_routing_behind=3
    ),
    "handoff": Handoff(
        request=_REQUEST,
        prefill_worker_id="p-1",
        kv_namespace="llama-fp32-v1-abc",
        kv_blocks=[BlockRef(_HASHES[0], 16), BlockRef(_HASHES[1], 3)],
        num_kv_tokens=19,
        decode_worker_id="d-2",
    ),
    "handoff_reply": HandoffReply(request_id="req-1", accepted=True, worker_id="d-2"),
    "output": OutputBatch(
        worker_id="d-2",
        tokens=[
            TokenEvent(
                request_id="req-1",
                index=1,
                token_ids=[42],
                text=" hi",
                logprobs=[TokenLogprob(42, -0.25, [42, 7], [-0.25, -2.0])],
                finish_reason="length",
                num_prompt_tokens=3,
            )
        ],
        errors=[ErrorEvent(request_id="req-2", code="worker_lost", message="decode worker d-9 lost", retryable=True)],
    ),
    "cancel": Cancel(request_ids=["req-1", "req-3"]),
    "load": LoadReport(
        worker_id="d-2",
        role="decode",
        model="demo",
        kv_namespace="llama-fp32-v1-abc",
        timestamp=1700000001.0,
        interval_s=0.5,
        num_running=12,
        num_waiting=3,
        num_queued_prefill_tokens=0,
        kv_blocks_used=100,
        kv_blocks_total=400,
        max_running=64,
        num_backlog=5,
        ranks=[RankLoad(0, 7, 1, 0, 0.0, 60, 200, 32), RankLoad(1, 5, 2, 16, 128.0, 40, 200, 32)],
    ),
    "forecast": TrafficForecast(
        source="gateway-g1",
        timestamp=1700000001.5,
        interval_s=60.0,
        rate_rps=2.5,
        forecast_rps=4.0,
        horizon_s=300.0,
        mean_prompt_tokens=120.0,
        mean_output_tokens=96.0,
        num_requests=1000,
        is_seasonal=True,
    ),
    "kv_event": KvEvent(
        kind="stored", kv_namespace="llama-fp32-v1-abc", where="store", block_hashes=_HASHES[:2], timestamp=1700000002.0
    ),
    "kv_prefetch": KvPrefetch(request_id="req-1", kv_namespace="llama-fp32-v1-abc", block_hashes=_HASHES[:2]),
    "kv_resync": KvResync(requester="prefill-balancer-1"),
    "kv_warm": KvWarm(
        request_id="req-1",
        kv_namespace="llama-fp32-v1-abc",
        block_hashes=_HASHES[:2],
        worker_id="decode-1",
        partial_hash=_HASHES[2],
    ),
    "kv_lookup": KvLookup(kv_namespace="llama-fp32-v1-abc", block_hashes=_HASHES),
    "kv_lookup_reply": KvLookupReply(num_cached_blocks=2),
    "kv_stats_request": KvStatsRequest(kv_namespace="llama-fp32-v1-abc"),
    "kv_stats": KvStats(
        num_blocks=3,
        num_bytes=3000,
        num_lookups=2,
        lookup_hit_rate=0.5,
        num_evictions=1,
        degraded=True,
        max_memory_bytes=1 << 30,
        eviction_policy="allkeys-lru",
        used_memory_bytes=5000,
        blocks_per_namespace={"llama-fp32-v1-abc": 3},
    ),
    "error_reply": ErrorReply(code="internal", message="handler failed: boom"),
}


def test_every_registered_type_has_a_sample():
    assert set(SAMPLES) == set(message_types())


@pytest.mark.parametrize("tag", sorted(SAMPLES))
def test_round_trip(tag):
    msg = SAMPLES[tag]
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), type(msg)) == msg


def _golden() -> dict[str, str]:
    if os.environ.get("FERRY_UPDATE_GOLDEN") == "1":  # deliberate schema change: rewrite, review the diff
        GOLDEN.write_text(json.dumps({t: encode(m).hex() for t, m in sorted(SAMPLES.items())}, indent=1) + "\n")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("tag", sorted(SAMPLES))
def test_golden_bytes(tag):
    """Silent schema drift (a renamed, reordered or retyped field) changes these bytes."""
    golden = bytes.fromhex(_golden()[tag])
    assert encode(SAMPLES[tag]) == golden
    assert decode(golden) == SAMPLES[tag]


def _raw(tag, fields, version=PROTOCOL_VERSION) -> bytes:
    return msgpack.packb([version, tag, fields], use_bin_type=True)


def _fields(msg) -> dict:
    return msgpack.unpackb(encode(msg))[2]


@pytest.mark.parametrize(
    "data, problem",
    [
        (b"\xc1garbage", "not msgpack"),
        (b"", "not msgpack"),
        (msgpack.packb({"a": 1}), "expected [version, type, fields]"),
        (_raw("submit", {}, version=99), "unsupported protocol version 99"),
        (_raw("nope", {}), "unknown message type 'nope'"),
        (_raw("cancel", []), "Cancel: expected a map of fields, got list"),
        (_raw("cancel", {}), "Cancel.request_ids: missing required field"),
        (_raw("cancel", {"request_ids": "r1"}), "Cancel.request_ids: expected a list, got str"),
        (_raw("cancel", {"request_ids": [1]}), "Cancel.request_ids[0]: expected str, got int"),
        (_raw("kv_lookup_reply", {"num_cached_blocks": True}), "expected int, got bool"),
        (_raw("load", {**_fields(SAMPLES["load"]), "role": "chef"}), "LoadReport: role='chef' must be one of"),
    ],
)
def test_bad_bytes_raise_one_named_error(data, problem):
    with pytest.raises(ProtocolError) as info:
        decode(data)
    assert problem in str(info.value)


def test_nested_field_errors_name_the_path():
    fields = _fields(SAMPLES["submit"])
    fields["request"]["sampling"]["top_p"] = "high"
    with pytest.raises(ProtocolError, match=r"SubmitRequest\.request\.sampling\.top_p: expected float, got str"):
        decode(_raw("submit", fields))
    fields["request"]["sampling"]["top_p"] = 1.5
    with pytest.raises(ProtocolError, match=r"top_p=1.5 must be in \(0, 1\]"):
        decode(_raw("submit", fields))


def test_expected_type_mismatch_and_unknown_fields():
    with pytest.raises(ProtocolError, match="expected Cancel, got SubmitReply"):
        decode(encode(SAMPLES["submit_reply"]), Cancel)
    newer = _raw("kv_lookup_reply", {"num_cached_blocks": 4, "added_in_v1_5": "x"})
    assert decode(newer) == KvLookupReply(num_cached_blocks=4)


def test_ints_are_accepted_for_floats_and_defaults_fill_missing_fields():
    msg = decode(_raw("submit_reply", {"request_id": "r", "accepted": False, "retry_after_s": 2}))
    assert msg.retry_after_s == 2.0 and isinstance(msg.retry_after_s, float)
    assert msg.reason == "" and msg.worker_id == ""


def test_oversized_message_is_refused():
    with pytest.raises(ProtocolError, match="over the"):
        decode(b"\x00" * (8 * 1024 * 1024 + 1))


def test_encode_refuses_unregistered_types():
    with pytest.raises(TypeError):
        encode(SamplingParams())


def test_handoff_checks_its_token_count():
    with pytest.raises(ValueError, match="num_kv_tokens"):
        Handoff(
            request=_REQUEST,
            prefill_worker_id="p",
            kv_namespace="n",
            kv_blocks=[BlockRef(_HASHES[0], 16)],
            num_kv_tokens=17,
        )


def test_block_hashes_chain_and_are_deterministic():
    tokens = list(range(40))
    hashes = hash_full_blocks(tokens, 16)
    assert len(hashes) == 2  # the 8-token tail is not a full block
    assert hashes[0] == hash_block(None, tokens[:16])
    assert hashes[1] == hash_block(hashes[0], tokens[16:32])
    # same tokens under a different parent (another prefix) hash differently
    assert hash_block(None, tokens[16:32]) != hashes[1]
    assert hash_block(None, tokens[:16], ["lora-a"]) != hashes[0]
    # pinned value: every process, every machine, every release computes this
    assert hashes[0].hex() == "bdb36aef6c4ee3bb20679f53b22c5a53"


def test_subject_builders_validate_tokens():
    assert subjects.work("prefill", "w-1") == "ferry.work.prefill.w-1"
    assert subjects.work_consumer("decode", "w_2") == "decode-w_2"
    assert subjects.out("gw1") == "ferry.out.gw1"
    assert subjects.load_role("decode") == "ferry.load.decode.*"
    with pytest.raises(ValueError, match="worker_id"):
        subjects.work("prefill", "a.b")
    with pytest.raises(ValueError, match="role"):
        subjects.load("router", "w1")
