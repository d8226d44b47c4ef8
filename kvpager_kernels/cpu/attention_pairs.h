// bf16 prefill tiles on AVX512-BF16's pair dot product (vdpbf16ps: sixteen
// fp32 lanes, each += a[2l] * b[2l] + a[2l+1] * b[2l+1], products exact, sums
// in fp32): half the instructions of attention_tiles.h's fp32 tiles for the
// scores and the value sums, with the rounding points of the walk, which are
// transformers' eager attention's: q.k to bf16, times the scale to bf16, each
// probability exp(s - max) / sum to bf16, the output once. Only the fp32
// summation order differs (pairs of dims or keys), so outputs agree with the
// walk to a few ulp before the output's rounding. The operands stay bf16: K
// is read from the pool as pairs of dims, Q transposed once into pairs of
// dims per row, V and the probabilities interleaved into pairs of keys.
//
// A probability is rounded after it is normalised, so no block's values can
// be summed before the row's sum of exps is whole (an online softmax would
// round other numbers). A tile goes over its context twice, in blocks of
// kPairKeys keys:
//   pass 1  scores (rounded, masked) written as bf16 to ss [L][rp] (they
//           are bf16 values: kept exactly, 2 bytes a key and row); each
//           row's maximum and sum of exps kept up online (pair_sums)
//   pass 2  a block's probabilities exp(s - max) * (1 / sum) from ss,
//           rounded to bf16 in pairs of keys, against the block's V in
//           pairs; the value sums stay fp32 across blocks
// The products are computed once; the kept scores are read once, in order.
// From 1,024 keys a tile holds about 128 rows (tokens x the GQA group) up to
// 65,536 keys (kPairScoreBytes), where the one-pass tile this replaced held
// its context's fp32 scores and probabilities and shrank to stay within 4
// MiB: 16 tokens up to 16,384 keys at 4 heads a kv head, 13 at 20,000.
// Against it (whole calls, Zen 5 EPYC, 2 threads; docs/kernels.md): 0.67-0.86
// of its time at 1,904 x 6,000, 0.47-0.60 at 512 x 16,384, 0.33-0.37 at
// 2,048 x 32,768; level to 13 % slower up to 512 x 512, where both fit L2 and
// this one computes each exp twice.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "attention_tiles.h"
#include "vec.h"

namespace kvpager {

// Keys a block (rounded down to a multiple of the pool's block size, at
// least one block): a block's probabilities, 64 pairs x 128 rows, are 32 KiB.
constexpr int64_t kPairKeys = 128;

// Rows a tile: about 128 (tokens x the GQA group, 16 to 128 tokens); past
// kPairScoreBytes of kept scores (65,536 keys at 128 rows) fewer, to stay
// within it. Contexts under kPairWideKeys keep tile_tokens' tiles (16
// tokens, up to 64 rows at small groups): there a wide tile's causal
// triangle (its later tokens' keys, masked for the earlier rows) is a large
// share of its scores, and 128 x 128 without GQA took 1.20x the time in
// tiles of 128 rows.
constexpr int64_t kPairTileRows = 128;
constexpr int64_t kPairScoreBytes = 1 << 24;
constexpr int64_t kPairWideKeys = 1024;
inline int64_t pair_tile_tokens(int64_t group, int64_t context) {
  if (context < kPairWideKeys) return tile_tokens(group, context);
  const int64_t g = std::max<int64_t>(group, 1);
  const int64_t most = std::clamp<int64_t>(kPairTileRows / g, kTileMaxTokens, kPairTileRows);
  const int64_t rows = kPairScoreBytes / (2 * std::max<int64_t>(context, 1));
  return std::clamp<int64_t>(rows / g, 1, most);
}

inline __m512bh as_bh(__m512i x) { return reinterpret_cast<__m512bh>(x); }

// One pair of bf16 read from the pool as 32 bits (memcpy: no aliasing of the bf16 storage).
inline int32_t load_pair(const uint32_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Two rows of sixteen bf16 (or one and zeros) as sixteen (a, b) pairs.
inline __m512i pair16(__m256i a, __m256i b) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(a), _mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline __m256i bits16(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }

// s16[i][16j..] = round(round(K[key_i] . Q[16j..]) * scale) for NK keys and
// J vectors of rows, stored as the bf16 they are (the second rounding's
// instruction gives the bits); qp: [P][rp] pairs of dims, krow[i]: the key's
// P pairs, s16 rows rp apart. Inlined, its epilogue unrolled: outlined, the
// compiler kept the accumulators on the stack.
template <int NK, int J>
[[gnu::always_inline]] inline void pair_scores(const uint32_t* __restrict qp, int64_t rp,
                                                 const uint32_t* const* krow, int64_t pairs,
                                                 uint16_t* __restrict s16, float scale) {
  __m512 acc[NK][J];
#pragma GCC unroll 32
  for (int i = 0; i < NK; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    __m512i qv[J];
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j) qv[j] = _mm512_loadu_si512(qp + p * rp + 16 * j);
#pragma GCC unroll 6
    for (int i = 0; i < NK; ++i) {
      const __m512bh kd = as_bh(_mm512_set1_epi32(load_pair(krow[i] + p)));
#pragma GCC unroll 4
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(qv[j]), kd);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
#pragma GCC unroll 6
  for (int i = 0; i < NK; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < J; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(s16 + i * rp + 16 * j),
                          bits16(_mm512_mul_ps(round_bf16x16(acc[i][j]), sc)));
}

// NK keys against every row vector, four vectors at a time.
template <int NK>
inline void pair_scores_keys(const uint32_t* qp, int64_t rp, const uint32_t* const* krow, int64_t pairs,
                               uint16_t* s16, float scale) {
  const int64_t nv = rp / 16;
  int64_t j = 0;
  for (; j + 4 <= nv; j += 4) pair_scores<NK, 4>(qp + 16 * j, rp, krow, pairs, s16 + 16 * j, scale);
  switch (nv - j) {
    case 3: return pair_scores<NK, 3>(qp + 16 * j, rp, krow, pairs, s16 + 16 * j, scale);
    case 2: return pair_scores<NK, 2>(qp + 16 * j, rp, krow, pairs, s16 + 16 * j, scale);
    case 1: return pair_scores<NK, 1>(qp + 16 * j, rp, krow, pairs, s16 + 16 * j, scale);
    default: return;
  }
}

// The scores of keys [k0, k1) (k0 a multiple of the block size) into ss
// [L][rp], block by block of the table, six keys a step (6 + 6 + 4 for
// 16-key blocks; across blocks, as the fp32 scores go, was level or slower
// here), K read in place as pairs of dims. The next block's K rows
// (up to the context's L keys) are prefetched while a block is scored: the
// blocks lie anywhere in the pool, and the rows of a long context come from
// L3 or memory (2,048 x 20,000, 8 heads over 2: 5-10 % off a call).
template <int C>
inline void pair_scores_range(const TileJob<c10::BFloat16>& jb, const uint32_t* qp, int64_t rp, int64_t k0,
                                int64_t k1, int64_t L, uint16_t* ss) {
  using T = c10::BFloat16;
  constexpr int64_t D = 16 * C, P = D / 2;
  const int64_t BS = jb.block_size;
  const uint32_t* krow[6];
  for (int64_t b = k0 / BS; b * BS < k1; ++b) {
    const T* kp = jb.k + static_cast<int64_t>(jb.table[b]) * jb.k_s0 + jb.kvh * jb.k_s2;
    const int64_t n = std::min<int64_t>(BS, k1 - b * BS);
    auto kr = [&](int64_t t) { return reinterpret_cast<const uint32_t*>(kp + t * jb.k_s1); };
    uint16_t* sb = ss + b * BS * rp;
    if ((b + 1) * BS < L) {
      const char* nk = reinterpret_cast<const char*>(jb.k + static_cast<int64_t>(jb.table[b + 1]) * jb.k_s0 +
                                                     jb.kvh * jb.k_s2);
      for (int64_t t2 = 0; t2 < BS; ++t2)
        for (int64_t o = 0; o < 2 * D; o += 64) _mm_prefetch(nk + 2 * t2 * jb.k_s1 + o, _MM_HINT_T0);
    }
    int64_t t = 0;
    for (; t + 6 <= n; t += 6) {
      for (int i = 0; i < 6; ++i) krow[i] = kr(t + i);
      pair_scores_keys<6>(qp, rp, krow, P, sb + t * rp, jb.scale);
    }
    for (int i = 0; i < n - t; ++i) krow[i] = kr(t + i);
    uint16_t* s = sb + t * rp;
    switch (n - t) {
      case 5: pair_scores_keys<5>(qp, rp, krow, P, s, jb.scale); break;
      case 4: pair_scores_keys<4>(qp, rp, krow, P, s, jb.scale); break;
      case 3: pair_scores_keys<3>(qp, rp, krow, P, s, jb.scale); break;
      case 2: pair_scores_keys<2>(qp, rp, krow, P, s, jb.scale); break;
      case 1: pair_scores_keys<1>(qp, rp, krow, P, s, jb.scale); break;
      default: break;
    }
  }
}

// exp(x) for x <= 0 (a kept score minus its row's maximum) as 2^(x log2 e):
// 8 multiplies, multiply-adds and scalefs where vexp16_fma_nonpos takes 11, and
// each exp is computed twice (a sum in pass 1, a probability in pass 2).
// The product x log2 e rounds once more: up to ~|x| ulp off exp(x) where
// vexp16_fma's polynomial is within one or two, so a probability of exp(-10)
// of its row's maximum may land on the other side of its bf16 rounding. On
// random-weight shapes 99.915 % of outputs still equal eager bf16
// attention's (99.935 % with exp's polynomial); whole calls took 0.87-0.93 of
// the time (docs/kernels.md).
inline __m512 pair_exp(__m512 x) { return vexp2_16_nonpos(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e))); }

// Sixteen kept bf16 scores as fp32.
inline __m512 load_s16(const uint16_t* p) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// tile_mask on kept bf16 scores: -inf past each row's position.
inline void mask_s16(uint16_t* ss, int64_t rp, const int32_t* pos, int64_t pos0, int64_t k0, int64_t k1) {
  const __m256i ninf = _mm256_set1_epi16(static_cast<int16_t>(0xff80));
  for (int64_t key = std::max(pos0 + 1, k0); key < k1; ++key)
    for (int64_t j = 0; j < rp / 16; ++j) {
      const __mmask16 past = _mm512_cmplt_epi32_mask(_mm512_loadu_si512(pos + 16 * j),
                                                     _mm512_set1_epi32(static_cast<int32_t>(key)));
      __m256i* s = reinterpret_cast<__m256i*>(ss + key * rp + 16 * j);
      _mm256_storeu_si256(s, _mm256_mask_mov_epi16(_mm256_loadu_si256(s), past, ninf));
    }
}

// The first pass's softmax over keys [k0, k1) of ss: each row's maximum mx
// and sum of exps kept up (a raised maximum scales the sum so far by
// exp(m - m')); the exps themselves are not kept (the second pass computes
// them again, against the final maximum), up to kTileExpVectors row vectors
// a pass.
inline void pair_sums(const uint16_t* ss, int64_t rp, int64_t k0, int64_t k1, float* mx, float* sum) {
  for (int64_t j0 = 0; j0 < rp / 16; j0 += kTileExpVectors) {
    const int64_t nv = std::min<int64_t>(kTileExpVectors, rp / 16 - j0);
    __m512 m[kTileExpVectors], s[kTileExpVectors];
    for (int64_t j = 0; j < nv; ++j) {
      m[j] = _mm512_loadu_ps(mx + 16 * (j0 + j));
      s[j] = _mm512_setzero_ps();
    }
    for (int64_t key = k0; key < k1; ++key)
      for (int64_t j = 0; j < nv; ++j) m[j] = _mm512_max_ps(m[j], load_s16(ss + key * rp + 16 * (j0 + j)));
    for (int64_t key = k0; key < k1; ++key)
      for (int64_t j = 0; j < nv; ++j) {
        const __m512 x = _mm512_sub_ps(load_s16(ss + key * rp + 16 * (j0 + j)), m[j]);
        s[j] = _mm512_add_ps(s[j], pair_exp(x));
      }
    for (int64_t j = 0; j < nv; ++j) online_step(mx + 16 * (j0 + j), sum + 16 * (j0 + j), m[j], s[j]);
  }
}

// o[r] (+)= sum over key pairs [0, n_pairs) of P[pair][r0 + r] . V[pair]
// for RR rows: from zero, or with onto, onto the fp32 sums o[r] holds (a
// tile's later key blocks); pp: [pairs][rp] probability pairs, vp:
// [pairs][D] value pairs.
template <int C, int RR>
inline void pair_values(const uint32_t* __restrict vp, const uint32_t* __restrict pp, int64_t rp, int64_t r0,
                        int64_t n_pairs, float* const* orow, bool onto = false) {
  constexpr int64_t D = 16 * C;
  __m512 acc[RR][C];
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = onto ? _mm512_loadu_ps(orow[r] + 16 * c) : _mm512_setzero_ps();
  for (int64_t m = 0; m < n_pairs; ++m) {
    __m512i vv[C];
    for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_si512(vp + m * D + 16 * c);
    const uint32_t* p = pp + m * rp + r0;
    for (int r = 0; r < RR; ++r) {
      const __m512bh pr = as_bh(_mm512_set1_epi32(static_cast<int>(p[r])));
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(vv[c]), pr);
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(orow[r] + 16 * c, acc[r][c]);
}

template <int C, int RR>
inline void pair_values_rest(int rest, const uint32_t* vp, const uint32_t* pp, int64_t rp, int64_t r0,
                             int64_t n_pairs, float* const* orow, bool onto = false) {
  if constexpr (RR > 0) {
    if (rest == RR) return pair_values<C, RR>(vp, pp, rp, r0, n_pairs, orow, onto);
    return pair_values_rest<C, RR - 1>(rest, vp, pp, rp, r0, n_pairs, orow, onto);
  }
}

// V of the keys [k0, k0 + 2 LP) as pairs of keys, vp [LP][D]: pair m holds
// keys k0 + 2m and k0 + 2m + 1 (zeros for keys from `end`: LP may pad past
// the context, or past a tile's key block).
template <int C>
inline void tile_value_pairs(const TileJob<c10::BFloat16>& jb, TileScratch& sc, int64_t k0, int64_t end, int64_t LP) {
  using T = c10::BFloat16;
  constexpr int64_t D = 16 * C;
  if (static_cast<int64_t>(sc.vp.size()) < LP * D) sc.vp.resize(LP * D);
  const int64_t BS = jb.block_size;
  auto v_row = [&](int64_t key) -> const T* {
    if (key >= end) return nullptr;
    return jb.v + static_cast<int64_t>(jb.table[key / BS]) * jb.v_s0 + (key % BS) * jb.v_s1 + jb.kvh * jb.v_s2;
  };
  uint32_t* vp = sc.vp.data();
  for (int64_t m = 0; m < LP; ++m) {
    const T* v0 = v_row(k0 + 2 * m);
    const T* v1 = v_row(k0 + 2 * m + 1);
    for (int c = 0; c < C; ++c) {
      const __m256i a = v0 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v0 + 16 * c)) : _mm256_setzero_si256();
      const __m256i b = v1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v1 + 16 * c)) : _mm256_setzero_si256();
      _mm512_storeu_si512(vp + m * D + 16 * c, pair16(a, b));
    }
  }
}

// The tile's rows (tile_rows) and their queries as pairs of dims, qp
// [D/2][rp]: 16 rows x 16 pairs a register transpose; padding rows zero.
template <int C>
inline void tile_query_pairs(const TileJob<c10::BFloat16>& jb, TileScratch& sc, int64_t R, int64_t rp, int64_t L) {
  using T = c10::BFloat16;
  constexpr int64_t P = 8 * C;
  if (static_cast<int64_t>(sc.qp.size()) < P * rp) sc.qp.resize(P * rp);
  tile_rows(jb, sc, R, rp, L);
  uint32_t* qp = sc.qp.data();
  for (int64_t j = 0; j < rp / 16; ++j)
    for (int64_t p0 = 0; p0 < P; p0 += 16) {
      const int64_t np = std::min<int64_t>(16, P - p0);
      const __mmask16 m = static_cast<__mmask16>((1u << np) - 1);
      __m512 blk[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t r = 16 * j + i;
        blk[i] = r < R ? _mm512_castsi512_ps(_mm512_maskz_loadu_epi32(
                             m, static_cast<const T*>(sc.rows[r]) + 2 * p0))
                       : _mm512_setzero_ps();
      }
      transpose16(blk);
      for (int i = 0; i < np; ++i) _mm512_storeu_ps(reinterpret_cast<float*>(qp + (p0 + i) * rp + 16 * j), blk[i]);
    }
}

// One bf16 tile (the comment at the top), D = 16 * C. Row r is token r / group,
// query head kvh * group + r % group.
template <int C>
void attend_tile_pairs(const TileJob<c10::BFloat16>& jb, TileScratch& sc) {
  using T = c10::BFloat16;
  constexpr int64_t D = 16 * C;
  const int64_t G = jb.group, R = jb.count * G, rp = (R + 15) / 16 * 16, L = jb.pos0 + jb.count;
  const int64_t BS = jb.block_size, KB = std::max<int64_t>(1, kPairKeys / BS) * BS, KP = (KB + 1) / 2;
  if (static_cast<int64_t>(sc.pp.size()) < KP * rp) sc.pp.resize(KP * rp);
  if (static_cast<int64_t>(sc.ss.size()) < L * rp) sc.ss.resize(L * rp);
  if (static_cast<int64_t>(sc.run.size()) < 2 * rp) sc.run.resize(2 * rp);
  if (static_cast<int64_t>(sc.of.size()) < R * D) sc.of.resize(R * D);
  uint16_t* ss = sc.ss.data();
  float* mx = sc.run.data();
  float* sum = mx + rp;
  std::fill(mx, mx + rp, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + rp, 0.f);
  tile_query_pairs<C>(jb, sc, R, rp, L);
  const uint32_t* qp = sc.qp.data();

  // Pass 1: scores (rounded, masked) kept as bf16; maximum and sum online.
  for (int64_t k0 = 0; k0 < L; k0 += KB) {
    const int64_t k1 = std::min(L, k0 + KB);
    pair_scores_range<C>(jb, qp, rp, k0, k1, L, ss);
    mask_s16(ss, rp, sc.pos.data(), jb.pos0, k0, k1);
    pair_sums(ss, rp, k0, k1, mx, sum);
  }
  for (int64_t j = 0; j < rp / 16; ++j)  // sum <- 1 / sum
    _mm512_storeu_ps(sum + 16 * j, _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(sum + 16 * j)));

  // Pass 2: probabilities exp(s - max) * (1 / sum) rounded to bf16, as
  // pairs of keys, against the block's V as pairs; the value sums stay fp32
  // across blocks and are rounded once. Two keys' sixteen rows are rounded by
  // one conversion into [key's sixteen, next key's sixteen], then
  // interleaved into sixteen pairs.
  const __m512i pairs_idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                             23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  auto prob = [&](int64_t key, int64_t j) {
    const __m512 s = _mm512_sub_ps(load_s16(ss + key * rp + 16 * j), _mm512_loadu_ps(mx + 16 * j));
    return _mm512_mul_ps(pair_exp(s), _mm512_loadu_ps(sum + 16 * j));
  };
  constexpr int RR = tile_value_rows<C>();
  float* orow[RR];
  uint32_t* pp = sc.pp.data();
  for (int64_t k0 = 0; k0 < L; k0 += KB) {
    const int64_t k1 = std::min(L, k0 + KB), np = (k1 - k0 + 1) / 2;
    tile_value_pairs<C>(jb, sc, k0, k1, np);
    for (int64_t m = 0; m < np; ++m) {
      const int64_t key = k0 + 2 * m;
      for (int64_t j = 0; j < rp / 16; ++j) {
        const __m512 a = prob(key, j), b = key + 1 < k1 ? prob(key + 1, j) : _mm512_setzero_ps();
        const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));
        _mm512_storeu_si512(pp + m * rp + 16 * j, _mm512_permutexvar_epi16(pairs_idx, both));
      }
    }
    // RR rows a step, up to the step's last row's position; every row sees
    // key 0, so from the second block on the sums are added onto.
    for (int64_t r0 = 0; r0 < R; r0 += RR) {
      const int rr = static_cast<int>(std::min<int64_t>(RR, R - r0));
      const int64_t n_keys = jb.pos0 + (r0 + rr - 1) / G + 1;
      if (k0 >= n_keys) continue;
      for (int i = 0; i < rr; ++i) orow[i] = sc.of.data() + (r0 + i) * D;
      pair_values_rest<C, RR>(rr, sc.vp.data(), pp, rp, r0, (std::min(n_keys, k1) - k0 + 1) / 2, orow, k0 > 0);
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // the output rounded once (c10: to nearest even)
    T* dst = jb.out + (jb.q0 + r / G) * jb.o_s0 + (jb.kvh * G + r % G) * jb.o_s1;
    const float* o = sc.of.data() + r * D;
    for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<T>(o[e]);
  }
}
}  // namespace kvpager
#endif
