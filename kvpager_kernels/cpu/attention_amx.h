// bf16 prompt tiles on AMX (Intel Sapphire Rapids and later): the tile of
// attention_tiles.h (up to 16 tokens x the GQA group against one kv head's
// context) with its two products on the matrix unit, the rest unchanged.
//
// AVX512-BF16's pair dot product (attend_tile_pairs) spends most of a bf16
// tile's time in the score and value sums. AMX's TDPBF16PS multiplies a
// 16 x 32 bf16 tile by a 32 x 16 one (held as 16 rows of pairs) into 16 x 16
// fp32 sums in one instruction, with the same arithmetic as the pair dot
// product (bf16 products exact, sums in fp32), so the rounding points stay
// those of transformers' eager attention:
//   scores  S[key][row] = K[key] . Q[row]: A = 16 keys x 32 dims read from the
//           pool in place (one block's rows are evenly strided), B = the tile's
//           query rows as pairs of dims (the layout the pair kernel builds)
//   then    S rounded to bf16, times the scale, rounded again; causal mask;
//           softmax down the keys (exps in fp32), probabilities to bf16
//   values  O[row] = P[row] . V: A = 16 rows x 32 keys of probabilities (the
//           exps transposed, a 16 x 16 register transpose at a time), B = V in
//           pairs of keys; the output rounded once.
// Only the fp32 summation order differs from the pair kernel's, so outputs
// agree to a few ulp before the output's rounding.
//
// Every tile is 16 rows x 64 bytes; operands past the context (a partial
// chunk of 16 keys, a pair past an odd end, keys up to the next 32) are read
// from zeroed scratch, never from past the pool's rows. Head dims that are a
// multiple of 32 only (others keep the pair kernel).
#pragma once

#include "amx.h"

#if defined(KVPAGER_AMX)
#define KVPAGER_AMX_TILES 1
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "attention_pairs.h"
#include "attention_tiles.h"

namespace kvpager {

// Tiles 0-3 hold sums, 4 and 5 operands (amx.h's configuration).
// The first N sum tiles zeroed, stored (16 rows, `stride` bytes apart), or
// += A (tile 4) . B (tile 5) into sum tile I.
template <int N>
inline void amx_zero() {
  if constexpr (N > 0) _tile_zero(0);
  if constexpr (N > 1) _tile_zero(1);
  if constexpr (N > 2) _tile_zero(2);
  if constexpr (N > 3) _tile_zero(3);
}
template <int I>
inline void amx_dot() {
  if constexpr (I == 0) _tile_dpbf16ps(0, 4, 5);
  if constexpr (I == 1) _tile_dpbf16ps(1, 4, 5);
  if constexpr (I == 2) _tile_dpbf16ps(2, 4, 5);
  if constexpr (I == 3) _tile_dpbf16ps(3, 4, 5);
}
template <int N>
inline void amx_store(float* const* dst, int64_t stride) {
  if constexpr (N > 0) _tile_stored(0, dst[0], stride);
  if constexpr (N > 1) _tile_stored(1, dst[1], stride);
  if constexpr (N > 2) _tile_stored(2, dst[2], stride);
  if constexpr (N > 3) _tile_stored(3, dst[3], stride);
}

// S[16 keys][rows 16j .. 16j + 16] for NJ groups of rows from j0: A = the
// 16 keys' rows (k, `k_stride` bytes apart), B = the rows' query pairs.
template <int NJ, int C>
inline void amx_scores(const uint16_t* k, int64_t k_stride, const uint32_t* qp, int64_t rp, int64_t j0, float* st) {
  amx_zero<NJ>();
  for (int dc = 0; dc < C / 2; ++dc) {  // 32 dims a step
    _tile_loadd(4, k + 32 * dc, k_stride);
    const uint32_t* q = qp + 16 * dc * rp + 16 * j0;
    _tile_loadd(5, q, rp * 4);
    amx_dot<0>();
    if constexpr (NJ > 1) {
      _tile_loadd(5, q + 16, rp * 4);
      amx_dot<1>();
    }
    if constexpr (NJ > 2) {
      _tile_loadd(5, q + 32, rp * 4);
      amx_dot<2>();
    }
    if constexpr (NJ > 3) {
      _tile_loadd(5, q + 48, rp * 4);
      amx_dot<3>();
    }
  }
  float* dst[4] = {st + 16 * j0, st + 16 * j0 + 16, st + 16 * j0 + 32, st + 16 * j0 + 48};
  amx_store<NJ>(dst, rp * 4);
}

template <int C>
inline void amx_scores_rows(const uint16_t* k, int64_t k_stride, const uint32_t* qp, int64_t rp, float* st) {
  const int64_t nj = rp / 16;
  int64_t j = 0;
  for (; j + 4 <= nj; j += 4) amx_scores<4, C>(k, k_stride, qp, rp, j, st);
  switch (nj - j) {
    case 3: return amx_scores<3, C>(k, k_stride, qp, rp, j, st);
    case 2: return amx_scores<2, C>(k, k_stride, qp, rp, j, st);
    case 1: return amx_scores<1, C>(k, k_stride, qp, rp, j, st);
    default: return;
  }
}

// O[16 rows][NC x 16 columns from c0] = P[16 rows][chunks x 32 keys] . V:
// pt: the rows' probabilities ([.][lk] bf16), vp: V as pairs of keys [.][D].
template <int NC, int64_t D>
inline void amx_values(const uint16_t* pt, int64_t lk, const uint32_t* vp, int64_t chunks, int64_t c0, float* of) {
  amx_zero<NC>();
  for (int64_t kc = 0; kc < chunks; ++kc) {
    _tile_loadd(4, pt + 32 * kc, lk * 2);
    const uint32_t* v = vp + 16 * kc * D + 16 * c0;
    _tile_loadd(5, v, D * 4);
    amx_dot<0>();
    if constexpr (NC > 1) {
      _tile_loadd(5, v + 16, D * 4);
      amx_dot<1>();
    }
    if constexpr (NC > 2) {
      _tile_loadd(5, v + 32, D * 4);
      amx_dot<2>();
    }
    if constexpr (NC > 3) {
      _tile_loadd(5, v + 48, D * 4);
      amx_dot<3>();
    }
  }
  float* dst[4] = {of + 16 * c0, of + 16 * c0 + 16, of + 16 * c0 + 32, of + 16 * c0 + 48};
  amx_store<NC>(dst, D * 4);
}

// One bf16 tile on AMX, D = 16 * C (C even). The calling thread has run
// amx_begin(). Row r is token r / group, query head kvh * group + r % group.
template <int C>
void attend_tile_amx(const TileJob<c10::BFloat16>& jb, TileScratch& sc) {
  static_assert(C % 2 == 0, "AMX tiles take 32 dims a step");
  using T = c10::BFloat16;
  constexpr int64_t D = 16 * C;
  const int64_t G = jb.group, R = jb.count * G, rp = (R + 15) / 16 * 16, L = jb.pos0 + jb.count;
  const int64_t BS = jb.block_size, lk = (L + 31) / 32 * 32;  // keys padded for the value products
  tile_query_pairs<C>(jb, sc, R, rp, L);
  tile_value_pairs<C>(jb, sc, 0, L, lk / 2);
  if (static_cast<int64_t>(sc.st.size()) < lk * rp) sc.st.resize(lk * rp);
  if (static_cast<int64_t>(sc.pt.size()) < rp * lk) sc.pt.resize(rp * lk);
  if (static_cast<int64_t>(sc.kt.size()) < 16 * D) sc.kt.resize(16 * D);
  float* st = sc.st.data();

  // Scores, 16 keys a step: in place where the 16 rows are one block's,
  // else gathered (zeros past the end).
  for (int64_t k0 = 0; k0 < L; k0 += 16) {
    const uint16_t* k;
    int64_t k_stride;
    if (BS % 16 == 0 && k0 + 16 <= L) {
      k = reinterpret_cast<const uint16_t*>(jb.k + static_cast<int64_t>(jb.table[k0 / BS]) * jb.k_s0 +
                                            (k0 % BS) * jb.k_s1 + jb.kvh * jb.k_s2);
      k_stride = jb.k_s1 * 2;
    } else {
      uint16_t* kt = sc.kt.data();
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t key = k0 + i;
        if (key < L)
          std::memcpy(kt + i * D,
                      jb.k + static_cast<int64_t>(jb.table[key / BS]) * jb.k_s0 + (key % BS) * jb.k_s1 + jb.kvh * jb.k_s2,
                      D * 2);
        else
          std::memset(kt + i * D, 0, D * 2);
      }
      k = kt, k_stride = D * 2;
    }
    amx_scores_rows<C>(k, k_stride, sc.qp.data(), rp, st + k0 * rp);
  }
  // round(round(q.k) * scale), as the walk and transformers round.
  const __m512 scale = _mm512_set1_ps(jb.scale);
  for (int64_t i = 0; i < L * rp; i += 16) {
    float* s = st + i;
    _mm512_storeu_ps(s, round_bf16x16(_mm512_mul_ps(round_bf16x16(_mm512_loadu_ps(s)), scale)));
  }
  tile_mask(st, rp, sc.pos.data(), jb.pos0, 0, L);

  // Softmax; the probabilities go out as bf16 rows of keys, P [rp][lk]:
  // 16 keys x 16 rows transposed in registers (zeros past the context).
  uint16_t* pt = sc.pt.data();
  for (int64_t j = 0; j < rp / 16; ++j) {
    const __m512 inv = tile_exps(st, rp, j, L);
    for (int64_t k0 = 0; k0 < lk; k0 += 16) {
      __m512 blk[16];
      for (int i = 0; i < 16; ++i)
        blk[i] = k0 + i < L ? _mm512_mul_ps(_mm512_loadu_ps(st + (k0 + i) * rp + 16 * j), inv) : _mm512_setzero_ps();
      transpose16(blk);
      for (int r = 0; r < 16; ++r)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pt + (16 * j + r) * lk + k0), bits16(blk[r]));
    }
  }

  // Values, 16 rows a step, reading the 32-key chunks up to the last row's position.
  if (static_cast<int64_t>(sc.of.size()) < 16 * D) sc.of.resize(16 * D);
  float* of = sc.of.data();
  const uint32_t* vp = sc.vp.data();
  for (int64_t j = 0; j < rp / 16; ++j) {
    const int64_t last = std::min<int64_t>(16 * j + 15, R - 1);
    const int64_t chunks = (jb.pos0 + last / G + 1 + 31) / 32;
    const uint16_t* prow = pt + 16 * j * lk;
    int64_t c0 = 0;
    for (; c0 + 4 <= C; c0 += 4) amx_values<4, D>(prow, lk, vp, chunks, c0, of);
    if (C - c0 == 2) amx_values<2, D>(prow, lk, vp, chunks, c0, of);
    for (int64_t r = 16 * j; r <= last; ++r) {  // the output rounded once (c10: to nearest even)
      T* dst = jb.out + (jb.q0 + r / G) * jb.o_s0 + (jb.kvh * G + r % G) * jb.o_s1;
      const float* o = of + (r - 16 * j) * D;
      for (int64_t e = 0; e < D; ++e) dst[e] = static_cast<T>(o[e]);
    }
  }
}

}  // namespace kvpager
#endif
