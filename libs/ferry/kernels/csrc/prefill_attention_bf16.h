// The bf16 dot format of prefill_attention.cpp (included by it inside its anonymous namespace, after F32 and
// Scratch): VDPBF16PS sums a pair of bf16 products per fp32 lane, so both matmuls pair up their reduction dimension.
// Scores: K packed [D/2, Lpad] of (k[d], k[d+1]) words, dotted with the broadcast (q[d], q[d+1]) word of a query row.
// P.V: V packed [Lpad/2, Dv] of (v[j][d], v[j+1][d]) words, dotted with the broadcast (p[j], p[j+1]) word of the
// row's softmax weights, rounded to bf16 once per block. Only where the build targets AVX512_BF16 (-march); else
// prefill_attention.cpp widens bf16 rows into its fp32 format.

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && FERRY_CPU_LANES == 16
#define FERRY_PREFILL_BF16_DOT 1

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }
inline __m512i bcast_pair(const void* p) {  // one 32-bit (bf16, bf16) pair in every lane
  int32_t bits;
  std::memcpy(&bits, p, 4);
  return _mm512_set1_epi32(bits);
}

// ---- bf16 dot format: K as [D/2, Lpad] (k[d], k[d+1]) pairs, V as [Lpad/2, Dv] (v[j][d], v[j+1][d]) pairs ----
struct Bf16Dot {
  using Packed = uint32_t;
  static int64_t k_size(const Shape& sh) { return sh.dim / 2 * sh.lpad; }
  static int64_t v_size(const Shape& sh) { return sh.lpad / 2 * sh.dim_v; }

  static void pack(const Rows<c10::BFloat16>& k, const Rows<c10::BFloat16>& v, const Shape& sh, int64_t h,
                   uint32_t* kp, uint32_t* vp) {
    std::fill(kp, kp + k_size(sh), 0u);
    for (int64_t j = 0; j < sh.len; ++j) {  // a pair of adjacent dims is one 32-bit word of the row
      const c10::BFloat16* kr = k.row(j, h);
      for (int64_t d = 0; d < sh.dim / 2; ++d) std::memcpy(kp + d * sh.lpad + j, kr + 2 * d, 4);
    }
    for (int64_t j = 0; j < sh.lpad; j += 2) {
      const c10::BFloat16* even = j < sh.len ? v.row(j, h) : nullptr;
      const c10::BFloat16* odd = j + 1 < sh.len ? v.row(j + 1, h) : nullptr;
      uint32_t* out = vp + j / 2 * sh.dim_v;
      for (int64_t d = 0; d < sh.dim_v; ++d)
        out[d] = (even ? even[d].x : 0u) | static_cast<uint32_t>(odd ? odd[d].x : 0u) << 16;
    }
  }

  static void load_q(const Rows<c10::BFloat16>& q, const Shape& sh, int64_t h, int64_t i0, int64_t rows,
                     Scratch& s) {
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(s.qb.data() + r * sh.dim, q.row(i0 + r / sh.group, h * sh.group + r % sh.group), sh.dim * 2);
  }

  template <int kR, int kV>
  static void scores(const Scratch& s, const uint32_t* kp, const Shape& sh, int64_t r0, int64_t j0, int64_t c0,
                     float* out) {
    __m512 acc[kR][kV];
#pragma GCC unroll 6
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) acc[r][c] = _mm512_setzero_ps();
    const uint16_t* q = s.qb.data() + r0 * sh.dim;
    const uint32_t* kcol = kp + j0 + c0;
    for (int64_t d = 0; d < sh.dim / 2; ++d) {
      __m512i k[kV];
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) k[c] = _mm512_loadu_si512(kcol + d * sh.lpad + c * 16);
#pragma GCC unroll 6
      for (int r = 0; r < kR; ++r) {
        const __m512bh qr = as_bh(bcast_pair(q + r * sh.dim + 2 * d));
#pragma GCC unroll 4
        for (int c = 0; c < kV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(k[c]), qr);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) _mm512_storeu_ps(out + (r0 + r) * kKeys + c0 + c * 16, acc[r][c]);
  }

  // the block's weights p[r][0..n) (n even, zeros past each row's visible keys) as bf16 pairs in s.pb
  static void weights(Scratch& s, int64_t rows, int64_t n) {
    for (int64_t r = 0; r < rows; ++r) {
      const float* p = s.scores.data() + r * kKeys;
      for (int64_t j = 0; j < n; j += 32) {  // scores rows are zero-filled to a multiple of 32 (softmax_row)
        const __m512bh packed = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(p + j + 16), _mm512_loadu_ps(p + j));
        _mm512_storeu_si512(s.pb.data() + r * kKeys / 2 + j / 2, reinterpret_cast<__m512i>(packed));
      }
    }
  }
  static int64_t pv_keys(int64_t width) { return round_up(width, 2); }

  template <int kR, int kV>
  static void values(Scratch& s, const uint32_t* vp, const Shape& sh, int64_t r0, int64_t j0, int64_t n,
                     int64_t d0) {
    __m512 acc[kR][kV];
    float* o = s.o.data() + r0 * sh.dim_v + d0;
#pragma GCC unroll 6
    for (int r = 0; r < kR; ++r) {
      const __m512 corr = _mm512_set1_ps(s.corr[r0 + r]);
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * sh.dim_v + c * 16), corr);
    }
    const uint32_t* p = s.pb.data() + r0 * kKeys / 2;
    const uint32_t* vrow = vp + j0 / 2 * sh.dim_v + d0;
    for (int64_t j = 0; j < n / 2; ++j) {
      __m512i v[kV];
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) v[c] = _mm512_loadu_si512(vrow + j * sh.dim_v + c * 16);
#pragma GCC unroll 6
      for (int r = 0; r < kR; ++r) {
        const __m512bh pr = as_bh(bcast_pair(p + r * kKeys / 2 + j));
#pragma GCC unroll 4
        for (int c = 0; c < kV; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(v[c]), pr);
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) _mm512_storeu_ps(o + r * sh.dim_v + c * 16, acc[r][c]);
  }
};
bool prefill_bf16_dot() { return true; }
#else
bool prefill_bf16_dot() { return false; }
#endif
