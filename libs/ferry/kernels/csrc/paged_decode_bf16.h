// Decode attention on a bf16 cache without widening its rows to fp32 (AVX512_BF16's VDPBF16PS): q.K scores with
// q rounded to bf16 once per item, and P.V with the softmax weights rounded to bf16 per tile. The widening path
// (paged_decode.cpp's attend) spends two instructions per 16 values of every K and V row (vpmovzxwd + vpslld)
// and one FMA per 16 products; here one VDPBF16PS takes 32 products (a pair per lane) straight from the row's
// bf16. Products and sums stay fp32 (VDPBF16PS rounds each pair's sum to fp32), as bf16 matmuls do everywhere
// (oneDNN, vLLM's CPU attention, flash-attention's P.V): what changes is q and P rounded to bf16, ~3 significant
// digits (measured against attention_ref in tests/unit/test_cpu_paged_attention.py and the throughput README).
//
// Scores: kQ query rows (<= 3, the GQA group's rows) against 4 key rows at a time, each key zmm loaded once for
// all of them; 4 * kQ accumulators summed by sum4 (cpu_math.h). P.V: VDPBF16PS pairs adjacent bf16, so two
// tokens' value rows are interleaved (vpunpcklwd / vpunpckhwd, within 128-bit lanes) and dotted with the
// broadcast pair of their weights: 2 shuffles per 32 values of 2 rows, against 4 widening instructions before.
// The unpacks leave each 32-dim block of the accumulator in lane order [8L + m | 8L + 4 + m] (L = 128-bit lane,
// m < 4): acc is kept in that order for the whole item (the softmax only scales it) and put back at the end.
//
// Only for head sizes compiled in (64, 128; D = Dv), unit-stride rows, AVX-512 BF16 at build time (-march
// target), and only when asked (FERRY_DECODE_BF16_DOT=1, cpu_decode.py): measured slower on this project's Xeon,
// where VDPBF16PS zmm issues once per 2 cycles (4 FMAs' time for its 32 products; bf16_dot_rate.cpp in
// ops/bench/throughput). Elsewhere attend widens as before.
// Included by paged_decode.cpp inside its anonymous namespace, after Scratch and Item.

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && FERRY_CPU_LANES == 16
#define FERRY_DECODE_BF16_DOT 1

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }
inline __m512i load_row(const void* p) { return _mm512_loadu_si512(p); }

// out[g][r] = q[g] . rows[r] for 4 key rows and kQ bf16 query rows.
template <int kD, int kQ>
inline void dot4xq_bf16(const uint16_t* const* q, const bf16* const* rows, float* const* out) {
  __m512 acc[kQ][4];
#pragma GCC unroll 3
  for (int g = 0; g < kQ; ++g)
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) acc[g][r] = _mm512_setzero_ps();
#pragma GCC unroll 4
  for (int64_t i = 0; i < kD; i += 32) {
    __m512i qi[kQ];
#pragma GCC unroll 3
    for (int g = 0; g < kQ; ++g) qi[g] = load_row(q[g] + i);
#pragma GCC unroll 4
    for (int r = 0; r < 4; ++r) {
      const __m512bh k = as_bh(load_row(rows[r] + i));
#pragma GCC unroll 3
      for (int g = 0; g < kQ; ++g) acc[g][r] = _mm512_dpbf16_ps(acc[g][r], as_bh(qi[g]), k);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < kQ; ++g) {
    const vec4 s = sum4(reinterpret_cast<vecf>(acc[g][0]), reinterpret_cast<vecf>(acc[g][1]),
                        reinterpret_cast<vecf>(acc[g][2]), reinterpret_cast<vecf>(acc[g][3]));
    for (int r = 0; r < 4; ++r) out[g][r] = s[r];
  }
}

template <int kD>
inline float dot_bf16(const uint16_t* q, const bf16* row) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < kD; i += 32) acc = _mm512_dpbf16_ps(acc, as_bh(load_row(q + i)), as_bh(load_row(row + i)));
  return _mm512_reduce_add_ps(acc);
}

// s[g][j] = q[g] . rows[j] over a tile, prefetching the rows in ahead[] spread over the loop (as score_rows).
template <int kD, int kQ>
inline void score_rows_bf16(const uint16_t* const* q, const bf16* const* rows, int64_t n, float* const* s,
                            const char* const* ahead, int64_t num_ahead, int64_t k_bytes, int64_t v_bytes) {
  int64_t j = 0;
  for (; j + 4 <= n; j += 4) {
    prefetch_pairs(ahead, j, std::min(j + 4, num_ahead), k_bytes, v_bytes);
    float* out[kQ];
    for (int g = 0; g < kQ; ++g) out[g] = s[g] + j;
    dot4xq_bf16<kD, kQ>(q, rows + j, out);
  }
  prefetch_pairs(ahead, j, num_ahead, k_bytes, v_bytes);
  for (; j < n; ++j)
    for (int g = 0; g < kQ; ++g) s[g][j] = dot_bf16<kD>(q[g], rows[j]);
}

// acc[g][d0..d0+64) (unpack order) += sum_j p[g][j] * rows[j][d0..d0+64), tokens two at a time; pairs[g][j / 2]
// holds bf16 p[g][j] (low half) and p[g][j + 1] (high half, 0 past the tile's end: the odd last token's partner
// row is itself, weighted 0).
template <int kQ>
inline void accumulate_bf16(float* const* acc, const bf16* const* rows, const uint32_t* const* pairs, int64_t n,
                            int64_t d0) {
  __m512 part[kQ][4];
#pragma GCC unroll 3
  for (int g = 0; g < kQ; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) part[g][c] = _mm512_loadu_ps(acc[g] + d0 + 16 * c);
  for (int64_t j = 0; j < n; j += 2) {
    const bf16* r0 = rows[j] + d0;
    const bf16* r1 = (j + 1 < n ? rows[j + 1] : rows[j]) + d0;
    const __m512i a0 = load_row(r0), a1 = load_row(r1), b0 = load_row(r0 + 32), b1 = load_row(r1 + 32);
    const __m512bh v[4] = {as_bh(_mm512_unpacklo_epi16(a0, a1)), as_bh(_mm512_unpackhi_epi16(a0, a1)),
                           as_bh(_mm512_unpacklo_epi16(b0, b1)), as_bh(_mm512_unpackhi_epi16(b0, b1))};
#pragma GCC unroll 3
    for (int g = 0; g < kQ; ++g) {
      const __m512bh w = as_bh(_mm512_set1_epi32(static_cast<int>(pairs[g][j / 2])));
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) part[g][c] = _mm512_dpbf16_ps(part[g][c], v[c], w);
    }
  }
#pragma GCC unroll 3
  for (int g = 0; g < kQ; ++g)
#pragma GCC unroll 4
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc[g] + d0 + 16 * c, part[g][c]);
}

// One tile's scores (values = false) or weighted value rows (values = true) for kQ rows from row g0.
template <int kD, int kQ>
inline void rows_of_tile_bf16(Scratch<bf16>& s, int64_t g0, int64_t n, const char* const* ahead, int64_t num_ahead,
                              int64_t row_bytes, bool values) {
  const uint16_t* q[kQ];
  float* sc[kQ];
  float* acc[kQ];
  const uint32_t* pairs[kQ];
  for (int g = 0; g < kQ; ++g) {
    q[g] = s.qb.data() + (g0 + g) * kD;
    sc[g] = s.scores.data() + (g0 + g) * kTile;
    acc[g] = s.acc.data() + (g0 + g) * kD;
    pairs[g] = s.pb.data() + (g0 + g) * kTile / 2;
  }
  if (!values) return score_rows_bf16<kD, kQ>(q, s.krows.data(), n, sc, ahead, num_ahead, row_bytes, row_bytes);
  for (int64_t d0 = 0; d0 < kD; d0 += 64) accumulate_bf16<kQ>(acc, s.vrows.data(), pairs, n, d0);
}

template <int kD>
inline void group_rows_bf16(Scratch<bf16>& s, int64_t group, int64_t n, const char* const* ahead, int64_t num_ahead,
                            int64_t row_bytes, bool values) {
  for (int64_t g = 0; g < group; g += 3) {
    const int64_t pre = g == 0 ? num_ahead : 0;  // the first run prefetches for the whole tile
    with_rows<3>(group - g, [&](auto rows) {
      rows_of_tile_bf16<kD, decltype(rows)::value>(s, g, n, ahead, pre, row_bytes, values);
    });
  }
}

// The tile's softmax weights p[g][0..n) as bf16 pairs in s.pb (kTile / 2 per row; past n, zeros).
inline void weights_to_bf16(Scratch<bf16>& s, int64_t group, int64_t n) {
  static_assert(kTile == 32);
  for (int64_t g = 0; g < group; ++g) {
    float* p = s.scores.data() + g * kTile;
    std::fill(p + n, p + kTile, 0.f);
    const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + 16), _mm512_loadu_ps(p));
    _mm512_storeu_si512(s.pb.data() + g * kTile / 2, reinterpret_cast<__m512i>(packed));
  }
}

// attend's counterpart for bf16 rows (D = Dv = kD): the same tiles, prefetches and online softmax.
template <int kD>
void attend_bf16(const Item& it, const Item* following, const CacheView<c10::BFloat16>& k,
                 const CacheView<c10::BFloat16>& v, int64_t bs, int64_t group, float scale, Scratch<bf16>& s) {
  static_assert(kD % 64 == 0);
  const int64_t row_bytes = kD * 2;
  for (int64_t i = 0; i < group * kD; ++i) s.qb[i] = to_bf16(it.q[i] * scale).bits;
  tiles(
      it, following, k, v, bs, group, kD, s,
      [&](int64_t n, int64_t num_ahead) {
        group_rows_bf16<kD>(s, group, n, s.ahead.data(), num_ahead, row_bytes, false);
      },
      [&](int64_t n) {
        weights_to_bf16(s, group, n);
        group_rows_bf16<kD>(s, group, n, s.ahead.data(), 0, row_bytes, true);
      });
  for (int64_t g = 0; g < group; ++g) {  // out of unpack order: position 16h + 4L + m of a block is 8L + 4h + m
    const float inv = 1.f / s.sum[g];
    const float* acc = s.acc.data() + g * kD;
    float* out = it.out + g * kD;
    for (int64_t b = 0; b < kD; b += 32)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t lane = 0; lane < 4; ++lane)
          for (int64_t m = 0; m < 4; ++m) out[b + 8 * lane + 4 * h + m] = acc[b + 16 * h + 4 * lane + m] * inv;
  }
}

#endif
