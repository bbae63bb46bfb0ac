// Issue rate of VDPBF16PS (AVX512_BF16: 32 bf16 products summed in pairs into 16 fp32 lanes) against
// VFMADD231PS (16 fp32 products) on zmm registers: 12 independent accumulators each, so the loop measures
// throughput, not latency (24 accumulators gave the same numbers). Why the bf16 decode attention path
// (libs/ferry/kernels/csrc/paged_decode_bf16.h) is off by default: see the throughput README's "attn" round.
//
//   g++ -O2 -march=native ops/bench/throughput/bf16_dot_rate.cpp -o /tmp/bf16_dot_rate && /tmp/bf16_dot_rate
#include <immintrin.h>

#include <chrono>
#include <cstdio>

int main() {
  const long n = 100000000;
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(i * 1e-9f);
  __m512i x = _mm512_set1_epi16(0x3f80), y = _mm512_set1_epi16(0x0001);
  __m512 xf = _mm512_set1_ps(1.0f), yf = _mm512_set1_ps(1e-30f);
  for (int rep = 0; rep < 2; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (long k = 0; k < n; ++k) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)x, (__m512bh)y);
      __asm__ volatile("" : "+v"(x), "+v"(y));  // keep the operands in registers, the loop not folded
    }
    const auto t1 = std::chrono::steady_clock::now();
    for (long k = 0; k < n; ++k) {
#pragma GCC unroll 12
      for (int i = 0; i < 12; ++i) acc[i] = _mm512_fmadd_ps(xf, yf, acc[i]);
      __asm__ volatile("" : "+v"(xf), "+v"(yf));
    }
    const auto t2 = std::chrono::steady_clock::now();
    const double dot_s = std::chrono::duration<double>(t1 - t0).count();
    const double fma_s = std::chrono::duration<double>(t2 - t1).count();
    printf("ns per instruction: vdpbf16ps %.3f (32 products)  vfmadd231ps %.3f (16 products)\n",
           dot_s / n / 12 * 1e9, fma_s / n / 12 * 1e9);
  }
  float sum = 0;
  for (int i = 0; i < 12; ++i) sum += _mm512_reduce_add_ps(acc[i]);
  printf("(checksum %g)\n", sum);
}
