// The layer loop of a small pure-decode CPU step in one call (ferry/model/decode_calls.py): per layer the
// q/k/v matmul, rotary, the K/V write, paged attention, o_proj, the residual add + norm, gate/up, SiLU-and-mul,
// down, the residual add + next norm. The same ops as the Python loop, in the same order and through the
// dispatcher (the kernels live in the other files of this library), so the results are bit for bit the same;
// what goes is Python's ~5 us around each of the ~300 calls of a SmolLM2 step (30 layers), and the GIL is taken
// back once per step instead of once per op (with a spinning Python thread beside it, a batch-1 forward took 29
// ms against the Python loop's 39.5; reports/20261205x-xeon-step-host/gil_probe.txt).
//
// Each layer's inputs are flat slices of three lists: tensors (kTensors a layer), ints (kInts), floats (kFloats);
// see decode_calls.py's flat_arguments for their order. bf16_dot: paged attention's (cpu_decode.BF16_DOT).
//
// copy_mode: 0, every matmul through the int8-activation kernel (quant_dot_linear); 1, through the bf16 copies
// (bf16_amx_linear, or bf16_dot_linear without AMX; copies: 4 a layer, qkv, o, gate_up, down), fp32 out; 2, as 1
// but gate/up hands bf16 rows to SiLU-and-mul and down (quant_linear.BF16_ACTIVATIONS). What QuantLinear.forward and
// GatedMLP.forward pick for a step of BF16_COPY_FROM_ROWS+ rows; decode_calls.run picks it per step. prefetch: that
// op's prefetch_bytes.

#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>

namespace {

constexpr int64_t kTensors = 16;  // 4 projections x (codes, scales, offsets), post norm, next norm, K cache, V cache
constexpr int64_t kInts = 24;     // 4 projections x (bits, group_size, n, digits, amx_from_rows), heads, kv heads, dim, window
constexpr int64_t kFloats = 3;    // post norm eps, next norm eps, attention scale

template <typename Sig>
c10::TypedOperatorHandle<Sig> find(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

using T = const at::Tensor&;

at::Tensor decode_layers(T x, T h0, T cos, T sin, T slots, T tables, T seq_lens, at::TensorList tensors,
                         at::IntArrayRef ints, at::ArrayRef<double> floats, bool bf16_dot, at::TensorList copies,
                         int64_t copy_mode, int64_t prefetch) {
  static auto dot = find<at::Tensor(T, T, T, T, int64_t, int64_t, int64_t, int64_t, int64_t)>(
      "ferry_cpu::quant_dot_linear");
  static auto add_norm = find<at::Tensor(T, T, T, double)>("ferry_cpu::add_rms_norm_");
  static auto rotary = find<void(T, T, T)>("ferry_cpu::rotary_");
  static auto write = find<void(T, T, T)>("ferry_cpu::write_kv");
  static auto attend = find<at::Tensor(T, T, T, T, T, double, int64_t, bool)>("ferry_cpu::paged_decode_attention");
  static auto silu = find<at::Tensor(T)>("ferry_cpu::silu_and_mul");
  // the copies' GEMM: AMX tiles where usable, else AVX512_BF16 (the same arguments and layout; quant_linear.copy_op)
  static auto copy_mm = find<at::Tensor(T, T, int64_t, bool, int64_t)>(
      find<bool()>("ferry_cpu::bf16_amx").call() ? "ferry_cpu::bf16_amx_linear" : "ferry_cpu::bf16_dot_linear");
  const int64_t layers = static_cast<int64_t>(tensors.size()) / kTensors;
  TORCH_CHECK_VALUE(static_cast<int64_t>(tensors.size()) == layers * kTensors &&
                        static_cast<int64_t>(ints.size()) == layers * kInts &&
                        static_cast<int64_t>(floats.size()) == layers * kFloats,
                    "decode_layers: ", tensors.size(), " tensors, ", ints.size(), " ints, ", floats.size(),
                    " floats do not make whole layers");
  TORCH_CHECK_VALUE(copy_mode >= 0 && copy_mode <= 2, "decode_layers: copy_mode ", copy_mode, " is not 0, 1 or 2");
  TORCH_CHECK_VALUE(copy_mode == 0 || static_cast<int64_t>(copies.size()) == layers * 4, "decode_layers: ",
                    copies.size(), " bf16 copies for ", layers, " layers (copy_mode ", copy_mode, ")");
  const int64_t rows = x.size(0);
  at::Tensor h = h0;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* t = tensors.data() + l * kTensors;
    const int64_t* i = ints.data() + l * kInts;
    const double* f = floats.data() + l * kFloats;
    const at::Tensor* c = copy_mode ? copies.data() + l * 4 : nullptr;
    auto linear = [&](T in, int p, bool bf16_out = false) {
      if (c != nullptr) return copy_mm.call(in, c[p], i[5 * p + 2], bf16_out, prefetch);
      return dot.call(in, t[3 * p], t[3 * p + 1], t[3 * p + 2], i[5 * p], i[5 * p + 1], i[5 * p + 2], i[5 * p + 3],
                      i[5 * p + 4]);
    };
    const int64_t heads = i[20], kv_heads = i[21], dim = i[22], window = i[23];
    const at::Tensor qkv = linear(h, 0).view({rows, heads + 2 * kv_heads, dim});  // [B, H + 2 Hkv, D]
    rotary.call(qkv.narrow(1, 0, heads + kv_heads), cos, sin);
    write.call(t[14], slots, qkv.narrow(1, heads, kv_heads));
    write.call(t[15], slots, qkv.narrow(1, heads + kv_heads, kv_heads));
    const at::Tensor out = attend.call(qkv.narrow(1, 0, heads), t[14], t[15], tables, seq_lens, f[2], window, bf16_dot);
    h = add_norm.call(x, linear(out.view({rows, -1}), 1), t[12], f[0]);
    h = add_norm.call(x, linear(silu.call(linear(h, 2, copy_mode == 2)), 3), t[13], f[1]);
  }
  return h;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(ferry_cpu, m) {
  m.def(
      "decode_layers(Tensor(a!) x, Tensor h, Tensor cos, Tensor sin, Tensor slots, Tensor tables, Tensor seq_lens, "
      "Tensor[] tensors, int[] ints, float[] floats, bool bf16_dot, Tensor[] copies, int copy_mode, int prefetch) "
      "-> Tensor",
      &decode_layers);
}
