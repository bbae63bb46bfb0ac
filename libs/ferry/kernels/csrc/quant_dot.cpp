// Matmul with group-wise int8 / int4 weights and int8 activations: out [M, N] = x [M, K] @ W.T, the products
// summed exactly in int32 (AVX-512 VNNI `vpdpbusd`: 64 byte products per instruction; AVX2
// `vpmaddubsw` + `vpmaddwd` where VNNI is missing), then scaled once per 32 inputs.
//
// Activations: each row's 32-input chunks are quantized on entry, q = round(x / d), d = absmax / 127 (so
// |q| <= 127); the chunk's error is at most d / 2 per input, which is what the unit test's tolerance rests on.
// Weights, in the layout of ferry/kernels/quant_pack.py's pack_for_dot (made once at load), 16 output columns
// per block, 64 bytes per (block, 4 or 8 inputs) so one 64-byte load feeds 16 lanes of 4-byte dots:
//   int8: codes [N/16, K/4, 64] uint8, byte 4c + j = code of column c at input 4i + j, plus 128 (0..255:
//         vpdpbusd multiplies unsigned by signed bytes; the activations stay the signed side, so a row's
//         four bytes can be broadcast from memory), the 128 taken off exactly: int sum - 128 * sum(q).
//   int4: codes [N/16, K/8, 64] uint8, byte 4c + j: low nibble column c at input 8i + j, high nibble at
//         8i + 4 + j (both 0..15).
//   scales, offsets [N/16, K/G, 16] fp32: w = (code - 128) * scale (int8), code * scale + offset (int4).
// Per 32-input chunk c and row m: s = sum_k q[m, k] * code[k] (int32, exact), then
//   out += d[m, c] * scale * s (+ d[m, c] * sum_k q[m, k] * offset, int4).
// One OpenMP region per call: the threads split the (row, chunk) pairs to quantize, meet at a barrier, then split
// the column blocks; a pass holds kRows rows' accumulators in registers, so the weights of batch 1-8 are read
// once (AVX-512) and more rows re-read a block's codes from L1/L2 (passes as even as kMaxRows allows).
//
// On CPUs with AMX-INT8, calls of amx_from_rows rows or more get their int32 sums from tiles instead
// (quant_dot_amx.h), with the same result bit for bit.
//
// quant_linear.cpp's float path (weights dequantized in registers, fp32 activations) stays beside it: the
// wrapper (quant_linear.py) chooses by row count. On machines without AVX2 this file defines the op but
// quant_dot_isa() returns "" and the wrapper never calls it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#if defined(__linux__) && defined(__x86_64__)  // for quant_dot_amx.h and bf16_amx.h
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

#if defined(__linux__) && defined(__x86_64__)
// The CPU has AMX tiles and the tile feature in CPUID.(7,0):EDX bit `feature_bit` (22: bf16, 25: int8), and Linux
// grants this process the tile state (arch_prctl; asking again after a grant is harmless).
[[maybe_unused]] bool amx_granted(unsigned feature_bit) {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool tile = d & (1u << 24), feature = d & (1u << feature_bit);
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return tile && feature && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}
#endif

constexpr int kChunk = 32;  // activation inputs per int8 scale
constexpr int kCols = 16;   // output columns per weight block
constexpr int kGroupBytes = 64;  // codes per (block, 4 inputs) for int8, (block, 8 inputs) for int4

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FERRY_DOT_ISA "avx512-vnni"
typedef __m512i ireg;  // 16 int32 lanes = the block's 16 columns, or 64 code bytes
typedef __m512 freg;
constexpr int kRegs = 1;        // registers per 16 columns
#ifndef FERRY_DOT_MAX_ROWS  // (a -D for ops/bench/throughput/vnni_ab.py)
#define FERRY_DOT_MAX_ROWS 8
#endif
constexpr int kMaxRows = FERRY_DOT_MAX_ROWS;  // 2 accumulators per row: 16 of the 32 zmm
inline ireg load_codes(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline ireg izero() { return _mm512_setzero_si512(); }
inline ireg low_nibbles(ireg w) { return _mm512_and_si512(w, _mm512_set1_epi8(15)); }
inline ireg high_nibbles(ireg w) { return _mm512_and_si512(_mm512_srli_epi16(w, 4), _mm512_set1_epi8(15)); }
inline ireg sub_i(ireg a, int32_t b) { return _mm512_sub_epi32(a, _mm512_set1_epi32(b)); }
inline ireg add_i(ireg a, ireg b) { return _mm512_add_epi32(a, b); }
inline ireg shift8_i(ireg a) { return _mm512_slli_epi32(a, 8); }
inline freg to_f(ireg a) { return _mm512_cvtepi32_ps(a); }
inline freg fzero() { return _mm512_setzero_ps(); }
inline freg load_f(const float* p) { return _mm512_loadu_ps(p); }
inline freg splat_f(float v) { return _mm512_set1_ps(v); }
inline freg mul_f(freg a, freg b) { return _mm512_mul_ps(a, b); }
inline freg fma_f(freg a, freg b, freg c) { return _mm512_fmadd_ps(a, b, c); }
inline void store_f(float* p, freg v) { _mm512_storeu_ps(p, v); }
// Unsigned codes times the four signed activation bytes x4 (the same in every lane), summed per lane.
struct Codes {
  ireg w;
};
template <bool kSigned>
inline Codes prepare(ireg w) {
  return {w};
}
template <bool kSigned>
inline ireg dot(ireg acc, const Codes& c, const int8_t* x4) {
#if !defined(FERRY_DOT_NO_BCAST_ASM)
  // The four bytes broadcast by the dot itself ({1to16}), where GCC emits a vpbroadcastd per set1(load): half
  // the instructions of the inner loop, 3-5% sooner on Zen 4 (ops/bench/throughput/reports/20261205x-amd-vnni).
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(c.w), "m"(*reinterpret_cast<const int32_t*>(x4)));
  return acc;
#else
  int32_t v;
  std::memcpy(&v, x4, 4);
  return _mm512_dpbusd_epi32(acc, c.w, _mm512_set1_epi32(v));
#endif
}
constexpr bool kBiasedInt8 = true;  // int8 codes enter as code + 128, corrected afterwards
#elif defined(__AVX2__)
#define FERRY_DOT_ISA "avx2"
typedef __m256i ireg;  // 8 columns, or 32 code bytes
typedef __m256 freg;
constexpr int kRegs = 2;
constexpr int kMaxRows = 3;  // 4 accumulators per row: 12 of the 16 ymm
inline ireg load_codes(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline ireg izero() { return _mm256_setzero_si256(); }
inline ireg low_nibbles(ireg w) { return _mm256_and_si256(w, _mm256_set1_epi8(15)); }
inline ireg high_nibbles(ireg w) { return _mm256_and_si256(_mm256_srli_epi16(w, 4), _mm256_set1_epi8(15)); }
inline ireg sub_i(ireg a, int32_t b) { return _mm256_sub_epi32(a, _mm256_set1_epi32(b)); }
inline ireg add_i(ireg a, ireg b) { return _mm256_add_epi32(a, b); }
inline ireg shift8_i(ireg a) { return _mm256_slli_epi32(a, 8); }
inline freg to_f(ireg a) { return _mm256_cvtepi32_ps(a); }
inline freg fzero() { return _mm256_setzero_ps(); }
inline freg load_f(const float* p) { return _mm256_loadu_ps(p); }
inline freg splat_f(float v) { return _mm256_set1_ps(v); }
inline freg mul_f(freg a, freg b) { return _mm256_mul_ps(a, b); }
inline freg fma_f(freg a, freg b, freg c) { return _mm256_fmadd_ps(a, b, c); }
inline void store_f(float* p, freg v) { _mm256_storeu_ps(p, v); }
// vpmaddubsw adds two u8 x s8 products into a saturating int16: fine for int4 codes (2 * 15 * 127), not for
// int8 codes + 128 (2 * 255 * 127). int8 therefore multiplies |code| by the activation with code's sign
// (at most 2 * 128 * 127 = 32512), llama.cpp's way: signed codes, no correction afterwards.
struct Codes {
  ireg magnitude, sign;
};
template <bool kSigned>
inline Codes prepare(ireg w) {
  if constexpr (kSigned) {
    const ireg code = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // code + 128 -> code
    return {_mm256_abs_epi8(code), code};
  } else {
    return {w, w};
  }
}
template <bool kSigned>
inline ireg dot(ireg acc, const Codes& c, const int8_t* x4) {
  int32_t v;
  std::memcpy(&v, x4, 4);
  ireg x = _mm256_set1_epi32(v);
  if constexpr (kSigned) x = _mm256_sign_epi8(x, c.sign);
  const ireg pairs = _mm256_maddubs_epi16(c.magnitude, x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}
constexpr bool kBiasedInt8 = false;
#else
#define FERRY_DOT_ISA ""
#endif

// How many 32-input chunks ahead a block's first pass prefetches its codes, scales and offsets (into the next
// block's past the end: a thread's blocks are contiguous). 12 and 4 measured alike, 3% sooner than none over
// SmolLM2's step, gate_up (576 -> 3072) 8-20% at 1-32 rows (ops/bench/throughput/reports/20261205x-amd-vnni).
#ifndef FERRY_DOT_PREFETCH
#define FERRY_DOT_PREFETCH 12
#endif
constexpr int kPrefetchChunks = FERRY_DOT_PREFETCH;

struct DotPacked {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;  // int4 only
  int64_t k, group_size;
};

// Activations quantized per 32-input chunk as one or two int8 digits: x ~ d * (256 * q1 + q2) (digits 2) or
// d * q1 (digits 1, d then the chunk's absmax / 127); per (row, chunk) d, the digit sum sum(256 * q1 + q2) or
// sum(q1) as an int, and d times it.
struct QuantRows {
  std::vector<int8_t> q1, q2;  // [M, K] (AMX) or [K / 32, M, 32] (quantize_range); q2 unused with one digit
  std::vector<float> scale, scaled_sum;
  std::vector<int32_t> sum;
  int64_t rows = 0, chunks = 0;  // M, K / 32 of the call
};

#if defined(__AVX2__)

using ferry_cpu::kLanes;
using ferry_cpu::loadv;
using ferry_cpu::vecf;
typedef int32_t veci __attribute__((vector_size(4 * FERRY_CPU_LANES)));
typedef int8_t vecb __attribute__((vector_size(FERRY_CPU_LANES), aligned(1)));

inline veci round_to_int(vecf v) {  // to nearest, ties to even (the default rounding mode)
#if FERRY_CPU_LANES == 16
  return reinterpret_cast<veci>(_mm512_cvtps_epi32(reinterpret_cast<__m512>(v)));
#else
  return reinterpret_cast<veci>(_mm256_cvtps_epi32(reinterpret_cast<__m256>(v)));
#endif
}

// a * b - c rounded once: the second digit's remainder, written as the FMA GCC contracted it to anyway (so the
// rounding is the same on every build; the unit test reproduces it in float64).
inline vecf mul_sub(vecf a, vecf b, vecf c) {
#if FERRY_CPU_LANES == 16
  return reinterpret_cast<vecf>(_mm512_fmsub_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#else
  return reinterpret_cast<vecf>(_mm256_fmsub_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                reinterpret_cast<__m256>(c)));
#endif
}

// One 32-input chunk (vectorised: per call this ran at ~2 ns an input as scalar code, ~2 ms of a batch-8 step).
template <int kDigits>
inline void quantize_chunk(const float* x, int8_t* q1, int8_t* q2, float& scale, int32_t& sum) {
  constexpr int kVecs = kChunk / kLanes;
  vecf v[kVecs], absmax_v = {};
  for (int i = 0; i < kVecs; ++i) {
    v[i] = loadv(x + i * kLanes);
    const vecf a = reinterpret_cast<vecf>(reinterpret_cast<veci>(v[i]) & 0x7FFFFFFF);
    absmax_v = absmax_v > a ? absmax_v : a;
  }
  float absmax = 0.f;
#if FERRY_CPU_LANES == 16  // a shuffle tree (GCC made 15 scalar vmaxss of the loop below); max is exact either way
  absmax = _mm512_reduce_max_ps(reinterpret_cast<__m512>(absmax_v));
#else
  for (int j = 0; j < kLanes; ++j) absmax = std::max(absmax, absmax_v[j]);
#endif
  const float inv = absmax > 0.f ? 127.f / absmax : 0.f;
  veci sums = {};
  for (int i = 0; i < kVecs; ++i) {
    const vecf t = v[i] * inv;  // x in units of absmax / 127: |t| <= 127
    veci hi = round_to_int(t);
    hi = hi > 127 ? 127 : hi < -127 ? -127 : hi;
    *reinterpret_cast<vecb*>(q1 + i * kLanes) = __builtin_convertvector(hi, vecb);
    if constexpr (kDigits == 2) {  // the remainder, |t - hi| <= 1/2, in steps of 1/256 (128 clamped to 127)
      veci lo = round_to_int(mul_sub(v[i], vecf{} + inv, __builtin_convertvector(hi, vecf)) * 256.f);
      lo = lo > 127 ? 127 : lo < -127 ? -127 : lo;
      *reinterpret_cast<vecb*>(q2 + i * kLanes) = __builtin_convertvector(lo, vecb);
      sums += hi * 256 + lo;
    } else {
      sums += hi;
    }
  }
  sum = 0;
#if FERRY_CPU_LANES == 16
  sum = _mm512_reduce_add_epi32(reinterpret_cast<__m512i>(sums));
#else
  for (int j = 0; j < kLanes; ++j) sum += sums[j];
#endif
  scale = absmax / 127.f / (kDigits == 2 ? 256.f : 1.f);
}

// Pairs [begin, end) of the M * K / 32 (row, chunk) pairs, i = row * K / 32 + chunk, into r (already sized by
// size_rows). The digits go row-major ([M, K], the AMX tiles' layout) where chunk_major_rows is 0, else chunk-major
// ([K / 32, M, 32], M = chunk_major_rows): a register pass then finds each of its rows' 32 bytes of a chunk at a
// fixed distance from one pointer (row-major, 16 row pointers did not fit the integer registers and spilled).
void quantize_range(const float* x, QuantRows& r, int digits, int64_t begin, int64_t end, int64_t chunk_major_rows) {
  const int64_t chunks = r.chunks;
  for (int64_t i = begin; i < end; ++i) {
    const int64_t at = chunk_major_rows ? ((i % chunks) * chunk_major_rows + i / chunks) * kChunk : i * kChunk;
    if (digits == 2)
      quantize_chunk<2>(x + i * kChunk, &r.q1[at], &r.q2[at], r.scale[i], r.sum[i]);
    else
      quantize_chunk<1>(x + i * kChunk, &r.q1[at], nullptr, r.scale[i], r.sum[i]);
    r.scaled_sum[i] = r.scale[i] * static_cast<float>(r.sum[i]);
  }
}

// The calling thread's QuantRows, grown to hold M rows of K inputs (never shrunk, so a step's calls allocate and
// clear nothing: every element read is written by quantize_range first).
QuantRows& size_rows(int64_t m_rows, int64_t k, int digits) {
  thread_local QuantRows r;
  const auto grow = [](auto& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(size);
  };
  const int64_t n = m_rows * (k / kChunk);
  grow(r.q1, m_rows * k);
  if (digits == 2) grow(r.q2, m_rows * k);
  grow(r.scale, n);
  grow(r.scaled_sum, n);
  grow(r.sum, n);
  r.rows = m_rows;
  r.chunks = k / kChunk;
  return r;
}

// One 32-input chunk's int32 sums for kRows rows (256 * s1 + s2 with two digits): an accumulator per (digit, row),
// the codes unpacked per 64-byte group and shared by every row and digit. q1, q2: the pass's first row's 32
// bytes of this chunk, the others' at fixed distances (chunk-major digits). (One accumulator per row, the second
// digit's dots after a shift by 8, measured no faster: ops/bench/throughput/reports/20261205x-amd-vnni.)
template <int kBits, int kDigits, int kRows>
inline void chunk_sums(const uint8_t* cc, const int8_t* q1, const int8_t* q2, ireg (&s)[kRows][kRegs]) {
  constexpr bool kSigned = kBits == 8 && !kBiasedInt8;
  constexpr int kGroupsPerChunk = kBits == 8 ? kChunk / 4 : kChunk / 8;  // 64-byte code groups per chunk
  constexpr int kInputs = kBits == 8 ? 4 : 8;                             // inputs per group
  constexpr int kRegBytes = kGroupBytes / kRegs;
  ireg sums[kDigits][kRows][kRegs];
  for (int d = 0; d < kDigits; ++d)
    for (int m = 0; m < kRows; ++m)
      for (int h = 0; h < kRegs; ++h) sums[d][m][h] = izero();
#pragma GCC unroll 8
  for (int i = 0; i < kGroupsPerChunk; ++i)
    for (int h = 0; h < kRegs; ++h) {
      const ireg w = load_codes(cc + i * kGroupBytes + h * kRegBytes);
      const Codes lo = kBits == 8 ? prepare<kSigned>(w) : prepare<false>(low_nibbles(w));
      const Codes hi = kBits == 8 ? lo : prepare<false>(high_nibbles(w));
      for (int d = 0; d < kDigits; ++d)
        for (int m = 0; m < kRows; ++m) {
          const int8_t* q = (d == 0 ? q1 : q2) + m * kChunk + i * kInputs;
          sums[d][m][h] = dot<kSigned>(sums[d][m][h], lo, q);
          if constexpr (kBits == 4) sums[d][m][h] = dot<false>(sums[d][m][h], hi, q + 4);
        }
    }
  for (int m = 0; m < kRows; ++m)
    for (int h = 0; h < kRegs; ++h)
      s[m][h] = kDigits == 2 ? add_i(shift8_i(sums[0][m][h]), sums[kDigits - 1][m][h]) : sums[0][m][h];
}

// out[m, block's columns] for kRows rows starting at row0.
template <int kBits, int kDigits, int kRows>
void block_rows(const DotPacked& p, const QuantRows& x, int64_t row0, int64_t block, float* out, int64_t n,
                int group_shift) {
  constexpr int kGroupsPerChunk = kBits == 8 ? kChunk / 4 : kChunk / 8;
  const int64_t chunks = p.k / kChunk, groups = p.k / p.group_size;
  const uint8_t* codes = p.codes + block * chunks * kGroupsPerChunk * kGroupBytes;
  const float* scales = p.scales + block * groups * kCols;
  const float* offsets = kBits == 4 ? p.offsets + block * groups * kCols : nullptr;
  const int64_t m_rows = x.rows;  // chunk-major digits: [chunks, M, 32]
  const int8_t* q1 = x.q1.data() + row0 * kChunk;
  const int8_t* q2 = kDigits == 2 ? x.q2.data() + row0 * kChunk : nullptr;
  freg acc[kRows][kRegs];
  for (int m = 0; m < kRows; ++m)
    for (int h = 0; h < kRegs; ++h) acc[m][h] = fzero();
  for (int64_t c = 0; c < chunks; ++c) {
    if (kPrefetchChunks > 0 && row0 == 0) {  // the first pass streams the block's codes (the next block's beyond)
      for (int i = 0; i < kGroupsPerChunk; ++i)
        _mm_prefetch(reinterpret_cast<const char*>(codes + ((c + kPrefetchChunks) * kGroupsPerChunk + i) * kGroupBytes),
                     _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(scales + ((c + kPrefetchChunks) >> group_shift) * kCols), _MM_HINT_T0);
      if constexpr (kBits == 4)
        _mm_prefetch(reinterpret_cast<const char*>(offsets + ((c + kPrefetchChunks) >> group_shift) * kCols),
                     _MM_HINT_T0);
    }
    ireg sums[kRows][kRegs];
    chunk_sums<kBits, kDigits, kRows>(codes + c * kGroupsPerChunk * kGroupBytes, q1 + c * m_rows * kChunk,
                                      kDigits == 2 ? q2 + c * m_rows * kChunk : nullptr, sums);
    const int64_t g = c >> group_shift;
    for (int m = 0; m < kRows; ++m) {
      const int64_t rc = (row0 + m) * chunks + c;
      const freg d = splat_f(x.scale[rc]);
      for (int h = 0; h < kRegs; ++h) {
        const freg scale = load_f(scales + g * kCols + h * (kCols / kRegs));
        ireg s = sums[m][h];
        if constexpr (kBits == 8 && kBiasedInt8) s = sub_i(s, 128 * x.sum[rc]);
        acc[m][h] = fma_f(to_f(s), mul_f(d, scale), acc[m][h]);
        if constexpr (kBits == 4)
          acc[m][h] = fma_f(splat_f(x.scaled_sum[rc]), load_f(offsets + g * kCols + h * (kCols / kRegs)), acc[m][h]);
      }
    }
  }
  const int64_t col = block * kCols, valid = std::min<int64_t>(kCols, n - col);
  for (int m = 0; m < kRows; ++m) {
    float row[kCols];
    for (int h = 0; h < kRegs; ++h) store_f(row + h * (kCols / kRegs), acc[m][h]);
    std::copy(row, row + valid, out + (row0 + m) * n + col);
  }
}

// Column blocks [begin, end), every row, in passes of as even a size as kMaxRows allows (9 rows: 5 + 4, not
// 8 + 1: a one-row pass is a single chain of dependent dots).
template <int kBits, int kDigits>
void dot_blocks(const DotPacked& p, const QuantRows& x, int64_t m_rows, int64_t n, float* out, int64_t begin,
                int64_t end) {
  const int64_t passes = (m_rows + kMaxRows - 1) / kMaxRows, per_pass = (m_rows + passes - 1) / passes;
  const int group_shift = __builtin_ctzll(p.group_size / kChunk);  // 32, 64, 128 inputs: 0, 1, 2
  for (int64_t block = begin; block < end; ++block)
    for (int64_t m = 0; m < m_rows; m += per_pass)
      ferry_cpu::with_rows<kMaxRows>(std::min<int64_t>(per_pass, m_rows - m), [&](auto rows) {
        block_rows<kBits, kDigits, decltype(rows)::value>(p, x, m, block, out, n, group_shift);
      });
}

// Quantizes x and multiplies in one parallel region: each thread quantizes its share of the (row, chunk) pairs,
// waits for the others at a barrier, then computes its share of the column blocks (one fork per call, and the
// quantization split over the threads instead of run before them on one).
template <int kBits, int kDigits>
void run(const DotPacked& p, const float* xf, QuantRows& x, int64_t m_rows, int64_t n, float* out) {
  const int64_t blocks = (n + kCols - 1) / kCols, pairs = m_rows * (p.k / kChunk);
#if defined(_OPENMP)
  const int threads = at::in_parallel_region() ? 1 : static_cast<int>(std::min<int64_t>(at::get_num_threads(), blocks));
#pragma omp parallel num_threads(threads)
  {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    quantize_range(xf, x, kDigits, pairs * t / nt, pairs * (t + 1) / nt, m_rows);
#pragma omp barrier
    dot_blocks<kBits, kDigits>(p, x, m_rows, n, out, blocks * t / nt, blocks * (t + 1) / nt);
  }
#else
  quantize_range(xf, x, kDigits, 0, pairs, m_rows);
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    dot_blocks<kBits, kDigits>(p, x, m_rows, n, out, begin, end);
  });
#endif
}

#endif  // __AVX2__

#include "quant_dot_amx.h"  // run_amx, amx_int8_usable
#include "bf16_amx.h"       // bf16_amx_linear, amx_bf16_usable
#include "bf16_dot.h"       // bf16_dot_linear, bf16_dot_usable

std::string quant_dot_isa() { return FERRY_DOT_ISA; }

// x [M, K] fp32 contiguous; codes, scales, offsets in pack_for_dot's layout (offsets: int4 only, else an empty
// tensor); n: the real output columns (the blocks may be padded); amx_from_rows: calls of this many rows or
// more take the AMX int8 tiles where amx_int8_usable() (the same output), 0: never -> [M, n] fp32.
at::Tensor quant_dot_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                            const at::Tensor& offsets, int64_t bits, int64_t group_size, int64_t n,
                            int64_t digits, int64_t amx_from_rows) {
  TORCH_CHECK(!quant_dot_isa().empty(), "quant_dot_linear: built without AVX2 (see quant_dot_isa())");
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "bits: ", bits, ", expected 8 or 4");
  TORCH_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128, "group_size: ", group_size);
  TORCH_CHECK_VALUE(digits == 1 || digits == 2, "digits: ", digits, ", expected 1 or 2");
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat);
  const int64_t m_rows = x.size(0), k = x.size(1), blocks = (n + kCols - 1) / kCols;
  const int64_t inputs_per_group = bits == 8 ? 4 : 8;
  TORCH_CHECK_VALUE(codes.dim() == 3 && codes.size(0) == blocks && codes.size(1) * inputs_per_group == k &&
                        codes.size(2) == kGroupBytes && k % group_size == 0,
                    "x [", m_rows, ", ", k, "] does not fit packed codes ", codes.sizes(), " for ", n, " outputs");
  TORCH_INTERNAL_ASSERT(codes.is_contiguous() && codes.scalar_type() == at::kByte && scales.is_contiguous() &&
                        scales.scalar_type() == at::kFloat && scales.numel() == blocks * (k / group_size) * kCols);
  TORCH_INTERNAL_ASSERT(bits == 8 || (offsets.is_contiguous() && offsets.scalar_type() == at::kFloat &&
                                      offsets.numel() == scales.numel()));
  auto out = at::empty({m_rows, n}, x.options());
#if defined(__AVX2__)
  QuantRows& q = size_rows(m_rows, k, static_cast<int>(digits));
  const DotPacked p{codes.data_ptr<uint8_t>(), scales.data_ptr<float>(),
                    bits == 4 ? offsets.data_ptr<float>() : nullptr, k, group_size};
  float* o = out.data_ptr<float>();
#if defined(FERRY_AMX_INT8_BUILT)
  if (amx_from_rows > 0 && m_rows >= amx_from_rows && amx_int8_usable()) {
    amx_calls.fetch_add(1, std::memory_order_relaxed);
    quantize_range(x.data_ptr<float>(), q, static_cast<int>(digits), 0, m_rows * (k / kChunk), 0);
    if (bits == 8)
      digits == 2 ? run_amx<8, 2>(p, q, m_rows, n, o) : run_amx<8, 1>(p, q, m_rows, n, o);
    else
      digits == 2 ? run_amx<4, 2>(p, q, m_rows, n, o) : run_amx<4, 1>(p, q, m_rows, n, o);
    return out;
  }
#endif
  const float* xf = x.data_ptr<float>();
  if (bits == 8)
    digits == 2 ? run<8, 2>(p, xf, q, m_rows, n, o) : run<8, 1>(p, xf, q, m_rows, n, o);
  else
    digits == 2 ? run<4, 2>(p, xf, q, m_rows, n, o) : run<4, 1>(p, xf, q, m_rows, n, o);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ferry_cpu, m) {
  m.def("quant_dot_isa() -> str", &quant_dot_isa);
  m.def("quant_dot_amx() -> bool", &amx_int8_usable);
  m.def("quant_dot_amx_calls() -> int", [] { return amx_calls.load(); });
  m.def("bf16_amx() -> bool", &amx_bf16_usable);
  m.def("bf16_amx_calls() -> int", [] { return amx_bf16_calls.load(); });
  m.def("bf16_amx_linear(Tensor x, Tensor packed, int n, bool out_bf16=False, int prefetch_bytes=0) -> Tensor",
        &bf16_amx_linear);
  m.def("bf16_dot() -> bool", &bf16_dot_usable);
  m.def("bf16_dot_calls() -> int", [] { return bf16_dot_calls.load(); });
  m.def("bf16_dot_linear(Tensor x, Tensor packed, int n, bool out_bf16=False, int prefetch_bytes=0) -> Tensor",
        &bf16_dot_linear);
  m.def(
      "quant_dot_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, int n, "
      "int digits, int amx_from_rows=0) -> Tensor",
      &quant_dot_linear);
}
