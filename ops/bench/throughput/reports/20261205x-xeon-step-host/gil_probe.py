"""A SmolLM2 batch-1 decode forward with a spinning Python thread beside it (GIL contention, as a worker's
event-loop thread makes): the C++ layer loop vs the Python one. cpu-run, not cpu-bench: rough."""

import threading
import time

import torch

from ferry.model import AttentionMetadata, decode_calls, load_model


def spin(stop: threading.Event, count: list[int]) -> None:
    while not stop.is_set():
        count[0] += 1


def main() -> None:
    torch.set_num_threads(1)
    lm = load_model("smollm2")
    kv = lm.model.make_kv_cache(64, 16)
    kv.data.normal_()
    (ids, pos), meta = AttentionMetadata.build_with_inputs([1], [100], [list(range(8))], 16, [5])
    for cpp in (True, False, True, False):
        decode_calls.CPP_LOOP = cpp
        lm.model(ids, pos, meta, kv)
        stop, count = threading.Event(), [0]
        thread = threading.Thread(target=spin, args=(stop, count))
        thread.start()
        started = time.perf_counter()
        for _ in range(40):
            lm.model(ids, pos, meta, kv)
        wall = time.perf_counter() - started
        stop.set()
        thread.join()
        print(
            f"cpp_loop={cpp}: {wall / 40 * 1000:.2f} ms a forward with a spinning Python thread beside it, "
            f"{count[0] / wall / 1e6:.2f} M spins/s"
        )


if __name__ == "__main__":
    main()
