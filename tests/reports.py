"""Load reports for tests: an idle worker's report, with what a test cares about overridden."""

from __future__ import annotations

import time
from typing import Any

from ferry.protocol import LoadReport


def load_report(worker_id: str = "w1", role: str = "prefill", **overrides: Any) -> LoadReport:
    """An idle worker's report (nothing running or queued, 8 free KV blocks, room for 4 sequences), stamped
    now, for model "m" in namespace "ns"; keyword arguments replace any field."""
    fields: dict[str, Any] = dict(
        worker_id=worker_id,
        role=role,
        model="m",
        kv_namespace="ns",
        timestamp=time.time(),
        interval_s=1.0,
        num_running=0,
        num_waiting=0,
        num_queued_prefill_tokens=0,
        kv_blocks_used=0,
        kv_blocks_total=8,
        max_running=4,
    )
    fields.update(overrides)
    return LoadReport(**fields)
