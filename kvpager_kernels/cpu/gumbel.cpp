// A sampled token drawn by the exponential race (the Gumbel-max trick) on
// CPU, in one pass over a row: for token t of a row keyed `key`,
//   bits = splitmix64(key ^ t), u = ((bits >> 11) + 0.5) * 2^-53,
//   score = log_p[t] - log(-log(u))   (float64),
// and the row's token is its first highest score (a NaN log_p: its first
// NaN). The reference is kvpager_kernels.gumbel.reference_gumbel_argmax:
// torch ops over [rows, V] int64 and float64 tensors, a full pass each (~20
// of them: 4-5 ms for 32 x 8,192 and ~8 ms for 32 x 32,000 on the Zen 5
// EPYC). Here the hash, both logarithms and the running maximum stay in
// registers. A row filtered by top-k / top-p comes sorted in descending
// order with each entry's token id (its dropped tokens -inf at the end):
// the scan stops at the first dropped token, so a top-k 50 row draws from
// 50 entries, not the vocabulary.
//
// The logarithm is fdlibm's (__ieee754_log: < 1 ulp), written once for
// scalars and once for eight lanes with the same IEEE operations in the same
// order (built with -ffp-contract=off): the AVX-512 and the portable builds
// draw the same tokens. torch's float64 log may differ from it in the last
// bit, which changes a draw only where two scores tie to ~1e-16.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>
#define KVPAGER_GUMBEL_AVX512 1
#endif

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull, kMix1 = 0xBF58476D1CE4E5B9ull, kMix2 = 0x94D049BB133111EBull;

inline uint64_t splitmix64(uint64_t x) {
  x += kGolden;
  x = (x ^ (x >> 30)) * kMix1;
  x = (x ^ (x >> 27)) * kMix2;
  return x ^ (x >> 31);
}

// fdlibm's constants for log(1 + f) = 2 atanh(s), s = f / (2 + f).
constexpr double kLn2Hi = 6.93147180369123816490e-01, kLn2Lo = 1.90821492927058770002e-10;
constexpr double kLg1 = 6.666666666666735130e-01, kLg2 = 3.999999999940941908e-01,
                 kLg3 = 2.857142874366239149e-01, kLg4 = 2.222219843214978396e-01,
                 kLg5 = 1.818357216161805012e-01, kLg6 = 1.531383769920937332e-01,
                 kLg7 = 1.479819860511658591e-01;
constexpr int64_t kMantissa = 0x000fffffffffffffll, kOne = 0x3ff0000000000000ll;
// Added to the mantissa, carries into bit 52 where it is at least ~sqrt(2):
// those x are taken as (x / 2) * 2^(k + 1), so f = m - 1 lies in [-0.29, 0.41].
constexpr int64_t kSqrt2Carry = 0x95f64ll << 32, kBit52 = 1ll << 52;

// log(x) for a positive normal double (the only inputs here: u in
// [2^-54, 1 - 2^-54], and -log(u) in [1.1e-16, 37.5]).
inline double log_fdlibm(double x) {
  int64_t ix;
  std::memcpy(&ix, &x, sizeof ix);
  int64_t k = (ix >> 52) - 1023;
  const int64_t mant = ix & kMantissa;
  const int64_t i = (mant + kSqrt2Carry) & kBit52;
  const int64_t mb = mant | (i ^ kOne);
  k += i >> 52;
  double m;
  std::memcpy(&m, &mb, sizeof m);
  const double f = m - 1.0;
  const double s = f / (2.0 + f), dk = static_cast<double>(k);
  const double z = s * s, w = z * z;
  const double t1 = w * (kLg2 + w * (kLg4 + w * kLg6));
  const double t2 = z * (kLg1 + w * (kLg3 + w * (kLg5 + w * kLg7)));
  const double R = t2 + t1, hfsq = 0.5 * (f * f);
  return dk * kLn2Hi - ((hfsq - (s * (hfsq + R) + dk * kLn2Lo)) - f);
}

// The noise of token t in a row keyed `key`: -log(-log(u)).
inline double gumbel(uint64_t key, uint64_t t) {
  const uint64_t bits = splitmix64(key ^ t);
  const double u = (static_cast<double>(bits >> 11) + 0.5) * 0x1p-53;
  return -log_fdlibm(-log_fdlibm(u));
}

#if defined(KVPAGER_GUMBEL_AVX512)
inline __m512d log_fdlibm8(__m512d x) {
  const __m512i ix = _mm512_castpd_si512(x);
  __m512i k = _mm512_sub_epi64(_mm512_srli_epi64(ix, 52), _mm512_set1_epi64(1023));
  const __m512i mant = _mm512_and_si512(ix, _mm512_set1_epi64(kMantissa));
  const __m512i i = _mm512_and_si512(_mm512_add_epi64(mant, _mm512_set1_epi64(kSqrt2Carry)), _mm512_set1_epi64(kBit52));
  const __m512i mb = _mm512_or_si512(mant, _mm512_xor_si512(i, _mm512_set1_epi64(kOne)));
  k = _mm512_add_epi64(k, _mm512_srli_epi64(i, 52));
  const __m512d f = _mm512_sub_pd(_mm512_castsi512_pd(mb), _mm512_set1_pd(1.0));
  const __m512d s = _mm512_div_pd(f, _mm512_add_pd(_mm512_set1_pd(2.0), f));
  const __m512d dk = _mm512_cvtepi64_pd(k);
  const __m512d z = _mm512_mul_pd(s, s), w = _mm512_mul_pd(z, z);
  auto mul = [](__m512d a, __m512d b) { return _mm512_mul_pd(a, b); };
  auto add = [](__m512d a, __m512d b) { return _mm512_add_pd(a, b); };
  auto c = [](double v) { return _mm512_set1_pd(v); };
  const __m512d t1 = mul(w, add(c(kLg2), mul(w, add(c(kLg4), mul(w, c(kLg6))))));
  const __m512d t2 = mul(z, add(c(kLg1), mul(w, add(c(kLg3), mul(w, add(c(kLg5), mul(w, c(kLg7))))))));
  const __m512d R = add(t2, t1), hfsq = mul(c(0.5), mul(f, f));
  const __m512d inner = _mm512_sub_pd(_mm512_sub_pd(hfsq, add(mul(s, add(hfsq, R)), mul(dk, c(kLn2Lo)))), f);
  return _mm512_sub_pd(mul(dk, c(kLn2Hi)), inner);
}

inline __m512i splitmix64x8(__m512i x) {
  x = _mm512_add_epi64(x, _mm512_set1_epi64(static_cast<int64_t>(kGolden)));
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 30)), _mm512_set1_epi64(static_cast<int64_t>(kMix1)));
  x = _mm512_mullo_epi64(_mm512_xor_si512(x, _mm512_srli_epi64(x, 27)), _mm512_set1_epi64(static_cast<int64_t>(kMix2)));
  return _mm512_xor_si512(x, _mm512_srli_epi64(x, 31));
}
#endif

// The first NaN of log_p[0, n), or -1.
inline int64_t first_nan(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] != x[i]) return i;
  return -1;
}

// One row: the position of its first highest score. Entry t is token t, or
// ids[t] where the row comes sorted (descending, its dropped tokens -inf at
// the end: the scan stops at the first of them).
int64_t row_draw(const float* lp, int64_t n, uint64_t key, const int64_t* ids) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  if (ids != nullptr) {
    int64_t kept = 0;  // the sorted row's finite (or NaN) prefix
    while (kept < n && lp[kept] != -std::numeric_limits<float>::infinity()) ++kept;
    n = std::max<int64_t>(kept, 1);
  }
  double top = kNegInf;
  int64_t best = 0, t = 0;
#if defined(KVPAGER_GUMBEL_AVX512)
  if (n >= 8) {
    __m512d m = _mm512_set1_pd(kNegInf);
    __m512i at = _mm512_setzero_si512();
    __m512i pos = _mm512_setr_epi64(0, 1, 2, 3, 4, 5, 6, 7);
    const __m512i keys = _mm512_set1_epi64(static_cast<int64_t>(key)), eight = _mm512_set1_epi64(8);
    __mmask8 nan = 0;
    for (; t + 8 <= n; t += 8, pos = _mm512_add_epi64(pos, eight)) {
      const __m512i tok = ids ? _mm512_loadu_si512(ids + t) : pos;
      const __m512i bits = splitmix64x8(_mm512_xor_si512(keys, tok));
      const __m512d u = _mm512_mul_pd(_mm512_add_pd(_mm512_cvtepu64_pd(_mm512_srli_epi64(bits, 11)), _mm512_set1_pd(0.5)),
                                      _mm512_set1_pd(0x1p-53));
      const __m512d neg = _mm512_set1_pd(-0.0);
      const __m512d g = _mm512_xor_pd(log_fdlibm8(_mm512_xor_pd(log_fdlibm8(u), neg)), neg);  // -log(-log(u))
      const __m512d lpd = _mm512_cvtps_pd(_mm256_loadu_ps(lp + t));
      const __m512d score = _mm512_add_pd(lpd, g);
      nan |= _mm512_cmp_pd_mask(lpd, lpd, _CMP_UNORD_Q);
      const __mmask8 gt = _mm512_cmp_pd_mask(score, m, _CMP_GT_OQ);  // strictly: each lane keeps its first
      m = _mm512_mask_mov_pd(m, gt, score);
      at = _mm512_mask_mov_epi64(at, gt, pos);
    }
    if (nan) return first_nan(lp, n);
    top = _mm512_reduce_max_pd(m);
    // The first position among the lanes holding the maximum (-inf everywhere: 0, as argmax).
    const __mmask8 eq = _mm512_cmp_pd_mask(m, _mm512_set1_pd(top), _CMP_EQ_OQ);
    best = top == kNegInf ? 0 : _mm512_mask_reduce_min_epi64(eq, at);
  }
#endif
  for (; t < n; ++t) {
    if (lp[t] != lp[t]) return first_nan(lp, n);
    const uint64_t tok = static_cast<uint64_t>(ids ? ids[t] : t);
    const double score = static_cast<double>(lp[t]) + gumbel(key, tok);
    if (score > top) top = score, best = t;
  }
  return best;
}

// log_p: [R, V] fp32 (rows contiguous); keys: [R] int64 -> [R] int64, each
// row's token. token_ids: [R, V] int64 (rows contiguous) when the rows come
// sorted in descending order, each entry's token (top-k / top-p's order: the
// scan ends at the first dropped token); none: entry t is token t.
at::Tensor gumbel_argmax(const at::Tensor& log_p, const at::Tensor& keys, const c10::optional<at::Tensor>& token_ids) {
  TORCH_CHECK(log_p.dim() == 2 && log_p.size(1) > 0 && log_p.stride(1) == 1 && log_p.scalar_type() == at::kFloat,
              "gumbel_argmax: log_p must be fp32 [R, V] with V > 0 and contiguous rows");
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == log_p.size(0) && keys.scalar_type() == at::kLong,
              "gumbel_argmax: keys must be int64 [R], one per row of log_p");
  const bool sorted = token_ids.has_value();
  if (sorted)
    TORCH_CHECK(token_ids->sizes() == log_p.sizes() && token_ids->scalar_type() == at::kLong && token_ids->stride(1) == 1,
                "gumbel_argmax: token_ids must be int64 [R, V] like log_p, rows contiguous");
  const int64_t rows = log_p.size(0), V = log_p.size(1), stride = log_p.stride(0);
  const int64_t id_stride = sorted ? token_ids->stride(0) : 0;
  const auto k = keys.contiguous();
  auto out = at::empty({rows}, keys.options());
  const float* lp = log_p.data_ptr<float>();
  const int64_t* kp = k.data_ptr<int64_t>();
  const int64_t* ip = sorted ? token_ids->data_ptr<int64_t>() : nullptr;
  int64_t* o = out.data_ptr<int64_t>();
  // A row of 8,192 tokens is ~0.1 ms of work: rows split across threads one by one.
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const int64_t* ids = sorted ? ip + r * id_stride : nullptr;
      const int64_t at = row_draw(lp + r * stride, V, static_cast<uint64_t>(kp[r]), ids);
      o[r] = ids ? ids[at] : at;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpager_cpu, m) { m.def("gumbel_argmax(Tensor log_p, Tensor keys, Tensor? token_ids=None) -> Tensor"); }

TORCH_LIBRARY_IMPL(kvpager_cpu, CPU, m) { m.impl("gumbel_argmax", &gumbel_argmax); }
