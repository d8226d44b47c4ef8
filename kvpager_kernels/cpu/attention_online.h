// fp32 prefill tiles with an online softmax: a long context in key blocks.
//
// attention_tiles.h's tile writes its rows' scores for the whole context,
// then masks, exponentiates, normalises and reads them back in passes. Past
// a few MiB of scores (L x rows floats: 16,384 keys x 64 rows is 4 MiB, twice
// a core's L2 on the Zen 5 EPYC) those passes go to L3, and tile_tokens
// shrinks the tile to stay under 4 MiB, so each tile re-reads the context's
// K/V for fewer rows. Here the context goes by in blocks of kOnlineKeys keys,
// each block's scores staying in L1/L2 from their products to their value
// sums:
//   scores   S[key][row] = (K[key] . Q[row]) * scale     (tile_scores_range)
//   mask     -inf past the row's position                 (tile_mask)
//   maximum  m'[row] = max(m[row], max over the block's keys)
//   exps     S[key][row] = exp(S - m'), l[row] = l * exp(m - m') + their sum
//   values   O[row] = O * exp(m - m') + sum_key S[key][row] * V[key]
// and once, after the last block, O[row] *= 1 / l[row]. The scores carry
// log2(e) in their scale and the exps are 2^(s - m') (vexp2_16_nonpos: 7
// multiplies, multiply-adds and scalefs where the one-pass tile's exp takes
// 11; whole calls 0.95-0.97 of the time), against a maximum over fewer keys;
// each raise of the maximum scales the sums so far by exp(m - m') (exactly 1
// where it did not rise), and the output is normalised once rather than every
// probability: outputs agree with the one-pass tile and the per-token walk to
// a few ulp (tests/kernels/test_kernels_cpu_tiles.py).
//
// A tile's rows no longer bound its scores, so it holds about 512 rows at any
// context (online_tile_tokens): 512 x 16,384 with 8 heads over 8 kv heads
// took 72.8 ms at 128 tokens a tile against 192.6 at 16, and ~512 rows took
// three quarters of ~128's time at 20,000 keys. Below
// online_min_keys (the kernel's argument, cpu_attention.ONLINE_MIN_KEYS:
// 8,192) the one-pass tile stays: its scores fit L2 there and the
// online tile's per-block work (a rescale of every row's sums, a maximum and
// its exp per block) made it 10-25 % slower at 128-256 keys and level at 8,192
// (docs/kernels.md).
//
// bf16 takes no online softmax: transformers' eager attention rounds each
// probability (normalised) to bf16, and an online softmax has no sum to
// normalise by until the last block. Its pair tiles (attention_pairs.h) go
// over the context twice in key blocks instead.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_tiles.h"
#include "vec.h"

namespace kvpager {

// Keys a block (rounded down to a multiple of the pool's block size, at
// least one block): 256 keys x 512 rows of scores is 512 KiB, in a core's
// L2 with the tile's QT (128 KiB) and the block's K/V rows. At ~128 rows 64
// to 256 ran within a few % of each other and 16 and 32 were 10-30 %
// slower (each block rescales every row's sums); at 512 rows 256 keys took
// 0.95-0.97 of 128's time (docs/kernels.md).
constexpr int64_t kOnlineKeys = 256;

// Query tokens per online tile: about kOnlineRows rows (tokens x the GQA
// group), 16 to 512 tokens. The tile reads the whole context's K/V once, so
// its rows are how often a K/V row loaded from L3 is used: 2,048 x 20,000
// (8 and 14 query heads over 2, 8 over 8) took 0.72-0.76 of the time at
// ~512 rows that it took at ~128 (0.81-0.83 at 256; 1,024 level with 512).
constexpr int64_t kOnlineRows = 512;
inline int64_t online_tile_tokens(int64_t group) {
  return std::clamp<int64_t>(kOnlineRows / std::max<int64_t>(group, 1), kTileMaxTokens, kOnlineRows);
}

// Block's scores st [n][rp] of keys [k0, k0 + n) turned into exp(s - m'),
// per row vector: mx (the running maximum), sum (the running sum of exps)
// and alpha (exp(m - m'), the factor for the value sums so far; 1 where the
// maximum did not rise) updated, up to kTileExpVectors vectors a pass
// (tile_exps_core).
inline void online_exps(float* st, int64_t rp, int64_t n, float* mx, float* sum, float* alpha,
                        const float* bmax = nullptr) {
  for (int64_t j0 = 0; j0 < rp / 16; j0 += kTileExpVectors) {
    const int64_t nv = std::min<int64_t>(kTileExpVectors, rp / 16 - j0);
    __m512 m[kTileExpVectors], s[kTileExpVectors];
    for (int64_t j = 0; j < nv; ++j) {
      m[j] = _mm512_loadu_ps(mx + 16 * (j0 + j));
      if (bmax) m[j] = _mm512_max_ps(m[j], _mm512_loadu_ps(bmax + 16 * (j0 + j)));
    }
    tile_exps_core<true>(st, rp, j0, nv, n, m, s, bmax ? n : 0);  // with bmax, no max pass
    for (int64_t j = 0; j < nv; ++j)
      _mm512_storeu_ps(alpha + 16 * (j0 + j), online_step<true>(mx + 16 * (j0 + j), sum + 16 * (j0 + j), m[j], s[j]));
  }
}

// The K and V rows of keys [k0, k1) of one kv head asked into L2: the next
// key block's, while this one is computed. Its blocks lie anywhere in the
// pool and a long context's rows come from L3 or memory: whole calls at
// 2,048 x 20,000 took 0.86-0.87 of the time, 512 x 16,384 0.92-0.95 (8 and
// 14 heads over 2, Zen 5 EPYC, medians of 5; docs/kernels.md). The bf16 pair
// tiles' value pass gained nothing from it (0.96-1.04).
template <int C>
inline void prefetch_rows_l2(const TileJob<float>& jb, int64_t k0, int64_t k1) {
  constexpr int64_t D = 16 * C;
  const int64_t BS = jb.block_size;
  for (int64_t b = k0 / BS; b * BS < k1; ++b) {
    const float* kb = jb.k + static_cast<int64_t>(jb.table[b]) * jb.k_s0 + jb.kvh * jb.k_s2;
    const float* vb = jb.v + static_cast<int64_t>(jb.table[b]) * jb.v_s0 + jb.kvh * jb.v_s2;
    for (int64_t t = std::max<int64_t>(0, k0 - b * BS); t < BS && b * BS + t < k1; ++t)
      for (int64_t o = 0; o < D; o += 16) {  // a 64-byte line a step
        _mm_prefetch(reinterpret_cast<const char*>(kb + t * jb.k_s1 + o), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vb + t * jb.v_s1 + o), _MM_HINT_T1);
      }
  }
}

// One fp32 tile, D = 16 * C: attend_tile's rows, in key blocks.
template <int C>
void attend_tile_online(const TileJob<float>& jb, TileScratch& sc) {
  constexpr int64_t D = 16 * C;
  const int64_t G = jb.group, R = jb.count * G, rp = (R + 15) / 16 * 16, L = jb.pos0 + jb.count;
  const int64_t BS = jb.block_size, KB = std::max<int64_t>(1, kOnlineKeys / BS) * BS;
  if (static_cast<int64_t>(sc.st.size()) < KB * rp) sc.st.resize(KB * rp);
  if (static_cast<int64_t>(sc.run.size()) < 4 * rp) sc.run.resize(4 * rp);
  float* st = sc.st.data();
  float* mx = sc.run.data();
  float* sum = mx + rp;
  float* alpha = sum + rp;
  float* bmax = alpha + rp;
  std::fill(mx, mx + rp, -std::numeric_limits<float>::infinity());
  std::fill(sum, sum + rp, 0.f);
  tile_rows(jb, sc, R, rp, L);
  tile_query_t<C, float>(sc, R, rp);

  constexpr int RR = tile_value_rows<C>();
  const ValueRows<float> vrows{nullptr, D};
  float* orow[RR];
  auto out_row = [&](int64_t r) { return jb.out + (jb.q0 + r / G) * jb.o_s0 + (jb.kvh * G + r % G) * jb.o_s1; };
  for (int64_t k0 = 0; k0 < L; k0 += KB) {
    const int64_t k1 = std::min(L, k0 + KB);
    if (k1 < L) prefetch_rows_l2<C>(jb, k1, std::min(L, k1 + KB));
    if (k1 <= jb.pos0 + 1) {  // every row sees every key of the block: its maximum kept as scored
      std::fill(bmax, bmax + rp, -std::numeric_limits<float>::infinity());
      tile_scores_range<C, float, true>(jb, sc, rp, k0, k1, st, bmax);
      online_exps(st, rp, k1 - k0, mx, sum, alpha, bmax);
    } else {
      tile_scores_range<C, float, true>(jb, sc, rp, k0, k1, st);
      tile_mask(st, rp, sc.pos.data(), jb.pos0, k0, k1);
      online_exps(st, rp, k1 - k0, mx, sum, alpha);
    }
    // Values, RR rows a step, up to the step's last row's position. A row
    // group whose keys all lie before k0 is skipped: its exps here are 0 and
    // its maximum did not rise (alpha 1).
    for (int64_t r0 = 0; r0 < R; r0 += RR) {
      const int rr = static_cast<int>(std::min<int64_t>(RR, R - r0));
      const int64_t n_keys = jb.pos0 + (r0 + rr - 1) / G + 1;
      if (k0 >= n_keys) continue;
      for (int i = 0; i < rr; ++i) orow[i] = out_row(r0 + i);
      tile_values_rest<C, RR>(rr, jb, vrows, st, rp, r0, k0, std::min(n_keys, k1), orow, k0, alpha);
    }
  }
  for (int64_t r = 0; r < R; ++r) {  // normalised once
    float* o = out_row(r);
    const __m512 inv = _mm512_set1_ps(1.f / sum[r]);
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), inv));
  }
}

}  // namespace kvpager
#endif
