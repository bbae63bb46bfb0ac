// Matmul with group-wise int8 / int4 weights, dequantized in registers: out [M, N] = x [M, K] @ W.T where
// W's row n, group g is q * scale (int8) or u * scale + offset (int4), the layout of ferry/kernels/quant_ref.py.
//
// A decode step at small batch is bound by streaming the weights from memory; int8 codes are a quarter of
// fp32's bytes and int4 an eighth. Each weight vector is loaded once, widened to fp32, scaled, and used
// for up to kRowsPerPass rows of x held in accumulators; a longer batch walks its rows in passes of
// kRowsPerPass over a block of weight rows that is still in L2. Threads split the weight rows
// (at::parallel_for), so every byte of the weight is read by one thread only.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <cstdint>

namespace {

using namespace ferry_cpu;

constexpr int kRowsPerPass = 8;   // x rows sharing each dequantized weight vector: 8 accumulators + 2 loads fit 16 registers
constexpr int64_t kBlockRows = 32;  // weight rows per block: 32 rows of K <= 4096 int8 codes stay in L2 between passes

typedef int32_t veci __attribute__((vector_size(4 * FERRY_CPU_LANES)));

// kLanes int8 codes widened to int32.
inline veci load_i8(const int8_t* p) {
#if FERRY_CPU_LANES == 16
  return reinterpret_cast<veci>(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<veci>(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef int8_t vec8 __attribute__((vector_size(FERRY_CPU_LANES), aligned(1)));
  return __builtin_convertvector(*reinterpret_cast<const vec8*>(p), veci);
#endif
}

// kLanes bytes zero-extended to int32.
inline veci load_u8(const uint8_t* p) {
#if FERRY_CPU_LANES == 16
  return reinterpret_cast<veci>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return reinterpret_cast<veci>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  typedef uint8_t vec8 __attribute__((vector_size(FERRY_CPU_LANES), aligned(1)));
  return __builtin_convertvector(*reinterpret_cast<const vec8*>(p), veci);
#endif
}

inline vecf to_vecf(veci v) { return __builtin_convertvector(v, vecf); }
inline vecf splat(float v) { return vecf{} + v; }

struct Weights {
  const uint8_t* codes;  // row-major [N, K * kBits / 8]
  const float* scales;   // [N, K / G]
  const float* offsets;  // [N, K / G], or nullptr: symmetric int4 (offset -8 * scale)
  int64_t k;             // input features
};

// out[m * ldo] = x[m] . W[n] for kRows rows of x (row stride k), one weight row n. Two accumulator sets when
// few rows: one FMA chain per row would wait on its own latency.
template <int kBits, int kG, int kRows>
inline void dot_row(const Weights& w, int64_t n, const float* x, float* out, int64_t ldo) {
  constexpr bool kTwoSets = kRows <= 4;
  vecf acc[kRows] = {}, acc2[kRows] = {};
  const int64_t groups = w.k / kG;
  const uint8_t* row = w.codes + n * (w.k * kBits / 8);
  const float* scales = w.scales + n * groups;
  const float* offsets = w.offsets ? w.offsets + n * groups : nullptr;
  for (int64_t g = 0; g < groups; ++g) {
    const vecf scale = splat(scales[g]);
    const float* xg = x + g * kG;
    if constexpr (kBits == 8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row) + g * kG;
#pragma GCC unroll 8
      for (int i = 0; i < kG; i += kLanes) {
        const vecf wv = to_vecf(load_i8(q + i)) * scale;
        const bool second = kTwoSets && (i / kLanes) % 2;
#pragma GCC unroll 8
        for (int m = 0; m < kRows; ++m) (second ? acc2[m] : acc[m]) += loadv(xg + m * w.k + i) * wv;
      }
    } else {
      const vecf offset = offsets ? splat(offsets[g]) : scale * -8.f;
      const uint8_t* q = row + g * (kG / 2);
#pragma GCC unroll 4
      for (int i = 0; i < kG / 2; i += kLanes) {
        const veci bytes = load_u8(q + i);
        const vecf lo = to_vecf(bytes & 15) * scale + offset;  // weights i .. i + kLanes of the group
        const vecf hi = to_vecf(bytes >> 4) * scale + offset;  // weights kG/2 + i ..
#pragma GCC unroll 8
        for (int m = 0; m < kRows; ++m) {
          acc[m] += loadv(xg + m * w.k + i) * lo;
          (kTwoSets ? acc2[m] : acc[m]) += loadv(xg + m * w.k + kG / 2 + i) * hi;
        }
      }
    }
  }
  for (int m = 0; m < kRows; ++m) out[m * ldo] = hsum(acc[m] + acc2[m]);
}

template <int kBits, int kG>
void pass_rows(const Weights& w, int64_t n_begin, int64_t n_end, const float* x, int rows, float* out, int64_t ldo) {
  for (int64_t n = n_begin; n < n_end; ++n) {
    switch (rows) {
#define FERRY_ROWS_CASE(R) \
  case R: dot_row<kBits, kG, R>(w, n, x, out + n, ldo); break;
      FERRY_ROWS_CASE(1)
      FERRY_ROWS_CASE(2)
      FERRY_ROWS_CASE(3)
      FERRY_ROWS_CASE(4)
      FERRY_ROWS_CASE(5)
      FERRY_ROWS_CASE(6)
      FERRY_ROWS_CASE(7)
      FERRY_ROWS_CASE(8)
#undef FERRY_ROWS_CASE
      default: TORCH_INTERNAL_ASSERT(false);
    }
  }
}

template <int kBits, int kG>
void run(const Weights& w, const float* x, int64_t m_rows, int64_t n_rows, float* out) {
  at::parallel_for(0, n_rows, kBlockRows, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; block += kBlockRows) {
      const int64_t block_end = std::min(block + kBlockRows, end);
      for (int64_t m = 0; m < m_rows; m += kRowsPerPass) {
        const int rows = static_cast<int>(std::min<int64_t>(kRowsPerPass, m_rows - m));
        pass_rows<kBits, kG>(w, block, block_end, x + m * w.k, rows, out + m * n_rows, n_rows);
      }
    }
  });
}

// x [M, K] fp32 contiguous; qweight int8 [N, K] (bits 8) or uint8 [N, K/2] (bits 4); scales, offsets fp32
// [N, K/G] contiguous (offsets: an empty tensor for none) -> [M, N] fp32.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales,
                        const at::Tensor& offsets, int64_t bits, int64_t group_size) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "bits: ", bits, ", expected 8 or 4");
  TORCH_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128, "group_size: ", group_size);
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat);
  TORCH_INTERNAL_ASSERT(qweight.dim() == 2 && qweight.is_contiguous() && scales.is_contiguous());
  const int64_t m_rows = x.size(0), k = x.size(1), n_rows = qweight.size(0);
  TORCH_CHECK_VALUE(qweight.size(1) * (8 / bits) == k && k % group_size == 0, "x [", m_rows, ", ", k,
                    "] does not fit qweight ", qweight.sizes(), " with group_size ", group_size);
  TORCH_INTERNAL_ASSERT(scales.scalar_type() == at::kFloat && scales.numel() == n_rows * (k / group_size));
  const bool has_offsets = offsets.numel() > 0;
  TORCH_INTERNAL_ASSERT(!has_offsets || (bits == 4 && offsets.is_contiguous() && offsets.scalar_type() == at::kFloat &&
                                         offsets.numel() == scales.numel()));
  auto out = at::empty({m_rows, n_rows}, x.options());
  const Weights w{static_cast<const uint8_t*>(qweight.data_ptr()), scales.data_ptr<float>(),
                  has_offsets ? offsets.data_ptr<float>() : nullptr, k};
  const float* xd = x.data_ptr<float>();
  float* od = out.data_ptr<float>();
#define FERRY_QUANT_CASE(B, G) \
  if (bits == B && group_size == G) return run<B, G>(w, xd, m_rows, n_rows, od), out;
  FERRY_QUANT_CASE(8, 32)
  FERRY_QUANT_CASE(8, 64)
  FERRY_QUANT_CASE(8, 128)
  FERRY_QUANT_CASE(4, 32)
  FERRY_QUANT_CASE(4, 64)
  FERRY_QUANT_CASE(4, 128)
#undef FERRY_QUANT_CASE
  TORCH_INTERNAL_ASSERT(false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ferry_cpu, m) {
  m.def("quant_linear(Tensor x, Tensor qweight, Tensor scales, Tensor offsets, int bits, int group_size) -> Tensor",
        &quant_linear);
}
