// The small per-layer ops of a CPU decode step, each one pass over its rows instead of a chain of
// ATen ops (each with its own dispatch, temporary and trip through memory): RMSNorm, SiLU-and-mul,
// rotary embedding in place, and the K/V write into the paged cache. At batch 64 on the bench model
// the ATen chains took ~7 ms of a ~80 ms step on one thread. Also the greedy pick over the vocabulary:
// ATen's argmax does not vectorise (~0.064 ms a 49,152-logit row, ~1.7 ms a SmolLM2 step of 25).
//
// fp32 activations only, SiLU-and-mul bf16 too (Python falls back to plain torch for anything else,
// ferry/kernels/cpu_layers.py); the cache written may be fp32, bf16 or fp16. Rows may have any stride, elements
// within a row are contiguous. Rows are split over at::parallel_for, so these use torch's threads like everything else.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace {

using namespace ferry_cpu;
static_assert(sizeof(bf16) == sizeof(c10::BFloat16), "bf16 must have c10::BFloat16's layout");

constexpr int64_t kGrain = 16;  // rows per parallel_for chunk: each row is only a few hundred floats

// o = w * row / sqrt(mean(row^2) + eps) for one row of `hidden` values.
inline void norm_row(const float* __restrict row, const float* __restrict w, float* __restrict o, int64_t hidden,
                     float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < hidden; ++i) squares += row[i] * row[i];
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
#pragma omp simd
  for (int64_t i = 0; i < hidden; ++i) o[i] = w[i] * (row[i] * inv);
}

// out[t] = weight * x[t] / sqrt(mean(x[t]^2) + eps), x [T, H] -> out [T, H] contiguous.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat);
  TORCH_INTERNAL_ASSERT(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                        weight.scalar_type() == at::kFloat);
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows, hidden}, x.options());
  const float* xd = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) norm_row(xd + t * stride, w, od + t * hidden, hidden, epsf);
  });
  return out;
}

// The residual add and the next RMSNorm in one pass: x[t] += delta[t] in place, then out[t] = weight *
// x[t] / sqrt(mean(x[t]^2) + eps), x and delta [T, H] -> out [T, H] contiguous. The same sums in the same
// order as an ATen add followed by rms_norm above, so the results are identical.
at::Tensor add_rms_norm_(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight, double eps) {
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat);
  TORCH_INTERNAL_ASSERT(delta.dim() == 2 && delta.stride(1) == 1 && delta.scalar_type() == at::kFloat &&
                        delta.size(0) == x.size(0) && delta.size(1) == x.size(1));
  TORCH_INTERNAL_ASSERT(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(1) &&
                        weight.scalar_type() == at::kFloat);
  const int64_t rows = x.size(0), hidden = x.size(1), stride = x.stride(0), d_stride = delta.stride(0);
  auto out = at::empty({rows, hidden}, x.options());
  float* xd = x.data_ptr<float>();
  const float* dd = delta.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const float epsf = static_cast<float>(eps);
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* __restrict row = xd + t * stride;
      const float* __restrict d = dd + t * d_stride;
      float* __restrict o = od + t * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) row[i] += d[i];
      norm_row(row, w, o, hidden, epsf);
    }
  });
  return out;
}

// silu(g) = g * sigmoid(g), from exp(-|g|) so the exponent is never positive (no overflow).
inline float silu(float g) {
  const float e = exp_nonpositive(-std::fabs(g));
  return g * ((g >= 0.f ? 1.f : e) / (1.f + e));
}

// x [T, 2I] = [gate | up] -> silu(gate) * up [T, I] contiguous (the gated MLP's activation), fp32 or bf16 (out
// in x's dtype). bf16 rows (the gate/up output of a bf16 copy's matmul on AMX, quant_linear.BF16_ACTIVATIONS) are
// widened, multiplied in fp32 and rounded once, where ATen's bf16 silu then mul rounds twice and makes a
// temporary: on a 2-core Xeon those two ATen ops were 8% of the SmolLM2 burst's prefill op time and 5% of its
// decode steps' (ops/bench/throughput/steps.py smollm2 prefill-ops / decode-ops).
template <typename T>
void silu_and_mul_rows(const T* xd, T* od, int64_t rows, int64_t width, int64_t stride) {
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* __restrict gate = xd + t * stride;
      const T* __restrict up = gate + width;
      T* __restrict o = od + t * width;
      if constexpr (std::is_same_v<T, float>) {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) o[i] = silu(gate[i]) * up[i];
      } else {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) o[i] = to_bf16(silu(to_float(gate[i])) * to_float(up[i]));
      }
    }
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  const bool is_bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0 &&
                        (is_bf16 || x.scalar_type() == at::kFloat));
  const int64_t rows = x.size(0), width = x.size(1) / 2, stride = x.stride(0);
  auto out = at::empty({rows, width}, x.options());
  if (is_bf16)
    silu_and_mul_rows(reinterpret_cast<const bf16*>(x.data_ptr<c10::BFloat16>()),
                      reinterpret_cast<bf16*>(out.data_ptr<c10::BFloat16>()), rows, width, stride);
  else
    silu_and_mul_rows(x.data_ptr<float>(), out.data_ptr<float>(), rows, width, stride);
  return out;
}

// Rotary embedding in place, halves layout (rotate_half): x [T, H, D]; cos, sin [T, D/2] contiguous.
// x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin for the halves x1 = x[..., :D/2], x2 = x[..., D/2:].
void rotary_(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_INTERNAL_ASSERT(x.dim() == 3 && x.stride(2) == 1 && x.size(2) % 2 == 0 && x.scalar_type() == at::kFloat);
  const int64_t rows = x.size(0), heads = x.size(1), half = x.size(2) / 2;
  TORCH_INTERNAL_ASSERT(cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kFloat &&
                        sin.scalar_type() == at::kFloat && cos.numel() == rows * half && sin.numel() == rows * half);
  const int64_t s_row = x.stride(0), s_head = x.stride(1);
  float* xd = x.data_ptr<float>();
  const float* cd = cos.data_ptr<float>();
  const float* sd = sin.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict c = cd + t * half;
      const float* __restrict s = sd + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        float* __restrict x1 = xd + t * s_row + h * s_head;
        float* __restrict x2 = x1 + half;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x1[i], b = x2[i];
          x1[i] = a * c[i] - b * s[i];
          x2[i] = b * c[i] + a * s[i];
        }
      }
    }
  });
}

template <typename T>
inline T from_float(float x) {
  if constexpr (std::is_same_v<T, bf16>) return to_bf16(x);  // vectorises; c10's conversion does not
  else if constexpr (std::is_same_v<T, fp8e4m3>) return to_fp8e4m3(x);  // likewise
  else return static_cast<T>(x);
}

// T: the cache's element type as stored (bf16 for c10::BFloat16, fp8e4m3 for c10::Float8_e4m3fn: same layouts).
template <typename T>
void write_rows(const at::Tensor& cache, const int64_t* slots, const at::Tensor& values) {
  const int64_t rows = values.size(0), heads = values.size(1), dim = values.size(2), bs = cache.size(1);
  const int64_t c_block = cache.stride(0), c_token = cache.stride(1), c_head = cache.stride(2);
  const int64_t v_row = values.stride(0), v_head = values.stride(1);
  T* cd = static_cast<T*>(cache.data_ptr());
  const float* vd = values.data_ptr<float>();
  at::parallel_for(0, rows, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* dst = cd + (slots[t] / bs) * c_block + (slots[t] % bs) * c_token;
      for (int64_t h = 0; h < heads; ++h) {
        T* __restrict d = dst + h * c_head;
        const float* __restrict v = vd + t * v_row + h * v_head;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) d[i] = from_float<T>(v[i]);
      }
    }
  });
}

// cache [N, bs, H, D] (any strides but unit element stride; fp32, bf16 or fp16) gets row slots[t] =
// values[t] [H, D] (fp32, converted). Slots are checked before anything is written: ValueError.
void write_kv(const at::Tensor& cache, const at::Tensor& slot_mapping, const at::Tensor& values) {
  TORCH_INTERNAL_ASSERT(cache.dim() == 4 && cache.stride(3) == 1);
  TORCH_INTERNAL_ASSERT(values.dim() == 3 && values.stride(2) == 1 && values.scalar_type() == at::kFloat);
  TORCH_INTERNAL_ASSERT(values.size(1) == cache.size(2) && values.size(2) == cache.size(3));
  TORCH_INTERNAL_ASSERT(slot_mapping.dim() == 1 && slot_mapping.is_contiguous() &&
                        slot_mapping.scalar_type() == at::kLong && slot_mapping.size(0) == values.size(0));
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t capacity = cache.size(0) * cache.size(1);
  for (int64_t t = 0; t < values.size(0); ++t)
    TORCH_CHECK_VALUE(slots[t] >= 0 && slots[t] < capacity, "slot_mapping[", t, "] = ", slots[t],
                      " is outside the cache's ", capacity, " slots");
  switch (cache.scalar_type()) {
    case at::kFloat: write_rows<float>(cache, slots, values); break;
    case at::kBFloat16: write_rows<bf16>(cache, slots, values); break;
    case at::kHalf: write_rows<c10::Half>(cache, slots, values); break;
    case at::kFloat8_e4m3fn: write_rows<fp8e4m3>(cache, slots, values); break;
    default: TORCH_CHECK_VALUE(false, "cache: dtype ", cache.scalar_type(), " is not fp32, bf16, fp16 or fp8 e4m3");
  }
}

// First index of each row's largest value, x [B, V] -> [B] int64, as torch.argmax: a NaN counts as
// the largest (the first NaN wins), ties go to the first. Pass 1 is a vectorised max (NaN noted, not
// compared); pass 2 finds the first chunk holding it, from cache, and the index inside that chunk.
constexpr int64_t kArgmaxChunk = 64;
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_INTERNAL_ASSERT(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kFloat && x.size(1) > 0);
  const int64_t rows = x.size(0), width = x.size(1), stride = x.stride(0);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xd = x.data_ptr<float>();
  int64_t* od = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict row = xd + t * stride;
      float best = -std::numeric_limits<float>::infinity();
      int nan = 0;
#pragma omp simd reduction(max : best) reduction(| : nan)
      for (int64_t i = 0; i < width; ++i) {
        best = row[i] > best ? row[i] : best;
        nan |= row[i] != row[i];
      }
      int64_t found = 0;
      for (int64_t c = 0; c < width; c += kArgmaxChunk) {  // the first chunk that holds the pick
        const int64_t n = std::min(kArgmaxChunk, width - c);
        int hit = 0;
#pragma omp simd reduction(| : hit)
        for (int64_t i = 0; i < n; ++i) hit |= nan ? row[c + i] != row[c + i] : row[c + i] == best;
        if (hit) {
          for (int64_t i = 0; i < n; ++i)
            if (nan ? row[c + i] != row[c + i] : row[c + i] == best) {
              found = c + i;
              break;
            }
          break;
        }
      }
      od[t] = found;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ferry_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", &rms_norm);
  m.def("add_rms_norm_(Tensor(a!) x, Tensor delta, Tensor weight, float eps) -> Tensor", &add_rms_norm_);
  m.def("silu_and_mul(Tensor x) -> Tensor", &silu_and_mul);
  m.def("rotary_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &rotary_);
  m.def("write_kv(Tensor(a!) cache, Tensor slot_mapping, Tensor values) -> ()", &write_kv);
  m.def("argmax_rows(Tensor x) -> Tensor", &argmax_rows);
}
