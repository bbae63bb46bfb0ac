"""This machine's memory speed as the matmuls see it: 2 threads reading (summing) a 512 MB bf16 tensor, and copying
one, best of 5 (GB/s of bytes read).

    /work/tools/cpu-bench python ops/bench/quant/membw.py
"""

import time

import torch


def main() -> None:
    big = torch.ones(256 << 20, dtype=torch.bfloat16)
    dst = torch.empty_like(big)
    for name, fn in (("read (sum)", lambda: big.sum(dtype=torch.float32)), ("copy", lambda: dst.copy_(big))):
        fn()
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - start)
        print(f"{name}: {big.numel() * 2 / best / 1e9:.1f} GB/s read ({torch.get_num_threads()} threads)", flush=True)


if __name__ == "__main__":
    main()
