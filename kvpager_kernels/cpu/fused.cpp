// Fused elementwise steps of a Llama-family layer on CPU, one pass over
// memory each instead of five to ten torch ops (each a dispatch, a
// temporary and a pass): RMSNorm with the residual add, RoPE with the K/V
// store, SiLU-and-multiply. Rounding follows the unfused torch ops
// (transformers' Llama code): fp32 math, and for 16-bit dtypes a rounding to
// the dtype wherever torch would store an intermediate tensor, so results
// match the reference (`kvpager_kernels/fused_reference.py`) bit for bit in the
// elementwise parts; only the order of the RMSNorm sum differs.
//
// Built with -ffp-contract=off: a fused multiply-add would round differently
// from torch's separate multiply and add.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "vec.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace {

// bf16 <-> fp32 on the raw bits, as c10::BFloat16 converts (round to nearest
// even, NaN kept quiet) but in a form the compiler vectorises: through the
// c10 struct the loop below stays scalar and runs ~6x slower.
inline float bf16_to_float(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  const uint16_t r = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return f != f ? static_cast<uint16_t>(0x7fc0) : r;
}

// Element access in the form the compiler vectorises: bf16 as raw bits,
// other types as themselves.
template <typename T>
struct Elem {
  using S = T;
  static float load(S x) { return static_cast<float>(x); }
  static S store(float f) { return static_cast<S>(f); }
};
template <>
struct Elem<c10::BFloat16> {
  using S = uint16_t;
  static float load(S x) { return bf16_to_float(x); }
  static S store(float f) { return float_to_bf16(f); }
};

// Round to T and back: where torch would materialise a T tensor.
template <typename T>
inline float rnd(float x) {
  return Elem<T>::load(Elem<T>::store(x));
}

template <typename T>
void rms_rows(const T* x_, const T* w_, T* out_, int64_t rows, int64_t n, int64_t x_s, int64_t o_s, float eps,
              T* residual_, int64_t r_s, const T* delta_, int64_t d_s) {
  using E = Elem<T>;
  using S = typename E::S;
  const S* x = reinterpret_cast<const S*>(x_);
  const S* w = reinterpret_cast<const S*>(w_);
  S* out = reinterpret_cast<S*>(out_);
  S* residual = reinterpret_cast<S*>(residual_);
  const S* delta = reinterpret_cast<const S*>(delta_);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* xr = x + r * x_s;
      S* hr = residual ? residual + r * r_s : nullptr;
      if (hr) {  // h = residual + delta, stored back as T (torch's add)
        const S* dr = delta + r * d_s;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) hr[i] = E::store(E::load(hr[i]) + E::load(dr[i]));
        xr = hr;
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) {
        const float v = E::load(xr[i]);
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      S* orow = out + r * o_s;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float y = rnd<T>(E::load(xr[i]) * inv);  // hidden.to(input_dtype)
        orow[i] = E::store(E::load(w[i]) * y);                     // weight * hidden
      }
    }
  });
}

// out = rms_norm(x) * weight. x: [R, N] (rows may be strided), weight: [N].
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [R, N] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(), "rms_norm: weight [N]");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "rms_norm: weight and x share one dtype");
  auto out = at::empty_like(x, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0),
                       x.size(1), x.stride(0), out.stride(0), static_cast<float>(eps), nullptr, 0, nullptr, 0);
  });
  return out;
}

// residual += delta (in place, as T), then returns rms_norm(residual) * weight.
at::Tensor add_rms_norm(const at::Tensor& delta, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.stride(1) == 1 && delta.sizes() == residual.sizes() &&
                  delta.stride(1) == 1,
              "add_rms_norm: delta and residual must be [R, N] with contiguous rows");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == residual.size(1) && weight.is_contiguous(),
              "add_rms_norm: weight [N]");
  TORCH_CHECK(delta.scalar_type() == residual.scalar_type() && weight.scalar_type() == residual.scalar_type(),
              "add_rms_norm: one dtype");
  auto out = at::empty_like(residual, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add_rms_norm", [&] {
    rms_rows<scalar_t>(residual.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       residual.size(0), residual.size(1), residual.stride(0), out.stride(0),
                       static_cast<float>(eps), residual.data_ptr<scalar_t>(), residual.stride(0),
                       delta.data_ptr<scalar_t>(), delta.stride(0));
  });
  return out;
}

// x * cos + rotate_half(x) * sin for one head row, each product and the sum
// rounded to T as torch does.
template <typename T>
inline void rope_row(const T* __restrict x_, const T* __restrict cos_, const T* __restrict sin_,
                     T* __restrict out_, int64_t d) {
  using E = Elem<T>;
  using S = typename E::S;
  const S* __restrict x = reinterpret_cast<const S*>(x_);
  const S* __restrict cos = reinterpret_cast<const S*>(cos_);
  const S* __restrict sin = reinterpret_cast<const S*>(sin_);
  S* __restrict out = reinterpret_cast<S*>(out_);
  const int64_t half = d / 2;
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {  // first half: x * cos - x[i + half] * sin
    const float a = rnd<T>(E::load(x[i]) * E::load(cos[i]));
    const float b = rnd<T>(-E::load(x[i + half]) * E::load(sin[i]));
    out[i] = E::store(a + b);
  }
#pragma omp simd
  for (int64_t i = half; i < d; ++i) {  // second half: x * cos + x[i - half] * sin
    const float a = rnd<T>(E::load(x[i]) * E::load(cos[i]));
    const float b = rnd<T>(E::load(x[i - half]) * E::load(sin[i]));
    out[i] = E::store(a + b);
  }
}

// qkv: [T, (H + 2 KVH) * D] (one projection's output); cos, sin: [T, D] in
// the model dtype. Applies RoPE to q (returned, [T, H, D]) and k, and writes
// k and v into the caches at slot_mapping ([T] int32/int64, negative = skip).
at::Tensor rope_store_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_heads,
                         int64_t num_kv_heads, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [NB, BS, KVH, D]");
  const int64_t D = k_cache.size(3), T_ = qkv.size(0), BS = k_cache.size(1);
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * D,
              "rope_store_kv: qkv must be [T, (H + 2 KVH) * D] with contiguous rows");
  TORCH_CHECK(k_cache.size(2) == num_kv_heads && D % 2 == 0, "rope_store_kv: cache heads/dim mismatch");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == T_ && cos.size(1) == D && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous(),
              "rope_store_kv: cos/sin must be contiguous [T, D]");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "rope_store_kv: cache head dim must be contiguous");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && sin.scalar_type() == cos.scalar_type() &&
                  k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type(),
              "rope_store_kv: one dtype");
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == T_, "rope_store_kv: slot_mapping [T]");
  auto slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * BS;
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(sp[t] < num_slots, "rope_store_kv: slot out of range");
  auto q = at::empty({T_, num_heads, D}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_store_kv", [&] {
    using T = scalar_t;
    const T* src = qkv.data_ptr<T>();
    const T* cp = cos.data_ptr<T>();
    const T* snp = sin.data_ptr<T>();
    T* qp = q.data_ptr<T>();
    T* kc = k_cache.data_ptr<T>();
    T* vc = v_cache.data_ptr<T>();
    const int64_t q_s = qkv.stride(0);
    const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1), ks2 = k_cache.stride(2);
    const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1), vs2 = v_cache.stride(2);
    at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const T* row = src + t * q_s;
        const T* c = cp + t * D;
        const T* s = snp + t * D;
        for (int64_t h = 0; h < num_heads; ++h) rope_row<T>(row + h * D, c, s, qp + (t * num_heads + h) * D, D);
        const int64_t slot = sp[t];
        if (slot < 0) continue;
        const int64_t blk = slot / BS, off = slot % BS;
        const T* kr = row + num_heads * D;
        const T* vr = kr + num_kv_heads * D;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          rope_row<T>(kr + h * D, c, s, kc + blk * ks0 + off * ks1 + h * ks2, D);
          T* vd = vc + blk * vs0 + off * vs1 + h * vs2;
          for (int64_t i = 0; i < D; ++i) vd[i] = vr[h * D + i];
        }
      }
    });
  });
  return q;
}

template <typename T>
void silu_mul_rows(const T* src, T* op, int64_t rows, int64_t I, int64_t s0) {
  using E = Elem<T>;
  using S = typename E::S;
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const S* g = reinterpret_cast<const S*>(src + t * s0);
      const S* u = g + I;
      S* o = reinterpret_cast<S*>(op + t * I);
      int64_t i = 0;
#if defined(__AVX512F__)
      // Explicit vectors (GCC's form of the loop below ran 2.5x slower than
      // fp32 for bf16) with the fused exp (vec.h): the exp was half of a call.
      const __m512 one = _mm512_set1_ps(1.f), neg = _mm512_set1_ps(-0.f);
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        for (; i + 16 <= I; i += 16) {
          const __m512 x = kvpager::bf16x16_load(g + i);
          const __m512 e = kvpager::vexp16_fma(_mm512_xor_ps(x, neg));  // exp(-x)
          // Rounded by the conversion instruction where there is one (a quarter
          // off a call on the AMX Xeon); the product feeds the down projection's
          // bf16 matrix products only (vec.h bf16x16_round_fast).
          const __m512 a = kvpager::bf16x16_round_fast(_mm512_div_ps(x, _mm512_add_ps(one, e)));
          kvpager::bf16x16_store_fast(o + i, _mm512_mul_ps(a, kvpager::bf16x16_load(u + i)));
        }
      } else if constexpr (std::is_same_v<T, float>) {
        for (; i + 16 <= I; i += 16) {
          const __m512 x = _mm512_loadu_ps(g + i);
          const __m512 e = kvpager::vexp16_fma(_mm512_xor_ps(x, neg));
          _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(u + i)));
        }
      }
#endif
#pragma omp simd
      for (int64_t k = i; k < I; ++k) {
        const float x = E::load(g[k]);
        const float a = rnd<T>(x / (1.f + kvpager::vexp(-x)));
        o[k] = E::store(a * E::load(u[k]));
      }
    }
  });
}

// gate_up: [T, 2I] -> silu(gate) * up: [T, I] (silu rounded to T first, as torch).
at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [T, 2I] with contiguous rows");
  const int64_t rows = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({rows, I}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, I, gate_up.stride(0));
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpager_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor delta, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
  m.def(
      "rope_store_kv(Tensor qkv, Tensor cos, Tensor sin, int num_heads, int num_kv_heads, Tensor(a!) k_cache, "
      "Tensor(b!) v_cache, Tensor slot_mapping) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvpager_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store_kv", &rope_store_kv);
  m.impl("silu_mul", &silu_mul);
}
