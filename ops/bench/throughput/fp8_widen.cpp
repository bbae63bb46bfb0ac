// fp8 e4m3 -> fp32 widening inside a dot product, the decode kernel's inner loop: the fp16 route of
// cpu_math.h (bits moved into an fp16, one vcvtph2ps, a multiply) vs a 256-entry table and a gather
// (FERRY_FP8_TABLE). Rows of 64 values (SmolLM2's head size) from a buffer bigger than L2, dotted with
// one fp32 query row, as the kernel does per key. Prints ns per row for each.
//
//   g++ -O3 -march=native -fno-math-errno -fassociative-math -fno-signed-zeros -fno-trapping-math \
//       -I libs/ferry/kernels/csrc ops/bench/throughput/fp8_widen.cpp -o /tmp/fp8_widen [-DFERRY_FP8_TABLE]
//   /work/tools/cpu-bench /tmp/fp8_widen
#include "cpu_math.h"

#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

using namespace ferry_cpu;

int main() {
  constexpr int64_t kDim = 64, kRows = 1 << 16;  // 4 MB of fp8 rows
  std::vector<fp8e4m3> rows(kDim * kRows);
  std::mt19937 gen(0);
  for (auto& r : rows) r.bits = static_cast<uint8_t>(gen() % 256 & 0xF7);  // no NaN codes
  std::vector<float> q(kDim, 0.5f);
  float checksum = 0.f, best = 1e30f;
  for (int rep = 0; rep < 20; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t r = 0; r < kRows; ++r) checksum += dot<kDim, fp8e4m3>(q.data(), rows.data() + r * kDim, kDim);
    const std::chrono::duration<float, std::nano> ns = std::chrono::steady_clock::now() - t0;
    best = std::min(best, ns.count() / kRows);
  }
  std::printf("%s: %.2f ns per 64-value row (checksum %g)\n",
#ifdef FERRY_FP8_TABLE
              "table+gather",
#else
              "fp16 route",
#endif
              best, checksum);
}
