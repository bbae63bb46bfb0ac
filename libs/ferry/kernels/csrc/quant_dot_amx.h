// The int8-activation matmul of quant_dot.cpp on AMX int8 tiles (TDPBSUD), for CPUs that have them: the same
// activation digits, the same packed codes, the same exact int32 sum per (row, 32-input chunk, column), and the
// same fp32 epilogue in the same order (acc += float(s) * (d * scale), then + d * sum(q) * offset for int4), so
// the output equals the VNNI kernel's bit for bit. Only where the int32 sums come from changes:
//   A tiles: a chunk of one activation digit, [rows <= 16, 32 bytes] read in place from QuantRows (stride K);
//   B tiles: a chunk of one 16-column block's codes in the VNNI layout [8, 64 bytes] (4 inputs x 16 columns
//            per row): pack_for_dot's int8 codes are that layout already (loaded in place), int4 codes are
//            split into their low / high nibbles into a 512-byte buffer first (pack_for_dot puts inputs
//            8i..8i+3 in the low and 8i+4..8i+7 in the high nibbles: rows 2i and 2i + 1);
//   C tiles: [rows, 16] int32, one per digit, zeroed per chunk (the activation scale is per chunk, so K per
//            tile op is 32 and the sums leave the tiles every chunk: stored, then scaled by vector code).
// A pass is one 16-column block and up to 16 rows, its fp32 accumulators in registers (the row count a template
// constant). Chunk c + 1's tile products are issued before chunk c's epilogue and stored after it, so the tile
// unit works while the vector units scale. Measured on a 2-core Xeon (ops/bench/quant/amx_rows.py), a whole
// SmolLM2 step's int4 matmuls: ~20% under the VNNI loop from 8 to 16 rows, ~0-10% from 17 to 23 (a second row
// pass repeats every tile op), and slower at 1-4 rows, where each chunk's fixed tile latency (~5 tile ops
// in a chain) outweighs 16 vpdpbusd a row: hence quant_linear.py's AMX_INT8_FROM_ROWS. Linux hands a process the tile state only after
// arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA): asked once per process; where it is refused, or cpuid
// lacks AMX-TILE / AMX-INT8, amx_int8_usable() is false and the VNNI kernel runs.
//
// Included by quant_dot.cpp inside its anonymous namespace (after DotPacked, QuantRows, kChunk, kCols). Built
// where the build targets AVX-512 VNNI (the epilogue's vectors) and the compiler knows the AMX target
// attributes (GCC 11+, clang 12+); elsewhere amx_int8_usable() is false.

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__x86_64__) && defined(__linux__) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define FERRY_AMX_INT8_BUILT 1
// (<cpuid.h>, <sys/syscall.h>, <unistd.h>: included by quant_dot.cpp at file scope.)

#define FERRY_AMX_TARGET __attribute__((target("amx-tile,amx-int8")))

bool amx_int8_usable() {
  static const bool usable = amx_granted(25);  // quant_dot.cpp
  return usable;
}

std::atomic<int64_t> amx_calls{0};  // calls that took the tiles (the tests' proof that the path ran)

constexpr int kAmxRows = 16;  // rows of a tile: activation rows per pass
constexpr int kBRows = kChunk / 4;  // B tile rows: 4 inputs each

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0 / tmm1: A (digit 1 / 2); tmm2: B; tmm4 / tmm5: C (digit 1 / 2).
FERRY_AMX_TARGET inline void configure_tiles(int rows) {
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = rows, cfg.colsb[t] = kChunk;
  cfg.rows[2] = kBRows, cfg.colsb[2] = 64;
  for (int t : {4, 5}) cfg.rows[t] = rows, cfg.colsb[t] = kCols * 4;
  _tile_loadconfig(&cfg);
}

inline void memory_barrier() { __asm__ volatile("" ::: "memory"); }  // the tile-load asm does not say it reads

// The B tile of (block, chunk c): int8 codes in place, int4 codes unpacked into buf.
template <int kBits>
inline const uint8_t* b_tile(const DotPacked& p, int64_t block, int64_t c, uint8_t* buf) {
  constexpr int kGroupsPerChunk = kBits == 8 ? kChunk / 4 : kChunk / 8;
  const uint8_t* codes = p.codes + (block * (p.k / kChunk) + c) * kGroupsPerChunk * kGroupBytes;
  if constexpr (kBits == 8) return codes;
  const __m512i mask = _mm512_set1_epi8(15);
  for (int i = 0; i < kGroupsPerChunk; ++i) {
    const __m512i w = _mm512_loadu_si512(codes + i * kGroupBytes);
    _mm512_store_si512(buf + 2 * i * 64, _mm512_and_si512(w, mask));
    _mm512_store_si512(buf + (2 * i + 1) * 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), mask));
  }
  memory_barrier();
  return buf;
}

// Chunk c's products into tmm4 (and tmm5): A from the digits' rows at a1 / a2, B from block's codes.
template <int kBits, int kDigits>
FERRY_AMX_TARGET inline void block_dp(const DotPacked& p, const int8_t* a1, const int8_t* a2, int64_t block, int64_t c,
                                      uint8_t* bbuf) {
  _tile_loadd(0, a1 + c * kChunk, p.k);
  if constexpr (kDigits == 2) _tile_loadd(1, a2 + c * kChunk, p.k);
  _tile_loadd(2, b_tile<kBits>(p, block, c, bbuf), 64);
  _tile_zero(4);
  _tile_dpbsud(4, 0, 2);
  if constexpr (kDigits == 2) {
    _tile_zero(5);
    _tile_dpbsud(5, 1, 2);
  }
}

template <int kDigits>  // the C tiles to sums[digit][row][column]
FERRY_AMX_TARGET inline void block_store(int32_t (*sums)[kAmxRows][kCols]) {
  _tile_stored(4, sums[0], kCols * 4);
  if constexpr (kDigits == 2) _tile_stored(5, sums[1], kCols * 4);
}

// out[row0 .. row0 + R, block's columns], exactly as block_rows in quant_dot.cpp computes them; the caller
// configured the tiles for R rows.
template <int kBits, int kDigits, int R>
FERRY_AMX_TARGET void amx_block(const DotPacked& p, const QuantRows& x, int64_t row0, int64_t block, float* out,
                                int64_t n) {
  alignas(64) uint8_t bbuf[kBRows * 64];
  alignas(64) int32_t sums[2][kAmxRows][kCols];
  const int64_t chunks = p.k / kChunk, groups = p.k / p.group_size, per_group = p.group_size / kChunk;
  const int8_t* a1 = x.q1.data() + row0 * p.k;
  const int8_t* a2 = kDigits == 2 ? x.q2.data() + row0 * p.k : nullptr;
  const float* scales = p.scales + block * groups * kCols;
  const float* offsets = kBits == 4 ? p.offsets + block * groups * kCols : nullptr;
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  block_dp<kBits, kDigits>(p, a1, a2, block, 0, bbuf);
  block_store<kDigits>(sums);
  for (int64_t c = 0; c < chunks; ++c) {
    if (c + 1 < chunks) block_dp<kBits, kDigits>(p, a1, a2, block, c + 1, bbuf);  // in flight during the epilogue
    const int64_t g = c / per_group;
    const __m512 scale = _mm512_loadu_ps(scales + g * kCols);
    for (int m = 0; m < R; ++m) {
      const int64_t rc = (row0 + m) * chunks + c;
      __m512i s = _mm512_load_si512(sums[0][m]);
      if constexpr (kDigits == 2) s = _mm512_add_epi32(_mm512_slli_epi32(s, 8), _mm512_load_si512(sums[1][m]));
      if constexpr (kBits == 8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * x.sum[rc]));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(_mm512_set1_ps(x.scale[rc]), scale), acc[m]);
      if constexpr (kBits == 4)
        acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(x.scaled_sum[rc]), _mm512_loadu_ps(offsets + g * kCols), acc[m]);
    }
    if (c + 1 < chunks) block_store<kDigits>(sums);
  }
  const int64_t col = block * kCols, valid = std::min<int64_t>(kCols, n - col);
  for (int m = 0; m < R; ++m) {
    alignas(64) float row[kCols];
    _mm512_store_ps(row, acc[m]);
    std::copy(row, row + valid, out + (row0 + m) * n + col);
  }
}

// One thread's share, column blocks [begin, end), every row; the tile state is a thread's, so each thread
// configures its own.
template <int kBits, int kDigits>
FERRY_AMX_TARGET void amx_blocks(const DotPacked& p, const QuantRows& x, int64_t m_rows, int64_t n, float* out,
                                 int64_t begin, int64_t end) {
  for (int64_t row0 = 0; row0 < m_rows; row0 += kAmxRows) {
    const int64_t rows = std::min<int64_t>(kAmxRows, m_rows - row0);
    configure_tiles(static_cast<int>(rows));
    for (int64_t block = begin; block < end; ++block)
      ferry_cpu::with_rows<kAmxRows>(rows, [&](auto r) {
        amx_block<kBits, kDigits, decltype(r)::value>(p, x, row0, block, out, n);
      });
  }
  _tile_release();
}

template <int kBits, int kDigits>
void run_amx(const DotPacked& p, const QuantRows& x, int64_t m_rows, int64_t n, float* out) {
  at::parallel_for(0, (n + kCols - 1) / kCols, 4, [&](int64_t begin, int64_t end) {
    amx_blocks<kBits, kDigits>(p, x, m_rows, n, out, begin, end);
  });
}

#else
bool amx_int8_usable() { return false; }
std::atomic<int64_t> amx_calls{0};
#endif
