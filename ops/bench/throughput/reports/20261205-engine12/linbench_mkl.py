"""The bench checkpoint's 33 decode-step matmuls at M rows: packed oneDNN (cpu_linear, today's path) vs F.linear
(MKL on this Intel box) vs oneDNN packed for 32/48 rows; alternating per M, the last of three passes of 20 steps."""

import time

import torch
import torch.nn.functional as F

from ferry.model.cpu_linear import linear

torch.manual_seed(0)
shapes = [(1536, 512), (512, 512), (2816, 512), (512, 1408)] * 8 + [(2048, 512)]
ws = [torch.randn(o, i) * 0.02 for o, i in shapes]
packs = {h: [torch.ops.mkldnn._reorder_linear_weight(w, h) for w in ws] for h in (16, 32)}
n_weights = sum(w.numel() for w in ws)
print("threads", torch.get_num_threads(), "MB", n_weights * 4 / 1e6)
for m in (1, 4, 8, 16, 30, 48):
    xs = {i: torch.randn(m, i) for _, i in shapes}
    ways = {
        "onednn16": lambda w, i, xs=xs: linear(xs[w.shape[1]], w, None, packs[16][i]),
        "onednn32": lambda w, i, xs=xs: linear(xs[w.shape[1]], w, None, packs[32][i]),
        "F.linear": lambda w, i, xs=xs: F.linear(xs[w.shape[1]], w),
    }
    times = {}
    for _rep in range(3):
        for name, way in ways.items():
            t = time.perf_counter()
            for _ in range(20):
                for i, w in enumerate(ws):
                    way(w, i)
            times[name] = (time.perf_counter() - t) / 20
    row = "  ".join(f"{k} {v * 1e3:6.2f} ms ({2 * m * n_weights / v / 1e9:5.1f} GF/s)" for k, v in times.items())
    print(f"M={m:3d}  {row}")
