// Vector helpers for the CPU kernels: 16-float vectors, dot products with shared horizontal sums, a
// vectorisable exp, prefetching, and the row dispatch of the register-blocked quantized matmuls.
// Header-only, included by paged_decode.cpp, quant_linear.cpp and quant_dot.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <utility>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace ferry_cpu {

// Calls f(std::integral_constant<int, R>{}) with R == rows for 1 <= rows <= kMax (a larger count
// runs kMax): a row count known only at run time, turned into the compile-time constant that sizes
// a register-blocked kernel's accumulators.
template <int kMax, int R = 1, typename F>
inline void with_rows(int64_t rows, F&& f) {
  static_assert(kMax >= 1 && R >= 1 && R <= kMax);
  if constexpr (R < kMax) {
    if (rows > R) return with_rows<kMax, R + 1>(rows, std::forward<F>(f));
  }
  f(std::integral_constant<int, R>{});
}

// One machine vector of floats: 16 lanes (a zmm) where -march gives AVX-512, else 8 (a ymm on AVX2,
// two q registers on NEON). A width the machine lacks is lowered by GCC through the stack: on an
// AVX2-only Zen 3, 16-float vectors made the accumulation loops spill every partial sum (~4x slower).
#if defined(__AVX512F__)
#define FERRY_CPU_LANES 16
#else
#define FERRY_CPU_LANES 8
#endif
constexpr int64_t kLanes = FERRY_CPU_LANES;
typedef float vecf __attribute__((vector_size(4 * FERRY_CPU_LANES)));
typedef float vecf_unaligned __attribute__((vector_size(4 * FERRY_CPU_LANES), aligned(4)));
typedef float vec4 __attribute__((vector_size(16)));

// bfloat16 storage, the layout of c10::BFloat16: the high 16 bits of an fp32, so widening is a shift.
struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x.bits) << 16); }
// fp32 -> bf16 rounded to nearest even, NaN kept a (quiet) NaN: what torch's conversion gives, branch-free.
inline bf16 to_bf16(float f) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, f);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return bf16{static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded)};
}

// kLanes consecutive values as fp32: a load, or for bf16 a widening load and a shift (no copy through memory).
inline vecf loadv(const float* p) { return *reinterpret_cast<const vecf_unaligned*>(p); }
inline vecf loadv(const bf16* p) {
#if FERRY_CPU_LANES == 16
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<vecf>(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__)  // one widening load (GCC makes four instructions of __builtin_convertvector here)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vecf>(_mm256_slli_epi32(wide, 16));
#else
  typedef uint16_t vecu16 __attribute__((vector_size(2 * FERRY_CPU_LANES), aligned(2)));
  typedef uint32_t vecu32 __attribute__((vector_size(4 * FERRY_CPU_LANES)));
  const vecu32 wide = __builtin_convertvector(*reinterpret_cast<const vecu16*>(p), vecu32) << 16;
  return reinterpret_cast<vecf>(wide);
#endif
}
// fp8 e4m3fn storage, the layout of c10::Float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no
// infinities, NaN only at S.1111.111 (never written: torch's conversion saturates at +-448).
struct fp8e4m3 {
  uint8_t bits;
};
// fp32 -> e4m3 as torch rounds: to nearest even, +-448 and beyond (infinities too) saturate to +-448, NaN stays
// NaN. Branch-free so write loops vectorise (c10's conversion branches per value).
inline fp8e4m3 to_fp8e4m3(float f) {
  const uint32_t bits = __builtin_bit_cast(uint32_t, f), sign = (bits >> 24) & 0x80u, mag = bits & 0x7FFFFFFFu;
  // 2^-6 and above: the mantissa rounded to 3 bits, the exponent rebased from 127 to 7 (wraps below: unused)
  const uint32_t normal = (mag + 0x7FFFFu + ((mag >> 20) & 1u) - (120u << 23)) >> 20;
  // below, subnormals: adding 2^14 (its ulp is 2^-9, e4m3's subnormal step) rounds to a whole number of steps
  const uint32_t sub = __builtin_bit_cast(uint32_t, __builtin_bit_cast(float, mag) + 16384.f) - 0x46800000u;
  uint32_t code = mag < (121u << 23) ? sub : std::min(normal, 0x7Eu);
  code = mag > 0x7F800000u ? 0x7Fu : code;
  return fp8e4m3{static_cast<uint8_t>(code | sign)};
}

// Widening moves the exponent and mantissa into an fp16's fields (bias 15) and converts that (one F16C
// instruction per vector), which handles e4m3's subnormals exactly, where building fp32 bits directly would
// make them fp32 denormals (slow on x86, or flushed). The fp16 is the value * 2^-8 (bias 15, not 7); the
// multiply that would undo it is left out, and kernels fold kWidenScale<R> into their scales instead.
inline float to_float(fp8e4m3 x) {  // value * 2^-8, as loadv
  const uint32_t b = x.bits, mag = b & 0x7Fu;
  // normal: exponent rebased from 7 to 127 - 8 (112 << 23 added); subnormal (exponent 0): mantissa * 2^-17
  const float normal = __builtin_bit_cast(float, (mag << 20) + (112u << 23));
  const float value = (mag >> 3) ? normal : static_cast<float>(mag) * 0x1p-17f;
  return (b & 0x80u) ? -value : value;
}
// What loadv / to_float of an R must be multiplied by to give the stored value.
template <typename R>
inline constexpr float kWidenScale = 1.f;
template <>
inline constexpr float kWidenScale<fp8e4m3> = 256.f;

inline void storev(float* p, vecf v) { *reinterpret_cast<vecf_unaligned*>(p) = v; }
// kLanes fp8 values as fp32. FERRY_FP8_TABLE: a 256-entry table and a gather instead of the fp16 route
// (measured slower: ops/bench/throughput/fp8_widen.cpp).
#if defined(FERRY_FP8_TABLE) && FERRY_CPU_LANES == 16
struct Fp8Table {
  float value[256];
  Fp8Table() {
    for (int i = 0; i < 256; ++i) value[i] = to_float(fp8e4m3{static_cast<uint8_t>(i)});
  }
};
inline const Fp8Table fp8_table{};
inline vecf loadv(const fp8e4m3* p) {
  const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<vecf>(_mm512_i32gather_ps(index, fp8_table.value, 4));
}
#elif FERRY_CPU_LANES == 16 && defined(__F16C__)
// bits s.eeee.mmm -> u16 s.0eeee.mmm0000000: sign-extended to 16 bits and shifted left by 7, which puts the
// sign in bit 15 and a copy of it in bit 14, then bit 14 cleared (3 integer ops per vector).
inline vecf loadv(const fp8e4m3* p) {
  const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i half = _mm256_and_si256(_mm256_slli_epi16(wide, 7), _mm256_set1_epi16(static_cast<short>(0xBFFF)));
  return reinterpret_cast<vecf>(_mm512_cvtph_ps(half));
}
#elif FERRY_CPU_LANES == 8 && defined(__F16C__)
inline vecf loadv(const fp8e4m3* p) {
  const __m128i wide = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i half = _mm_and_si128(_mm_slli_epi16(wide, 7), _mm_set1_epi16(static_cast<short>(0xBFFF)));
  return reinterpret_cast<vecf>(_mm256_cvtph_ps(half));
}
#else
inline vecf loadv(const fp8e4m3* p) {
  vecf v;
  for (int i = 0; i < kLanes; ++i) v[i] = to_float(p[i]);
  return v;
}
#endif
inline float hsum(vecf v) {
  float sum = 0.f;
  for (int i = 0; i < kLanes; ++i) sum += v[i];  // reassociated into a shuffle tree (-fassociative-math)
  return sum;
}

// kN > 0 (a multiple of 2 * kLanes): n is kN, known at compile time: two vector accumulators, no remainder.
template <int kN, typename R>
inline float dot(const float* __restrict a, const R* __restrict b, int64_t n) {
  if constexpr (kN > 0 && kN % (2 * kLanes) == 0) {
    vecf even = {}, odd = {};
#pragma GCC unroll 16
    for (int64_t i = 0; i < kN; i += 2 * kLanes) {
      even += loadv(a + i) * loadv(b + i);
      odd += loadv(a + i + kLanes) * loadv(b + i + kLanes);
    }
    return hsum(even + odd);
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t i = 0; i < n; ++i) sum += a[i] * to_float(b[i]);
  return sum;
}

// The lane sums of four vectors, [sum a, sum b, sum c, sum d], with one shuffle tree for all four
// (four separate horizontal sums were the kernel's largest cost). Pairs are summed within 128-bit
// lanes first (in-lane shuffles are cheap everywhere), the halves last.
inline vec4 sum4(vecf a, vecf b, vecf c, vecf d) {
#if FERRY_CPU_LANES == 16
  // [a | b] halves summed: lanes 0-7 hold a's 8 partial sums, lanes 8-15 b's
  const vecf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  const vecf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
                  __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  // four lanes per vector: a 0-3, b 4-7, c 8-11, d 12-15
  const vecf abcd = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
                    __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const vecf pairs = abcd + __builtin_shufflevector(abcd, abcd, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  const vecf sums = pairs + __builtin_shufflevector(pairs, pairs, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return vec4{sums[0], sums[4], sums[8], sums[12]};
#else
  // hadd(x, y) = [x0+x1, x2+x3, y0+y1, y2+y3 | x4+x5, x6+x7, y4+y5, y6+y7], one in-lane step
  auto hadd = [](vecf x, vecf y) {
    return __builtin_shufflevector(x, y, 0, 2, 8, 10, 4, 6, 12, 14) +
           __builtin_shufflevector(x, y, 1, 3, 9, 11, 5, 7, 13, 15);
  };
  const vecf abcd = hadd(hadd(a, b), hadd(c, d));  // [a b c d | a b c d]: each half holds half the sums
  return __builtin_shufflevector(abcd, abcd, 0, 1, 2, 3) + __builtin_shufflevector(abcd, abcd, 4, 5, 6, 7);
#endif
}

// Four dot products of each of kQ query rows (heads of one KV head's group) with four key rows: each key
// row is loaded once for all kQ. out[g][r] = q[g] . rows[r]. kQ <= kMaxQueryRows: the 4 * kQ partial sums,
// the kQ query vectors and the key vector fit the registers (16 on AVX2: 2 rows; 32 on AVX-512: 3).
constexpr int kMaxQueryRows = kLanes == 16 ? 3 : 2;
template <int kN, int kQ, typename R>
inline void dot4xq(const float* const* q, const R* const* rows, float* const* out) {
  static_assert(kN > 0 && kN % kLanes == 0 && kQ >= 1 && kQ <= kMaxQueryRows);
  vecf acc[kQ][4] = {};
#pragma GCC unroll 16
  for (int64_t i = 0; i < kN; i += kLanes) {
    vecf qi[kQ];
#pragma GCC unroll 3
    for (int g = 0; g < kQ; ++g) qi[g] = loadv(q[g] + i);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const vecf k = loadv(rows[r] + i);
#pragma GCC unroll 3
      for (int g = 0; g < kQ; ++g) acc[g][r] += qi[g] * k;
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < kQ; ++g) {
    const vec4 s = sum4(acc[g][0], acc[g][1], acc[g][2], acc[g][3]);
    for (int r = 0; r < 4; ++r) out[g][r] = s[r];
  }
}

// Into L2 (and L3), not L1: rows are fetched several tiles ahead, more than L1 holds.
inline void prefetch_row(const char* row, int64_t bytes) {
  for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(row + byte, 0, 2);
}

// The K and V rows of ahead[2 * a], ahead[2 * a + 1] for a in [from, to): a tile's prefetches, spread over a loop.
inline void prefetch_pairs(const char* const* ahead, int64_t from, int64_t to, int64_t k_bytes, int64_t v_bytes) {
  for (int64_t a = from; a < to; ++a) {
    prefetch_row(ahead[2 * a], k_bytes);
    prefetch_row(ahead[2 * a + 1], v_bytes);
  }
}

// s[g][j] = q[g] . rows[j] over a tile for kQ query rows (each key row read once for all of them);
// meanwhile prefetches the K and V rows in ahead[2 * j], ahead[2 * j + 1] for j < num_ahead, spread over
// the loop rather than in one burst.
template <int kD, int kQ, typename R>
inline void score_rows(const float* const* q, const R* const* rows, int64_t n, int64_t dim, float* const* s,
                       const char* const* ahead, int64_t num_ahead, int64_t k_bytes, int64_t v_bytes) {
  int64_t j = 0;
  if constexpr (kD > 0 && kD % kLanes == 0) {
    for (; j + 4 <= n; j += 4) {
      prefetch_pairs(ahead, j, std::min(j + 4, num_ahead), k_bytes, v_bytes);
      float* out[kQ];
      for (int g = 0; g < kQ; ++g) out[g] = s[g] + j;
      dot4xq<kD, kQ, R>(q, rows + j, out);
    }
  }
  prefetch_pairs(ahead, j, num_ahead, k_bytes, v_bytes);
  for (; j < n; ++j)
    for (int g = 0; g < kQ; ++g) s[g][j] = dot<kD, R>(q[g], rows[j], dim);
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
