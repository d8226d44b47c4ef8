// Matmuls on a weight oneDNN has already packed: decode steps, and fp32
// prefill steps of up to 2,048 rows (kvpager_kernels/packed_gemm.py MAX_ROWS).
//
// The executor's linears hold their weights only in oneDNN's blocked layout
// (executor_service/linear.py). For the few rows of a decode step, oneDNN's
// brgemm kernels leave much of an AVX-512 core idle and wait on memory (and
// at prefill sizes this kernel ran 2-5 % ahead of them here). This
// kernel reads the same packed buffer (no second copy of any weight, but
// bf16 on AMX CPUs, whose oneDNN layout differs: a dense copy) a whole
// 64-column panel at a time, in order: register tiles of at most 6 rows x 64
// columns (24 accumulators), and while it computes one panel it asks for the
// next into L2 (in shares spread over its row tiles), so the weights stream
// from memory once per step in one sequential pass. (The first form took
// 32-column halves of panels in 12-row tiles: every other pair of lines of
// the buffer, a pattern the hardware's stream prefetcher follows less
// well. On the Zen 5 EPYC the 0.5B Llama's decode linears at 32 rows went
// 69 -> 61 ms a step in fp32 and 33 -> 30 in bf16, one row 30 -> 22 ms;
// docs/benchmarks.md.) A long K (the MLP's down
// projection) is taken in blocks, so that a block of the input rows, the
// panel block being read and the next one asked for all stay in L2. The sums
// stay fp32 between blocks, in the same order: the product is bit-identical.
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

#include "amx.h"

// Loops start on a 64-byte line. Where the compiler placed them, the row
// tiles' k-loops ran up to ~20 % apart between builds of nearly the same
// code (a 0.5B decode step's linears at 32 rows with the spread requests
// below: 52, 57 and 62 ms in three builds); on a line, 52-55.
#pragma GCC optimize("align-loops=64")

namespace at::native {
// Exported by libtorch_cpu (torch's AOT paths use them): the buffer and size
// of an opaque oneDNN tensor.
TORCH_API void* data_ptr_from_mkldnn(const at::Tensor& mkldnn_tensor);
TORCH_API int64_t nbytes_from_mkldnn(const at::Tensor& mkldnn_tensor);
}  // namespace at::native

namespace {

constexpr int64_t kPanel = 64;  // columns of a packed panel: one register tile's width (four zmm)
constexpr int kRows = 6;        // most rows of one register tile (6 x 4 accumulators + 4 of the panel + 1)
// Row tiles a panel from which each asks for its share of the next panel,
// spread over its k-steps, rather than the whole of it: requests at about
// the rate the panels are consumed, where every tile asking for everything
// sent them in a burst during the first tile (most of them again to L2
// after). On the Zen 5 EPYC, the 0.5B Llama's linears with every weight
// from memory (2 threads, both forms in turn in one process), time spread /
// time whole: fp32 16 rows 0.98, 24-32 rows 0.83-0.89, 48 0.93-1.02, 64
// 0.89-0.91, 128 0.94, 512 0.96-0.97; bf16 16-48 rows 0.91-0.95. At 8 rows
// (two tiles) 1.01-1.07, hence 3 (docs/kernels.md).
constexpr int64_t kSpreadTiles = 3;
// Most bytes of one panel's k-block (64 columns x k elements): with the
// input rows' block and the next panel asked for beside it, inside a 1 MiB
// L2. A K that fits is one block: splitting it would only add the partial
// sums' store and reload.
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

// Where a tile's fp32 sums go between k-blocks: `part` rows ldp apart.
// in: the sums of the earlier blocks (null on the first block); out: where
// this block's sums go unless it is the last (null: the last block, which
// writes the output row itself). Outside the AVX-512 block below: the
// panel loop names it in every build (an AVX2 build failed on it).
struct Partial {
  const float* in;
  float* out;
  int64_t ldp;
};

// What one row tile asks for of the next panel, a k-row (bf16: a pair-row;
// 256 bytes either way) at a time from `at`: kSpread, `rows` rows spread
// evenly over the tile's `steps` k-steps (for_each_panel gives each row tile
// its share of the panel); else one row every k-step, the whole panel.
// Outside the AVX-512 block too, as Partial.
struct Ask {
  const char* at;  // the next row to ask for; null: none
  int64_t rows;
  int64_t steps;
  int64_t credit = 0;  // rows x k-steps taken, less steps per row asked for
};

#if defined(__AVX512F__)

// A tile's accumulators start at the sums of the earlier k-blocks, or at its
// 64 columns' bias (fp32), or at zero.
template <int MB>
inline void start_acc(const float* bias, const Partial& pt, __m512 (&acc)[MB][4]) {
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j)
      acc[r][j] = pt.in ? _mm512_loadu_ps(pt.in + r * pt.ldp + 16 * j)
                        : (bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps());
}

// Sums that are not final yet go back to the partial buffer.
template <int MB>
inline bool keep_partial(const Partial& pt, const __m512 (&acc)[MB][4]) {
  if (!pt.out) return false;
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(pt.out + r * pt.ldp + 16 * j, acc[r][j]);
  return true;
}

// Ask for one k-row of the next panel (256 bytes: four lines) into L2.
inline void ask_for(const char* c) {
  _mm_prefetch(c, _MM_HINT_T1);
  _mm_prefetch(c + 64, _MM_HINT_T1);
  _mm_prefetch(c + 128, _MM_HINT_T1);
  _mm_prefetch(c + 192, _MM_HINT_T1);
}

template <bool kSpread>
inline void ask_step(Ask& a, int64_t k) {
  if constexpr (kSpread) {
    a.credit += a.rows;
    if (a.credit < a.steps) return;
    a.credit -= a.steps;
    ask_for(a.at);
    a.at += 256;
  } else if (a.at) {  // loop-invariant: the compiler takes it out of the loop
    ask_for(a.at + 256 * k);
  }
}

// y[r][0:64] = x[r] . panel + bias, for MB rows, over one k-block of `kl`
// elements; x: the block's first input element, rows ldx apart; b: the
// panel's first element in the block (k-rows of 64, in order); ask: this
// tile's share of the panel the thread reads next, asked for while it computes.
template <int MB, bool kSpread>
inline void tile_f32(const float* __restrict x, int64_t ldx, int64_t kl, const float* __restrict b,
                     const float* bias, const Partial& pt, float* __restrict y, int64_t ldy, Ask ask) {
  __m512 acc[MB][4];
  start_acc<MB>(bias, pt, acc);
  for (int64_t k = 0; k < kl; ++k) {
    const float* bk = b + k * kPanel;
    const __m512 b0 = _mm512_loadu_ps(bk), b1 = _mm512_loadu_ps(bk + 16);
    const __m512 b2 = _mm512_loadu_ps(bk + 32), b3 = _mm512_loadu_ps(bk + 48);
    ask_step<kSpread>(ask, k);
#pragma GCC unroll 6
    for (int r = 0; r < MB; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
    }
  }
  if (keep_partial<MB>(pt, acc)) return;
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + r * ldy + 16 * j, acc[r][j]);
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bf16 form: each step takes a pair of k (one vdpbf16ps per 16 columns;
// a k-row pair of the panel is 128 elements), accumulates in fp32 (across
// k-blocks too) and rounds to bf16 once at the end (to nearest even). kl is even.
template <int MB, bool kSpread>
inline void tile_bf16(const uint16_t* __restrict x, int64_t ldx, int64_t kl, const uint16_t* __restrict b,
                      const float* bias, const Partial& pt, uint16_t* __restrict y, int64_t ldy,
                      Ask ask) {
  __m512 acc[MB][4];
  start_acc<MB>(bias, pt, acc);
  for (int64_t kp = 0; kp < kl / 2; ++kp) {
    const uint16_t* bk = b + kp * 2 * kPanel;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bk), b1 = (__m512bh)_mm512_loadu_si512(bk + 32);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(bk + 64), b3 = (__m512bh)_mm512_loadu_si512(bk + 96);
    ask_step<kSpread>(ask, kp);
#pragma GCC unroll 6
    for (int r = 0; r < MB; ++r) {
      uint32_t pair;
      std::memcpy(&pair, x + r * ldx + 2 * kp, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, b1);
      acc[r][2] = _mm512_dpbf16_ps(acc[r][2], a, b2);
      acc[r][3] = _mm512_dpbf16_ps(acc[r][3], a, b3);
    }
  }
  if (keep_partial<MB>(pt, acc)) return;
  for (int r = 0; r < MB; ++r)
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + 16 * j), (__m256i)_mm512_cvtneps_pbh(acc[r][j]));
}
#endif

#if defined(KVPAGER_AMX)
// bf16 steps of kAmxMinRows rows or more on AMX: the same panels, read in the
// same order, with TDPBF16PS doing a panel's products (16 rows x 64 columns
// x 32 k a step: four 16 x 16 sum tiles, the input in tile 4, the panel's
// 16 pair-rows x 16 columns in tile 5). On AMX the vdpbf16ps tiles above
// are compute-bound from a few rows (8 rows: 1.0-2.4x oneDNN's time) while
// oneDNN's AMX kernels leave the memory system idle part of the time; this
// streams the weights at closer to the machine's read bandwidth (0.5B
// linears, 32 rows, 24 layers' weights from memory, 2 threads: 0.67x
// oneDNN's time, docs/benchmarks.md). Sums in fp32, the output rounded once
// (to nearest even), as oneDNN's.
constexpr int64_t kAmxMinRows = 4;

// Rows [16g, 16g + 16) of x (K a multiple of 32) times one panel into
// out [16][64] fp32. The first row group of a panel asks for the rows 16 KiB
// ahead of those it reads (the panel's tail, then the next panel's head).
inline void amx_panel_rows(const uint16_t* x, int64_t K, const uint16_t* panel, float* out, bool ask_ahead) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kk = 0; kk < K / 32; ++kk) {
    const uint16_t* b = panel + kk * 16 * 2 * kPanel;  // 16 pair-rows of 128 elements
    if (ask_ahead) {
      const char* a = reinterpret_cast<const char*>(b) + (16 << 10);
      for (int l = 0; l < 16 * 2 * kPanel * 2; l += 64) _mm_prefetch(a + l, _MM_HINT_T0);
    }
    _tile_loadd(4, x + kk * 32, K * 2);
    _tile_loadd(5, b, 4 * kPanel);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, b + 32, 4 * kPanel);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, b + 64, 4 * kPanel);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, b + 96, 4 * kPanel);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, out, 4 * kPanel);
  _tile_stored(1, out + 16, 4 * kPanel);
  _tile_stored(2, out + 32, 4 * kPanel);
  _tile_stored(3, out + 48, 4 * kPanel);
}

// y [M, N] = x [Mp, K] (rows past M zero) . w (panels [N/64][K/2][64][2]) + bias.
void amx_gemm(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const float* bias,
              uint16_t* y) {
  const int64_t panels = N / kPanel, groups = (M + 15) / 16;
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    kvpager::amx_begin();
    alignas(64) float out[16 * kPanel];
    for (int64_t p = p0; p < p1; ++p) {
      const uint16_t* panel = w + p * K * kPanel;
      for (int64_t g = 0; g < groups; ++g) {
        amx_panel_rows(x + 16 * g * K, K, panel, out, g == 0);
        const int64_t rows = std::min<int64_t>(16, M - 16 * g);
        for (int64_t r = 0; r < rows; ++r)
          for (int j = 0; j < 4; ++j) {
            __m512 v = _mm512_load_ps(out + r * kPanel + 16 * j);
            if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + p * kPanel + 16 * j));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + (16 * g + r) * N + p * kPanel + 16 * j),
                                (__m256i)_mm512_cvtneps_pbh(v));
          }
      }
    }
    kvpager::amx_end();
  });
}
#endif

// f(integral_constant<rows>) for 0 < rows <= MB.
template <int MB, typename F>
inline void dispatch_rows(int64_t rows, F&& f) {
  if constexpr (MB > 0) {
    if (rows == MB) return f(std::integral_constant<int, MB>{});
    return dispatch_rows<MB - 1>(rows, f);
  }
}

// The k-blocks of a K: even lengths (bf16 pairs), about kBlockBytes of a
// panel each, as equal as they come.
int64_t k_block(int64_t K, int64_t elem_bytes) {
  const int64_t cap = std::max<int64_t>(2, kBlockBytes / (kPanel * elem_bytes));
  const int64_t blocks = (K + cap - 1) / cap;
  const int64_t kb = (K + blocks - 1) / blocks;
  return std::min(K, kb + (kb & 1));
}

// Rows of a band: where a weight has too few panels to occupy the threads
// (a narrow weight on a many-core CPU), a step's rows are split into bands
// of at least this many (two row tiles), each (band, panel) a unit of work,
// so that a prefill step takes every thread and a 32-row decode step at
// least twice as many as it has panels (the parallelism of the first form's
// half panels). A band reads its panels again, from L3: the bands of one
// panel run at the same time on different threads.
constexpr int64_t kBandRows = 12;

// How many row bands M rows take beside `panels` panels on `threads` threads.
int64_t row_bands(int64_t M, int64_t panels, int64_t threads) {
  if (panels >= 2 * threads) return 1;
  const int64_t want = (2 * threads + panels - 1) / panels;
  return std::clamp<int64_t>(want, 1, std::max<int64_t>(1, M / kBandRows));
}

// part: fp32 [M, N] for the sums between k-blocks (unused with one block;
// for fp32 it may be y itself: a tile reads its sums before it writes them).
template <typename T, typename Fn>
void for_each_panel(int64_t M, int64_t K, int64_t N, const T* x, const T* w, const float* bias, T* y, float* part,
                    Fn tile) {
  // A thread takes a contiguous range of units (band, panel), so it walks
  // the packed buffer in order and "next" is the panel it reads next. With
  // k-blocks, it takes its units block by block: the input rows' block stays
  // in L2 while the panels stream past.
  const int64_t panels = N / kPanel;
  const int64_t KB = k_block(K, static_cast<int64_t>(sizeof(T)));
  const int64_t bands = row_bands(M, panels, at::get_num_threads());
  auto panel_ptr = [&](int64_t u, int64_t k0) { return w + (u % panels) * K * kPanel + k0 * kPanel; };
  at::parallel_for(0, bands * panels, 1, [&](int64_t u0, int64_t u1) {
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
      const int64_t kl = std::min(KB, K - k0);
      const bool first = k0 == 0, last = k0 + kl == K;
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t p = u % panels, band = u / panels;
        const int64_t m0 = M * band / bands, m1 = M * (band + 1) / bands;
        const T* b = panel_ptr(u, k0);
        const T* next = u + 1 < u1 ? panel_ptr(u + 1, k0) : (last ? nullptr : panel_ptr(u0, k0 + KB));
        const float* bp = bias ? bias + p * kPanel : nullptr;
        // Row tiles as equal as they come (32 rows: 6, 6, 5, 5, 5, 5, not
        // five of 6 and one of 2): a short tile pays a panel's reload for few FMAs.
        const int64_t tiles = (m1 - m0 + kRows - 1) / kRows, base = (m1 - m0) / tiles, longer = (m1 - m0) % tiles;
        // From kSpreadTiles row tiles a panel, tile t asks for the t-th share
        // of the next panel's k-rows, spread over its k-steps (Ask); with
        // fewer, every tile asks for the whole next panel as it goes.
        const int64_t steps = sizeof(T) == 2 ? kl / 2 : kl;
        const char* nx = reinterpret_cast<const char*>(next);
        int64_t m = m0;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t rows = base + (t < longer);
          const int64_t a0 = steps * t / tiles, a1 = steps * (t + 1) / tiles;
          dispatch_rows<kRows>(rows, [&](auto mb) {
            float* sums = part ? part + m * N + p * kPanel : nullptr;
            const Partial pt{first ? nullptr : sums, last ? nullptr : sums, N};
            if (tiles >= kSpreadTiles)
              tile(mb, std::true_type{}, x + m * K + k0, kl, b, bp, pt, y + m * N + p * kPanel,
                   Ask{nx ? nx + 256 * a0 : nullptr, nx ? a1 - a0 : 0, steps});
            else
              tile(mb, std::false_type{}, x + m * K + k0, kl, b, bp, pt, y + m * N + p * kPanel, Ask{nx, steps, steps});
          });
          m += rows;
        }
      }
    }
  });
}

int64_t itemsize(at::ScalarType t) { return t == at::kFloat ? 4 : 2; }

// Whether packed_gemm can read `w` (oneDNN-packed, [n, k] logically): its
// dtype has a kernel in this build and its buffer holds exactly n * k
// elements in whole panels (a padded layout is another layout).
// A dense contiguous tensor of n * k elements is read as the same layout
// (kvpager_kernels/packed_gemm.py to_panels: where oneDNN packs a dtype
// another way, as bf16 on AMX CPUs, a copy in this layout).
bool packed_gemm_readable(const at::Tensor& w, int64_t n, int64_t k) {
  if (n <= 0 || k <= 0 || n % kPanel != 0) return false;
  if (!w.is_mkldnn() && !(w.layout() == at::kStrided && w.device().is_cpu() && w.is_contiguous())) return false;
  const auto t = w.scalar_type();
  if (t == at::kFloat) {
    if (!compiled_fp32()) return false;
  } else if (t == at::kBFloat16) {
    if (!compiled_bf16() || k % 2 != 0) return false;
  } else {
    return false;
  }
  const int64_t bytes = w.is_mkldnn() ? at::native::nbytes_from_mkldnn(w) : w.numel() * itemsize(t);
  return bytes == n * k * itemsize(t);
}

const void* weight_data(const at::Tensor& w) {
  return w.is_mkldnn() ? at::native::data_ptr_from_mkldnn(w) : w.data_ptr();
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
    const float* wp = static_cast<const float*>(weight_data(w));
    float* yp = y.data_ptr<float>();
    for_each_panel<float>(M, K, n, x.data_ptr<float>(), wp, bp, yp, yp,
                          [&](auto mb, auto spread, const float* xr, int64_t kl, const float* b, const float* bh,
                              const Partial& pt, float* yr, Ask ask) {
                            tile_f32<decltype(mb)::value, decltype(spread)::value>(xr, K, kl, b, bh, pt, yr, n, ask);
                          });
    return y;
  }
#endif
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (x.scalar_type() == at::kBFloat16) {
    const uint16_t* wp = static_cast<const uint16_t*>(weight_data(w));
    const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
    uint16_t* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
#if defined(KVPAGER_AMX)
    // A dense weight here is a to_panels copy (bf16 on an AMX CPU). Rows in
    // 16s: a ragged last group is read from a zero-padded copy of x.
    if (!w.is_mkldnn() && M >= kAmxMinRows && K % 32 == 0 && kvpager::amx_usable()) {
      at::Tensor padded;
      if (M % 16 != 0) {
        padded = at::zeros({(M + 15) / 16 * 16, K}, x.options());
        padded.narrow(0, 0, M).copy_(x);
        xp = reinterpret_cast<const uint16_t*>(padded.data_ptr<at::BFloat16>());
      }
      amx_gemm(xp, M, K, wp, n, bp, yp);
      return y;
    }
#endif
    at::Tensor part;  // fp32 sums between k-blocks (none with a single block)
    if (k_block(K, 2) < K) part = at::empty({M, n}, x.options().dtype(at::kFloat));
    for_each_panel<uint16_t>(M, K, n, xp, wp, bp, yp, part.defined() ? part.data_ptr<float>() : nullptr,
                             [&](auto mb, auto spread, const uint16_t* xr, int64_t kl, const uint16_t* b,
                                const float* bh, const Partial& pt, uint16_t* yr, Ask ask) {
                              tile_bf16<decltype(mb)::value, decltype(spread)::value>(xr, K, kl, b, bh, pt, yr, n, ask);
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
