"""fp32 vs bf16 dense matmul rate on this box (torch's default threads), SmolLM2 prefill shapes."""

import time

import torch

torch.manual_seed(0)
print("threads", torch.get_num_threads(), "mkldnn bf16", torch.backends.mkldnn.is_available())
for m, k, n in [(2048, 576, 1536), (2048, 1536, 576), (2048, 576, 576), (8, 576, 1536)]:
    for dt in (torch.float32, torch.bfloat16):
        a = torch.randn(m, k).to(dt)
        w = torch.randn(n, k).to(dt)
        for _ in range(3):
            torch.nn.functional.linear(a, w)
        reps = 20 if m > 8 else 500
        t = time.perf_counter()
        for _ in range(reps):
            torch.nn.functional.linear(a, w)
        dt_s = (time.perf_counter() - t) / reps
        print(f"M={m} K={k} N={n} {dt!s:15s} {2 * m * k * n / dt_s / 1e9:8.1f} GF/s  {dt_s * 1e3:.3f} ms")
