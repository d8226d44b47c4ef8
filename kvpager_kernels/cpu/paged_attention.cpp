// Paged attention on CPU, reading K/V straight from the block pool.
//
// The torch reference gathers every sequence's blocks into a padded
// [S, L, KVH, D] copy per layer before attending; here each (sequence,
// query token) walks its block table twice (scores, then values), so a
// decode reads each cached K/V row once and copies nothing. With many such
// items every kv head of one is walked together (a block's K rows of all
// heads are one contiguous run); with few, each (item, kv head) is a unit
// of work of its own, so that every thread has some. The H / KVH query
// heads that share a kv head are computed together: one K/V row load
// serves the whole GQA group. In a 16-bit dtype scores and
// probabilities are rounded where transformers' eager attention rounds them
// (finish_scores, scale_round). fp32 and bf16 prefill chunks (at least
// tile_min_query tokens) go to attention_tiles.h instead: up to 16 tokens x
// the group at once, as small matrix products, rounded at the same points
// (fp32 contexts of online_min_keys or more: attention_online.h, in key
// blocks with an online softmax; bf16 on AVX512-BF16: attention_pairs.h, in
// key blocks twice, the scores kept as bf16); decodes (and fp16) are walked here.
//
// Registered as torch.ops.kvpager_cpu.paged_attention (see kvpager_kernels/cpu_attention.py,
// which decides which sequences come here; kvpager_kernels/reference.py is the reference).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "attention_amx.h"
#include "attention_online.h"
#include "attention_pairs.h"
#include "attention_tiles.h"
#include "vec.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <numeric>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// A K/V row as float: fp32 rows are read in place, 16-bit ones converted
// into `buf`.
template <typename T>
inline const float* row_f32(const T* __restrict src, float* __restrict buf, int d) {
#pragma omp simd
  for (int i = 0; i < d; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

template <>
inline const float* row_f32<float>(const float* __restrict src, float* __restrict, int) {
  return src;
}

template <>
inline const float* row_f32<c10::BFloat16>(const c10::BFloat16* __restrict src, float* __restrict buf, int d) {
  // bf16 is the top half of an fp32: widen and shift (the generic cast does not vectorise).
  const uint16_t* u = reinterpret_cast<const uint16_t*>(src);
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= d; i += 16) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + i)));
    _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
  }
#endif
  for (; i < d; ++i) {
    const uint32_t bits = static_cast<uint32_t>(u[i]) << 16;
    std::memcpy(buf + i, &bits, sizeof(float));
  }
  return buf;
}

// How many blocks ahead of the one being read its successors are asked
// for (a block's rows of one kv head are a few cache lines, read in less
// than a memory latency; docs/benchmarks.md has the cold-cache figures).
constexpr int64_t prefetch_blocks() { return 4; }

// Asks for every cache line of n rows of d elements, `stride` elements
// apart (a block's keys or values of one kv head): the hardware prefetcher
// does not follow a block table from one page to the next. Into L2, not L1:
// the blocks asked for ahead (K and V) outgrow a 32 KiB L1 before they are
// read (a cold decode at the 0.5B model's shapes, builds alternated on the
// EPYC: fp32 ~650 -> ~580 us a layer, bf16 ~570 -> ~450).
template <typename T>
inline void prefetch_rows(const T* rows, int64_t n, int64_t stride, int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < n; ++t) {
    const char* r = reinterpret_cast<const char*>(rows + t * stride);
    for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(r + off, 0, 2);
  }
}

template <int DC>
inline float dot(const float* __restrict a, const float* __restrict b, int d_rt) {
  const int d = DC > 0 ? DC : d_rt;
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

template <int DC>
inline void axpy(float p, const float* __restrict x, float* __restrict y, int d_rt) {
  const int d = DC > 0 ? DC : d_rt;
#pragma omp simd
  for (int i = 0; i < d; ++i) y[i] += p * x[i];
}


#if defined(__AVX512F__)

// Sixteen vectors -> one: lane t of the result is the sum of v[t]'s lanes
// (a transpose-and-add tree: ~3 instructions per dot product instead of a
// full horizontal reduction each).
inline __m512 reduce16(__m512* v) {
  __m512 w[8], x[4], y[2];
  for (int i = 0; i < 8; ++i)
    w[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(w[2 * i]), b = _mm512_castps_pd(w[2 * i + 1]);
    x[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  for (int i = 0; i < 2; ++i)
    y[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * i], x[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
}

// Sixteen elements of a cache row as fp32.
template <typename T>
inline __m512 load16(const T* p);
template <>
inline __m512 load16<float>(const float* p) {
  return _mm512_loadu_ps(p);
}
template <>
inline __m512 load16<c10::BFloat16>(const c10::BFloat16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
template <>
inline __m512 load16<c10::Half>(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Scores of up to 16 consecutive keys (rows of `rows`, `stride` elements
// apart) for each of the G queries: out[g * out_stride + t].
template <typename T, int DC>
inline void scores16(const float* qf, int64_t G, const T* rows, int64_t stride, int64_t n, float* out,
                     int64_t out_stride);

// fp32 rows are read in place by every query head of the group.
template <int DC>
inline void scores16_f32(const float* qf, int64_t G, const float* rows, int64_t stride, int64_t n, float* out,
                         int64_t out_stride) {
  constexpr int C = DC / 16;
  for (int64_t g = 0; g < G; ++g) {
    __m512 qv[C];
    for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qf + g * DC + 16 * c);
    __m512 acc[16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t < n) {
        const float* r = rows + t * stride;
        __m512 a = _mm512_mul_ps(qv[0], load16<float>(r));
        for (int c = 1; c < C; ++c) a = _mm512_fmadd_ps(qv[c], load16<float>(r + 16 * c), a);
        acc[t] = a;
      } else {
        acc[t] = _mm512_setzero_ps();
      }
    }
    const __m512 sum = reduce16(acc);
    _mm512_mask_storeu_ps(out + g * out_stride, static_cast<__mmask16>((1u << n) - 1u), sum);
  }
}

template <typename T, int DC>
inline void scores16(const float* qf, int64_t G, const T* rows, int64_t stride, int64_t n, float* out,
                     int64_t out_stride) {
  if constexpr (std::is_same_v<T, float>) {
    scores16_f32<DC>(qf, G, rows, stride, n, out, out_stride);
  } else {
    // 16-bit rows are widened once into an L1-resident tile that all G query
    // heads then read (widening per head cost G times the conversions).
    alignas(64) float tile[16 * DC];
    constexpr int C = DC / 16;
    for (int64_t t = 0; t < n; ++t)
      for (int c = 0; c < C; ++c) _mm512_store_ps(tile + t * DC + 16 * c, load16<T>(rows + t * stride + 16 * c));
    scores16_f32<DC>(qf, G, tile, DC, n, out, out_stride);
  }
}

// acc[g] = sum_t p[g][t] * V[t] for GC query heads starting at g0, the
// accumulators in registers (GC * DC / 16 of them) for the whole context.
// Keys are positions [start, end); probs[g * (end - start) + pos - start].
template <typename T, int DC, int GC>
inline void pv_chunk(const float* probs, int64_t start, int64_t end, int64_t g0, const T* v, const int32_t* table,
                     int64_t BS, int64_t v_s0, int64_t v_s1, int64_t kvh_off, float* acc) {
  constexpr int C = DC / 16;
  const int64_t L = end - start;
  __m512 a[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  for (int64_t b = start / BS; b * BS < end; ++b) {
    const T* vb = v + static_cast<int64_t>(table[b]) * v_s0 + kvh_off;
    const int64_t n = std::min<int64_t>(BS, end - b * BS);
    const int64_t pf = b + prefetch_blocks();
    if (pf * BS < end) prefetch_rows(v + static_cast<int64_t>(table[pf]) * v_s0 + kvh_off, BS, v_s1, DC);
    for (int64_t t = std::max<int64_t>(0, start - b * BS); t < n; ++t) {
      const T* r = vb + t * v_s1;
      __m512 vr[C];
      for (int c = 0; c < C; ++c) vr[c] = load16<T>(r + 16 * c);
      for (int g = 0; g < GC; ++g) {
        const __m512 pg = _mm512_set1_ps(probs[(g0 + g) * L + b * BS + t - start]);
        for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(pg, vr[c], a[g][c]);
      }
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g0 + g) * DC + 16 * c, a[g][c]);
}

// All G heads in register-sized chunks (at most 16 accumulators each).
template <typename T, int DC>
inline void pv_all(const float* probs, int64_t start, int64_t end, int64_t G, const T* v, const int32_t* table,
                   int64_t BS, int64_t v_s0, int64_t v_s1, int64_t kvh_off, float* acc) {
  constexpr int C = DC / 16;
  constexpr int GMAX = C >= 16 ? 1 : 16 / C;  // 4 heads at D 64, 2 at 128, 1 at 256
  int64_t g = 0;
  for (; g + GMAX <= G; g += GMAX) pv_chunk<T, DC, GMAX>(probs, start, end, g, v, table, BS, v_s0, v_s1, kvh_off, acc);
  if constexpr (GMAX >= 4) {
    if (g + 2 <= G) pv_chunk<T, DC, 2>(probs, start, end, g, v, table, BS, v_s0, v_s1, kvh_off, acc), g += 2;
  }
  if constexpr (GMAX >= 2) {
    for (; g < G; ++g) pv_chunk<T, DC, 1>(probs, start, end, g, v, table, BS, v_s0, v_s1, kvh_off, acc);
  }
}
#define KVPAGER_HAVE_SCORES16 1
#elif defined(__AVX2__) && defined(__FMA__)

// The AVX2 forms of the functions above: eight lanes, so "16" keys are two
// groups of eight and a 64-dim row is eight registers. Same arithmetic per
// lane (fp32 products, fused multiply-adds along the head dim).

// Eight vectors -> one: lane t is the sum of v[t]'s lanes.
inline __m256 reduce8(__m256* v) {
  __m256 w[4], x[2];
  for (int i = 0; i < 4; ++i) w[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
  for (int i = 0; i < 2; ++i) x[i] = _mm256_hadd_ps(w[2 * i], w[2 * i + 1]);
  // x[0] lanes: (v0 v1 v2 v3 | v0 v1 v2 v3) halves of 128 bits; x[1] the same for v4..v7.
  const __m256 lo = _mm256_permute2f128_ps(x[0], x[1], 0x20), hi = _mm256_permute2f128_ps(x[0], x[1], 0x31);
  return _mm256_add_ps(lo, hi);
}

template <typename T>
inline __m256 load8(const T* p);
template <>
inline __m256 load8<float>(const float* p) {
  return _mm256_loadu_ps(p);
}
template <>
inline __m256 load8<c10::BFloat16>(const c10::BFloat16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
template <>
inline __m256 load8<c10::Half>(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Scores of up to 16 consecutive keys for each of the G queries (as scores16 above).
template <typename T, int DC>
inline void scores16(const float* qf, int64_t G, const T* rows, int64_t stride, int64_t n, float* out,
                     int64_t out_stride) {
  constexpr int C = DC / 8;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = qf + g * DC;
    for (int64_t t0 = 0; t0 < n; t0 += 8) {
      const int64_t m = std::min<int64_t>(8, n - t0);
      __m256 acc[8];
      for (int64_t t = 0; t < 8; ++t) {
        if (t < m) {
          const T* r = rows + (t0 + t) * stride;
          __m256 a = _mm256_mul_ps(_mm256_loadu_ps(qg), load8<T>(r));
          for (int c = 1; c < C; ++c) a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), load8<T>(r + 8 * c), a);
          acc[t] = a;
        } else {
          acc[t] = _mm256_setzero_ps();
        }
      }
      alignas(32) float sum[8];
      _mm256_store_ps(sum, reduce8(acc));
      for (int64_t t = 0; t < m; ++t) out[g * out_stride + t0 + t] = sum[t];
    }
  }
}

// acc[g] = sum_t p[g][t] * V[t] for GC heads from g0 (as pv_chunk above).
template <typename T, int DC, int GC>
inline void pv_chunk(const float* probs, int64_t start, int64_t end, int64_t g0, const T* v, const int32_t* table,
                     int64_t BS, int64_t v_s0, int64_t v_s1, int64_t kvh_off, float* acc) {
  constexpr int C = DC / 8;
  const int64_t L = end - start;
  __m256 a[GC][C];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm256_setzero_ps();
  for (int64_t b = start / BS; b * BS < end; ++b) {
    const T* vb = v + static_cast<int64_t>(table[b]) * v_s0 + kvh_off;
    const int64_t n = std::min<int64_t>(BS, end - b * BS);
    const int64_t pf = b + prefetch_blocks();
    if (pf * BS < end) prefetch_rows(v + static_cast<int64_t>(table[pf]) * v_s0 + kvh_off, BS, v_s1, DC);
    for (int64_t t = std::max<int64_t>(0, start - b * BS); t < n; ++t) {
      const T* r = vb + t * v_s1;
      for (int c = 0; c < C; ++c) {
        const __m256 vr = load8<T>(r + 8 * c);
        for (int g = 0; g < GC; ++g)
          a[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(probs[(g0 + g) * L + b * BS + t - start]), vr, a[g][c]);
      }
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(acc + (g0 + g) * DC + 8 * c, a[g][c]);
}

template <typename T, int DC>
inline void pv_all(const float* probs, int64_t start, int64_t end, int64_t G, const T* v, const int32_t* table,
                   int64_t BS, int64_t v_s0, int64_t v_s1, int64_t kvh_off, float* acc) {
  constexpr int C = DC / 8;
  constexpr int GMAX = C >= 12 ? 1 : 12 / C;  // accumulators within 16 ymm registers: 1 head at D 64, 3 at 32
  int64_t g = 0;
  for (; g + GMAX <= G; g += GMAX) pv_chunk<T, DC, GMAX>(probs, start, end, g, v, table, BS, v_s0, v_s1, kvh_off, acc);
  if constexpr (GMAX >= 2) {
    for (; g < G; ++g) pv_chunk<T, DC, 1>(probs, start, end, g, v, table, BS, v_s0, v_s1, kvh_off, acc);
  }
}
#define KVPAGER_HAVE_SCORES16 1
#endif

// The largest of s[0..n): GCC leaves a std::max reduction scalar (one
// dependent vmaxss per score: a sixth of a decode's attention time).
inline float row_max(const float* s, int64_t n) {
  int64_t t = 0;
  float mx = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(s + t));
  mx = _mm512_reduce_max_ps(m);
#elif defined(__AVX2__)
  __m256 m = _mm256_set1_ps(mx);
  for (; t + 8 <= n; t += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  for (float x : lanes) mx = std::max(mx, x);
#endif
  for (; t < n; ++t) mx = std::max(mx, s[t]);
  return mx;
}

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_s0, q_s1;                    // q [T, H, D] strides (last is 1)
  int64_t o_s0, o_s1;                    // out [T, H, D]
  int64_t k_s0, k_s1, k_s2;              // k_cache [NB, BS, KVH, D]
  int64_t v_s0, v_s1, v_s2;
  int64_t num_blocks;
  int64_t window;   // sliding window in tokens (0 = none): keys > pos - window
  float softcap;    // logit soft-capping (0 = none): s = softcap * tanh(s / softcap)
};

// Per-thread scratch, grown on demand.
struct Scratch {
  std::vector<float> q, acc, row, scores;
  void fit(int64_t g, int64_t d, int64_t context) {
    if (static_cast<int64_t>(q.size()) < g * d) q.resize(g * d), acc.resize(g * d);
    if (static_cast<int64_t>(row.size()) < d) row.resize(d);
    if (static_cast<int64_t>(scores.size()) < g * context) scores.resize(g * context);
  }
};

// The first key a query at `pos` sees (transformers' sliding window).
inline int64_t window_start(int64_t pos, int64_t window) {
  return window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
}

// Asks for the first blocks a query at `pos` reads of kv head `kvh` (every
// head: kvh < 0; the rest are asked for as the walk goes): issued by `run`
// for a thread's next item while it attends the current one.
template <typename T>
inline void prefetch_first_blocks(const Shape& sh, const T* k, const T* v, const int32_t* table, int64_t pos,
                                  int64_t kvh) {
  const int64_t BS = sh.block_size, first = window_start(pos, sh.window) / BS, last = pos / BS + 1;
  const int64_t h0 = kvh < 0 ? 0 : kvh, h1 = kvh < 0 ? sh.num_kv_heads : kvh + 1;
  for (int64_t b = first; b < std::min(last, first + prefetch_blocks()); ++b)
    for (int64_t h = h0; h < h1; ++h) {
      prefetch_rows(k + static_cast<int64_t>(table[b]) * sh.k_s0 + h * sh.k_s2, BS, sh.k_s1, sh.head_dim);
      prefetch_rows(v + static_cast<int64_t>(table[b]) * sh.v_s0 + h * sh.v_s2, BS, sh.v_s1, sh.head_dim);
    }
}

// x held in the model dtype T, as fp32 (fp32: x itself). c10's conversions
// round to nearest even, as torch's do.
template <typename T>
inline float as_t(float x) {
  return static_cast<float>(static_cast<T>(x));
}
template <>
inline float as_t<float>(float x) {
  return x;
}

#if defined(__AVX512F__)
using kvpager::round_bf16x16;  // attention_tiles.h: the walk and the tiles round alike
#elif defined(__AVX2__)
// Eight fp32 rounded to bf16 (to nearest even, NaN -> 0x7fc0 as c10), as fp32.
inline __m256 round_bf16x8(__m256 f) {
  const __m256i u = _mm256_castps_si256(f);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb),
                                     _mm256_set1_epi32(static_cast<int>(0xffff0000u)));
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)),
                          _mm256_cmp_ps(f, f, _CMP_UNORD_Q));
}
#endif

// s[0..n) = s * mul, rounded to T (softmax's normalisation, then
// ``.to(T)``: the probabilities the values are weighted by).
template <typename T>
inline void scale_round(float* s, int64_t n, float mul) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512 m = _mm512_set1_ps(mul);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, round_bf16x16(_mm512_mul_ps(_mm512_loadu_ps(s + i), m)));
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256 m = _mm256_set1_ps(mul);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(s + i, round_bf16x8(_mm256_mul_ps(_mm256_loadu_ps(s + i), m)));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) s[j] = as_t<T>(s[j] * mul);
}

// Raw products q.k -> the scores transformers' eager attention softmaxes:
// in a 16-bit model dtype its matmul rounds q.k (summed in fp32) to T, the
// scaling rounds again, and Gemma 2's soft-capping rounds after each of its
// three ops. Rounding where it rounds keeps bf16 greedy output close to
// transformers' (random weights' logits are nearly flat, so every rounding
// flips ties); for fp32 it is the same order of operations, q.k then the scale.
template <typename T>
inline void finish_scores(float* s, int64_t n, float scale, float softcap) {
  int64_t i = 0;
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m512 sc = _mm512_set1_ps(scale);
    for (; i + 16 <= n; i += 16)
      _mm512_storeu_ps(s + i, round_bf16x16(_mm512_mul_ps(round_bf16x16(_mm512_loadu_ps(s + i)), sc)));
  }
#elif defined(__AVX2__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const __m256 sc = _mm256_set1_ps(scale);
    for (; i + 8 <= n; i += 8)
      _mm256_storeu_ps(s + i, round_bf16x8(_mm256_mul_ps(round_bf16x8(_mm256_loadu_ps(s + i)), sc)));
  }
#endif
#pragma omp simd
  for (int64_t j = i; j < n; ++j) s[j] = as_t<T>(as_t<T>(s[j]) * scale);
  if (softcap > 0.f)
    for (int64_t j = 0; j < n; ++j) s[j] = as_t<T>(as_t<T>(std::tanh(as_t<T>(s[j] / softcap))) * softcap);
}

// qf[r * d ..] = the n query heads from `q` (rows `stride` apart) as fp32;
// they are scaled after the product, where transformers scales.
template <typename T>
inline void load_queries(const T* q, int64_t stride, int64_t n, int d, float* qf) {
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < d; ++i) qf[r * d + i] = static_cast<float>(q[r * stride + i]);
}

// Each of `rows` rows of L scores -> its softmax, rounded to T
// (softmax(..., dtype=float32).to(T), as transformers' eager attention).
template <typename T>
inline void softmax_rows(float* scores, int64_t rows, int64_t L) {
  for (int64_t g = 0; g < rows; ++g) {
    float* s = scores + g * L;
    const float mx = row_max(s, L);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < L; ++t) {
      s[t] = kvpager::vexp(s[t] - mx);
      sum += s[t];
    }
    scale_round<T>(s, L, 1.f / sum);
  }
}

// out rows (`stride` apart) = the n fp32 accumulators, in T.
template <typename T>
inline void store_outputs(const float* acc, int64_t n, int d, T* out, int64_t stride) {
  for (int64_t r = 0; r < n; ++r)
    for (int i = 0; i < d; ++i) out[r * stride + i] = static_cast<T>(acc[r * d + i]);
}

// One query token of one sequence against one kv head, its GQA group of
// query heads at once. `pos`: the query's absolute position (it sees keys
// start..pos, start = 0 without a window; blocks before start are never
// read). Three passes over the context: scores, softmax, weighted values
// (no online rescaling: the scores of one query fit in a small buffer).
template <typename T, int DC>
void attend_one(const Shape& sh, const T* q, const T* k, const T* v, T* out, const int32_t* table,
                int64_t pos, int64_t kvh, float scale, Scratch& sc) {
  const int d = DC > 0 ? DC : static_cast<int>(sh.head_dim);
  const int64_t G = sh.group, BS = sh.block_size;
  const int64_t start = window_start(pos, sh.window), end = pos + 1;
  const int64_t L = end - start;  // keys seen; scores[g * L + key - start]
  sc.fit(G, d, L);
  float* qf = sc.q.data();
  float* acc = sc.acc.data();
  float* row = sc.row.data();
  float* scores = sc.scores.data();  // [G, L]
  load_queries(q + kvh * G * sh.q_s1, sh.q_s1, G, d, qf);
  const int64_t first_block = start / BS, n_blocks = (end + BS - 1) / BS;  // the first ones asked for by run()
  for (int64_t b = first_block; b < n_blocks; ++b) {
    const int64_t blk = static_cast<int64_t>(table[b]);
    const int64_t n = std::min<int64_t>(BS, end - b * BS);
    const int64_t t_lo = std::max<int64_t>(0, start - b * BS);
    float* sb = scores + b * BS - start;  // sb[t]: key b * BS + t
    const T* kb = k + blk * sh.k_s0 + kvh * sh.k_s2;
    // Blocks are pages of their own: the hardware prefetcher does not follow the table.
    // V's rows come in during the scores pass too: the values pass then reads
    // them from L2 (a decode's K/V of one kv head is tens of KB).
    if (b + prefetch_blocks() < n_blocks) {
      const int64_t ahead = static_cast<int64_t>(table[b + prefetch_blocks()]);
      prefetch_rows(k + ahead * sh.k_s0 + kvh * sh.k_s2, BS, sh.k_s1, d);
      prefetch_rows(v + ahead * sh.v_s0 + kvh * sh.v_s2, BS, sh.v_s1, d);
    }
#ifdef KVPAGER_HAVE_SCORES16
    if constexpr (DC > 0 && DC % 16 == 0) {
      for (int64_t t0 = t_lo; t0 < n; t0 += 16)
        scores16<T, DC>(qf, G, kb + t0 * sh.k_s1, sh.k_s1, std::min<int64_t>(16, n - t0), sb + t0, L);
      continue;
    }
#endif
    for (int64_t t = t_lo; t < n; ++t) {
      const float* kr = row_f32<T>(kb + t * sh.k_s1, row, d);
      for (int64_t g = 0; g < G; ++g) sb[g * L + t] = dot<DC>(qf + g * d, kr, d);
    }
  }
  finish_scores<T>(scores, G * L, scale, sh.softcap);
  softmax_rows<T>(scores, G, L);
#ifdef KVPAGER_HAVE_SCORES16
  if constexpr (DC > 0 && DC % 16 == 0) {
    pv_all<T, DC>(scores, start, end, G, v, table, BS, sh.v_s0, sh.v_s1, kvh * sh.v_s2, acc);
  } else
#endif
  {
    std::fill(acc, acc + G * d, 0.f);
    for (int64_t b = first_block; b < n_blocks; ++b) {
      const int64_t blk = static_cast<int64_t>(table[b]);
      const int64_t n = std::min<int64_t>(BS, end - b * BS);
      const T* vb = v + blk * sh.v_s0 + kvh * sh.v_s2;
      for (int64_t t = std::max<int64_t>(0, start - b * BS); t < n; ++t) {
        const float* vr = row_f32<T>(vb + t * sh.v_s1, row, d);
        for (int64_t g = 0; g < G; ++g) axpy<DC>(scores[g * L + b * BS + t - start], vr, acc + g * d, d);
      }
    }
  }
  store_outputs(acc, G, d, out + kvh * G * sh.o_s1, sh.o_s1);
}

#ifdef KVPAGER_HAVE_SCORES16
// One query token of one sequence against every kv head: attend_one's
// arithmetic head by head (the same bits), but the scores pass reads each
// block's K rows of all heads in turn, one contiguous run in either pool
// layout, and asks for the run four blocks ahead. The values pass walks V
// head by head (pv_all). 16 sequences x 1,450 tokens of the 30M Llama's
// shapes, fp32, blocks in random order on huge pages: 1,003-1,006 -> 874-901
// us a layer; 32 x 200 at 24 layers 291-293 -> 255-263 (docs/benchmarks.md).
template <typename T, int DC>
void attend_all(const Shape& sh, const T* q, const T* k, const T* v, T* out, const int32_t* table, int64_t pos,
                float scale, Scratch& sc) {
  const int64_t G = sh.group, BS = sh.block_size, KVH = sh.num_kv_heads, H = sh.num_heads;
  const int64_t start = window_start(pos, sh.window), end = pos + 1;
  const int64_t L = end - start;  // scores[(kvh * G + g) * L + key - start]
  sc.fit(H, DC, L);
  float* qf = sc.q.data();
  float* acc = sc.acc.data();
  float* scores = sc.scores.data();  // [H, L]
  load_queries(q, sh.q_s1, H, DC, qf);
  // A block's rows of every kv head form one run when nothing else sits between blocks.
  const bool run_per_block = sh.k_s0 == BS * KVH * DC;
  const int64_t first_block = start / BS, n_blocks = (end + BS - 1) / BS;
  for (int64_t b = first_block; b < n_blocks; ++b) {
    const int64_t blk = static_cast<int64_t>(table[b]);
    const int64_t n = std::min<int64_t>(BS, end - b * BS);
    const int64_t t_lo = std::max<int64_t>(0, start - b * BS);
    if (b + prefetch_blocks() < n_blocks) {
      const T* ahead = k + static_cast<int64_t>(table[b + prefetch_blocks()]) * sh.k_s0;
      if (run_per_block)
        prefetch_rows(ahead, 1, 0, BS * KVH * DC);
      else
        for (int64_t h = 0; h < KVH; ++h) prefetch_rows(ahead + h * sh.k_s2, BS, sh.k_s1, DC);
    }
    for (int64_t h = 0; h < KVH; ++h) {
      const T* kb = k + blk * sh.k_s0 + h * sh.k_s2;
      float* sb = scores + h * G * L + b * BS - start;  // sb[g * L + t]: head h * G + g, key b * BS + t
      for (int64_t t0 = t_lo; t0 < n; t0 += 16)
        scores16<T, DC>(qf + h * G * DC, G, kb + t0 * sh.k_s1, sh.k_s1, std::min<int64_t>(16, n - t0), sb + t0, L);
    }
  }
  finish_scores<T>(scores, H * L, scale, sh.softcap);
  softmax_rows<T>(scores, H, L);
  for (int64_t h = 0; h < KVH; ++h)
    pv_all<T, DC>(scores + h * G * L, start, end, G, v, table, BS, sh.v_s0, sh.v_s1, h * sh.v_s2, acc + h * G * DC);
  store_outputs(acc, H, DC, out, sh.o_s1);
}
#endif

// attend_all where the build has it for this head dim (run never asks otherwise).
template <typename T, int DC>
inline void attend_whole(const Shape& sh, const T* q, const T* k, const T* v, T* out, const int32_t* table,
                         int64_t pos, float scale, Scratch& sc) {
#ifdef KVPAGER_HAVE_SCORES16
  if constexpr (DC > 0 && DC % 16 == 0) {
    attend_all<T, DC>(sh, q, k, v, out, table, pos, scale, sc);
    return;
  }
#endif
  TORCH_CHECK(false, "paged_attention: no whole-item walk for head_dim ", sh.head_dim);
}

// Items per thread from which every kv head of an item is walked together
// (attend_all): below it, an item per (token, kv head) keeps the threads
// evenly loaded (16 x 1,450 and 4 x 6,000 tokens on two threads: 6-13 %
// quicker whole; 2 and 3 x 6,000: 7-30 % slower).
constexpr int64_t whole_items_per_thread() { return 4; }

template <typename T, int DC>
void run(const Shape& sh, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
         const at::Tensor& v_cache, const int32_t* tables, const int32_t* seq_lens, const int32_t* qsl,
         const std::vector<int64_t>& items, float scale) {
  // items: flattened (seq, query token) pairs, packed as seq << 32 | token.
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t team = at::get_num_threads();
  bool whole = false;
#ifdef KVPAGER_HAVE_SCORES16
  whole = DC > 0 && DC % 16 == 0 && static_cast<int64_t>(items.size()) >= whole_items_per_thread() * team;
#endif
  const int64_t per_item = whole ? 1 : sh.num_kv_heads;  // units of work per item
  const int64_t n_work = static_cast<int64_t>(items.size()) * per_item;
  // Work is handed out one unit (a token, or a token's kv head) at a time, last first: a
  // prefill chunk's later tokens attend more keys, and parallel_for's static
  // halves gave the second thread three times the first's work on a single
  // sequence (1.5x the balanced time). Every thread pulls until none is left.
  // A thread takes its next item before attending the current one and asks
  // for the next one's first blocks: they arrive while this one computes
  // (a decode item is a few blocks; waiting for its first ones was a tenth
  // of a cold decode's attention).
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(team, n_work);
  struct Item {
    int64_t s, token, pos, kvh;
  };
  auto locate = [&](int64_t taken) {
    const int64_t w = n_work - 1 - taken;
    const int64_t item = items[w / per_item];
    const int64_t s = item >> 32, j = item & 0xffffffff;
    const int64_t q_len = qsl[s + 1] - qsl[s];
    const Item it{s, qsl[s] + j, static_cast<int64_t>(seq_lens[s]) - q_len + j, whole ? -1 : w % per_item};
    prefetch_first_blocks(sh, kp, vp, tables + s * sh.max_blocks, it.pos, it.kvh);
    return it;
  };
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch scratch;
    int64_t taken = next.fetch_add(1, std::memory_order_relaxed);
    if (taken >= n_work) return;
    Item cur = locate(taken);
    while (true) {
      const int64_t following = next.fetch_add(1, std::memory_order_relaxed);
      const bool more = following < n_work;
      Item nxt{};
      if (more) nxt = locate(following);
      if (whole)
        attend_whole<T, DC>(sh, qp + cur.token * sh.q_s0, kp, vp, op + cur.token * sh.o_s0,
                            tables + cur.s * sh.max_blocks, cur.pos, scale, scratch);
      else
        attend_one<T, DC>(sh, qp + cur.token * sh.q_s0, kp, vp, op + cur.token * sh.o_s0,
                          tables + cur.s * sh.max_blocks, cur.pos, cur.kvh, scale, scratch);
      if (!more) break;
      cur = nxt;
    }
  });
}

#if defined(__AVX512F__)
// Whether bf16 tiles of this head dim run on AMX: built for it, asked for
// (amx), granted by the kernel, D a multiple of 32.
bool amx_takes(bool amx, int64_t head_dim) {
#if defined(KVPAGER_AMX_TILES)
  return amx && head_dim % 32 == 0 && kvpager::amx_usable();
#else
  (void)amx;
  (void)head_dim;
  return false;
#endif
}

// The tiles of fp32 and bf16 prefill chunks (attention_tiles.h; fp32 of long
// contexts attention_online.h; bf16 on AVX512-BF16 attention_pairs.h), handed
// out one at a time, last first (a sequence's later tokens attend more keys).
// amx: bf16 tiles of a head dim that is a multiple of 32 on the matrix unit
// (attention_amx.h), where it is built and the kernel grants it.
template <int C, typename T>
void run_tiles(const std::vector<kvpager::TileJob<T>>& jobs, bool amx) {
  std::atomic<int64_t> next{0};
  const int64_t n = static_cast<int64_t>(jobs.size());
#if defined(KVPAGER_AMX_TILES)
  if constexpr (std::is_same_v<T, c10::BFloat16> && C % 2 == 0) {
    if (amx_takes(amx, 16 * C)) {
      at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
        kvpager::TileScratch scratch;
        kvpager::amx_begin();
        for (int64_t taken = next.fetch_add(1, std::memory_order_relaxed); taken < n;
             taken = next.fetch_add(1, std::memory_order_relaxed))
          kvpager::attend_tile_amx<C>(jobs[n - 1 - taken], scratch);
        kvpager::amx_end();
      });
      return;
    }
  }
#endif
  (void)amx;
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    kvpager::TileScratch scratch;
    for (int64_t taken = next.fetch_add(1, std::memory_order_relaxed); taken < n;
         taken = next.fetch_add(1, std::memory_order_relaxed)) {
      const kvpager::TileJob<T>& jb = jobs[n - 1 - taken];
      if constexpr (std::is_same_v<T, float>) {
        if (jb.online) {
          kvpager::attend_tile_online<C>(jb, scratch);
          continue;
        }
      }
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        kvpager::attend_tile_pairs<C>(jb, scratch);
        continue;
      }
#endif
      kvpager::attend_tile<C, T>(jb, scratch);
    }
  });
}

// Whether a chunk of q_len queries goes to the tiles: fp32 or bf16, a head
// dim with a tile kernel, no window or soft-capping, and at least
// tile_min_query tokens (0: never).
bool tiles_take(const Shape& sh, at::ScalarType dtype, int64_t q_len, int64_t tile_min_query) {
  const int64_t d = sh.head_dim;
  return tile_min_query > 0 && q_len >= tile_min_query && (dtype == at::kFloat || dtype == at::kBFloat16) &&
         sh.window == 0 &&
         sh.softcap == 0.f && (d == 32 || d == 64 || d == 80 || d == 96 || d == 128 || d == 256);
}

// Whether bf16 tiles of this head dim run on AVX512-BF16's pair dot product
// (attention_pairs.h): built for it, and AMX does not take them.
bool pairs_take(at::ScalarType dtype, bool amx_tiles, int64_t head_dim) {
#if defined(__AVX512BF16__)
  return dtype == at::kBFloat16 && !amx_takes(amx_tiles, head_dim);
#else
  (void)dtype;
  (void)amx_tiles;
  (void)head_dim;
  return false;
#endif
}

template <typename T>
void dispatch_tiles(int64_t head_dim, const std::vector<kvpager::TileJob<T>>& jobs, bool amx) {
  switch (head_dim / 16) {
    case 2: return run_tiles<2, T>(jobs, amx);
    case 4: return run_tiles<4, T>(jobs, amx);
    case 5: return run_tiles<5, T>(jobs, amx);
    case 6: return run_tiles<6, T>(jobs, amx);
    case 8: return run_tiles<8, T>(jobs, amx);
    case 16: return run_tiles<16, T>(jobs, amx);
    default: TORCH_CHECK(false, "paged_attention: no tile kernel for head_dim ", head_dim);
  }
}
#endif

template <typename T>
void dispatch_dim(const Shape& sh, const at::Tensor& out, const at::Tensor& q, const at::Tensor& k,
                  const at::Tensor& v, const int32_t* tables, const int32_t* seq_lens, const int32_t* qsl,
                  const std::vector<int64_t>& items, float scale) {
  switch (sh.head_dim) {
    case 32: return run<T, 32>(sh, out, q, k, v, tables, seq_lens, qsl, items, scale);
    case 64: return run<T, 64>(sh, out, q, k, v, tables, seq_lens, qsl, items, scale);
    case 80: return run<T, 80>(sh, out, q, k, v, tables, seq_lens, qsl, items, scale);
    case 96: return run<T, 96>(sh, out, q, k, v, tables, seq_lens, qsl, items, scale);
    case 128: return run<T, 128>(sh, out, q, k, v, tables, seq_lens, qsl, items, scale);
    case 256: return run<T, 256>(sh, out, q, k, v, tables, seq_lens, qsl, items, scale);
    default: return run<T, 0>(sh, out, q, k, v, tables, seq_lens, qsl, items, scale);
  }
}

// out, q: [T, H, D]; k_cache, v_cache: [NB, BS, KVH, D] (any strides, last 1);
// block_tables: [S, MB] int32 contiguous; seq_lens: [S] int32; query_start_loc:
// [S + 1] int32; seqs: [Sd] int64, the sequences to compute (others' rows of
// `out` are left alone). Query j of sequence s sits at position
// seq_lens[s] - q_len[s] + j and attends to positions <= its own (and, with
// window > 0, > its own - window; table entries before the first query's
// window may be padding). softcap > 0: Gemma 2's logit soft-capping.
// tile_min_query: fp32 and bf16 chunks of at least this many queries are
// attended in tiles (attention_tiles.h, AVX-512 builds); 0 walks every query alone.
// online_min_keys, online_min_rows: fp32 tiles of contexts at least
// online_min_keys long, in chunks of at least online_min_rows rows (queries x
// the GQA group), run attention_online.h's key blocks instead (0 keys: never).
// amx_tiles: bf16 tiles on AMX where there is one (attention_amx.h); false: the
// AVX-512 tiles everywhere.
void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache,
                     const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                     const at::Tensor& query_start_loc, const at::Tensor& seqs, double scale, int64_t window,
                     double softcap, int64_t tile_min_query, int64_t online_min_keys, int64_t online_min_rows,
                     bool amx_tiles) {
  TORCH_CHECK(window >= 0 && softcap >= 0, "window and softcap must be >= 0 (0 = off)");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "q and out must be [T, H, D] of one shape");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "caches must be [NB, BS, KVH, D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && v_cache.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "q, out and the caches must share one dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "the head dim must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.is_contiguous() && block_tables.dim() == 2,
              "block_tables must be contiguous [S, MB] int32");
  TORCH_CHECK(seq_lens.scalar_type() == at::kInt && seq_lens.is_contiguous(), "seq_lens must be int32");
  TORCH_CHECK(query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous() &&
                  query_start_loc.numel() == seq_lens.numel() + 1,
              "query_start_loc must be [S + 1] int32");
  TORCH_CHECK(seqs.scalar_type() == at::kLong && seqs.is_contiguous(), "seqs must be int64");
  Shape sh{};
  sh.num_heads = q.size(1);
  sh.head_dim = q.size(2);
  sh.block_size = k_cache.size(1);
  sh.num_kv_heads = k_cache.size(2);
  sh.num_blocks = k_cache.size(0);
  TORCH_CHECK(k_cache.size(3) == sh.head_dim, "cache head_dim differs from q's");
  TORCH_CHECK(sh.num_heads % sh.num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  sh.group = sh.num_heads / sh.num_kv_heads;
  sh.max_blocks = block_tables.size(1);
  sh.q_s0 = q.stride(0), sh.q_s1 = q.stride(1);
  sh.o_s0 = out.stride(0), sh.o_s1 = out.stride(1);
  sh.k_s0 = k_cache.stride(0), sh.k_s1 = k_cache.stride(1), sh.k_s2 = k_cache.stride(2);
  sh.v_s0 = v_cache.stride(0), sh.v_s1 = v_cache.stride(1), sh.v_s2 = v_cache.stride(2);
  sh.window = window;
  sh.softcap = static_cast<float>(softcap);

  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qsl = query_start_loc.data_ptr<int32_t>();
  const int64_t* sp = seqs.data_ptr<int64_t>();
  const int64_t num_seqs = seq_lens.numel();
  const float sc = static_cast<float>(scale);
  std::vector<int64_t> items;
  items.reserve(static_cast<size_t>(seqs.numel()));
#if defined(__AVX512F__)
  std::vector<kvpager::TileJob<float>> jobs;
  std::vector<kvpager::TileJob<c10::BFloat16>> jobs16;
#endif
  for (int64_t i = 0; i < seqs.numel(); ++i) {
    const int64_t s = sp[i];
    TORCH_CHECK(s >= 0 && s < num_seqs, "sequence index out of range");
    const int64_t q_len = qsl[s + 1] - qsl[s];
    TORCH_CHECK(q_len >= 1 && qsl[s + 1] <= q.size(0) && lens[s] >= q_len, "bad query/sequence lengths");
    const int64_t need = (static_cast<int64_t>(lens[s]) + sh.block_size - 1) / sh.block_size;
    TORCH_CHECK(need <= sh.max_blocks, "sequence longer than its block table");
    for (int64_t b = window_start(lens[s] - q_len, window) / sh.block_size; b < need; ++b) {
      const int32_t blk = tables[s * sh.max_blocks + b];
      TORCH_CHECK(blk >= 0 && blk < sh.num_blocks, "block id out of range");
    }
#if defined(__AVX512F__)
    if (tiles_take(sh, q.scalar_type(), q_len, tile_min_query)) {
      const bool online = q.scalar_type() == at::kFloat && online_min_keys > 0 && lens[s] >= online_min_keys &&
                          q_len * sh.group >= online_min_rows;
      int64_t per = online ? kvpager::online_tile_tokens(sh.group) : kvpager::tile_tokens(sh.group, lens[s]);
      if (online) {
        // Tiles of equal size, and at least two a thread where the chunk
        // has 16 tokens a tile for them: a 128-token chunk over one kv head
        // is otherwise one tile for one thread.
        const int64_t want = (2 * at::get_num_threads() + sh.num_kv_heads - 1) / sh.num_kv_heads;
        const int64_t n = std::min(std::max((q_len + per - 1) / per, want),
                                   std::max<int64_t>(1, q_len / kvpager::kTileMaxTokens));
        per = (q_len + n - 1) / n;
        // ... of whole row vectors where the chunk allows: at 7 heads a kv
        // head 71 tokens are 497 rows in 512, 80 tokens 560 in 560.
        const int64_t unit = 16 / std::gcd<int64_t>(sh.group, 16);
        per = std::min(q_len, (per + unit - 1) / unit * unit);
      }
#if defined(__AVX512BF16__)
      if (pairs_take(q.scalar_type(), amx_tiles, sh.head_dim)) per = kvpager::pair_tile_tokens(sh.group, lens[s]);
#endif
      // A kv head's tiles one after another: the threads take neighbouring
      // jobs (run_tiles), so they read one head's K/V from L3 at a time
      // rather than each its own (0.92-1.0 of the time, docs/kernels.md).
      auto add = [&](auto& to, auto* elem) {
        using T = std::remove_pointer_t<decltype(elem)>;
        for (int64_t h = 0; h < sh.num_kv_heads; ++h)
          for (int64_t j = 0; j < q_len; j += per)
            to.push_back({q.data_ptr<T>(), sh.q_s0, sh.q_s1, k_cache.data_ptr<T>(), sh.k_s0, sh.k_s1, sh.k_s2,
                          v_cache.data_ptr<T>(), sh.v_s0, sh.v_s1, sh.v_s2, out.data_ptr<T>(), sh.o_s0, sh.o_s1,
                          tables + s * sh.max_blocks, sh.block_size, sh.group, qsl[s] + j, lens[s] - q_len + j,
                          std::min(per, q_len - j), h, sc, online});
      };
      if (q.scalar_type() == at::kFloat)
        add(jobs, static_cast<float*>(nullptr));
      else
        add(jobs16, static_cast<c10::BFloat16*>(nullptr));
      continue;
    }
#endif
    for (int64_t j = 0; j < q_len; ++j) items.push_back((s << 32) | j);
  }
#if defined(__AVX512F__)
  if (!jobs.empty()) dispatch_tiles(sh.head_dim, jobs, false);
  if (!jobs16.empty()) dispatch_tiles(sh.head_dim, jobs16, amx_tiles);
#endif
  if (items.empty()) return;
  switch (q.scalar_type()) {
    case at::kFloat:
      return dispatch_dim<float>(sh, out, q, k_cache, v_cache, tables, lens, qsl, items, sc);
    case at::kBFloat16:
      return dispatch_dim<c10::BFloat16>(sh, out, q, k_cache, v_cache, tables, lens, qsl, items, sc);
    case at::kHalf:
      return dispatch_dim<c10::Half>(sh, out, q, k_cache, v_cache, tables, lens, qsl, items, sc);
    default:
      TORCH_CHECK(false, "paged_attention: unsupported dtype ", q.scalar_type());
  }
}

// Whether bf16 prompt tiles run on AMX here: built for it (-march=native on
// an AMX CPU) and granted the tile state by the kernel.
bool amx_usable() {
#if defined(KVPAGER_AMX_TILES)
  return kvpager::amx_usable();
#else
  return false;
#endif
}

// The fp32 online tiles' exp, vec.h's vexp2_16_nonpos, over a float32 tensor of
// inputs <= 0 (its test compares it with exp2 in float64).
at::Tensor exp2_nonpos(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "exp2_nonpos: float32 input, got ", x.scalar_type());
#if defined(__AVX512F__)
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty_like(xc);
  const float* src = xc.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t n = xc.numel();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = n - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(dst + i, live, kvpager::vexp2_16_nonpos(_mm512_maskz_loadu_ps(live, src + i)));
  }
  return out;
#else
  TORCH_CHECK(false, "exp2_nonpos: built without AVX-512 (the tiles' exp is AVX-512 only)");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvpager_cpu, m) {
  m.def("exp2_nonpos(Tensor x) -> Tensor", &exp2_nonpos);
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
      "Tensor seq_lens, Tensor query_start_loc, Tensor seqs, float scale, int window, float softcap, "
      "int tile_min_query, int online_min_keys, int online_min_rows, bool amx_tiles) -> ()");
  m.def("amx_usable() -> bool", &amx_usable);
}

TORCH_LIBRARY_IMPL(kvpager_cpu, CPU, m) { m.impl("paged_attention", &paged_attention); }
