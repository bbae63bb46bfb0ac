// A bf16 GEMM on AMX tiles for the bf16 weight copies (quant_linear.py's BF16_COPY_FROM_ROWS): out [M, N] =
// x [M, K] @ W.T, x fp32 or bf16 (rounded to bf16 on entry, round-to-nearest-even as torch's .to(bfloat16)), W
// bf16 packed once at load (quant_linear.py's pack_bf16_amx), products summed in fp32 by TDPBF16PS (the
// instruction oneDNN's AMX GEMM uses), out fp32 or rounded to bf16. Written because oneDNN's GEMM streamed a
// decode step's weights at well under memory speed for 16-128 rows.
//
// Weight layout, [N/32, K/32, 2, 16, 16, 2] bf16 (N and K padded with zeros to multiples of 32): for each group
// of 32 output columns and each 32-input chunk, its two B tiles (columns 0-15, 16-31 of the group), each the
// VNNI pair layout [16 input pairs, 16 columns x 2 inputs] = 1024 bytes. A thread's groups are contiguous, so
// its weight bytes are one stream, read once (software prefetch_bytes ahead of it: 0 by default, no gain measured).
//
// x is copied into a zero-padded bf16 buffer [M rounded up to 16, K rounded up to 32] (the tiles read whole 16 x
// 32 blocks). Threads split the column groups (at::parallel_for); per group, every 32-row pass (4 C tiles: 2 row
// tiles x 2 column tiles; the last pass may hold 16 rows) walks the K chunks, so the group's weights come from
// memory on the first pass and from L2 on the next ones (a group's weights: K * 64 bytes, 96 KB at K = 1536). Calls
// of more than 512 rows run in blocks of 512 rows (kBfRowBlock). C tiles leave straight into an fp32 output when
// whole, else (edges, bf16 output) through a 16 x 16 buffer. Measured (throughput README, twelfth round): at memory
// speed from 1 to ~16 rows, ahead of oneDNN up to 1024 rows, ~10-17% behind it at 1700-2048 (a full prefill step).
//
// Included by quant_dot.cpp inside its anonymous namespace; built where the compiler targets AVX-512 BF16 (the
// conversions) and knows the AMX target attributes; elsewhere amx_bf16_usable() is false.

constexpr int64_t kBfChunk = 32;   // inputs per tile product (16 pairs)
constexpr int64_t kBfGroup = 32;   // output columns per group (two B tiles)
constexpr int64_t kBfTile = 512;   // bf16 elements per tile (16 x 64 bytes)
// Rows per block of a long call (prefill): all column groups run on one block's rows before the next, so the rows'
// bf16 copy (up to 512 x K x 2 bytes: 1.5 MB at K = 1536) stays in L2 while the groups stream past it.
constexpr int64_t kBfRowBlock = 512;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define FERRY_BF16_ROWS_BUILT 1  // the conversions to bf16 (shared with bf16_dot.h)

// x's rows [begin, end) into the padded bf16 buffer (its padding already zero).
inline void bf16_rows(const at::Tensor& x, uint16_t* a, int64_t lda, int64_t begin, int64_t end) {
  const int64_t k = x.size(1);
  if (x.scalar_type() == at::kBFloat16) {
    const auto* src = reinterpret_cast<const uint16_t*>(x.data_ptr());
    for (int64_t r = begin; r < end; ++r) std::memcpy(a + r * lda, src + r * k, k * 2);
    return;
  }
  const float* src = x.data_ptr<float>();
  for (int64_t r = begin; r < end; ++r) {
    for (int64_t i = 0; i < k; i += 16) {
      const __mmask16 mask = k - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (k - i)) - 1);
      const __m512 v = _mm512_maskz_loadu_ps(mask, src + r * k + i);
      _mm256_mask_storeu_epi16(a + r * lda + i, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}

// x [M, K] -> a zero-padded bf16 copy [M rounded up to 16, lda] (lda: K rounded up to 32): the tiles read whole 16 x
// 32 blocks; the padding is zero (also zero in the weight, but 0 * NaN).
inline at::Tensor bf16_padded_rows(const at::Tensor& x, int64_t lda, int64_t m_rows) {
  const int64_t k = x.size(1), padded_rows = (m_rows + 15) / 16 * 16;
  auto a = at::empty({padded_rows, lda}, x.options().dtype(at::kBFloat16));
  auto* ap = reinterpret_cast<uint16_t*>(a.data_ptr());
  if (lda != k)
    for (int64_t r = 0; r < m_rows; ++r) std::memset(ap + r * lda + k, 0, (lda - k) * 2);
  if (padded_rows != m_rows) std::memset(ap + m_rows * lda, 0, (padded_rows - m_rows) * lda * 2);
  at::parallel_for(0, m_rows, std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1)),
                   [&](int64_t begin, int64_t end) { bf16_rows(x, ap, lda, begin, end); });
  return a;
}
#endif

#if defined(FERRY_BF16_ROWS_BUILT) && defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define FERRY_AMX_BF16_BUILT 1

#define FERRY_AMX_BF16_TARGET __attribute__((target("amx-tile,amx-bf16")))

bool amx_bf16_usable() {
  static const bool usable = amx_granted(22);  // quant_dot.cpp
  return usable;
}

struct alignas(64) BfTileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile 16 rows x 64 bytes. tmm0, tmm1: C (row tile 0; column tiles 0, 1); tmm2, tmm3: C (row tile 1);
// tmm4, tmm5: A (row tiles 0, 1); tmm6, tmm7: B (column tiles 0, 1).
FERRY_AMX_BF16_TARGET inline void bf16_configure() {
  BfTileConfig cfg;
  for (int t = 0; t < 8; ++t) cfg.rows[t] = 16, cfg.colsb[t] = 64;
  _tile_loadconfig(&cfg);
}

// One group's products for one pass of 16 * kRowTiles rows: a at the pass's first row (stride lda elements),
// b at the group's first chunk.
template <int kRowTiles>
FERRY_AMX_BF16_TARGET inline void bf16_pass(const uint16_t* a, int64_t lda, const uint16_t* b, int64_t chunks,
                                            int64_t prefetch_bytes) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kRowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t c = 0; c < chunks; ++c) {
    const uint16_t* bc = b + c * 2 * kBfTile;
    if (prefetch_bytes > 0) {
      const char* ahead = reinterpret_cast<const char*>(bc) + prefetch_bytes;
      for (int line = 0; line < 2 * kBfTile * 2; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    }
    _tile_loadd(6, bc, 64);
    _tile_loadd(7, bc + kBfTile, 64);
    _tile_loadd(4, a + c * kBfChunk, lda * 2);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (kRowTiles == 2) {
      _tile_loadd(5, a + 16 * lda + c * kBfChunk, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
}

// buf [16, 16] fp32 -> out rows [row0, row0 + rows), columns [col, col + cols) (out row stride n).
template <typename T>
inline void bf16_write(const float (*buf)[16], T* out, int64_t n, int64_t row0, int64_t rows, int64_t col,
                       int64_t cols) {
  if (rows <= 0 || cols <= 0) return;
  const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
  for (int64_t r = 0; r < std::min<int64_t>(rows, 16); ++r) {
    const __m512 v = _mm512_load_ps(buf[r]);
    T* dst = out + (row0 + r) * n + col;
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(dst, mask, v);
    } else {
      _mm256_mask_storeu_epi16(dst, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}

template <int kRowTiles, typename T>
FERRY_AMX_BF16_TARGET inline void bf16_store(T* out, int64_t m_rows, int64_t n, int64_t row0, int64_t col) {
  if constexpr (std::is_same_v<T, float>) {
    if (row0 + 16 * kRowTiles <= m_rows && col + 32 <= n) {  // whole tiles: straight into out
      float* o = out + row0 * n + col;
      _tile_stored(0, o, n * 4);
      _tile_stored(1, o + 16, n * 4);
      if constexpr (kRowTiles == 2) {
        _tile_stored(2, o + 16 * n, n * 4);
        _tile_stored(3, o + 16 * n + 16, n * 4);
      }
      return;
    }
  }
  alignas(64) float buf[16][16];
  const int64_t c0 = std::min<int64_t>(16, n - col), c1 = std::min<int64_t>(16, n - col - 16);
  _tile_stored(0, buf, 64);
  bf16_write(buf, out, n, row0, m_rows - row0, col, c0);
  _tile_stored(1, buf, 64);
  bf16_write(buf, out, n, row0, m_rows - row0, col + 16, c1);
  if constexpr (kRowTiles == 2) {
    _tile_stored(2, buf, 64);
    bf16_write(buf, out, n, row0 + 16, m_rows - row0 - 16, col, c0);
    _tile_stored(3, buf, 64);
    bf16_write(buf, out, n, row0 + 16, m_rows - row0 - 16, col + 16, c1);
  }
}

// Column groups [begin, end), every row; the tile state is a thread's, so each thread configures its own.
template <typename T>
FERRY_AMX_BF16_TARGET void bf16_groups(const uint16_t* a, int64_t lda, int64_t m_rows, const uint16_t* w,
                                       int64_t chunks, T* out, int64_t n, int64_t begin, int64_t end,
                                       int64_t prefetch_bytes) {
  bf16_configure();
  const int64_t padded_rows = (m_rows + 15) / 16 * 16;
  for (int64_t block = 0; block < padded_rows; block += kBfRowBlock) {
    const int64_t block_end = std::min(padded_rows, block + kBfRowBlock);
    for (int64_t g = begin; g < end; ++g) {
      const uint16_t* b = w + g * chunks * 2 * kBfTile;
      for (int64_t row0 = block; row0 < block_end; row0 += 32) {
        const int64_t ahead = row0 == 0 ? prefetch_bytes : 0;  // later passes read the group from L2
        if (block_end - row0 >= 32) {
          bf16_pass<2>(a + row0 * lda, lda, b, chunks, ahead);
          bf16_store<2>(out, m_rows, n, row0, g * kBfGroup);
        } else {
          bf16_pass<1>(a + row0 * lda, lda, b, chunks, ahead);
          bf16_store<1>(out, m_rows, n, row0, g * kBfGroup);
        }
      }
    }
  }
  _tile_release();
}

#else
bool amx_bf16_usable() { return false; }
#endif

std::atomic<int64_t> amx_bf16_calls{0};  // calls that took the tiles (the tests' proof that the path ran)

// x [M, K] fp32 or bf16 contiguous and a weight packed by pack_bf16_amx for n outputs, else a ValueError naming op
// -> the weight's 32-input chunks.
inline int64_t bf16_check_packed(const char* op, const at::Tensor& x, const at::Tensor& packed, int64_t n) {
  TORCH_CHECK_VALUE(x.dim() == 2 && x.is_contiguous() &&
                        (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                    op, ": x must be a contiguous 2-D fp32 or bf16 tensor");
  const int64_t k = x.size(1), chunks = (k + kBfChunk - 1) / kBfChunk, groups = (n + kBfGroup - 1) / kBfGroup;
  TORCH_CHECK_VALUE(packed.dim() == 6 && packed.size(0) == groups && packed.size(1) == chunks &&
                        packed.size(2) == 2 && packed.size(3) == 16 && packed.size(4) == 16 && packed.size(5) == 2 &&
                        packed.is_contiguous() && packed.scalar_type() == at::kBFloat16,
                    op, ": x [", x.size(0), ", ", k, "] does not fit a packed weight ", packed.sizes(), " for ", n,
                    " outputs");
  return chunks;
}

// x [M, K] fp32 or bf16 contiguous; packed [ceil(n / 32), ceil(K / 32), 2, 16, 16, 2] bf16 (pack_bf16_amx);
// n: the real output columns; out_bf16: round the output to bf16 -> [M, n] fp32 or bf16; prefetch_bytes: how
// far ahead of the weight stream to prefetch (0: none).
at::Tensor bf16_amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t n, bool out_bf16,
                           int64_t prefetch_bytes) {
  TORCH_CHECK(amx_bf16_usable(), "bf16_amx_linear: no AMX-BF16 tiles here (see bf16_amx())");
  const int64_t m_rows = x.size(0), chunks = bf16_check_packed("bf16_amx_linear", x, packed, n);
  const int64_t groups = packed.size(0);
  auto out = at::empty({m_rows, n}, x.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
#if defined(FERRY_AMX_BF16_BUILT)
  if (m_rows == 0) return out;
  amx_bf16_calls.fetch_add(1, std::memory_order_relaxed);
  const int64_t lda = chunks * kBfChunk;
  const at::Tensor a = bf16_padded_rows(x, lda, m_rows);
  const auto* ap = reinterpret_cast<const uint16_t*>(a.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    if (out_bf16)
      bf16_groups(ap, lda, m_rows, w, chunks, reinterpret_cast<uint16_t*>(out.data_ptr()), n, begin, end,
                  prefetch_bytes);
    else
      bf16_groups(ap, lda, m_rows, w, chunks, out.data_ptr<float>(), n, begin, end, prefetch_bytes);
  });
#endif
  return out;
}
