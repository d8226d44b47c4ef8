// Small-row matmuls (decode steps) on a weight oneDNN has already packed.
//
// The executor's linears hold their weights only in oneDNN's blocked layout
// (executor_service/linear.py). For the few rows of a decode step, oneDNN's
// brgemm kernels leave much of an AVX-512 core idle (measured on the 2-core
// EPYC: fp32 147 against 175 GFLOP/s for the 0.5B Llama's linears at 32
// rows, bf16 319 against 364; docs/benchmarks.md). This kernel reads the same
// packed buffer (no second copy of any weight) with a register tile of 12
// rows x 32 columns, and asks for the next column panel while it computes
// the current one (the weights stream from memory once per step). A long K
// (the MLP's down projection) is taken in blocks, so that a block of the
// input rows, the half panel being read and the next one asked for all stay
// in L2 (the 0.5B Llama's fp32 down projection at 32 rows ran ~10 % faster
// on the 2-core EPYC, bf16 level; docs/benchmarks.md). The sums stay fp32
// between blocks, in the same order: the product is bit-identical.
//
// The layouts it reads are oneDNN's avx512_core choices for a [N, K] weight:
//   fp32 AB16b64a   = [N / 64][K][64]
//   bf16 AB16b64a2b = [N / 64][K / 2][64][2]   (pairs of k for vdpbf16ps)
// The packed tensor is opaque; the Python side (kvpager_kernels/packed_gemm.py)
// checks its size here and its layout by a probe against oneDNN's own
// product before using this kernel, and keeps oneDNN wherever either fails.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace at::native {
// Exported by libtorch_cpu (torch's AOT paths use them): the buffer and size
// of an opaque oneDNN tensor.
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

constexpr int64_t kPanel = 64;  // columns of a packed panel
constexpr int64_t kHalf = 32;   // columns of one register tile (two zmm)
constexpr int kRows = 12;       // rows of one register tile
// Most bytes of one half panel's k-block (32 columns x k elements): with the
// input rows' block (32 rows: as many bytes again) and the next half asked
// for beside it, inside a 1 MiB L2. A K that fits is one block: splitting it
// would only add the partial sums' store and reload (the 30M model's 1,376).
constexpr int64_t kBlockBytes = 256 * 1024;

bool compiled_fp32() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

bool compiled_bf16() {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512F__)
// Where a tile's fp32 sums go between k-blocks: `part` rows ldp apart.
// in: the sums of the earlier blocks (null on the first block); out: where
// this block's sums go unless it is the last (null: the last block, which
// writes the output row itself).
struct Partial {
  const float* in;
  float* out;
  int64_t ldp;
};

// A tile's accumulators start at the sums of the earlier k-blocks, or at its
// 32 columns' bias (fp32), or at zero.
template <int MB>
inline void start_acc(const float* bias, const Partial& pt, __m512* acc0, __m512* acc1) {
  if (pt.in) {
    for (int r = 0; r < MB; ++r)
      acc0[r] = _mm512_loadu_ps(pt.in + r * pt.ldp), acc1[r] = _mm512_loadu_ps(pt.in + r * pt.ldp + 16);
    return;
  }
  const __m512 i0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 i1 = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int r = 0; r < MB; ++r) acc0[r] = i0, acc1[r] = i1;
}

// Sums that are not final yet go back to the partial buffer.
template <int MB>
inline bool keep_partial(const Partial& pt, const __m512* acc0, const __m512* acc1) {
  if (!pt.out) return false;
  for (int r = 0; r < MB; ++r) {
    _mm512_storeu_ps(pt.out + r * pt.ldp, acc0[r]);
    _mm512_storeu_ps(pt.out + r * pt.ldp + 16, acc1[r]);
  }
  return true;
}

// y[r][0:32] = x[r] . panel-half + bias, for MB rows, over one k-block of
// `kl` elements; x: the block's first input element, rows ldx apart; b: the
// half's first element in the block, rows 64 apart; next: where the thread
// reads next (asked for, into L2, while this one computes; null on all but
// the first row tile).
template <int MB>
inline void tile_f32(const float* __restrict x, int64_t ldx, int64_t kl, const float* __restrict b,
                     const float* bias, const Partial& pt, float* __restrict y, int64_t ldy, const float* next) {
  __m512 acc0[MB], acc1[MB];
  start_acc<MB>(bias, pt, acc0, acc1);
  for (int64_t k = 0; k < kl; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b + k * kPanel), b1 = _mm512_loadu_ps(b + k * kPanel + 16);
    if (next) {
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + k * kPanel + 16), _MM_HINT_T1);
    }
#pragma GCC unroll 12
    for (int r = 0; r < MB; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc0[r] = _mm512_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm512_fmadd_ps(a, b1, acc1[r]);
    }
  }
  if (keep_partial<MB>(pt, acc0, acc1)) return;
  for (int r = 0; r < MB; ++r) {
    _mm512_storeu_ps(y + r * ldy, acc0[r]);
    _mm512_storeu_ps(y + r * ldy + 16, acc1[r]);
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bf16 form: each step takes a pair of k (one vdpbf16ps per 16 columns),
// accumulates in fp32 (across k-blocks too) and rounds to bf16 once at the
// end (to nearest even). kl is even.
template <int MB>
inline void tile_bf16(const uint16_t* __restrict x, int64_t ldx, int64_t kl, const uint16_t* __restrict b,
                      const float* bias, const Partial& pt, uint16_t* __restrict y, int64_t ldy,
                      const uint16_t* next) {
  __m512 acc0[MB], acc1[MB];
  start_acc<MB>(bias, pt, acc0, acc1);
  for (int64_t kp = 0; kp < kl / 2; ++kp) {
    const uint16_t* bk = b + kp * 2 * kPanel;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bk), b1 = (__m512bh)_mm512_loadu_si512(bk + 32);
    if (next) {
      _mm_prefetch(reinterpret_cast<const char*>(next + kp * 2 * kPanel), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(next + kp * 2 * kPanel + 32), _MM_HINT_T1);
    }
#pragma GCC unroll 12
    for (int r = 0; r < MB; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * kp, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc0[r] = _mm512_dpbf16_ps(acc0[r], a, b0);
      acc1[r] = _mm512_dpbf16_ps(acc1[r], a, b1);
    }
  }
  if (keep_partial<MB>(pt, acc0, acc1)) return;
  for (int r = 0; r < MB; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), (__m256i)_mm512_cvtneps_pbh(acc0[r]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16), (__m256i)_mm512_cvtneps_pbh(acc1[r]));
  }
}
#endif

// f(integral_constant<rest>) for 0 < rest <= MB: the last, partial row tile.
template <int MB, typename F>
inline void dispatch_rest(int64_t rest, F&& f) {
  if constexpr (MB > 0) {
    if (rest == MB) return f(std::integral_constant<int, MB>{});
    return dispatch_rest<MB - 1>(rest, f);
  }
}

// The k-blocks of a K: even lengths (bf16 pairs), about kBlockBytes of a
// half panel each, as equal as they come.
int64_t k_block(int64_t K, int64_t elem_bytes) {
  const int64_t cap = std::max<int64_t>(2, kBlockBytes / (kHalf * elem_bytes));
  const int64_t blocks = (K + cap - 1) / cap;
  const int64_t kb = (K + blocks - 1) / blocks;
  return std::min(K, kb + (kb & 1));
}

// part: fp32 [M, N] for the sums between k-blocks (unused with one block;
// for fp32 it may be y itself: a tile reads its sums before it writes them).
template <typename T, typename Fn>
void for_each_half(int64_t M, int64_t K, int64_t N, const T* x, const T* w, const float* bias, T* y, float* part,
                   int64_t elems_per_k, Fn tile) {
  // Halves are numbered across panels; a thread takes a contiguous range, so
  // it walks the packed buffer in order and "next" is the half it reads next.
  // With k-blocks, a thread takes its halves block by block: the input rows'
  // block stays in L2 while its halves stream past.
  const int64_t halves = N / kHalf;
  const int64_t KB = k_block(K, static_cast<int64_t>(sizeof(T)));
  auto half_ptr = [&](int64_t h, int64_t k0) {
    return w + (h / 2) * K * kPanel + k0 * kPanel + (h % 2) * kHalf * elems_per_k;
  };
  at::parallel_for(0, halves, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t kl = std::min(KB, K - k0);
      const bool first = k0 == 0, last = k0 + kl == K;
      for (int64_t h = h0; h < h1; ++h) {
        const T* b = half_ptr(h, k0);
        const T* next = h + 1 < h1 ? half_ptr(h + 1, k0) : (last ? nullptr : half_ptr(h0, k0 + KB));
        const float* bh = bias ? bias + h * kHalf : nullptr;
        auto one = [&](auto mb, int64_t m) {
          float* sums = part ? part + m * N + h * kHalf : nullptr;
          const Partial pt{first ? nullptr : sums, last ? nullptr : sums, N};
          tile(mb, x + m * K + k0, kl, b, bh, pt, y + m * N + h * kHalf, m == 0 ? next : nullptr);
        };
        int64_t m = 0;
        for (; m + kRows <= M; m += kRows) one(std::integral_constant<int, kRows>{}, m);
        dispatch_rest<kRows - 1>(M - m, [&](auto mb) { one(mb, m); });
      }
    }
  });
}

int64_t itemsize(at::ScalarType t) { return t == at::kFloat ? 4 : 2; }

// Whether packed_gemm can read `w` (oneDNN-packed, [n, k] logically): its
// dtype has a kernel in this build and its buffer holds exactly n * k
// elements in whole panels (a padded layout is another layout).
bool packed_gemm_readable(const at::Tensor& w, int64_t n, int64_t k) {
  if (!w.is_mkldnn() || n <= 0 || k <= 0 || n % kPanel != 0) return false;
  const auto t = w.scalar_type();
  if (t == at::kFloat) {
    if (!compiled_fp32()) return false;
  } else if (t == at::kBFloat16) {
    if (!compiled_bf16() || k % 2 != 0) return false;
  } else {
    return false;
  }
  return at::native::nbytes_from_mkldnn(w) == n * k * itemsize(t);
}

// x: [M, K] contiguous, the weight's dtype; w: oneDNN-packed [n, K];
// bias: [n] fp32 or undefined. Returns y: [M, n] in x's dtype.
at::Tensor packed_gemm(const at::Tensor& x, const at::Tensor& w, int64_t n, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "packed_gemm: x must be a contiguous [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed_gemm_readable(w, n, K), "packed_gemm: this packed weight is not readable here");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "packed_gemm: x and the weight must share one dtype");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "packed_gemm: bias must be a contiguous fp32 [n] tensor");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, n}, x.options());
  if (M == 0) return y;
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    const float* wp = static_cast<const float*>(at::native::data_ptr_from_mkldnn(w));
    float* yp = y.data_ptr<float>();
    for_each_half<float>(M, K, n, x.data_ptr<float>(), wp, bp, yp, yp, 1,
                         [&](auto mb, const float* xr, int64_t kl, const float* b, const float* bh, const Partial& pt,
                             float* yr, const float* next) {
                           tile_f32<decltype(mb)::value>(xr, K, kl, b, bh, pt, yr, n, next);
                         });
    return y;
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* wp = static_cast<const uint16_t*>(at::native::data_ptr_from_mkldnn(w));
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    at::Tensor part;  // fp32 sums between k-blocks (none with a single block)
    if (k_block(K, 2) < K) part = at::empty({M, n}, x.options().dtype(at::kFloat));
    for_each_half<uint16_t>(M, K, n, xp, wp, bp, yp, part.defined() ? part.data_ptr<float>() : nullptr, 2,
                            [&](auto mb, const uint16_t* xr, int64_t kl, const uint16_t* b, const float* bh,
                                const Partial& pt, uint16_t* yr, const uint16_t* next) {
                              tile_bf16<decltype(mb)::value>(xr, K, kl, b, bh, pt, yr, n, next);
                            });
    return y;
  }
#endif
  TORCH_CHECK(false, "packed_gemm: no kernel for ", x.scalar_type(), " in this build");
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpager_cpu, m) {
  m.def("packed_gemm_readable(Tensor w, int n, int k) -> bool");
  m.def("packed_gemm(Tensor x, Tensor w, int n, Tensor? bias) -> Tensor");
}

// The weight is an opaque oneDNN (MkldnnCPU) tensor, x a dense CPU one: one
// kernel for every backend key the pair can dispatch to.
TORCH_LIBRARY_IMPL(kvpager_cpu, CompositeExplicitAutograd, m) {
  m.impl("packed_gemm_readable", &packed_gemm_readable);
  m.impl("packed_gemm", &packed_gemm);
}
