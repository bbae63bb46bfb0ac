// Fused paged decode attention for the CPU: one new query token per sequence against its cached
// K/V, read in place from the paged cache (no gather copy), with an online softmax over token tiles.
//
// Work item = (sequence, KV head): the G = H / Hkv query heads sharing a KV head are computed
// together, so each K/V row is read from memory once. Items are handed out longest sequence first
// from an atomic counter inside at::parallel_for, so the kernel uses at most torch's thread count,
// shares ATen's thread pool (no second OpenMP team competing for cores) and balances mixed lengths.
// Hot loops hold machine-width float vectors in registers (GCC/Clang vector extensions: 16 lanes with
// AVX-512, else 8; cpu_math.h) and take a KV head's query rows three at a time on AVX-512 (two on AVX2:
// what the registers hold), so each K/V row is loaded once per run of rows; the rest are `omp simd`
// loops (-fopenmp-simd: no OpenMP runtime). The softmax uses our own vectorisable exp, and only
// reassociation is allowed, not -ffast-math: the online softmax relies on -inf. The rows kAhead tiles
// ahead (into the next item's) are prefetched into L2 while the current tile is computed.
//
// Python checks shapes, dtypes and devices first (ferry/kernels/cpu_decode.py); here, values that
// only the data reveals (seq_lens vs the block table, block ids vs the cache) raise ValueError.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace {

using namespace ferry_cpu;

// Tiles prefetched ahead. Measured at batch 64, context 256, 1 thread, bench shapes: 3 tiles took ~15%
// less time than 1 (which could not cover DRAM latency); 4-8 were no better than 3.
constexpr int64_t kAhead = 3;
constexpr int64_t kTile = 32;  // tokens per online-softmax step; at batch 64, 16-32 ran ~1.25x faster than 64-128

template <typename T>
struct CacheView {  // a logical [N, bs, Hkv, dim] cache with arbitrary element strides
  const T* data;
  int64_t s_block, s_token, s_head, s_dim, dim;
  const T* row(int64_t block, int64_t offset, int64_t head) const {
    return data + block * s_block + offset * s_token + head * s_head;
  }
};

template <typename T>
CacheView<T> view_of(const at::Tensor& cache) {
  return {cache.data_ptr<T>(), cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3), cache.size(3)};
}

// Rows are read as R: in place where the loops can (R = T: unit-stride fp32, or bf16, widened in
// registers), else as fp32 rows converted into buf (R = float; fp16, or elements with a stride).
template <typename R, typename T>
inline const R* row_as(const T* src, int64_t stride, int64_t n, float* buf) {
  if constexpr (std::is_same_v<T, float> && std::is_same_v<R, float>) {
    if (stride == 1) return src;
  }
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<R, bf16>) {
    return reinterpret_cast<const bf16*>(src);  // run<> picks R = bf16 only for unit-stride rows
  } else if constexpr (std::is_same_v<T, c10::Float8_e4m3fn> && std::is_same_v<R, fp8e4m3>) {
    return reinterpret_cast<const fp8e4m3*>(src);  // likewise R = fp8e4m3
  } else {
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(src[i * stride]);
    return buf;
  }
}

template <typename R>
struct Scratch {  // one per worker thread, sized once
  std::vector<float> q, acc, scores, max, sum, kbuf, vbuf;
  std::vector<const R*> krows, vrows;
  std::vector<const char*> ahead;  // [kTile, 2]: K and V row addresses of the next tile
  std::vector<uint16_t> qb;        // [G, D] bf16 query rows (paged_decode_bf16.h)
  std::vector<uint32_t> pb;        // [G, kTile / 2] the tile's softmax weights as bf16 pairs (likewise)
  Scratch(int64_t group, int64_t dim, int64_t dim_v)
      : q(group * dim), acc(group * dim_v), scores(group * kTile), max(group), sum(group), kbuf(kTile * dim),
        vbuf(kTile * dim_v), krows(kTile), vrows(kTile), ahead(2 * kTile), qb(group * dim), pb(group * kTile / 2) {}
  void start_item() {  // an item's online-softmax state: nothing accumulated, running max -inf
    std::fill(acc.begin(), acc.end(), 0.f);
    std::fill(max.begin(), max.end(), -std::numeric_limits<float>::infinity());
    std::fill(sum.begin(), sum.end(), 0.f);
  }
};

struct Item {  // one (sequence, KV head) work item
  const float* q;  // [G, D] query rows of this KV head's group
  float* out;      // [G, Dv]
  const int64_t* table;
  int64_t first, len, head;
};

// Row pointers of tokens t0..t0+n-1 of the item's KV head, walking the block table.
template <typename R, typename T>
inline void tile_rows(const Item& it, const CacheView<T>& c, int64_t bs, int64_t t0, int64_t n, const R** rows,
                      float* buf) {
  for (int64_t j = 0, blk = t0 / bs, off = t0 % bs; j < n; ++blk, off = 0) {  // one cache block at a time
    const T* base = c.row(it.table[blk], 0, it.head);
    for (; off < bs && j < n; ++off, ++j) rows[j] = row_as<R>(base + off * c.s_token, c.s_dim, c.dim, buf + j * c.dim);
  }
}

// Addresses of K and V rows of tokens t0..t0+n-1, to prefetch while a tile before them is computed:
// each cache block is its own few KB (often its own page), where hardware prefetchers stop, so
// without this every block starts with cache misses. Interleaving the prefetches with the scoring
// loop (one K and one V row per token) keeps the miss buffers fed without a burst that stalls them.
template <typename T>
int64_t rows_ahead(const Item* it, const CacheView<T>& k, const CacheView<T>& v, int64_t bs, int64_t t0,
                   const char** out) {
  if (it == nullptr || t0 >= it->len || k.s_dim != 1 || v.s_dim != 1) return 0;
  const int64_t n = std::min(kTile, it->len - t0);
  int64_t blk = t0 / bs, off = t0 % bs;
  for (int64_t j = 0; j < n; ++j) {
    out[2 * j] = reinterpret_cast<const char*>(k.row(it->table[blk], off, it->head));
    out[2 * j + 1] = reinterpret_cast<const char*>(v.row(it->table[blk], off, it->head));
    if (++off == bs) off = 0, ++blk;
  }
  return n;
}

// rows_ahead for the tile kAhead tiles after `tile` of it (num_tiles in all): past its last tile, the next
// item's (`following`, may be null) first ones, so a new item does not start with cache misses.
template <typename T>
int64_t tile_ahead(const Item& it, const Item* following, int64_t tile, int64_t num_tiles, const CacheView<T>& k,
                   const CacheView<T>& v, int64_t bs, const char** out) {
  const int64_t target = tile + kAhead;
  const Item* ahead_item = target < num_tiles ? &it : following;
  const int64_t ahead_t0 = target < num_tiles ? it.first + target * kTile
                                              : (following ? following->first + (target - num_tiles) * kTile : 0);
  return rows_ahead(ahead_item, k, v, bs, ahead_t0, out);
}

// Online softmax over one tile for query row g: scores become weights against the new running max,
// and what was accumulated so far is rescaled to that max.
inline void softmax_tile(float* __restrict sc, int64_t n, float* __restrict acc, int64_t dim_v, float& max,
                         float& sum) {
  float tile_max = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) tile_max = std::max(tile_max, sc[j]);
  const float new_max = std::max(max, tile_max);
  const float correction = std::exp(max - new_max);  // 0 on the first tile (max was -inf)
  float tile_sum = 0.f;
#pragma omp simd reduction(+ : tile_sum)
  for (int64_t j = 0; j < n; ++j) {
    sc[j] = exp_nonpositive(sc[j] - new_max);
    tile_sum += sc[j];
  }
  sum = sum * correction + tile_sum;
  max = new_max;
  if (correction != 1.f) {
#pragma omp simd
    for (int64_t d = 0; d < dim_v; ++d) acc[d] *= correction;
  }
}

// acc[g][0..w) += sum_j p[g][j] * rows[j][d0..d0+w) for kQ query rows: each value row is read once for
// all of them. Full chunks of kChunk floats keep their partial sums in registers across the tile's tokens
// (4 vectors per query row, with the row and the kQ weights: 11 of AVX2's 16 registers for 2 rows, 16 of
// AVX-512's 32 for 3); a narrower remainder (w < kChunk) takes the plain loop.
constexpr int64_t kChunk = 4 * kLanes;
template <int kQ, typename R>
inline void accumulate(float* const* acc, const R* const* rows, const float* const* p, int64_t n, int64_t d0,
                       int64_t w) {
  if (w == kChunk) {
    vecf part[kQ][4];
#pragma GCC unroll 3
    for (int g = 0; g < kQ; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) part[g][c] = loadv(acc[g] + d0 + c * kLanes);
    for (int64_t j = 0; j < n; ++j) {
      const R* vr = rows[j] + d0;
      vecf a[kQ];
#pragma GCC unroll 3
      for (int g = 0; g < kQ; ++g) a[g] = vecf{} + p[g][j];
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) {
        const vecf v = loadv(vr + c * kLanes);
#pragma GCC unroll 3
        for (int g = 0; g < kQ; ++g) part[g][c] += a[g] * v;
      }
    }
#pragma GCC unroll 3
    for (int g = 0; g < kQ; ++g)
#pragma GCC unroll 4
      for (int c = 0; c < 4; ++c) storev(acc[g] + d0 + c * kLanes, part[g][c]);
    return;
  }
  for (int64_t j = 0; j < n; ++j) {
    const R* __restrict vr = rows[j] + d0;
    for (int g = 0; g < kQ; ++g) {
      float* __restrict out = acc[g] + d0;
      const float a = p[g][j];
#pragma omp simd
      for (int64_t d = 0; d < w; ++d) out[d] += a * to_float(vr[d]);
    }
  }
}

// One tile for the kQ query rows from row g0 of the item's group: their scores (values = false), or
// their weighted sums of the tile's value rows (values = true, after the softmax).
template <int kD, int kQ, typename R>
inline void rows_of_tile(Scratch<R>& s, int64_t g0, int64_t n, int64_t dim, int64_t dim_v, const char* const* ahead,
                         int64_t num_ahead, int64_t k_bytes, int64_t v_bytes, bool values) {
  const float* q[kQ];
  float* sc[kQ];
  float* acc[kQ];
  for (int g = 0; g < kQ; ++g) {
    q[g] = s.q.data() + (g0 + g) * dim;
    sc[g] = s.scores.data() + (g0 + g) * kTile;
    acc[g] = s.acc.data() + (g0 + g) * dim_v;
  }
  if (!values) {
    score_rows<kD, kQ, R>(q, s.krows.data(), n, dim, sc, ahead, num_ahead, k_bytes, v_bytes);
    return;
  }
  for (int64_t d0 = 0; d0 < dim_v; d0 += kChunk)
    accumulate<kQ, R>(acc, s.vrows.data(), sc, n, d0, std::min(kChunk, dim_v - d0));
}

// Runs rows_of_tile over the whole group, kMaxQueryRows rows at a time (a shorter last run).
template <int kD, typename R>
inline void group_rows(Scratch<R>& s, int64_t group, int64_t n, int64_t dim, int64_t dim_v, const char* const* ahead,
                       int64_t num_ahead, int64_t k_bytes, int64_t v_bytes, bool values) {
  for (int64_t g = 0; g < group; g += kMaxQueryRows) {
    const int64_t rows = std::min<int64_t>(kMaxQueryRows, group - g);
    const int64_t pre = g == 0 ? num_ahead : 0;  // the first run prefetches for the whole tile
    if constexpr (kMaxQueryRows >= 3) {
      if (rows == 3) {
        rows_of_tile<kD, 3, R>(s, g, n, dim, dim_v, ahead, pre, k_bytes, v_bytes, values);
        continue;
      }
    }
    if (rows == 2) rows_of_tile<kD, 2, R>(s, g, n, dim, dim_v, ahead, pre, k_bytes, v_bytes, values);
    else rows_of_tile<kD, 1, R>(s, g, n, dim, dim_v, ahead, pre, k_bytes, v_bytes, values);
  }
}

// One (sequence, KV head): out[g] = softmax(q_g K^T * scale) V over the visible tokens, one tile of
// kTile tokens at a time, reading each K/V row once for all G query rows. kD/kDv: head sizes fixed
// at compile time for the common shapes, 0 = read them at run time.
// The tile loop of both decode attention paths (attend, attend_bf16): per kTile tokens of the item, the prefetch
// targets ahead (tile_ahead), the tile's K and V row addresses, scores(n, num_ahead) (q.K into s.scores, prefetching
// num_ahead targets), each query row's online softmax into s.acc (rows of width dim_v), then values(n) (P.V into
// s.acc). The item's softmax state is reset first.
template <typename T, typename R, typename Scores, typename Values>
inline void tiles(const Item& it, const Item* following, const CacheView<T>& k, const CacheView<T>& v, int64_t bs,
                  int64_t group, int64_t dim_v, Scratch<R>& s, Scores&& scores, Values&& values) {
  s.start_item();
  const int64_t num_tiles = (it.len - it.first + kTile - 1) / kTile;
  for (int64_t t0 = it.first, tile = 0; t0 < it.len; t0 += kTile, ++tile) {
    const int64_t n = std::min(kTile, it.len - t0);
    const int64_t num_ahead = tile_ahead(it, following, tile, num_tiles, k, v, bs, s.ahead.data());
    tile_rows(it, k, bs, t0, n, s.krows.data(), s.kbuf.data());
    tile_rows(it, v, bs, t0, n, s.vrows.data(), s.vbuf.data());
    scores(n, num_ahead);
    for (int64_t g = 0; g < group; ++g)
      softmax_tile(s.scores.data() + g * kTile, n, s.acc.data() + g * dim_v, dim_v, s.max[g], s.sum[g]);
    values(n);
  }
}

template <typename T, typename R, int kD, int kDv>
void attend(const Item& it, const Item* following, const CacheView<T>& k, const CacheView<T>& v, int64_t bs,
            int64_t group, float scale, Scratch<R>& s) {
  const int64_t dim = kD ? kD : k.dim, dim_v = kDv ? kDv : v.dim;
  const int64_t k_bytes = dim * static_cast<int64_t>(sizeof(T)), v_bytes = dim_v * static_cast<int64_t>(sizeof(T));
  // rows of R read as value / kWidenScale (fp8): the queries and the output take the factor back
  const float q_scale = scale * kWidenScale<R>;
  for (int64_t i = 0; i < group * dim; ++i) s.q[i] = it.q[i] * q_scale;
  // the group's query rows kMaxQueryRows at a time: each K and V row is read once per run of rows
  tiles(
      it, following, k, v, bs, group, dim_v, s,
      [&](int64_t n, int64_t num_ahead) {
        group_rows<kD, R>(s, group, n, dim, dim_v, s.ahead.data(), num_ahead, k_bytes, v_bytes, false);
      },
      [&](int64_t n) { group_rows<kD, R>(s, group, n, dim, dim_v, s.ahead.data(), 0, k_bytes, v_bytes, true); });
  for (int64_t g = 0; g < group; ++g) {
    const float inv = kWidenScale<R> / s.sum[g];
    for (int64_t d = 0; d < dim_v; ++d) it.out[g * dim_v + d] = s.acc[g * dim_v + d] * inv;
  }
}

#include "paged_decode_bf16.h"

#if defined(FERRY_DECODE_BF16_DOT)
bool decode_bf16_dot() { return true; }
#else
bool decode_bf16_dot() { return false; }
#endif

// First visible position of each sequence; raises ValueError on lengths or block ids the cache
// cannot hold, before any thread reads memory through them.
std::vector<int64_t> check_and_window(const int64_t* tables, const int64_t* lens, int64_t batch,
                                      int64_t max_blocks, int64_t bs, int64_t num_blocks, int64_t window) {
  std::vector<int64_t> first(batch);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = lens[b];
    TORCH_CHECK_VALUE(len >= 1 && len <= max_blocks * bs, "seq_lens[", b, "] = ", len, " must be in 1..",
                      max_blocks * bs, " (block_tables has ", max_blocks, " blocks of ", bs, " tokens)");
    first[b] = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    for (int64_t blk = first[b] / bs; blk <= (len - 1) / bs; ++blk) {
      const int64_t id = tables[b * max_blocks + blk];
      TORCH_CHECK_VALUE(id >= 0 && id < num_blocks, "block_tables[", b, ", ", blk, "] = ", id,
                        " is outside the cache's ", num_blocks, " blocks");
    }
  }
  return first;
}

// kDot: bf16 rows through paged_decode_bf16.h's attend_bf16 (T = c10::BFloat16, R = bf16, kD = kDv).
template <typename T, typename R, int kD, int kDv, bool kDot = false>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* tables,
         int64_t max_blocks, const int64_t* lens, const std::vector<int64_t>& first, float scale, at::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), dim_v = out.size(2);
  const int64_t kv_heads = k_cache.size(2), bs = k_cache.size(1), group = heads / kv_heads;
  const CacheView<T> k = view_of<T>(k_cache), v = view_of<T>(v_cache);
  std::vector<int64_t> order(batch);  // longest first: long items start early, short ones fill the gaps
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lens[a] - first[a] > lens[b] - first[b]; });
  const float* qd = q.data_ptr<float>();
  const int64_t q_row = q.stride(0);  // a sequence's heads are contiguous; rows may be a view's (e.g. qkv's q part)
  float* od = out.data_ptr<float>();
  const int64_t items = batch * kv_heads;
  std::atomic<int64_t> next{0};
  // one chunk per worker; each worker pulls items until none are left (dynamic scheduling). Nested
  // inside another parallel region at::parallel_for runs inline, and one worker then does everything.
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Scratch<R> s(group, dim, dim_v);
    auto item = [&](int64_t w) {
      const int64_t b = order[w / kv_heads], h = w % kv_heads, row = b * heads + h * group;
      return Item{qd + b * q_row + h * group * dim, od + row * dim_v, tables + b * max_blocks, first[b], lens[b], h};
    };
    // claim one item ahead, so the current item's last tiles can prefetch the next one's first
    for (int64_t w = next.fetch_add(1), following = next.fetch_add(1); w < items;
         w = following, following = next.fetch_add(1)) {
      const Item it = item(w), after = following < items ? item(following) : Item{};
      const Item* next_item = following < items ? &after : nullptr;
#if defined(FERRY_DECODE_BF16_DOT)
      if constexpr (kDot) {
        attend_bf16<kD>(it, next_item, k, v, bs, group, scale, s);
        continue;
      }
#endif
      attend<T, R, kD, kDv>(it, next_item, k, v, bs, group, scale, s);
    }
  });
}

// bf16_dot: bf16 rows of a compiled-in head size (64, 128) go through attend_bf16 where it was built.
template <typename T, typename R>
void run_dims(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const int64_t* tables,
              int64_t max_blocks, const int64_t* lens, const std::vector<int64_t>& first, float scale,
              at::Tensor& out, bool bf16_dot = false) {
  const int64_t dim = q.size(2), dim_v = out.size(2);
#if defined(FERRY_DECODE_BF16_DOT)
  if constexpr (std::is_same_v<R, bf16>) {
    if (bf16_dot && dim == 64 && dim_v == 64)
      return run<T, R, 64, 64, true>(q, k_cache, v_cache, tables, max_blocks, lens, first, scale, out);
    if (bf16_dot && dim == 128 && dim_v == 128)
      return run<T, R, 128, 128, true>(q, k_cache, v_cache, tables, max_blocks, lens, first, scale, out);
  }
#endif
  if (dim == 64 && dim_v == 64) return run<T, R, 64, 64>(q, k_cache, v_cache, tables, max_blocks, lens, first, scale, out);
  if (dim == 128 && dim_v == 128) return run<T, R, 128, 128>(q, k_cache, v_cache, tables, max_blocks, lens, first, scale, out);
  run<T, R, 0, 0>(q, k_cache, v_cache, tables, max_blocks, lens, first, scale, out);
}

// q [B, H, D] fp32, each row's [H, D] contiguous (rows may be a wider tensor's); k_cache [N, bs, Hkv, D],
// v_cache [N, bs, Hkv, Dv] (any strides, one dtype: fp32, bf16, fp16 or fp8 e4m3); block_tables [B, M] int64 contiguous;
// seq_lens [B] int64 contiguous; window <= 0: none; bf16_dot: a bf16 cache's scores and weighted sums with
// VDPBF16PS where built (decode_bf16_dot()), q and the softmax weights rounded to bf16 -> [B, H, Dv] fp32.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                  const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                  int64_t window, bool bf16_dot) {
  TORCH_INTERNAL_ASSERT(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2) && q.scalar_type() == at::kFloat);
  TORCH_INTERNAL_ASSERT(k_cache.dim() == 4 && v_cache.dim() == 4 && k_cache.scalar_type() == v_cache.scalar_type());
  TORCH_INTERNAL_ASSERT(block_tables.is_contiguous() && block_tables.scalar_type() == at::kLong);
  TORCH_INTERNAL_ASSERT(seq_lens.is_contiguous() && seq_lens.scalar_type() == at::kLong);
  TORCH_INTERNAL_ASSERT(block_tables.size(0) == q.size(0) && seq_lens.size(0) == q.size(0));
  TORCH_INTERNAL_ASSERT(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3));
  auto out = at::empty({q.size(0), q.size(1), v_cache.size(3)}, q.options());
  if (q.size(0) == 0) return out;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  const auto first = check_and_window(tables, lens, q.size(0), max_blocks, k_cache.size(1), k_cache.size(0), window);
  const float s = static_cast<float>(scale);
  switch (k_cache.scalar_type()) {
    case at::kFloat: run_dims<float, float>(q, k_cache, v_cache, tables, max_blocks, lens, first, s, out); break;
    case at::kBFloat16:  // read in place and widened in registers where elements are contiguous
      if (k_cache.stride(3) == 1 && v_cache.stride(3) == 1)
        run_dims<c10::BFloat16, bf16>(q, k_cache, v_cache, tables, max_blocks, lens, first, s, out, bf16_dot);
      else
        run_dims<c10::BFloat16, float>(q, k_cache, v_cache, tables, max_blocks, lens, first, s, out);
      break;
    case at::kHalf: run_dims<c10::Half, float>(q, k_cache, v_cache, tables, max_blocks, lens, first, s, out); break;
    case at::kFloat8_e4m3fn:  // a quarter of fp32's bytes, widened in registers like bf16
      if (k_cache.stride(3) == 1 && v_cache.stride(3) == 1)
        run_dims<c10::Float8_e4m3fn, fp8e4m3>(q, k_cache, v_cache, tables, max_blocks, lens, first, s, out);
      else
        run_dims<c10::Float8_e4m3fn, float>(q, k_cache, v_cache, tables, max_blocks, lens, first, s, out);
      break;
    default:
      TORCH_CHECK_VALUE(false, "k_cache: dtype ", k_cache.scalar_type(), " is not fp32, bf16, fp16 or fp8 e4m3");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(ferry_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale, int window, bool bf16_dot=False) -> Tensor",
        &paged_decode_attention);
  m.def("decode_bf16_dot() -> bool", &decode_bf16_dot);
}
