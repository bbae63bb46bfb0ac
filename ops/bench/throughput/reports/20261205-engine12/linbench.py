"""Times the bench checkpoint's 33 weight matmuls of a decode step (packed oneDNN, cpu_linear) at M rows."""

import time

import torch

from ferry.model.cpu_linear import linear, pack

torch.manual_seed(0)
shapes = [(1536, 512), (512, 512), (2816, 512), (512, 1408)] * 8 + [(2048, 512)]
ws = [torch.randn(o, i) * 0.02 for o, i in shapes]
ps = [pack(w) for w in ws]
n_weights = sum(w.numel() for w in ws)
print("threads", torch.get_num_threads(), "MB", n_weights * 4 / 1e6)
for m in (1, 4, 8, 16, 30, 48):
    xs = {i: torch.randn(m, i) for _, i in shapes}
    for _rep in range(3):  # the last of three passes of 20 steps
        t = time.perf_counter()
        for _ in range(20):
            for w, p in zip(ws, ps):
                linear(xs[w.shape[1]], w, None, p)
        dt = (time.perf_counter() - t) / 20
    gf, gb = 2 * m * n_weights / dt / 1e9, n_weights * 4 / dt / 1e9
    print(f"M={m:3d} {dt * 1e3:6.2f} ms/step  {gf:6.1f} GF/s  {gb:5.1f} GB/s weights")
