// A bf16 GEMM on AVX512_BF16 (`vdpbf16ps`) for the bf16 weight copies on CPUs without AMX (AMD Zen 4/5, Cooper
// Lake): out [M, N] = x [M, K] @ W.T, with bf16_amx_linear's arguments and weight layout (pack_bf16_amx), so a copy
// packed once serves whichever of the two kernels the CPU runs. Written because oneDNN's bf16 GEMM was poor at the
// row counts of a decode step (16-64 rows) on a 2-core AMD EPYC.
//
// The layout already suits vdpbf16ps: a B tile's row (64 bytes) is one input pair of 16 columns, [16 columns x 2
// inputs], i.e. one zmm whose lane c dots column c's pair with an x pair broadcast to every lane. A pass holds kRows
// rows x 32 columns (one column group: 2 zmm a row) of fp32 sums in registers and walks the K pairs once: per pair,
// 2 weight loads and kRows broadcasts feed 2 * kRows vdpbf16ps. Per column group, the passes over the rows follow
// each other, so the group's weights (K * 64 bytes: 36 KB at K = 576, 96 KB at K = 1536) come from memory on the
// first pass (software prefetch_bytes ahead) and from L2 on the next ones. Threads split the column groups; a
// thread's groups are contiguous, so its weight bytes are one stream. Calls of more than kBfRowBlock rows run in
// row blocks as bf16_amx_linear does.
//
// Rounding: each output lane is one fp32 chain over the pairs in order, and vdpbf16ps adds a pair's two (exact)
// bf16 products one after the other, the odd input's first, each rounded to fp32 (nearest even; denormals flushed):
// tests/unit/test_bf16_dot.py checks this bit for bit against torch doing the same sums.
//
// Included by quant_dot.cpp after bf16_amx.h (bf16_padded_rows, bf16 layout constants), inside its anonymous
// namespace; built where bf16_amx.h's conversions are (FERRY_BF16_ROWS_BUILT), elsewhere bf16_dot_usable() is false.

constexpr int kDotMaxRows = 12;  // rows a pass: 24 accumulators + 2 weights + a broadcast of the 32 zmm
// Row blocks of this many rows or more (prefill) run passes of 6 rows x two groups; shorter ones 12 rows x one group.
// A whole SmolLM2 step's matmuls on a 2-core AMD EPYC (reports/20261205x-amd-bf16-dot-gemm/wide_narrow_rows.json),
// two groups vs one: 86.6 vs 91.7 ms at 128 rows, 340 vs 363 at 512, 1495 vs 1581 at 2048; mixed at 16-64 rows
// (19.1 vs 18.4 at 16, 20.9 vs 23.0 at 24, 26.4 vs 25.1 at 32, 46.1 vs 44.6 at 64).
constexpr int64_t kDotWideFromRows = 128;

#if defined(FERRY_BF16_ROWS_BUILT)

bool bf16_dot_usable() {
  static const bool usable = __builtin_cpu_supports("avx512bf16");
  return usable;
}

// kGroups column groups' 32 columns each for kRows rows starting at a (row stride lda elements); b at the first
// group's first chunk (the next group's follows, group_stride elements on); out at the pass's first row and the first
// group's first column (row stride n); cols: real columns from there (up to 32 * kGroups).
template <int kRows, int kGroups, typename T>
inline void dot_pass(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t chunks, T* out, int64_t n,
                     int64_t cols, int64_t prefetch_bytes, int pass, int passes) {
  constexpr int kVecs = 2 * kGroups;
  const int64_t group_stride = chunks * 2 * kBfTile;
  __m512 acc[kRows][kVecs];
  for (int r = 0; r < kRows; ++r)
    for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* bc = b + c * 2 * kBfTile;
    const uint16_t* ac = a + c * kBfChunk;
    if (prefetch_bytes != 0) {  // this pass's share of the chunk's lines prefetch_bytes ahead
      for (int gi = 0; gi < kGroups; ++gi) {
        const char* ahead = reinterpret_cast<const char*>(bc + gi * group_stride) + prefetch_bytes;
        for (int line = pass; line < 2 * kBfTile * 2 / 64; line += passes) _mm_prefetch(ahead + line * 64, _MM_HINT_T0);
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < 16; ++p) {
      __m512bh wv[kVecs];
      for (int v = 0; v < kVecs; ++v)
        wv[v] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(bc + (v / 2) * group_stride + (v % 2) * kBfTile + p * 32));
      for (int r = 0; r < kRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, ac + r * lda + 2 * p, 4);
        const __m512bh xr = reinterpret_cast<__m512bh>(_mm512_set1_epi32(pair));
        for (int v = 0; v < kVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], xr, wv[v]);
      }
    }
  }
  __mmask16 masks[kVecs];
  for (int v = 0; v < kVecs; ++v) {
    const int64_t left = cols - 16 * v;
    masks[v] = left >= 16 ? 0xffff : left <= 0 ? 0 : static_cast<__mmask16>((1u << left) - 1);
  }
  for (int r = 0; r < kRows; ++r) {
    T* dst = out + r * n;
    for (int v = 0; v < kVecs; ++v) {
      if constexpr (std::is_same_v<T, float>) {
        _mm512_mask_storeu_ps(dst + 16 * v, masks[v], acc[r][v]);
      } else {
        _mm256_mask_storeu_epi16(dst + 16 * v, masks[v], reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(acc[r][v])));
      }
    }
  }
}

template <typename T, int kGroups, int kRows>
inline void dot_pass_rows(int rows, const uint16_t* a, int64_t lda, const uint16_t* b, int64_t chunks, T* out,
                          int64_t n, int64_t cols, int64_t prefetch_bytes, int pass, int passes) {
  if constexpr (kRows > 1) {
    if (rows < kRows)
      return dot_pass_rows<T, kGroups, kRows - 1>(rows, a, lda, b, chunks, out, n, cols, prefetch_bytes, pass,
                                                  passes);
  }
  dot_pass<kRows, kGroups>(a, lda, b, chunks, out, n, cols, prefetch_bytes, pass, passes);
}

// Groups [g, g + kGroups), the row block [block, block + block_rows): passes of up to kMaxRows rows, the rows split
// evenly over the passes (16 rows: 2 x 8, not 12 + 4).
template <typename T, int kGroups, int kMaxRows>
inline void dot_block(const uint16_t* a, int64_t lda, const uint16_t* w, int64_t chunks, T* out, int64_t n, int64_t g,
                      int64_t block, int64_t block_rows, int64_t prefetch_bytes) {
  const int64_t passes = (block_rows + kMaxRows - 1) / kMaxRows;
  // -1: where one pass covers the rows, 4 KB ahead of the stream; where several do, the next groups' bytes, spread
  // over the passes, so the memory fetches the next groups while the later passes compute from L2
  const int64_t group_bytes = chunks * 2 * kBfTile * 2;
  const int64_t ahead = prefetch_bytes >= 0 ? prefetch_bytes : passes == 1 ? 4096 : kGroups * group_bytes;
  const uint16_t* b = w + g * chunks * 2 * kBfTile;
  const int64_t col = g * kBfGroup, cols = std::min<int64_t>(kGroups * kBfGroup, n - col);
  for (int64_t pass = 0, row0 = block; pass < passes; ++pass) {
    const int64_t rows = (block_rows - (row0 - block) + (passes - pass) - 1) / (passes - pass);
    dot_pass_rows<T, kGroups, kMaxRows>(static_cast<int>(rows), a + row0 * lda, lda, b, chunks, out + row0 * n + col,
                                        n, cols, ahead, static_cast<int>(pass), static_cast<int>(passes));
    row0 += rows;
  }
}

// Column groups [begin, end), every row: per row block, per group (or, in blocks of kDotWideFromRows+ rows, per two
// groups: 6 rows x 64 columns a pass, 4 weight loads and 6 broadcasts per 24 products against 12 and 2 x 12),
// passes over the block's rows.
template <typename T>
void dot_groups(const uint16_t* a, int64_t lda, int64_t m_rows, const uint16_t* w, int64_t chunks, T* out,
                int64_t n, int64_t begin, int64_t end, int64_t prefetch_bytes) {
  for (int64_t block = 0; block < m_rows; block += kBfRowBlock) {
    const int64_t block_rows = std::min(m_rows - block, kBfRowBlock);
    const bool wide = block_rows >= kDotWideFromRows;
    for (int64_t g = begin; g < end;) {
      if (wide && g + 1 < end) {
        dot_block<T, 2, 6>(a, lda, w, chunks, out, n, g, block, block_rows, prefetch_bytes);
        g += 2;
      } else {
        dot_block<T, 1, kDotMaxRows>(a, lda, w, chunks, out, n, g, block, block_rows, prefetch_bytes);
        g += 1;
      }
    }
  }
}

#else
bool bf16_dot_usable() { return false; }
#endif

std::atomic<int64_t> bf16_dot_calls{0};  // calls that ran here (the tests' proof that the path ran)

// bf16_amx_linear's contract (bf16_amx.h) on vdpbf16ps.
at::Tensor bf16_dot_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool out_bf16,
                           int64_t prefetch_bytes) {
  TORCH_CHECK(bf16_dot_usable(), "bf16_dot_linear: no AVX512_BF16 here (see bf16_dot())");
  const int64_t chunks = bf16_check_packed("bf16_dot_linear", x, packed, n);
  auto out = at::empty({x.size(0), n}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
#if defined(FERRY_BF16_ROWS_BUILT)
  const int64_t m_rows = x.size(0), groups = packed.size(0), lda = chunks * kBfChunk;
  if (m_rows == 0) return out;
  bf16_dot_calls.fetch_add(1, std::memory_order_relaxed);
  const at::Tensor a = bf16_padded_rows(x, lda, m_rows);
  const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    if (out_bf16)
      dot_groups(ap, lda, m_rows, w, chunks, reinterpret_cast<uint16_t*>(out.data_ptr()), n, begin, end,
                 prefetch_bytes);
    else
      dot_groups(ap, lda, m_rows, w, chunks, out.data_ptr<float>(), n, begin, end, prefetch_bytes);
  });
#endif
  return out;
}
