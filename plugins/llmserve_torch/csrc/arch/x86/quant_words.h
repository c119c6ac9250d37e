// The group kernel's many rows of 8-bit weights on AVX2 without VNNI (quant_matmul.cpp includes it after
// quant_bytes.h): the Qwen2.5-0.5B file's Q8_0 head at a large batch of decodes, a Q8_0 file's prompts. On the tiles
// (quant_avx2.h) each block of 6 rows splits a tile's group into int16 pairs again, and each row's broadcast meets one
// tile of 8 outputs, so a vpmaddwd costs two more instructions (its broadcast and its add) of the four pipes that run
// them: the head ran at ~68 G multiply-adds/s on two Zen 3 cores, whose vpmaddwd alone do ~200 G. Here a pair of
// tiles' groups is split into int16 pairs (q - centre) once per block of rows into a panel of words, and 3 rows at a
// time meet it, each broadcast in two vpmaddwd (16 outputs); the int32 sums are exact, so the outputs are the tiles'
// up to float rounding.
#pragma once

#include <immintrin.h>

#include "arch/x86/quant_bytes.h"

namespace quant {

// Whether many rows of these weights meet word panels here: 8-bit weights' narrow rows too (they have no int8 products
// without VNNI, so their activations stay int16 as on the tiles), and a prompt's int16 rows of weights below 8 bits
// with scales per 32 (faster than their exact float32 products on FMA panels; the tiles' int16 rounding, as every
// other build's prompt rows have)
template <typename F>
constexpr bool word_rows_of(bool narrow) {
  return F::kBits == 8 || (!narrow && F::kParts == 1);
}

constexpr int kWordRows = 3;  // rows of x a microkernel holds: 6 int32 and 6 float32 sums, 2 weights, a broadcast
// Units of a group: 16 pairs of inputs, unit j meeting the activations' int16 at 2j..2j+1 (tile_acts' pairs order:
// within each 4 inputs 4c.. of the group, (4c, 4c + 2) then (4c + 1, 4c + 3)); units 0-7 hold inputs 0-15, a part
constexpr int kWordUnits = 16;

// Groups g0..g0+ng of NT tiles from b into a panel: [group][unit][tile] 32 bytes (lane r: output r's pair of q -
// centre as int16), and each group's scales sc and zero terms zc ([group][part][tile] of 8 floats, as byte_panel)
template <typename F, int NT>
HOT_INLINE void word_panel(const uint8_t* w, int t0, int K, int g0, int ng, int16_t* panel, float* sc, float* zc) {
  constexpr int P = F::kParts;
  const __m256i even = _mm256_set1_epi16(0x00FF), centre = _mm256_set1_epi16(F::kCentre);
  for (int t = 0; t < NT; ++t) {
    const Block<F> b(w, t0 + t, K);
    for (int g = g0; g < g0 + ng; ++g) {
      const uint8_t* wg = b.values(g);
      int16_t* pg = panel + (g - g0) * kWordUnits * NT * 16 + t * 16;
      for (int c = 0; c < 4; ++c) {
        __m256i lo, hi;
        unpack_chunk<F>(wg, c, lo, hi);
        // chunk c holds inputs 4c.. (lo, units 2c and 2c + 1) and 16 + 4c.. (hi, units 8 + 2c and 9 + 2c)
        const __m256i u[4] = {_mm256_and_si256(lo, even), _mm256_srli_epi16(lo, 8), _mm256_and_si256(hi, even),
                              _mm256_srli_epi16(hi, 8)};
        const int at[4] = {2 * c, 2 * c + 1, 8 + 2 * c, 9 + 2 * c};
        for (int i = 0; i < 4; ++i)
          _mm256_store_si256(reinterpret_cast<__m256i*>(pg + at[i] * NT * 16), _mm256_sub_epi16(u[i], centre));
      }
      for (int p = 0; p < P; ++p) {
        const int at = (((g - g0) * P + p) * NT + t) * 8;
        const __m256 s = tile_scales<F>(b, g, p, 0);
        _mm256_store_ps(sc + at, s);
        if (F::kOff)
          _mm256_store_ps(zc + at, _mm256_fmadd_ps(_mm256_set1_ps(F::kCentre), s, tile_scales<F>(b, g, p, 1)));
      }
    }
  }
}

// Rows r0..r0+MR of x's int16 pairs (a, K a row) against NT tiles' panel of groups g0..g0+ng: the float32 sums
// carried between panels in c ([rows][16], in L1), the last panel's stored into y (outputs past N are padding). Every
// loop over registers unrolled, as byte_rows
template <typename F, int MR, int NT, typename U>
HOT_INLINE void word_rows(const Pairs& a, int r0, int K, int g0, int ng, const int16_t* panel, const float* sc,
                          const float* zc, bool first, bool last, float* c, U* y, int64_t ys, int n0, int N) {
  constexpr int P = F::kParts, UP = kWordUnits / P;
  const int ngk = K / kG;
  __m256 acc[MR][NT];
#pragma GCC unroll 3
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) acc[r][t] = first ? _mm256_setzero_ps() : _mm256_load_ps(c + 16 * r + 8 * t);
  for (int g = 0; g < ng; ++g) {
    const int16_t* xg = a.q.data() + static_cast<int64_t>(r0) * K + (g0 + g) * kG;
    const int16_t* pg = panel + g * kWordUnits * NT * 16;
#pragma GCC unroll 1
    for (int p = 0; p < P; ++p) {
      __m256i s[MR][NT];
#pragma GCC unroll 3
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t) s[r][t] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int j = p * UP; j < (p + 1) * UP; ++j) {
        __m256i wv[NT];
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t) wv[t] = _mm256_load_si256(reinterpret_cast<const __m256i*>(pg + (j * NT + t) * 16));
#pragma GCC unroll 3
        for (int r = 0; r < MR; ++r) {
          const __m256i xv = broadcast4(xg + r * K + 2 * j);
#pragma GCC unroll 2
          for (int t = 0; t < NT; ++t) s[r][t] = _mm256_add_epi32(s[r][t], _mm256_madd_epi16(wv[t], xv));
        }
      }
#pragma GCC unroll 3
      for (int r = 0; r < MR; ++r) {
        const int64_t at = static_cast<int64_t>(r0 + r) * ngk + g0 + g;
        const __m256 d = _mm256_broadcast_ss(&a.d[at]);
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t)
          acc[r][t] = _mm256_fmadd_ps(_mm256_load_ps(sc + ((g * P + p) * NT + t) * 8),
                                      _mm256_mul_ps(_mm256_cvtepi32_ps(s[r][t]), d), acc[r][t]);
      }
    }
    if (!F::kOff) continue;
    // with offsets, the zero term (centre * scale + offset) times the exact sum of x
#pragma GCC unroll 3
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int p = 0; p < P; ++p) {
        const int64_t at = static_cast<int64_t>(r0 + r) * ngk + g0 + g;
        const __m256 xsum = _mm256_broadcast_ss(p ? &a.xs1[at] : &a.xs0[at]);
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t)
          acc[r][t] = _mm256_fmadd_ps(_mm256_load_ps(zc + ((g * P + p) * NT + t) * 8), xsum, acc[r][t]);
      }
  }
  panel_sums_out<MR, NT>(acc, last, c, y, ys, n0, N);
}

// Every row of a block (rows m0.. of a) against NT tiles from t0, panel after panel
template <typename F, int NT, typename U>
void word_block(const uint8_t* w, int t0, const Pairs& a, int m0, int rows, int16_t* panel, float* sc, float* zc,
                float* c, U* y, int64_t ys, int N, int K) {
  const int ng = K / kG, n0 = t0 * kTile;
  for (int g0 = 0; g0 < ng; g0 += kPanelGroups) {
    const int pg = ng - g0 < kPanelGroups ? ng - g0 : kPanelGroups;
    word_panel<F, NT>(w, t0, K, g0, pg, panel, sc, zc);
    const bool first = g0 == 0, last = g0 + pg == ng;
    int r = 0;
    for (; r + kWordRows <= rows; r += kWordRows)
      word_rows<F, kWordRows, NT>(a, m0 + r, K, g0, pg, panel, sc, zc, first, last, c + 16 * r, y + r * ys, ys, n0, N);
    if (rows - r == 2)
      word_rows<F, 2, NT>(a, m0 + r, K, g0, pg, panel, sc, zc, first, last, c + 16 * r, y + r * ys, ys, n0, N);
    else if (rows - r == 1)
      word_rows<F, 1, NT>(a, m0 + r, K, g0, pg, panel, sc, zc, first, last, c + 16 * r, y + r * ys, ys, n0, N);
  }
}

// This member's tiles (group_matmul's share) against every row of x, its activations int16 pairs as the tiles take
// them, in pairs of tiles and blocks of rows
template <typename F, typename T, typename U>
void word_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, U* y, int64_t ys, int N, int K) {
  const Pairs& a = tile_acts<F>(x, xs, rows, K, false, true);
  constexpr int P = F::kParts;
  thread_local std::vector<float> panel_store, sc_store, zc_store, c_store;  // grown once
  int16_t* panel = reinterpret_cast<int16_t*>(aligned32(panel_store, kPanelGroups * kWordUnits * 2 * 16 / 2));
  float* sc = aligned32(sc_store, kPanelGroups * P * 2 * 8);
  float* zc = aligned32(zc_store, kPanelGroups * P * 2 * 8);
  float* c = aligned32(c_store, kFmaBlockRows * 16);
  const int tiles = quant_tiles(N), t1 = tm.share_end(tiles);
  for (int m0 = 0; m0 < rows; m0 += kFmaBlockRows) {
    const int mr = rows - m0 < kFmaBlockRows ? rows - m0 : kFmaBlockRows;
    U* ym = y + m0 * ys;
    int t = tm.share_begin(tiles);
    for (; t + 2 <= t1; t += 2) word_block<F, 2>(w, t, a, m0, mr, panel, sc, zc, c, ym, ys, N, K);
    if (t < t1) word_block<F, 1>(w, t, a, m0, mr, panel, sc, zc, c, ym, ys, N, K);
  }
}

}  // namespace quant
