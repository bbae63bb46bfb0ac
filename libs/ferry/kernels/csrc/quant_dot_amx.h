// The int8-activation matmul of quant_dot.cpp on AMX int8 tiles (TDPBSUD), for CPUs that have them: the same
// activation digits, the same packed codes, the same exact int32 sum per (row, 32-input chunk, column), and the
// same fp32 epilogue in the same order (acc += float(s) * (d * scale), then + d * sum(q) * offset for int4), so
// the output equals the VNNI kernel's bit for bit. Only where the int32 sums come from changes:
//   A tiles: a chunk of one activation digit, [rows <= 16, 32 bytes] read in place from QuantRows (stride K);
//   B tiles: a chunk of one 16-column block's codes in the VNNI layout [8, 64 bytes] (4 inputs x 16 columns
//            per row): pack_for_dot's int8 codes are that layout already (loaded in place), int4 codes are
//            split into their low / high nibbles into a 512-byte buffer first (pack_for_dot puts inputs
//            8i..8i+3 in the low and 8i+4..8i+7 in the high nibbles: rows 2i and 2i + 1);
//   C tiles: [rows, 16] int32, one per (digit, block), zeroed per chunk (the activation scale is per chunk, so
//            K per tile op is 32 and the sums leave the tiles every chunk).
// Two column blocks per pass share the A tiles (8 tiles: 2 digits of A, 2 B, 4 C). The epilogue (vector code)
// of chunk c runs after the tile ops of chunk c + 1 are issued, into the other half of a double buffer, so the
// tile unit and the vector units overlap. Linux hands a process the tile state only after
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
  static const bool usable = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    const bool tile = d & (1u << 24), int8 = d & (1u << 25);
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return tile && int8 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return usable;
}

constexpr int kAmxRows = 16;  // rows of a tile: activation rows per pass
constexpr int kBRows = kChunk / 4;  // B tile rows: 4 inputs each

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tmm0 / tmm1: A (digit 1 / 2); tmm2 / tmm3: B (block 0 / 1); tmm4 + 2 * block + digit: C.
FERRY_AMX_TARGET inline void configure_tiles(int rows) {
  TileConfig cfg;
  for (int t : {0, 1}) cfg.rows[t] = rows, cfg.colsb[t] = kChunk;
  for (int t : {2, 3}) cfg.rows[t] = kBRows, cfg.colsb[t] = 64;
  for (int t : {4, 5, 6, 7}) cfg.rows[t] = rows, cfg.colsb[t] = kCols * 4;
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

// Sums of one chunk c for `rows` rows (A tiles loaded by the caller) and blocks `block` (and block + 1 when pair),
// stored to sums[block][digit][row][column].
template <int kBits, int kDigits>
FERRY_AMX_TARGET inline void tile_sums(const DotPacked& p, const QuantRows& x, int64_t row0, int64_t block, bool pair,
                                       int64_t c, uint8_t (*bbuf)[kBRows * 64], int32_t (*sums)[2][kAmxRows][kCols]) {
  const int8_t* a = x.q1.data() + row0 * p.k + c * kChunk;
  _tile_loadd(0, a, p.k);
  if constexpr (kDigits == 2) _tile_loadd(1, x.q2.data() + row0 * p.k + c * kChunk, p.k);
  _tile_loadd(2, b_tile<kBits>(p, block, c, bbuf[0]), 64);
  _tile_zero(4);
  _tile_dpbsud(4, 0, 2);
  if constexpr (kDigits == 2) {
    _tile_zero(5);
    _tile_dpbsud(5, 1, 2);
  }
  if (pair) {
    _tile_loadd(3, b_tile<kBits>(p, block + 1, c, bbuf[1]), 64);
    _tile_zero(6);
    _tile_dpbsud(6, 0, 3);
    if constexpr (kDigits == 2) {
      _tile_zero(7);
      _tile_dpbsud(7, 1, 3);
    }
  }
  _tile_stored(4, sums[0][0], kCols * 4);
  if constexpr (kDigits == 2) _tile_stored(5, sums[0][1], kCols * 4);
  if (pair) {
    _tile_stored(6, sums[1][0], kCols * 4);
    if constexpr (kDigits == 2) _tile_stored(7, sums[1][1], kCols * 4);
  }
}

// acc[b][m] += chunk c's sums scaled, exactly as block_rows in quant_dot.cpp does it.
template <int kBits, int kDigits>
inline void scale_sums(const DotPacked& p, const QuantRows& x, int64_t row0, int rows, int64_t block, int blocks,
                       int64_t c, const int32_t (*sums)[2][kAmxRows][kCols], float (*acc)[kAmxRows][kCols]) {
  const int64_t chunks = p.k / kChunk, groups = p.k / p.group_size, g = c / (p.group_size / kChunk);
  for (int b = 0; b < blocks; ++b) {
    const __m512 scale = _mm512_loadu_ps(p.scales + ((block + b) * groups + g) * kCols);
    const __m512 offset = kBits == 4 ? _mm512_loadu_ps(p.offsets + ((block + b) * groups + g) * kCols) : scale;
    for (int m = 0; m < rows; ++m) {
      const int64_t rc = (row0 + m) * chunks + c;
      __m512i s = _mm512_load_si512(sums[b][0][m]);
      if constexpr (kDigits == 2) s = _mm512_add_epi32(_mm512_slli_epi32(s, 8), _mm512_load_si512(sums[b][1][m]));
      if constexpr (kBits == 8) s = _mm512_sub_epi32(s, _mm512_set1_epi32(128 * x.sum[rc]));
      __m512 a = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(_mm512_set1_ps(x.scale[rc]), scale),
                                 _mm512_load_ps(acc[b][m]));
      if constexpr (kBits == 4) a = _mm512_fmadd_ps(_mm512_set1_ps(x.scaled_sum[rc]), offset, a);
      _mm512_store_ps(acc[b][m], a);
    }
  }
}

// out[row0 .. row0 + rows, columns of block (and block + 1)]; the caller configured the tiles for `rows`.
template <int kBits, int kDigits>
FERRY_AMX_TARGET void amx_pass(const DotPacked& p, const QuantRows& x, int64_t row0, int rows, int64_t block,
                               int blocks, float* out, int64_t n) {
  alignas(64) uint8_t bbuf[2][kBRows * 64];
  alignas(64) int32_t sums[2][2][2][kAmxRows][kCols];  // [chunk parity][block][digit][row][column]
  alignas(64) float acc[2][kAmxRows][kCols] = {};
  const int64_t chunks = p.k / kChunk;
  const bool pair = blocks == 2;
  tile_sums<kBits, kDigits>(p, x, row0, block, pair, 0, bbuf, sums[0]);
  for (int64_t c = 0; c < chunks; ++c) {
    if (c + 1 < chunks) tile_sums<kBits, kDigits>(p, x, row0, block, pair, c + 1, bbuf, sums[(c + 1) & 1]);
    scale_sums<kBits, kDigits>(p, x, row0, rows, block, blocks, c, sums[c & 1], acc);
  }
  for (int b = 0; b < blocks; ++b) {
    const int64_t col = (block + b) * kCols, valid = std::min<int64_t>(kCols, n - col);
    for (int m = 0; m < rows; ++m) std::copy(acc[b][m], acc[b][m] + valid, out + (row0 + m) * n + col);
  }
}

// One thread's share, column-block pairs [begin, end), every row: the tile state is per thread.
template <int kBits, int kDigits>
FERRY_AMX_TARGET void amx_blocks(const DotPacked& p, const QuantRows& x, int64_t m_rows, int64_t n, float* out,
                                 int64_t begin, int64_t end) {
  const int64_t blocks = (n + kCols - 1) / kCols;
  for (int64_t row0 = 0; row0 < m_rows; row0 += kAmxRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kAmxRows, m_rows - row0));
    configure_tiles(rows);
    for (int64_t pair = begin; pair < end; ++pair) {
      const int in_pair = static_cast<int>(std::min<int64_t>(2, blocks - 2 * pair));
      amx_pass<kBits, kDigits>(p, x, row0, rows, 2 * pair, in_pair, out, n);
    }
  }
  _tile_release();
}

template <int kBits, int kDigits>
void run_amx(const DotPacked& p, const QuantRows& x, int64_t m_rows, int64_t n, float* out) {
  const int64_t pairs = ((n + kCols - 1) / kCols + 1) / 2;
  at::parallel_for(0, pairs, 2, [&](int64_t begin, int64_t end) {
    amx_blocks<kBits, kDigits>(p, x, m_rows, n, out, begin, end);
  });
}

#else
bool amx_int8_usable() { return false; }
#endif
