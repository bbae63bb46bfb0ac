// Matmul with group-wise int8 / int4 weights, dequantized in registers: out [M, N] = x [M, K] @ W.T, W in the
// column-blocked layout of ferry/kernels/quant_pack.py (built once at load from quant_ref.py's):
//   int8: codes [N/16, K, 16] int8, scales [N/16, K/G, 16]: for each input k, the 16 codes of a block of
//         16 output columns sit side by side, so one vector load gives 16 weights for 16 outputs.
//   int4: codes [N/32, K, 16] uint8, low nibble column j, high nibble column 16 + j of a 32-column block;
//         scales and offsets [N/32, K/G, 32] (w = u * scale + offset).
// Per input k: the block's codes are widened, scaled and used by every row of x in the pass (one
// broadcast and one FMA per row and vector), accumulating whole output vectors: no horizontal sums.
// Weights are read once per pass; a batch longer than a pass re-reads the block from L1/L2 (K x 16
// bytes). Threads split the column blocks (at::parallel_for), so each weight byte is read by one thread.
//
// Why this layout: a decode step at batch 1-8 streams every weight once and does few FLOPs per byte, so
// what counts is bytes (int8: a quarter of fp32, int4: an eighth) and instructions per weight vector
// (load+widen, convert, scale, then per row broadcast + FMA); K-major rows needed a horizontal sum per
// output and row and held fewer outputs in registers.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

using namespace ferry_cpu;

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

// a * b + c as one FMA instruction: with -fassociative-math GCC otherwise regroups `acc += x * w` over
// the unrolled loop into multiplies and adds.
inline vecf fma(vecf a, vecf b, vecf c) {
#if FERRY_CPU_LANES == 16
  return reinterpret_cast<vecf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<vecf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

constexpr int kCodeBytes = 16;  // bytes of codes per (block, k): 16 int8 columns, or 32 int4 columns
// Accumulator registers a pass may use: half of the vector registers (32 zmm with AVX-512, else 16).
constexpr int kAccRegs = FERRY_CPU_LANES == 16 ? 16 : 8;

template <int kBits>
struct Layout {
  static constexpr int kCols = kBits == 8 ? 16 : 32;  // output columns per block
  static constexpr int kVecs = kCols / kLanes;         // vectors per block row
  static constexpr int kMaxRows = std::min(8, kAccRegs / kVecs);
};

struct Packed {
  const uint8_t* codes;
  const float* scales;
  const float* offsets;  // int4 only
  int64_t k;
};

// Independent accumulator copies a pass keeps so that enough FMA chains run at once to hide the FMA
// latency (~4 cycles, 2 per cycle): a batch-1 int8 pass has a single chain otherwise, one FMA per 4 cycles.
template <int kBits, int kRows>
constexpr int kSplit = kRows * Layout<kBits>::kVecs >= 8 ? 1 : kRows * Layout<kBits>::kVecs >= 4 ? 2
                       : kRows * Layout<kBits>::kVecs >= 2 ? 4 : 8;

// The block's weight vectors at input k: codes widened, scaled (and offset, int4).
template <int kBits>
inline void dequant_row(const uint8_t* row, const vecf* scale, const vecf* offset, vecf* w) {
  constexpr int kVecs = Layout<kBits>::kVecs;
  if constexpr (kBits == 8) {
    for (int c = 0; c < kVecs; ++c) w[c] = to_vecf(load_i8(reinterpret_cast<const int8_t*>(row) + c * kLanes)) * scale[c];
  } else {
    for (int c = 0; c < kVecs / 2; ++c) {
      const veci bytes = load_u8(row + c * kLanes);
      w[c] = fma(to_vecf(bytes & 15), scale[c], offset[c]);
      w[c + kVecs / 2] = fma(to_vecf(bytes >> 4), scale[c + kVecs / 2], offset[c + kVecs / 2]);
    }
  }
}

// acc[m][:] = x[m] . W[block] for kRows rows of x (stride ldx), one column block.
template <int kBits, int kG, int kRows>
inline void block_pass(const Packed& p, int64_t block, const float* x, int64_t ldx, vecf (*acc)[Layout<kBits>::kVecs]) {
  constexpr int kCols = Layout<kBits>::kCols, kVecs = Layout<kBits>::kVecs, kCopies = kSplit<kBits, kRows>;
  static_assert(kG % kCopies == 0);
  const int64_t groups = p.k / kG;
  const uint8_t* codes = p.codes + block * p.k * kCodeBytes;
  const float* scales = p.scales + block * groups * kCols;
  const float* offsets = kBits == 4 ? p.offsets + block * groups * kCols : nullptr;
  vecf part[kCopies][kRows][kVecs];
  for (int s = 0; s < kCopies; ++s)
    for (int m = 0; m < kRows; ++m)
      for (int c = 0; c < kVecs; ++c) part[s][m][c] = vecf{};
  for (int64_t g = 0; g < groups; ++g) {
    vecf scale[kVecs], offset[kVecs];
    for (int c = 0; c < kVecs; ++c) {
      scale[c] = loadv(scales + g * kCols + c * kLanes);
      if constexpr (kBits == 4) offset[c] = loadv(offsets + g * kCols + c * kLanes);
    }
#pragma GCC unroll 2
    for (int64_t k = g * kG; k < (g + 1) * kG; k += kCopies) {
#pragma GCC unroll 8
      for (int s = 0; s < kCopies; ++s) {
        vecf w[kVecs];
        dequant_row<kBits>(codes + (k + s) * kCodeBytes, scale, offset, w);
#pragma GCC unroll 8
        for (int m = 0; m < kRows; ++m) {
          const vecf xb = splat(x[m * ldx + k + s]);
          for (int c = 0; c < kVecs; ++c) part[s][m][c] = fma(xb, w[c], part[s][m][c]);
        }
      }
    }
  }
  for (int m = 0; m < kRows; ++m)
    for (int c = 0; c < kVecs; ++c) {
      acc[m][c] = part[0][m][c];
      for (int s = 1; s < kCopies; ++s) acc[m][c] += part[s][m][c];
    }
}

template <int kBits, int kG, int kRows>
void block_rows(const Packed& p, int64_t block, const float* x, float* out, int64_t n) {
  constexpr int kCols = Layout<kBits>::kCols, kVecs = Layout<kBits>::kVecs;
  vecf acc[kRows][kVecs];
  block_pass<kBits, kG, kRows>(p, block, x, p.k, acc);
  const int64_t col = block * kCols, valid = std::min<int64_t>(kCols, n - col);
  for (int m = 0; m < kRows; ++m) {
    if (valid == kCols) {
      for (int c = 0; c < kVecs; ++c) storev(out + m * n + col + c * kLanes, acc[m][c]);
    } else {  // the last block of an N that is not a multiple of kCols: its padding columns are dropped
      float tail[kCols];
      for (int c = 0; c < kVecs; ++c) storev(tail + c * kLanes, acc[m][c]);
      std::copy(tail, tail + valid, out + m * n + col);
    }
  }
}

template <int kBits, int kG>
void run(const Packed& p, const float* x, int64_t m_rows, int64_t n, float* out) {
  constexpr int kMax = Layout<kBits>::kMaxRows;
  const int64_t blocks = (n + Layout<kBits>::kCols - 1) / Layout<kBits>::kCols;
  at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      for (int64_t m = 0; m < m_rows; m += kMax) {
        const float* xm = x + m * p.k;
        float* om = out + m * n;
        ferry_cpu::with_rows<kMax>(std::min<int64_t>(kMax, m_rows - m), [&](auto rows) {
          block_rows<kBits, kG, decltype(rows)::value>(p, block, xm, om, n);
        });
      }
    }
  });
}

// Many rows (prefill, large decode batches): a register pass holds only kMaxRows rows (2 for int4 on AVX2),
// so every weight was dequantized M/2 times. Here a thread dequantizes its block once into an fp32 buffer
// (panel-major: [panels, K, panel width], L2-resident) and a register-blocked GEMM reads it for all M
// rows: 6 rows x 2 vectors of accumulators (the usual AVX2 6x16 tile: 12 accumulators, 2 weight vectors,
// 1 broadcast), rows outermost so a row group's x stays in L1 across the block's panels. Per k and row
// the sum is one FMA into one accumulator, as in block_pass with kSplit 1: the same results bit for bit.
template <int kBits>
struct Tile {
  static constexpr int kPanelVecs = std::min(2, Layout<kBits>::kVecs);
  static constexpr int kPanelCols = kPanelVecs * kLanes;
  static constexpr int kPanels = Layout<kBits>::kCols / kPanelCols;
  static constexpr int kRows = 12 / kPanelVecs;
};

template <int kBits, int kG>
void dequant_block(const Packed& p, int64_t block, float* w) {
  constexpr int kCols = Layout<kBits>::kCols, kVecs = Layout<kBits>::kVecs, kPV = Tile<kBits>::kPanelVecs;
  const int64_t groups = p.k / kG;
  const uint8_t* codes = p.codes + block * p.k * kCodeBytes;
  const float* scales = p.scales + block * groups * kCols;
  const float* offsets = kBits == 4 ? p.offsets + block * groups * kCols : nullptr;
  for (int64_t g = 0; g < groups; ++g) {
    vecf scale[kVecs], offset[kVecs];
    for (int c = 0; c < kVecs; ++c) {
      scale[c] = loadv(scales + g * kCols + c * kLanes);
      if constexpr (kBits == 4) offset[c] = loadv(offsets + g * kCols + c * kLanes);
    }
    for (int64_t k = g * kG; k < (g + 1) * kG; ++k) {
      vecf v[kVecs];
      dequant_row<kBits>(codes + k * kCodeBytes, scale, offset, v);
      for (int c = 0; c < kVecs; ++c)
        storev(w + (c / kPV) * p.k * Tile<kBits>::kPanelCols + k * Tile<kBits>::kPanelCols + (c % kPV) * kLanes, v[c]);
    }
  }
}

// out[m, :valid] = x[m] . panel for kRows rows (x stride k, out stride n); panel [k, kPV * kLanes].
template <int kPV, int kRows>
inline void panel_rows(const float* panel, const float* x, int64_t k, float* out, int64_t n, int64_t valid) {
  vecf acc[kRows][kPV];
  for (int m = 0; m < kRows; ++m)
    for (int c = 0; c < kPV; ++c) acc[m][c] = vecf{};
  for (int64_t kk = 0; kk < k; ++kk) {
    vecf w[kPV];
    for (int c = 0; c < kPV; ++c) w[c] = loadv(panel + kk * kPV * kLanes + c * kLanes);
#pragma GCC unroll 12
    for (int m = 0; m < kRows; ++m) {
      const vecf xb = splat(x[m * k + kk]);
      for (int c = 0; c < kPV; ++c) acc[m][c] = fma(xb, w[c], acc[m][c]);
    }
  }
  for (int m = 0; m < kRows; ++m) {
    float row[kPV * kLanes];
    for (int c = 0; c < kPV; ++c) storev(row + c * kLanes, acc[m][c]);
    std::copy(row, row + valid, out + m * n);
  }
}

template <int kBits, int kG>
void run_tiled(const Packed& p, const float* x, int64_t m_rows, int64_t n, float* out) {
  using T = Tile<kBits>;
  constexpr int kCols = Layout<kBits>::kCols, kPV = T::kPanelVecs, kMax = T::kRows;
  const int64_t blocks = (n + kCols - 1) / kCols;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(p.k * kCols);
    for (int64_t block = begin; block < end; ++block) {
      dequant_block<kBits, kG>(p, block, w.data());
      for (int64_t m = 0; m < m_rows; m += kMax) {
        for (int panel = 0; panel < T::kPanels; ++panel) {
          const int64_t col = block * kCols + panel * T::kPanelCols;
          const int64_t valid = std::min<int64_t>(T::kPanelCols, n - col);
          if (valid <= 0) break;
          const float* wp = w.data() + panel * p.k * T::kPanelCols;
          const float* xm = x + m * p.k;
          float* om = out + m * n + col;
          switch (std::min<int64_t>(kMax, m_rows - m)) {
#define FERRY_TILE_CASE(R)                                                     \
  case R:                                                                      \
    if constexpr (R <= kMax) panel_rows<kPV, R>(wp, xm, p.k, om, n, valid); \
    break;
            FERRY_TILE_CASE(1)
            FERRY_TILE_CASE(2)
            FERRY_TILE_CASE(3)
            FERRY_TILE_CASE(4)
            FERRY_TILE_CASE(5)
            FERRY_TILE_CASE(6)
            FERRY_TILE_CASE(7)
            FERRY_TILE_CASE(8)
            FERRY_TILE_CASE(9)
            FERRY_TILE_CASE(10)
            FERRY_TILE_CASE(11)
            FERRY_TILE_CASE(12)
#undef FERRY_TILE_CASE
            default: TORCH_INTERNAL_ASSERT(false);
          }
        }
      }
    }
  });
}

// x [M, K] fp32 contiguous; codes, scales, offsets in the packed layout above (offsets: int4 only, else an
// empty tensor); n: the real output columns (the packed blocks may be padded) -> [M, n] fp32. From
// tiled_from_rows rows on, the dequantize-once path (run_tiled), else register passes (run).
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& offsets, int64_t bits, int64_t group_size, int64_t n,
                        int64_t tiled_from_rows) {
  TORCH_CHECK_VALUE(bits == 8 || bits == 4, "bits: ", bits, ", expected 8 or 4");
  TORCH_CHECK_VALUE(group_size == 32 || group_size == 64 || group_size == 128, "group_size: ", group_size);
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kFloat);
  const int64_t m_rows = x.size(0), k = x.size(1), cols = bits == 8 ? 16 : 32;
  const int64_t blocks = (n + cols - 1) / cols;
  TORCH_CHECK_VALUE(codes.dim() == 3 && codes.size(0) == blocks && codes.size(1) == k && codes.size(2) == kCodeBytes &&
                        k % group_size == 0,
                    "x [", m_rows, ", ", k, "] does not fit packed codes ", codes.sizes(), " for ", n, " outputs");
  TORCH_INTERNAL_ASSERT(codes.is_contiguous() && scales.is_contiguous() && scales.scalar_type() == at::kFloat &&
                        scales.numel() == blocks * (k / group_size) * cols);
  TORCH_INTERNAL_ASSERT(bits == 8 || (offsets.is_contiguous() && offsets.scalar_type() == at::kFloat &&
                                      offsets.numel() == scales.numel()));
  auto out = at::empty({m_rows, n}, x.options());
  const Packed p{static_cast<const uint8_t*>(codes.data_ptr()), scales.data_ptr<float>(),
                 bits == 4 ? offsets.data_ptr<float>() : nullptr, k};
  const float* xd = x.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const bool tiled = m_rows >= tiled_from_rows;
#define FERRY_QUANT_CASE(B, G)                                                                          \
  if (bits == B && group_size == G)                                                                     \
    return (tiled ? run_tiled<B, G>(p, xd, m_rows, n, od) : run<B, G>(p, xd, m_rows, n, od)), out;
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
  m.def(
      "quant_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int bits, int group_size, int n, "
      "int tiled_from_rows) -> Tensor",
      &quant_linear);
}
