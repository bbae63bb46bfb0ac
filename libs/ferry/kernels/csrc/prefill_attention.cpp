// Causal prefill attention on the CPU for a whole new prompt (no cached context, no sliding window): q [L, H, D],
// k [L, Hkv, D], v [L, Hkv, Dv] of the prompt's own tokens -> [L, H, Dv]. Replaces repeat_interleave of K/V to H
// heads + torch's CPU flash SDPA (~150 GFLOP/s on SmolLM2's 9/3 heads of 64).
//
// Work item = (KV head, block of kQueryTokens query tokens): the G = H / Hkv query heads of that KV head are extra
// rows of one tile (row r = token r / G, head r % G), so K/V are never repeated. Each item walks the key blocks
// of kKeys keys up to its last token (the causal blocks after it are skipped; only the diagonal block is masked)
// with an online softmax: scores S = Q K^T of a block, the running max / sum / rescale per row, then O += P V.
// Items are handed out heaviest (latest query block) first from an atomic counter inside at::parallel_for.
//
// K and V of each KV head are packed once per call so that the two matmuls are register-blocked broadcast-FMA
// kernels (kRows query rows x kVecs vectors of keys or value dims held in registers):
//  - fp32 (q/k/v fp32, or bf16 where the CPU lacks AVX512_BF16): K transposed to [D, Lpad], V rows [Lpad, Dv],
//    plain FMAs on machine vectors (cpu_math.h: AVX-512 or AVX2);
//  - bf16 dot (q/k/v bf16 on a CPU with AVX512_BF16; prefill_attention_bf16.h): VDPBF16PS, which sums a pair of
//    bf16 products per lane. K is packed [D/2, Lpad] of (k[d], k[d+1]) pairs and dotted with the broadcast
//    (q[d], q[d+1]) pair; V is packed [Lpad/2, Dv] of (v[j][d], v[j+1][d]) pairs and dotted with the broadcast
//    (p[j], p[j+1]) pair, the softmax weights rounded to bf16 (as oneDNN's and flash-attention's bf16 P.V do).
//    Products sum in fp32.
// Scores, softmax and O stay fp32; the output takes q's dtype.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

namespace {

using namespace ferry_cpu;

// Measured (bf16 and fp32, SmolLM2 shapes, L 50-600, 2 threads): 8 or 32 query tokens, 128 keys, within 3% of these.
constexpr int64_t kQueryTokens = 16;  // query tokens per item: G * 16 tile rows (48 on SmolLM2)
constexpr int64_t kKeys = 64;         // keys per online-softmax step
// micro-kernel: kRows rows x kVecs vectors of accumulators (AVX-512: 6 x 4 = 24 of 32 registers; AVX2: 3 x 3 of 16)
constexpr int kRows = kLanes == 16 ? 6 : 3;
constexpr int kVecs = kLanes == 16 ? 4 : 3;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

struct Shape {
  int64_t len, heads, kv_heads, group, dim, dim_v, lpad;
  float scale;
};

template <typename T>
struct Rows {  // a [L, heads, dim] tensor with any token / head stride, elements contiguous
  const T* data;
  int64_t s_token, s_head;
  const T* row(int64_t token, int64_t head) const { return data + token * s_token + head * s_head; }
};

template <typename T>
Rows<T> rows_of(const at::Tensor& t) {
  return {reinterpret_cast<const T*>(t.data_ptr()), t.stride(0), t.stride(1)};
}

inline float widen(float x) { return x; }
inline float widen(c10::BFloat16 x) { return to_float(bf16{x.x}); }

struct Scratch {  // one per worker thread, kept across calls (thread_local) and grown when a call needs more
  std::vector<float> scores, o, max, sum, corr;
  std::vector<float> qf;     // [M, D] fp32 query rows (fp32 format)
  std::vector<uint16_t> qb;  // [M, D] bf16 query rows (bf16 dot format)
  std::vector<uint32_t> pb;  // [M, kKeys / 2] bf16 weight pairs (bf16 dot format)
  void fit(const Shape& sh) {
    const int64_t rows = kQueryTokens * sh.group;
    if (static_cast<int64_t>(max.size()) >= rows && static_cast<int64_t>(o.size()) >= rows * sh.dim_v &&
        static_cast<int64_t>(qf.size()) >= rows * sh.dim)
      return;
    scores.resize(rows * kKeys), o.resize(rows * sh.dim_v), max.resize(rows), sum.resize(rows), corr.resize(rows);
    qf.resize(rows * sh.dim), qb.resize(rows * sh.dim), pb.resize(rows * kKeys / 2);
  }
};

// ---- fp32 format: K^T [D, Lpad] and V [Lpad, Dv] per KV head, fp32 ----
struct F32 {
  using Packed = float;
  static int64_t k_size(const Shape& sh) { return sh.dim * sh.lpad; }
  static int64_t v_size(const Shape& sh) { return sh.lpad * sh.dim_v; }

  template <typename T>
  static void pack(const Rows<T>& k, const Rows<T>& v, const Shape& sh, int64_t h, float* kt, float* vp) {
    std::fill(kt, kt + k_size(sh), 0.f);
    for (int64_t j = 0; j < sh.len; ++j) {
      const T* kr = k.row(j, h);
      for (int64_t d = 0; d < sh.dim; ++d) kt[d * sh.lpad + j] = widen(kr[d]);
      const T* vr = v.row(j, h);
      float* out = vp + j * sh.dim_v;
      for (int64_t d = 0; d < sh.dim_v; ++d) out[d] = widen(vr[d]);
    }
    std::fill(vp + sh.len * sh.dim_v, vp + v_size(sh), 0.f);
  }

  template <typename T>
  static void load_q(const Rows<T>& q, const Shape& sh, int64_t h, int64_t i0, int64_t rows, Scratch& s) {
    for (int64_t r = 0; r < rows; ++r) {
      const T* src = q.row(i0 + r / sh.group, h * sh.group + r % sh.group);
      float* dst = s.qf.data() + r * sh.dim;
      for (int64_t d = 0; d < sh.dim; ++d) dst[d] = widen(src[d]);
    }
  }

  // s[r][c] = q[r] . k[j0 + c] for kR rows from r0 and kV vectors of keys from column c0
  template <int kR, int kV>
  static void scores(const Scratch& s, const float* kt, const Shape& sh, int64_t r0, int64_t j0, int64_t c0,
                     float* out) {
    vecf acc[kR][kV] = {};
    const float* q = s.qf.data() + r0 * sh.dim;
    const float* kcol = kt + j0 + c0;
    for (int64_t d = 0; d < sh.dim; ++d) {
      vecf k[kV];
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) k[c] = loadv(kcol + d * sh.lpad + c * kLanes);
#pragma GCC unroll 6
      for (int r = 0; r < kR; ++r) {
        const vecf qr = vecf{} + q[r * sh.dim + d];
#pragma GCC unroll 4
        for (int c = 0; c < kV; ++c) acc[r][c] += qr * k[c];
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) storev(out + (r0 + r) * kKeys + c0 + c * kLanes, acc[r][c]);
  }

  static void weights(Scratch&, int64_t, int64_t) {}  // P.V reads the fp32 weights as they are
  static int64_t pv_keys(int64_t width) { return width; }

  // o[r][d0..) = o[r][d0..) * corr[r] + sum_j p[r][j] v[j0 + j][d0..) for kR rows, kV vectors of value dims
  template <int kR, int kV>
  static void values(Scratch& s, const float* vp, const Shape& sh, int64_t r0, int64_t j0, int64_t n, int64_t d0) {
    vecf acc[kR][kV];
    float* o = s.o.data() + r0 * sh.dim_v + d0;
#pragma GCC unroll 6
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) acc[r][c] = loadv(o + r * sh.dim_v + c * kLanes) * s.corr[r0 + r];
    const float* p = s.scores.data() + r0 * kKeys;
    const float* vrow = vp + j0 * sh.dim_v + d0;
    for (int64_t j = 0; j < n; ++j) {
      vecf v[kV];
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) v[c] = loadv(vrow + j * sh.dim_v + c * kLanes);
#pragma GCC unroll 6
      for (int r = 0; r < kR; ++r) {
        const vecf pr = vecf{} + p[r * kKeys + j];
#pragma GCC unroll 4
        for (int c = 0; c < kV; ++c) acc[r][c] += pr * v[c];
      }
    }
#pragma GCC unroll 6
    for (int r = 0; r < kR; ++r)
#pragma GCC unroll 4
      for (int c = 0; c < kV; ++c) storev(o + r * sh.dim_v + c * kLanes, acc[r][c]);
  }
};

#include "prefill_attention_bf16.h"

// Online softmax of one row's block: scores of keys [0, visible) become weights exp(s * scale - new max), the
// rest up to `fill` zeros; corr = exp(old max - new max) rescales what the row accumulated before.
inline void softmax_row(float* __restrict sc, int64_t visible, int64_t fill, float scale, float& max, float& sum,
                        float& corr) {
  if (visible <= 0) {  // a row whose token comes before the whole block: nothing to add
    std::fill(sc, sc + fill, 0.f);
    corr = 1.f;
    return;
  }
  float tile_max = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : tile_max)
  for (int64_t j = 0; j < visible; ++j) tile_max = std::max(tile_max, sc[j]);
  const float new_max = std::max(max, tile_max * scale);  // scale > 0 (checked by the op)
  corr = std::exp(max - new_max);                         // 0 on the first block (max was -inf)
  float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
  for (int64_t j = 0; j < visible; ++j) {
    sc[j] = exp_nonpositive(sc[j] * scale - new_max);
    tile_sum += sc[j];
  }
  std::fill(sc + visible, sc + fill, 0.f);
  sum = sum * corr + tile_sum;
  max = new_max;
}

// One item: query tokens [i0, i0 + tokens) of KV head h's G query heads against keys [0, i0 + tokens).
template <typename Fmt, typename T, typename O>
void attend(const Rows<T>& q, const typename Fmt::Packed* kp, const typename Fmt::Packed* vp, const Shape& sh,
            int64_t h, int64_t i0, O* out, Scratch& s) {
  const int64_t tokens = std::min(kQueryTokens, sh.len - i0), rows = tokens * sh.group;
  Fmt::load_q(q, sh, h, i0, rows, s);
  std::fill(s.o.begin(), s.o.begin() + rows * sh.dim_v, 0.f);
  std::fill(s.max.begin(), s.max.end(), -std::numeric_limits<float>::infinity());
  std::fill(s.sum.begin(), s.sum.end(), 0.f);
  const int64_t last = i0 + tokens - 1;  // the item's last token: keys after it are never visible
  for (int64_t j0 = 0; j0 <= last; j0 += kKeys) {
    const int64_t width = std::min(kKeys, last - j0 + 1);  // keys of this block that some row sees
    const int64_t cols = round_up(width, kLanes);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows)
      with_rows<kRows>(rows - r0, [&](auto nr) {
        for (int64_t c0 = 0; c0 < cols; c0 += kVecs * kLanes)
          with_rows<kVecs>((cols - c0) / kLanes, [&](auto nv) {
            Fmt::template scores<decltype(nr)::value, decltype(nv)::value>(s, kp, sh, r0, j0, c0, s.scores.data());
          });
      });
    const int64_t keys = Fmt::pv_keys(width);
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t visible = std::min(width, i0 + r / sh.group - j0 + 1);
      softmax_row(s.scores.data() + r * kKeys, visible, round_up(keys, 32), sh.scale, s.max[r], s.sum[r], s.corr[r]);
    }
    Fmt::weights(s, rows, keys);
    for (int64_t r0 = 0; r0 < rows; r0 += kRows)
      with_rows<kRows>(rows - r0, [&](auto nr) {
        for (int64_t d0 = 0; d0 < sh.dim_v; d0 += kVecs * kLanes)
          with_rows<kVecs>((sh.dim_v - d0) / kLanes, [&](auto nv) {
            Fmt::template values<decltype(nr)::value, decltype(nv)::value>(s, vp, sh, r0, j0, keys, d0);
          });
      });
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / s.sum[r];
    const float* o = s.o.data() + r * sh.dim_v;
    O* dst = out + ((i0 + r / sh.group) * sh.heads + h * sh.group + r % sh.group) * sh.dim_v;
    for (int64_t d = 0; d < sh.dim_v; ++d) {
      if constexpr (std::is_same_v<O, float>) dst[d] = o[d] * inv;
      else dst[d] = to_bf16(o[d] * inv);
    }
  }
}

template <typename Fmt, typename T, typename O>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const Shape& sh, O* out) {
  using P = typename Fmt::Packed;
  const Rows<T> qr = rows_of<T>(q), kr = rows_of<T>(k), vr = rows_of<T>(v);
  const int64_t k_size = Fmt::k_size(sh), v_size = Fmt::v_size(sh);
  std::unique_ptr<P[]> kp(new P[k_size * sh.kv_heads]), vp(new P[v_size * sh.kv_heads]);
  // a KV head is packed by the first worker that needs it, inside the one parallel region (a short prompt's
  // whole attention takes a few tens of us: a second region's fork and join would be a good part of it)
  std::unique_ptr<std::atomic<int>[]> state(new std::atomic<int>[sh.kv_heads]);  // 0 not packed, 1 packing, 2 done
  for (int64_t h = 0; h < sh.kv_heads; ++h) state[h].store(0);
  auto packed = [&](int64_t h) {
    int expected = 0;
    if (state[h].compare_exchange_strong(expected, 1)) {
      Fmt::pack(kr, vr, sh, h, kp.get() + h * k_size, vp.get() + h * v_size);
      state[h].store(2, std::memory_order_release);
    }
    while (state[h].load(std::memory_order_acquire) != 2) std::this_thread::yield();
  };
  const int64_t blocks = (sh.len + kQueryTokens - 1) / kQueryTokens, items = blocks * sh.kv_heads;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    thread_local Scratch s;
    s.fit(sh);
    for (int64_t w = next.fetch_add(1); w < items; w = next.fetch_add(1)) {
      const int64_t block = blocks - 1 - w / sh.kv_heads, h = w % sh.kv_heads;  // latest (most keys) first
      packed(h);
      attend<Fmt, T, O>(qr, kp.get() + h * k_size, vp.get() + h * v_size, sh, h, block * kQueryTokens, out, s);
    }
  });
}

// q [L, H, D], k [L, Hkv, D], v [L, Hkv, Dv] (any token / head strides, elements contiguous), all fp32 or all bf16;
// D and Dv multiples of 16; scale > 0 -> [L, H, Dv] in q's dtype: causal attention of a whole new prompt.
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  TORCH_INTERNAL_ASSERT(q.dim() == 3 && k.dim() == 3 && v.dim() == 3);
  TORCH_INTERNAL_ASSERT(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1);
  TORCH_INTERNAL_ASSERT(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type());
  TORCH_INTERNAL_ASSERT(k.size(0) == q.size(0) && v.size(0) == q.size(0) && k.size(1) == v.size(1));
  TORCH_INTERNAL_ASSERT(q.size(1) % k.size(1) == 0 && q.size(2) == k.size(2));
  TORCH_INTERNAL_ASSERT(q.size(2) % 16 == 0 && v.size(2) % 16 == 0 && scale > 0);
  const int64_t len = q.size(0), heads = q.size(1), kv_heads = k.size(1);
  const Shape sh{len,         heads,     kv_heads, heads / kv_heads, q.size(2), v.size(2), round_up(len, kKeys),
                 static_cast<float>(scale)};
  auto out = at::empty({len, heads, sh.dim_v}, q.options());
  if (len == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    run<F32, float, float>(q, k, v, sh, out.data_ptr<float>());
    return out;
  }
  TORCH_INTERNAL_ASSERT(q.scalar_type() == at::kBFloat16);
  bf16* od = reinterpret_cast<bf16*>(out.data_ptr());
#if defined(FERRY_PREFILL_BF16_DOT)
  run<Bf16Dot, c10::BFloat16, bf16>(q, k, v, sh, od);
#else
  run<F32, c10::BFloat16, bf16>(q, k, v, sh, od);
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ferry_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor", &prefill_attention);
  m.def("prefill_bf16_dot() -> bool", &prefill_bf16_dot);
}
