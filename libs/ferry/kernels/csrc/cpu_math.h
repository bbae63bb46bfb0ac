// Vector helpers for the CPU attention kernels: 16-float vectors, dot products with shared horizontal
// sums, a vectorisable exp and prefetching. Header-only, included by paged_decode.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace ferry_cpu {

// 16 floats as one value: GCC/Clang lower it to whatever vector registers -march gives (one zmm on
// AVX-512, two ymm on AVX2), so hot loops hold their accumulators in registers on any x86/ARM build.
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16_unaligned __attribute__((vector_size(64), aligned(4)));
constexpr int64_t kLanes = 16;

inline vec16 load16(const float* p) { return *reinterpret_cast<const vec16_unaligned*>(p); }
inline void store16(float* p, vec16 v) { *reinterpret_cast<vec16_unaligned*>(p) = v; }
inline float hsum16(vec16 v) {
  float sum = 0.f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];  // reassociated into a shuffle tree (-fassociative-math)
  return sum;
}

// kN > 0 (a multiple of 16): n is kN, known at compile time: two vector accumulators, no remainder.
template <int kN>
inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  if constexpr (kN > 0 && kN % (2 * kLanes) == 0) {
    vec16 even = {}, odd = {};
#pragma GCC unroll 16
    for (int64_t i = 0; i < kN; i += 2 * kLanes) {
      even += load16(a + i) * load16(b + i);
      odd += load16(a + i + kLanes) * load16(b + i + kLanes);
    }
    return hsum16(even + odd);
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// Four dot products of one query row with four key rows, summed across lanes together: one shuffle
// tree for four results instead of four (the horizontal sums were the kernel's largest cost).
template <int kN>
inline void dot4(const float* __restrict q, const float* const* rows, float* out) {
  static_assert(kN > 0 && kN % kLanes == 0);
  vec16 acc[4] = {};
#pragma GCC unroll 16
  for (int64_t i = 0; i < kN; i += kLanes) {
    const vec16 qi = load16(q + i);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) acc[r] += qi * load16(rows[r] + i);
  }
  // [a | b] halves summed: lanes 0-7 hold a's 8 partial sums, lanes 8-15 b's
  const vec16 ab = __builtin_shufflevector(acc[0], acc[1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(acc[0], acc[1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vec16 cd = __builtin_shufflevector(acc[2], acc[3], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                   __builtin_shufflevector(acc[2], acc[3], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // four lanes per row: a 0-3, b 4-7, c 8-11, d 12-15
  const vec16 abcd = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                     __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vec16 pairs = abcd + __builtin_shufflevector(abcd, abcd, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const vec16 sums = pairs + __builtin_shufflevector(pairs, pairs, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  out[0] = sums[0], out[1] = sums[4], out[2] = sums[8], out[3] = sums[12];
}

// Into L2 (and L3), not L1: rows are fetched several tiles ahead, more than L1 holds.
inline void prefetch_row(const char* row, int64_t bytes) {
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(row + byte, 0, 2);
}

// scores[j] = q . rows[j] for one query row over a tile; meanwhile prefetches the K and V rows in
// ahead[2 * j], ahead[2 * j + 1] for j < num_ahead, spread over the loop rather than in one burst.
template <int kD>
inline void score_row(const float* __restrict q, const float* const* rows, int64_t n, int64_t dim, float* scores,
                      const char* const* ahead, int64_t num_ahead, int64_t k_bytes, int64_t v_bytes) {
  int64_t j = 0;
  if constexpr (kD > 0 && kD % kLanes == 0) {
    for (; j + 4 <= n; j += 4) {
      for (int64_t a = j; a < std::min(j + 4, num_ahead); ++a) {
        prefetch_row(ahead[2 * a], k_bytes);
        prefetch_row(ahead[2 * a + 1], v_bytes);
      }
      dot4<kD>(q, rows + j, scores + j);
    }
  }
  for (int64_t a = j; a < num_ahead; ++a) {
    prefetch_row(ahead[2 * a], k_bytes);
    prefetch_row(ahead[2 * a + 1], v_bytes);
  }
  for (; j < n; ++j) scores[j] = dot<kD>(q, rows[j], dim);
}

// exp(x) for x <= 0 (scores minus their running max): 2^k * e^r with |r| <= ln2/2 and a degree-6
// Taylor polynomial, ~1e-7 relative error; 0 below -87, where e^x would leave the normal floats
// (denormals are slow and, next to the max term's 1, meaningless). Branch-free so callers vectorise.
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = std::max(x, -87.0f);
  const float k = std::floor(x * 1.44269504f + 0.5f);
  const float r = (x - k * 0.693145751953125f) - k * 1.428606765330187e-6f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  return underflow ? 0.f : p * __builtin_bit_cast(float, (static_cast<int32_t>(k) + 127) << 23);
}

}  // namespace ferry_cpu
