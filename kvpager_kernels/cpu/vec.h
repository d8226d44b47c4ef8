// Small vectorisable helpers shared by the CPU kernels.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvpager {

// exp, vectorisable (std::exp is a scalar libm call: it was most of a
// decode's attention time). Cephes' single-precision polynomial after
// reducing x = n ln2 + f: within ~2 ulp of expf on [-87, 88]; +inf above,
// 0 below (expf's subnormal tail flushed), NaN for NaN, so silu and
// softmax see infinities as torch's exp gives them. Needs IEEE semantics
// (no -ffast-math: the rounding trick must not be reassociated).
inline float vexp(float in) {
  const float x = std::min(std::max(in, -87.0f), 88.0f);
  // Round to nearest by the 1.5 * 2^23 trick (std::floor blocks vectorisation).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float f = x - n * 0.693359375f + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * f + 1.3981999507e-3f;
  y = y * f + 8.3334519073e-3f;
  y = y * f + 4.1665795894e-2f;
  y = y * f + 1.6666665459e-1f;
  y = y * f + 5.0000001201e-1f;
  y = y * f * f + f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  float r = y * scale;
  r = in > 88.0f ? INFINITY : r;
  r = in < -87.0f ? 0.0f : r;
  return in != in ? in : r;
}

#if defined(__AVX512F__)
// The same function on sixteen lanes, operation for operation (separate
// multiplies and adds, as the scalar form is compiled with
// -ffp-contract=off), so both give identical results.
inline __m512 vexp16(__m512 in) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(in, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 n = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), magic), magic);
  const __m512 f = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(2.12194440e-4f)));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_add_ps(_mm512_mul_ps(y, f), _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, f), _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_add_ps(_mm512_mul_ps(y, f), _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_add_ps(_mm512_mul_ps(y, f), _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_add_ps(_mm512_mul_ps(y, f), _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(y, f), f), f), _mm512_set1_ps(1.0f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  __m512 r = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
  r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(in, _mm512_set1_ps(88.0f), _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
  r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(in, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(in, in, _CMP_UNORD_Q), in);
}

// exp of x already clamped to [-87, 88]: vexp16's reduction and polynomial
// with its multiply-adds fused and 2^n applied by scalef.
inline __m512 vexp16_fma_clamped(__m512 x) {
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f),
                                   _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(y, f), f, f), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// vexp16 with its multiply-adds fused and 2^n applied by scalef: 21
// operations where vexp16 takes 33, the same reduction, polynomial and
// special values; results within an ulp or two of vexp16's (fused roundings).
// For the prefill tiles' softmax (the exps were a third of a tile) and
// silu_mul's vector loops (half of a call); the per-token walk keeps vexp16
// (bit-identical to the scalar vexp).
inline __m512 vexp16_fma(__m512 in) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(in, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 r = vexp16_fma_clamped(x);
  r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(in, _mm512_set1_ps(88.0f), _CMP_GT_OQ), _mm512_set1_ps(INFINITY));
  r = _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(in, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(in, in, _CMP_UNORD_Q), in);
}

// vexp16_fma for inputs <= 0 (a score minus its row's maximum; -inf for a
// masked key): the same bits there, without the clamp and the result fixes
// that only inputs above 88 need (16 operations). A NaN input stays NaN
// (max returns its second operand when either is NaN).
inline __m512 vexp16_fma_nonpos(__m512 in) {
  const __m512 r = vexp16_fma_clamped(_mm512_max_ps(_mm512_set1_ps(-87.0f), in));
  return _mm512_mask_mov_ps(r, _mm512_cmp_ps_mask(in, _mm512_set1_ps(-87.0f), _CMP_LT_OQ), _mm512_setzero_ps());
}

// 2^x for x <= 0 (a base-2 score minus its row's maximum; -inf for a masked
// key): the fp32 online tiles' exps (attention_online.h), whose scores
// carry log2(e) in their scale. x = n + f with n = round(x) and f = x - n
// exact in [-1/2, 1/2], 2^f by a degree-6 polynomial (least-squares fit on Chebyshev nodes, within
// 0.93 ulp of 2^f in fp32 Horner; the constant term 1, so 2^0 is 1 exactly),
// 2^n applied by scalef. Inputs under -150 give 0 (2^-150 rounds to 0, where
// a result under 2^-126 comes out subnormal), NaN stays NaN. 7 multiplies,
// multiply-adds and scalefs where vexp16_fma_nonpos takes 11 (its two-constant
// reduction and the 1.44 multiply are gone): 0.56-0.57 of its time in a
// tile's exp pass (docs/kernels.md).
constexpr float kLog2e = 1.44269504088896341f;
inline __m512 vexp2_16_nonpos(__m512 in) {
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-150.0f), in);  // NaN: max returns its second operand
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 y = _mm512_set1_ps(1.5353361e-04f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.3398875e-03f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.6184369e-03f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.5503324e-02f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022648e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.9314718e-01f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
}

// Sixteen bf16 (raw bits) widened to fp32, and fp32 rounded to bf16 exactly
// as c10::BFloat16 rounds (to nearest even; NaN -> 0x7fc0; subnormals kept,
// unlike the AVX512-BF16 conversion instruction, which flushes them).
inline __m512 bf16x16_load(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(p))), 16));
}
inline __m512i bf16x16_round_bits(__m512 f) {  // the bf16 in the low 16 bits of each lane
  const __m512i u = _mm512_castps_si512(f);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
inline __m512 bf16x16_round(__m512 f) {  // f rounded to bf16, as fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_round_bits(f), 16));
}
inline void bf16x16_store(uint16_t* p, __m512 f) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16x16_round_bits(f)));
}

// The same rounding in one instruction where the CPU has AVX512-BF16
// (vcvtneps2bf16: to nearest even, NaN kept NaN), which flushes subnormal
// results to zero where c10 keeps them; for values that only bf16 matrix
// products read next (vdpbf16ps and AMX read subnormal bf16 inputs as zero).
// Without AVX512-BF16, bf16x16_round / bf16x16_store.
inline __m512 bf16x16_round_fast(__m512 f) {
#if defined(__AVX512BF16__)
  const __m256i h = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#else
  return bf16x16_round(f);
#endif
}
inline void bf16x16_store_fast(uint16_t* p, __m512 f) {
#if defined(__AVX512BF16__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f)));
#else
  bf16x16_store(p, f);
#endif
}
#endif

}  // namespace kvpager
