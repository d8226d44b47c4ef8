// Prefill attention in tiles (fp32 and bf16, AVX-512): many query tokens of
// one sequence against one kv head at once, as small matrix products.
//
// The per-token walk in paged_attention.cpp computes each query's scores as
// dot products (a 16-lane multiply-add chain and a transpose-and-add
// reduction per key) and re-reads the context's K/V once per token. For a
// prompt that is most of a prefill's attention. Here a tile's query rows
// (tokens x the GQA group's heads, up to 16 x 7 = 112 at the 0.5B Llama's
// shapes) are laid out transposed once, QT [D][rows], so a key's scores for
// 16 rows are one register of fused multiply-adds, and each K and V row
// loaded serves every row of the tile:
//   scores   ST[key][row] = (K[key] . Q[row]) * scale   6 keys x 64 rows a step
//   mask     ST[key][row] = -inf past the row's position (causal)
//   softmax  down the keys, 16 rows a vector (max, exp, sum, * 1/sum)
//   values   O[row] = sum_key ST[key][row] * V[key]     up to 6 rows x D a step
// The softmax and the value sums are the per-token walk's arithmetic
// (probabilities scaled by 1/sum, values summed key by key; fp32 scales the
// value sums by 1/sum instead, once a row) but for the exp, vexp16's
// polynomial with its multiply-adds fused (vexp16_fma, within an ulp or two:
// 10-12 % off a tile's time against vexp16; the fp32 online tiles score in
// base 2 and take 2^x, attention_online.h, and the bf16 pair tiles
// 2^(x log2 e), attention_pairs.h); the scores differ in summation order
// (along D in one chain, not in 16 lanes reduced by a tree), so outputs
// agree to a few ulp.
//
// bf16 (T = c10::BFloat16): the same tiles in fp32 (K rows converted a block
// at a time, V once a tile), rounded where the walk rounds, which is where
// transformers' eager attention rounds: q.k to bf16, times the scale to bf16,
// the softmax's probabilities to bf16, the output once. Where the CPU has
// AVX512-BF16, bf16 tiles run on its pair dot product instead
// (attention_pairs.h: operands in bf16, the same rounding points), and on
// AMX where there is one (attention_amx.h).
//
// On the 0.5B Llama's shapes (a 4,544-token prefill of 32 prompts, one
// layer, 2 threads on the AVX-512 EPYC) the attention took 28 ms walked per
// token and ~18 ms in tiles (docs/benchmarks.md).
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>

#include "vec.h"

namespace kvpager {

// Rows' scores kept for one tile: at most this many bytes (the tile shrinks
// as the context grows). Fewer rows a tile read the context's K/V more
// often: at 1 MiB a 32,768-token context left 2 tokens a tile and bf16 ran
// 1,024 x 32,768 in 790 ms; at 4 MiB (8 tokens) in 340 ms; 8 MiB was no
// faster (Zen 5 EPYC, 2 threads; docs/kernels.md).
constexpr int64_t kTileScoreBytes = 1 << 22;
constexpr int64_t kTileMaxTokens = 16;

// Rows a tile may hold at small GQA groups: kTileMaxTokens tokens of one
// query head a kv head are 16 rows, one vector, whose scores load a K
// element for every multiply-add.
constexpr int64_t kTileMaxRows = 64;

// Query tokens per tile for a sequence attending `context` keys with
// `group` query heads per kv head.
inline int64_t tile_tokens(int64_t group, int64_t context) {
  const int64_t rows = kTileScoreBytes / (4 * std::max<int64_t>(context, 1));
  const int64_t g = std::max<int64_t>(group, 1);
  return std::clamp<int64_t>(rows / g, 1, std::max(kTileMaxTokens, kTileMaxRows / g));
}

// Sixteen fp32 rounded to bf16, as fp32: vec.h's one-instruction form where
// the CPU has AVX512-BF16 (it flushes subnormal results to zero, where c10
// keeps them: a score or probability under 1e-38 weighs nothing in a sum of
// values), else its integer form.
inline __m512 round_bf16x16(__m512 x) { return bf16x16_round_fast(x); }

// Sixteen elements as fp32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// n rows of D elements, `stride` apart, as contiguous fp32 rows in `dst`.
template <int C, typename T>
inline void rows_f32(const T* src, int64_t stride, int64_t n, float* dst) {
  for (int64_t t = 0; t < n; ++t)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(dst + t * 16 * C + 16 * c, load16(src + t * stride + 16 * c));
}

// Scratch rows start on a cache line: a row of 16 floats is then one line,
// where malloc's 16-byte alignment split every vector load across two.
template <typename T>
struct LineAlloc {
  using value_type = T;
  LineAlloc() = default;
  template <typename U>
  LineAlloc(const LineAlloc<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64))); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const LineAlloc<U>&) const { return true; }
};
template <typename T>
using LineVec = std::vector<T, LineAlloc<T>>;

struct TileScratch {
  LineVec<float> qt, st;       // QT [D][rp], ST [L][rp]
  LineVec<float> kf, vf, of;   // bf16 only: K of a block [BS][D], V [L][D], out rows [RR][D]
  LineVec<uint32_t> qp, pp, vp;  // bf16 pairs: Q [D/2][rp], P [keys/2][rp], V [keys/2][D] (a key block's)
  LineVec<uint16_t> kt, pt;      // bf16 on AMX (attention_amx.h): K rows [16][D], P [rp][L]
  LineVec<float> run;          // online fp32 tiles: max, sum, alpha, a block's max [4][rp]; pair tiles: max, 1/sum [2][rp]
  LineVec<uint16_t> ss;        // pair tiles (attention_pairs.h): the context's scores as bf16 [L][rp]
  std::vector<int32_t> pos;        // [rp] each row's position (padding: the last row's)
  std::vector<const void*> rows;   // [R] each row's query vector (a const T*)
};

// One tile: the query tokens [0, count) at q rows q0 + t, positions pos0 + t,
// against kv head kvh of a sequence whose block table is `table`.
template <typename T>
struct TileJob {
  const T* q;
  int64_t q_s0, q_s1;
  const T* k;
  int64_t k_s0, k_s1, k_s2;
  const T* v;
  int64_t v_s0, v_s1, v_s2;
  T* out;
  int64_t o_s0, o_s1;
  const int32_t* table;
  int64_t block_size, group;
  int64_t q0, pos0, count, kvh;
  float scale;
  bool online;  // fp32: attention_online.h's tile (a long context)
};

// r[i][j] <- r[j][i]: sixteen rows of sixteen floats transposed in registers.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  for (int i = 0; i < 2; ++i)
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0x88);
      t[8 * i + 4 + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + 4 + j], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0x88);
    r[8 + j] = _mm512_shuffle_f32x4(t[j], t[8 + j], 0xDD);
  }
}

// Each row's query vector and position for a tile of R rows (rp padded).
template <typename T>
inline void tile_rows(const TileJob<T>& jb, TileScratch& sc, int64_t R, int64_t rp, int64_t L) {
  const int64_t G = jb.group;
  sc.pos.resize(rp);
  sc.rows.resize(R);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t t = r / G;
    sc.rows[r] = jb.q + (jb.q0 + t) * jb.q_s0 + (jb.kvh * G + r % G) * jb.q_s1;
    sc.pos[r] = static_cast<int32_t>(jb.pos0 + t);
  }
  for (int64_t r = R; r < rp; ++r) sc.pos[r] = static_cast<int32_t>(L - 1);  // padding sees real keys: no NaN
}

// Causal mask on the scores of keys [k0, k1), st [k1 - k0][rp] from key k0:
// only the tile's own later tokens (keys past pos0) lie past a row's position.
inline void tile_mask(float* st, int64_t rp, const int32_t* pos, int64_t pos0, int64_t k0, int64_t k1) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t key = std::max(pos0 + 1, k0); key < k1; ++key)
    for (int64_t j = 0; j < rp / 16; ++j) {
      const __m512i p = _mm512_loadu_si512(pos + 16 * j);
      const __mmask16 past = _mm512_cmplt_epi32_mask(p, _mm512_set1_epi32(static_cast<int32_t>(key)));
      float* s = st + (key - k0) * rp + 16 * j;
      _mm512_storeu_ps(s, _mm512_mask_mov_ps(_mm512_loadu_ps(s), past, ninf));
    }
}

// The exps of the row vectors [j0, j0 + nv) (nv <= kTileExpVectors) down n
// keys of st: m[j] (in: a maximum to start from) raised to the keys' max, the
// scores replaced by exp(score - m) in place, s[j] = each row's sum of them.
// The vectors share each pass, so a pass reads a key's line once, not once a
// vector, and their max and sum chains interleave.
constexpr int64_t kTileExpVectors = 16;
// m already holds the maximum of the keys before max_from (the scores
// kernel kept it), so the max pass reads only the keys from there.
// B2: the scores are base-2 (fp32 online tiles: tile_scores_range<..., true>
// put log2(e) in their scale), the exps 2^(score - m) (vexp2_16_nonpos);
// else exp.
template <bool B2 = false>
inline void tile_exps_core(float* st, int64_t rp, int64_t j0, int64_t nv, int64_t n, __m512* m, __m512* s,
                           int64_t max_from = 0) {
  for (int64_t j = 0; j < nv; ++j) s[j] = _mm512_setzero_ps();
  for (int64_t key = max_from; key < n; ++key)
    for (int64_t j = 0; j < nv; ++j) m[j] = _mm512_max_ps(m[j], _mm512_loadu_ps(st + key * rp + 16 * (j0 + j)));
  for (int64_t key = 0; key < n; ++key)
    for (int64_t j = 0; j < nv; ++j) {
      float* p = st + key * rp + 16 * (j0 + j);
      const __m512 x = _mm512_sub_ps(_mm512_loadu_ps(p), m[j]);  // <= 0: m is their max
      const __m512 e = B2 ? vexp2_16_nonpos(x) : vexp16_fma_nonpos(x);
      _mm512_storeu_ps(p, e);
      s[j] = _mm512_add_ps(s[j], e);
    }
}

// An online softmax's step for sixteen rows (the online and pair tiles):
// their running maximum at *mj raised to m (finite: a tile's first key block
// holds key 0, which every row sees), their running sum at *sj scaled by
// exp(m_old - m) (exactly 1 where the maximum did not rise) plus s, the
// block's sum of exps against m; returns that factor. B2: base-2 scores
// (the factor 2^(m_old - m)).
template <bool B2 = false>
inline __m512 online_step(float* mj, float* sj, __m512 m, __m512 s) {
  const __m512 m_old = _mm512_loadu_ps(mj);
  const __mmask16 rose = _mm512_cmp_ps_mask(m, m_old, _CMP_GT_OQ);
  const __m512 d = _mm512_sub_ps(m_old, m);  // < 0 where it rose (-inf from a first block's -inf)
  const __m512 a = _mm512_mask_mov_ps(_mm512_set1_ps(1.f), rose, B2 ? vexp2_16_nonpos(d) : vexp16_fma(d));
  _mm512_storeu_ps(mj, m);
  _mm512_storeu_ps(sj, _mm512_fmadd_ps(_mm512_loadu_ps(sj), a, s));
  return a;
}

// Softmax of the row vectors [j0, j0 + nv) down the L keys: their scores
// replaced by exp(score - max) in place; inv[j] = 1 / each row's sum of them.
// bmax: each row's maximum over the keys before max_from, kept as scored.
inline void tile_exps_n(float* st, int64_t rp, int64_t j0, int64_t nv, int64_t L, __m512* inv,
                        const float* bmax = nullptr, int64_t max_from = 0) {
  __m512 mx[kTileExpVectors], sum[kTileExpVectors];
  for (int64_t j = 0; j < nv; ++j)
    mx[j] = bmax ? _mm512_loadu_ps(bmax + 16 * (j0 + j)) : _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  tile_exps_core(st, rp, j0, nv, L, mx, sum, bmax ? max_from : 0);
  for (int64_t j = 0; j < nv; ++j) inv[j] = _mm512_div_ps(_mm512_set1_ps(1.f), sum[j]);
}

// The rows [16j, 16j + 16) alone; returns 1 / each row's sum.
inline __m512 tile_exps(float* st, int64_t rp, int64_t j, int64_t L) {
  __m512 inv;
  tile_exps_n(st, rp, j, 1, L, &inv);
  return inv;
}

// st[i][16j..] = (K[key_i] . QT[.][16j..]) * scale for NK keys and J vectors
// of rows (NK * J accumulators; 6 x 4 leaves room for the operands).
// R16: rounded as bf16 (the product, then the scaled score).
// With bmax (fp32), bmax[16j..] is raised to the stored scores' maximum.
template <int NK, int J, bool R16>
inline void tile_scores(const float* __restrict qt, int64_t rp, const float* const* krow, int64_t d_len,
                        float* __restrict st, float scale, float* __restrict bmax = nullptr) {
  __m512 acc[NK][J];
  for (int i = 0; i < NK; ++i)
    for (int j = 0; j < J; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < d_len; ++d) {
    __m512 qv[J];
    for (int j = 0; j < J; ++j) qv[j] = _mm512_loadu_ps(qt + d * rp + 16 * j);
    for (int i = 0; i < NK; ++i) {
      const __m512 kd = _mm512_set1_ps(krow[i][d]);
      for (int j = 0; j < J; ++j) acc[i][j] = _mm512_fmadd_ps(kd, qv[j], acc[i][j]);
    }
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int i = 0; i < NK; ++i)
    for (int j = 0; j < J; ++j) {
      if constexpr (R16) {
        _mm512_storeu_ps(st + i * rp + 16 * j, round_bf16x16(_mm512_mul_ps(round_bf16x16(acc[i][j]), sc)));
      } else {
        acc[i][j] = _mm512_mul_ps(acc[i][j], sc);
        _mm512_storeu_ps(st + i * rp + 16 * j, acc[i][j]);
      }
    }
  if constexpr (!R16)
    if (bmax)
      for (int j = 0; j < J; ++j) {
        __m512 m = _mm512_loadu_ps(bmax + 16 * j);
        for (int i = 0; i < NK; ++i) m = _mm512_max_ps(m, acc[i][j]);
        _mm512_storeu_ps(bmax + 16 * j, m);
      }
}

// NK keys against every row vector, four vectors at a time.
template <int NK, bool R16>
inline void tile_scores_keys(const float* qt, int64_t rp, const float* const* krow, int64_t d_len, float* st,
                             float scale, float* bmax = nullptr) {
  const int64_t nv = rp / 16;
  int64_t j = 0;
  auto bm = [&](int64_t jj) { return bmax ? bmax + 16 * jj : nullptr; };
  for (; j + 4 <= nv; j += 4) tile_scores<NK, 4, R16>(qt + 16 * j, rp, krow, d_len, st + 16 * j, scale, bm(j));
  switch (nv - j) {
    case 3: return tile_scores<NK, 3, R16>(qt + 16 * j, rp, krow, d_len, st + 16 * j, scale, bm(j));
    case 2: return tile_scores<NK, 2, R16>(qt + 16 * j, rp, krow, d_len, st + 16 * j, scale, bm(j));
    case 1: return tile_scores<NK, 1, R16>(qt + 16 * j, rp, krow, d_len, st + 16 * j, scale, bm(j));
    default: return;
  }
}

// The tile's queries transposed, qt [D][rp] (fp32; padding rows zero): 16
// rows x 16 dims a register transpose. Rows as tile_rows laid them out.
template <int C, typename T>
inline void tile_query_t(TileScratch& sc, int64_t R, int64_t rp) {
  constexpr int64_t D = 16 * C;
  if (static_cast<int64_t>(sc.qt.size()) < D * rp) sc.qt.resize(D * rp);
  float* qt = sc.qt.data();
  for (int64_t j = 0; j < rp / 16; ++j)
    for (int c = 0; c < C; ++c) {
      __m512 blk[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t r = 16 * j + i;
        blk[i] = r < R ? load16(static_cast<const T*>(sc.rows[r]) + 16 * c) : _mm512_setzero_ps();
      }
      transpose16(blk);
      for (int i = 0; i < 16; ++i) _mm512_storeu_ps(qt + (16 * c + i) * rp + 16 * j, blk[i]);
    }
}

// The fp32 K rows of one kv head, key after key along a block table,
// without a division per key (six keys a step straddle blocks). A block's
// table entry is read when its first key is asked for, never past the context.
struct KeyCursor {
  const float* head;  // the kv head's element 0 of pool block 0
  const int32_t* table;
  int64_t s0, s1, block_size, b, t;
  const float* base;  // block b's rows
  KeyCursor(const float* k, int64_t kvh_offset, const int32_t* tb, int64_t k_s0, int64_t k_s1, int64_t bs,
            int64_t key)
      : head(k + kvh_offset), table(tb), s0(k_s0), s1(k_s1), block_size(bs), b(key / bs), t(key % bs),
        base(head + static_cast<int64_t>(tb[key / bs]) * k_s0) {}
  const float* row() {
    if (t == block_size) {
      t = 0;
      base = head + static_cast<int64_t>(table[++b]) * s0;
    }
    return base + (t++) * s1;
  }
};

// Scores of NK keys (row pointers) against the tile's rows, NK < 6.
template <int C, bool R16>
inline void tile_scores_rest(int nk, const float* qt, int64_t rp, const float* const* krow, float* st, float scale,
                             float* bmax = nullptr) {
  constexpr int64_t D = 16 * C;
  switch (nk) {
    case 5: return tile_scores_keys<5, R16>(qt, rp, krow, D, st, scale, bmax);
    case 4: return tile_scores_keys<4, R16>(qt, rp, krow, D, st, scale, bmax);
    case 3: return tile_scores_keys<3, R16>(qt, rp, krow, D, st, scale, bmax);
    case 2: return tile_scores_keys<2, R16>(qt, rp, krow, D, st, scale, bmax);
    case 1: return tile_scores_keys<1, R16>(qt, rp, krow, D, st, scale, bmax);
    default: return;
  }
}

// Scores of the keys [k0, k1) (k0 a multiple of the block size) against the
// tile's queries (tile_query_t), st [k1 - k0][rp] from key k0, six keys a
// step. fp32 K is read in place, the six rows wherever the table puts them:
// a 16-key block split 6 + 6 + 4 ran the scores at ~75 % of the FMA rate,
// six keys across blocks at ~95 % (one thread, rows in L1/L2; docs/kernels.md).
// bf16: a block converted at a time (a 6 + 6 + 4 split of its rows).
// B2 (fp32): base-2 scores, log2(e) in the scale (tile_exps_core<true>).
template <int C, typename T, bool B2 = false>
inline void tile_scores_range(const TileJob<T>& jb, TileScratch& sc, int64_t rp, int64_t k0, int64_t k1, float* st,
                              float* bmax = nullptr) {
  constexpr int64_t D = 16 * C;
  constexpr bool R16 = std::is_same_v<T, c10::BFloat16>;
  const int64_t BS = jb.block_size;
  const float* qt = sc.qt.data();
  const float* krow[6];
  if constexpr (!R16) {
    const float scale2 = B2 ? jb.scale * kLog2e : jb.scale;
    KeyCursor kc(jb.k, jb.kvh * jb.k_s2, jb.table, jb.k_s0, jb.k_s1, BS, k0);
    int64_t key = k0;
    for (; key + 6 <= k1; key += 6) {
      for (int i = 0; i < 6; ++i) krow[i] = kc.row();
      tile_scores_keys<6, false>(qt, rp, krow, D, st + (key - k0) * rp, scale2, bmax);
    }
    for (int i = 0; key + i < k1; ++i) krow[i] = kc.row();
    tile_scores_rest<C, false>(static_cast<int>(k1 - key), qt, rp, krow, st + (key - k0) * rp, scale2, bmax);
  } else {
    if (static_cast<int64_t>(sc.kf.size()) < BS * D) sc.kf.resize(BS * D);
    for (int64_t b = k0 / BS; b * BS < k1; ++b) {
      const int64_t n = std::min<int64_t>(BS, k1 - b * BS);
      rows_f32<C>(jb.k + static_cast<int64_t>(jb.table[b]) * jb.k_s0 + jb.kvh * jb.k_s2, jb.k_s1, n, sc.kf.data());
      float* sb = st + (b * BS - k0) * rp;
      int64_t t = 0;
      for (; t + 6 <= n; t += 6) {
        for (int i = 0; i < 6; ++i) krow[i] = sc.kf.data() + (t + i) * D;
        tile_scores_keys<6, true>(qt, rp, krow, D, sb + t * rp, jb.scale);
      }
      for (int i = 0; i < n - t; ++i) krow[i] = sc.kf.data() + (t + i) * D;
      tile_scores_rest<C, true>(static_cast<int>(n - t), qt, rp, krow, sb + t * rp, jb.scale);
    }
  }
}

// Rows per value step: RR rows x C vectors of D in registers (at most 24).
template <int C>
constexpr int tile_value_rows() {
  return C >= 16 ? 1 : std::min(6, 24 / C);
}

// Where a tile reads its V rows as fp32: in the pool (fp32), or in the
// tile's converted copy (bf16: vf [L][D]).
template <typename T>
struct ValueRows {
  const float* vf;  // bf16 only
  int64_t d;
  const float* block(const TileJob<T>& jb, int64_t b) const {
    if constexpr (std::is_same_v<T, float>)
      return jb.v + static_cast<int64_t>(jb.table[b]) * jb.v_s0 + jb.kvh * jb.v_s2;
    else
      return vf + b * jb.block_size * d;
  }
  int64_t row_stride(const TileJob<T>& jb) const {
    if constexpr (std::is_same_v<T, float>)
      return jb.v_s1;
    else
      return d;
  }
};

// o[r] (+)= sum over keys [k0, k1) of st[key - kst][r0 + r] * V[key] for RR
// rows: from zero when k0 is 0, else onto the sums o[r] holds (fp32, stored
// and read back unrounded: the same sums in the same key order as one walk),
// each first scaled by alpha[r0 + r] where alpha is given (the online
// softmax's correction for a raised maximum).
template <int C, int RR, typename T>
inline void tile_values(const TileJob<T>& jb, const ValueRows<T>& vrows, const float* __restrict st, int64_t rp,
                        int64_t r0, int64_t k0, int64_t k1, float* const* orow, int64_t kst = 0,
                        const float* alpha = nullptr) {
  __m512 acc[RR][C];
  for (int r = 0; r < RR; ++r) {
    const __m512 a = alpha ? _mm512_set1_ps(alpha[r0 + r]) : _mm512_set1_ps(1.f);
    for (int c = 0; c < C; ++c) {
      if (k0 == 0)
        acc[r][c] = _mm512_setzero_ps();
      else
        acc[r][c] = alpha ? _mm512_mul_ps(_mm512_loadu_ps(orow[r] + 16 * c), a) : _mm512_loadu_ps(orow[r] + 16 * c);
    }
  }
  const int64_t BS = jb.block_size, vs1 = vrows.row_stride(jb);
  for (int64_t b = k0 / BS; b * BS < k1; ++b) {
    const float* vb = vrows.block(jb, b);
    const int64_t n = std::min<int64_t>(BS, k1 - b * BS);
    for (int64_t t = std::max<int64_t>(0, k0 - b * BS); t < n; ++t) {
      const float* vr = vb + t * vs1;
      const float* p = st + (b * BS + t - kst) * rp + r0;
      __m512 vv[C];
      for (int c = 0; c < C; ++c) vv[c] = _mm512_loadu_ps(vr + 16 * c);
      for (int r = 0; r < RR; ++r) {
        const __m512 pr = _mm512_set1_ps(p[r]);
        for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(pr, vv[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < RR; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(orow[r] + 16 * c, acc[r][c]);
}

template <int C, int RR, typename T>
inline void tile_values_rest(int rest, const TileJob<T>& jb, const ValueRows<T>& vrows, const float* st, int64_t rp,
                             int64_t r0, int64_t k0, int64_t k1, float* const* orow, int64_t kst = 0,
                             const float* alpha = nullptr) {
  if constexpr (RR > 0) {
    if (rest == RR) return tile_values<C, RR>(jb, vrows, st, rp, r0, k0, k1, orow, kst, alpha);
    return tile_values_rest<C, RR - 1>(rest, jb, vrows, st, rp, r0, k0, k1, orow, kst, alpha);
  }
}

// Keys a value pass reads before the next row group reads them: V rows and
// the probabilities of that many keys stay in L1/L2 across the row groups,
// where a pass over the whole context re-read both from L3 once a group
// (a 6,000-key context: 1.5 MB of V and 1.5 MB of probabilities).
constexpr int64_t kTileValueKeys = 256;

// Softmax down the L keys of every row vector: scores replaced by
// probabilities, exp(score - max) / sum (R16: rounded to bf16), up to
// kTileExpVectors vectors a pass; with inv_rows, exp(score - max) alone and
// inv_rows[r] = 1 / row r's sum (the caller scales the value sums).
template <bool R16>
inline void tile_softmax(float* st, int64_t rp, int64_t L, float* inv_rows = nullptr, const float* bmax = nullptr,
                         int64_t max_from = 0) {
  for (int64_t j0 = 0; j0 < rp / 16; j0 += kTileExpVectors) {
    const int64_t nv = std::min<int64_t>(kTileExpVectors, rp / 16 - j0);
    __m512 inv[kTileExpVectors];
    tile_exps_n(st, rp, j0, nv, L, inv, bmax, max_from);
    if (inv_rows) {
      for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(inv_rows + 16 * (j0 + j), inv[j]);
      continue;
    }
    for (int64_t key = 0; key < L; ++key)
      for (int64_t j = 0; j < nv; ++j) {
        float* s = st + key * rp + 16 * (j0 + j);
        const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(s), inv[j]);
        _mm512_storeu_ps(s, R16 ? round_bf16x16(p) : p);  // softmax(..., dtype=float32).to(T)
      }
  }
}

// One tile, D = 16 * C. Row r is token r / group, query head kvh * group + r % group.
template <int C, typename T>
void attend_tile(const TileJob<T>& jb, TileScratch& sc) {
  constexpr int64_t D = 16 * C;
  constexpr bool R16 = std::is_same_v<T, c10::BFloat16>;
  static_assert(R16 || std::is_same_v<T, float>, "tiles: fp32 or bf16");
  const int64_t G = jb.group, R = jb.count * G, rp = (R + 15) / 16 * 16, L = jb.pos0 + jb.count;
  if (static_cast<int64_t>(sc.st.size()) < L * rp) sc.st.resize(L * rp);
  tile_rows(jb, sc, R, rp, L);
  const int64_t BS = jb.block_size;
  ValueRows<T> vrows{nullptr, D};
  if constexpr (R16) {
    const int64_t nb = (L + BS - 1) / BS;
    if (static_cast<int64_t>(sc.vf.size()) < nb * BS * D) sc.vf.resize(nb * BS * D);
    for (int64_t b = 0; b < nb; ++b)
      rows_f32<C>(jb.v + static_cast<int64_t>(jb.table[b]) * jb.v_s0 + jb.kvh * jb.v_s2, jb.v_s1,
                  std::min<int64_t>(BS, L - b * BS), sc.vf.data() + b * BS * D);
    vrows.vf = sc.vf.data();
  }
  float* st = sc.st.data();
  tile_query_t<C, T>(sc, R, rp);
  // fp32: the keys every row sees (those up to pos0) keep their maximum as
  // they are scored, and the max pass reads only the tile's own keys.
  float* bmax = nullptr;
  const int64_t seen = R16 ? 0 : jb.pos0 + 1;
  if constexpr (!R16) {
    if (static_cast<int64_t>(sc.run.size()) < 2 * rp) sc.run.resize(2 * rp);
    bmax = sc.run.data() + rp;
    std::fill(bmax, bmax + rp, -std::numeric_limits<float>::infinity());
    tile_scores_range<C>(jb, sc, rp, 0, seen, st, bmax);
    if (seen < L) tile_scores_range<C>(jb, sc, rp, seen, L, st + seen * rp);  // a cursor at L would read past the table
  } else {
    tile_scores_range<C>(jb, sc, rp, 0, L, st);
  }

  tile_mask(st, rp, sc.pos.data(), jb.pos0, 0, L);
  // fp32: the exps stay unnormalised and each row's value sums are scaled by
  // 1 / its sum once (a pass over the scores less than normalising them:
  // 1,904 x 6,000 58.2-60.8 -> 55.8-56.7 ms). bf16 rounds the normalised
  // probabilities, as transformers' eager attention does.
  float* inv_rows = nullptr;
  if constexpr (!R16) inv_rows = sc.run.data();
  tile_softmax<R16>(st, rp, L, inv_rows, bmax, seen);

  // Values, RR rows a step; a step reads keys up to its last row's position,
  // kTileValueKeys of them for every row group before the next ones.
  constexpr int RR = tile_value_rows<C>();
  const int64_t KB = std::max<int64_t>(1, kTileValueKeys / BS) * BS;
  float* orow[RR];
  T* dst[RR];
  if constexpr (R16)
    if (static_cast<int64_t>(sc.of.size()) < R * D) sc.of.resize(R * D);  // every row's sums across key blocks
  for (int64_t k0 = 0; k0 < L; k0 += KB)
    for (int64_t r0 = 0; r0 < R; r0 += RR) {
      const int rr = static_cast<int>(std::min<int64_t>(RR, R - r0));
      const int64_t n_keys = jb.pos0 + (r0 + rr - 1) / G + 1;
      if (k0 >= n_keys) continue;
      for (int i = 0; i < rr; ++i) {
        const int64_t r = r0 + i;
        dst[i] = jb.out + (jb.q0 + r / G) * jb.o_s0 + (jb.kvh * G + r % G) * jb.o_s1;
        if constexpr (R16)
          orow[i] = sc.of.data() + r * D;
        else
          orow[i] = dst[i];
      }
      tile_values_rest<C, RR>(rr, jb, vrows, st, rp, r0, k0, std::min(n_keys, k0 + KB), orow);
      if (inv_rows && k0 + KB >= n_keys)  // the row's sums are whole: times 1 / its sum
        for (int i = 0; i < rr; ++i) {
          const __m512 iv = _mm512_set1_ps(inv_rows[r0 + i]);
          for (int c = 0; c < C; ++c)
            _mm512_storeu_ps(orow[i] + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(orow[i] + 16 * c), iv));
        }
      if constexpr (R16)  // the output rounded once, as the walk rounds it (c10: to nearest even)
        if (k0 + KB >= n_keys)
          for (int i = 0; i < rr; ++i)
            for (int64_t e = 0; e < D; ++e) dst[i][e] = static_cast<c10::BFloat16>(orow[i][e]);
    }
}

}  // namespace kvpager
#endif
