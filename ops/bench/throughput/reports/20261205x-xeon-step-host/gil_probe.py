"""A SmolLM2 batch-1 decode forward with a spinning Python thread beside it (GIL contention, as a worker's
event-loop thread makes): the C++ layer loop vs the Python one. cpu-run, not cpu-bench: rough."""
import threading, time, torch
torch.set_num_threads(1)
from ferry.model import AttentionMetadata, decode_calls, load_model
lm = load_model("smollm2")
kv = lm.model.make_kv_cache(64, 16)
kv.data.normal_()
(ids, pos), meta = AttentionMetadata.build_with_inputs([1], [100], [list(range(8))], 16, [5])
for cpp in (True, False, True, False):
    decode_calls.CPP_LOOP = cpp
    lm.model(ids, pos, meta, kv)
    stop, count = [False], [0]
    def spin():
        while not stop[0]:
            count[0] += 1
    t = threading.Thread(target=spin); t.start()
    started = time.perf_counter()
    for _ in range(40):
        lm.model(ids, pos, meta, kv)
    wall = time.perf_counter() - started
    stop[0] = True; t.join()
    print(f"cpp_loop={cpp}: {wall / 40 * 1000:.2f} ms a forward with a spinning Python thread beside it, "
          f"{count[0] / wall / 1e6:.2f} M spins/s")
