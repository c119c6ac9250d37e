// The group kernel's many narrow rows on AVX2 without VNNI (quant_matmul.cpp includes it after quant_fma.h): a large
// batch of decodes, its activations rounded to int8. On the tiles (quant_avx2.h) each block of 4 rows unpacks a
// tile's group again, which costs about as many instructions as the rows' vpmaddubsw; here a pair of tiles' groups is
// unpacked once per block of rows into a panel of bytes, and 3 rows at a time meet it in vpmaddubsw (two per 4 inputs
// and 16 outputs), their int16 sums widened once per window that cannot overflow and scaled into float32 sums.
#pragma once

#include <immintrin.h>

#include "arch/x86/quant_fma.h"

namespace quant {

// Whether narrow rows of these weights meet byte panels here: weights below 8 bits (their unsigned values and int8
// activations keep vpmaddubsw's pair sums within int16; 8-bit ones are not narrow on AVX2), scales per 32 (Q6_K's per
// 16 run faster on the float32 panels, fma_rows_of: these 0.91x)
template <typename F>
constexpr bool byte_rows_of() {
  return F::kBits < 8 && F::kParts == 1;
}

// Rows of x a microkernel holds: 6 int16 and 6 float32 sums, 2 weight vectors and a broadcast, of 16 registers
constexpr int kByteRows = 3;
// Pieces of a group: 8 of 4 inputs each (piece i: inputs 16 * (i / 4) + 4 * (i % 4) ..), the vpmaddubsw products an
// int16 sum holds before it is widened (kSums), never across a part's end (Q6_K's scales per 16)
template <typename F>
constexpr int kWindow = F::kParts == 2 && kSums<F> > 4 ? 4 : kSums<F> > 8 ? 8 : kSums<F>;

// Groups g0..g0+ng of NT tiles from b into a panel: [group][piece][tile] 32 bytes (lane r: output r's 4 inputs), and
// each group's scales sc and zero terms zc (centre * scale + offset, as tile_rows makes them), [group][part][tile] of
// 8 floats
template <typename F, int NT>
HOT_INLINE void byte_panel(const uint8_t* w, int t0, int K, int g0, int ng, uint8_t* panel, float* sc, float* zc) {
  constexpr int P = F::kParts;
  for (int t = 0; t < NT; ++t) {
    const Block<F> b(w, t0 + t, K);
    for (int g = g0; g < g0 + ng; ++g) {
      const uint8_t* wg = b.values(g);
      uint8_t* pg = panel + (g - g0) * 8 * NT * 32 + t * 32;
      for (int c = 0; c < 4; ++c) {
        __m256i lo, hi;
        unpack_chunk<F>(wg, c, lo, hi);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pg + c * NT * 32), lo);
        _mm256_store_si256(reinterpret_cast<__m256i*>(pg + (4 + c) * NT * 32), hi);
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

// A microkernel's float32 sums: carried in c ([rows][16], in L1) to the next panel, or after the last stored into y
// (outputs past N are padding, not stored)
template <int MR, int NT, typename U>
HOT_INLINE void panel_sums_out(const __m256 (&acc)[MR][NT], bool last, float* c, U* y, int64_t ys, int n0, int N) {
  if (!last) {
#pragma GCC unroll 3
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) _mm256_store_ps(c + 16 * r + 8 * t, acc[r][t]);
    return;
  }
  const int valid = N - n0 < 8 * NT ? N - n0 : 8 * NT;
  alignas(32) float out[MR][16];
#pragma GCC unroll 3
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) _mm256_store_ps(out[r] + 8 * t, acc[r][t]);
  for (int r = 0; r < MR; ++r)
    for (int i = 0; i < valid; ++i) store(y + r * ys + n0 + i, out[r][i]);
}

// Rows r0..r0+MR of x's bytes (xb, K a row) against NT tiles' panel of groups g0..g0+ng (a: x's scales and sums): the
// float32 sums carried between panels in c ([rows][16], in L1), the last panel's stored into y (outputs past N are
// padding). One function with every loop over registers unrolled, as fma_rows (g++ otherwise keeps the sums on the
// stack)
template <typename F, int MR, int NT, typename U>
HOT_INLINE void byte_rows(const int8_t* xb, const Pairs& a, int r0, int K, int g0, int ng, const uint8_t* panel,
                          const float* sc, const float* zc, bool first, bool last, float* c, U* y, int64_t ys, int n0,
                          int N) {
  constexpr int P = F::kParts, W = kWindow<F>;
  const int ngk = K / kG;
  __m256 acc[MR][NT];
#pragma GCC unroll 3
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) acc[r][t] = first ? _mm256_setzero_ps() : _mm256_load_ps(c + 16 * r + 8 * t);
  for (int g = 0; g < ng; ++g) {
    const int8_t* xg = xb + static_cast<int64_t>(r0) * K + (g0 + g) * kG;
    const uint8_t* pg = panel + g * 8 * NT * 32;
    // window after window, its pieces in a rolled loop: unrolled, g++ loaded every piece's weights ahead and spilled
#pragma GCC unroll 1
    for (int i0 = 0; i0 < 8; i0 += W) {
      __m256i s[MR][NT];
#pragma GCC unroll 3
      for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t) s[r][t] = _mm256_setzero_si256();
#pragma GCC unroll 1
      for (int i = i0; i < i0 + W; ++i) {
        __m256i wv[NT];
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t)
          wv[t] = _mm256_load_si256(reinterpret_cast<const __m256i*>(pg + (i * NT + t) * 32));
        const int8_t* xi = xg + 16 * (i >> 2) + 4 * (i & 3);
#pragma GCC unroll 3
        for (int r = 0; r < MR; ++r) {
          const __m256i xv = broadcast4(xi + r * K);
#pragma GCC unroll 2
          for (int t = 0; t < NT; ++t) s[r][t] = _mm256_add_epi16(s[r][t], _mm256_maddubs_epi16(wv[t], xv));
        }
      }
      const int p = P == 2 ? i0 / 4 : 0;
      // sum((q - centre) * xq) = sum(q * xq) - centre * sum(xq): the second term in int32, in a part's last window
      const bool part_end = (i0 + W) % (8 / P) == 0;
#pragma GCC unroll 3
      for (int r = 0; r < MR; ++r) {
        const int64_t at = static_cast<int64_t>(r0 + r) * ngk + g0 + g;
        const __m256 d = _mm256_broadcast_ss(&a.d[at]);
        const __m256i cq = _mm256_set1_epi32(part_end ? F::kCentre * (p ? a.qs1[at] : a.qs0[at]) : 0);
#pragma GCC unroll 2
        for (int t = 0; t < NT; ++t) {
          const __m256i q = _mm256_sub_epi32(_mm256_madd_epi16(s[r][t], _mm256_set1_epi16(1)), cq);
          acc[r][t] = _mm256_fmadd_ps(_mm256_load_ps(sc + ((g * P + p) * NT + t) * 8),
                                      _mm256_mul_ps(_mm256_cvtepi32_ps(q), d), acc[r][t]);
        }
      }
    }
    if (!F::kOff) continue;
    // with offsets, the zero term times the exact sum of x
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

// Every row of a block (rows m0.. of xb and a) against NT tiles from t0, panel after panel
template <typename F, int NT, typename U>
void byte_block(const uint8_t* w, int t0, const int8_t* xb, const Pairs& a, int m0, int rows, uint8_t* panel,
                float* sc, float* zc, float* c, U* y, int64_t ys, int N, int K) {
  const int ng = K / kG, n0 = t0 * kTile;
  for (int g0 = 0; g0 < ng; g0 += kPanelGroups) {
    const int pg = ng - g0 < kPanelGroups ? ng - g0 : kPanelGroups;
    byte_panel<F, NT>(w, t0, K, g0, pg, panel, sc, zc);
    const bool first = g0 == 0, last = g0 + pg == ng;
    int r = 0;
    for (; r + kByteRows <= rows; r += kByteRows)
      byte_rows<F, kByteRows, NT>(xb, a, m0 + r, K, g0, pg, panel, sc, zc, first, last, c + 16 * r, y + r * ys, ys,
                                  n0, N);
    if (rows - r == 2)
      byte_rows<F, 2, NT>(xb, a, m0 + r, K, g0, pg, panel, sc, zc, first, last, c + 16 * r, y + r * ys, ys, n0, N);
    else if (rows - r == 1)
      byte_rows<F, 1, NT>(xb, a, m0 + r, K, g0, pg, panel, sc, zc, first, last, c + 16 * r, y + r * ys, ys, n0, N);
  }
}

// This member's tiles (group_matmul's share) against every row of x, its activations rounded to int8 (narrow), in
// pairs of tiles and blocks of rows
template <typename F, typename T, typename U>
void byte_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, U* y, int64_t ys, int N, int K) {
  const Pairs& a = tile_acts<F>(x, xs, rows, K, true);
  constexpr int P = F::kParts;
  thread_local std::vector<int8_t> xb;  // the rows' bytes packed, K a row: a panel's 64 rows then fit L1 beside it
  xb.resize(static_cast<size_t>(rows) * K);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < K / kG; ++g)  // the narrow bytes sit where split's l bytes would (tile_acts)
      std::memcpy(xb.data() + static_cast<int64_t>(r) * K + g * kG,
                  a.q.data() + static_cast<int64_t>(r) * K + g * kG + 16, kG);
  thread_local std::vector<float> panel_store, sc_store, zc_store, c_store;  // grown once
  uint8_t* panel = reinterpret_cast<uint8_t*>(aligned32(panel_store, kPanelGroups * 8 * 2 * 32 / 4));
  float* sc = aligned32(sc_store, kPanelGroups * P * 2 * 8);
  float* zc = aligned32(zc_store, kPanelGroups * P * 2 * 8);
  float* c = aligned32(c_store, kFmaBlockRows * 16);
  const int tiles = quant_tiles(N), t1 = tm.share_end(tiles);
  for (int m0 = 0; m0 < rows; m0 += kFmaBlockRows) {
    const int mr = rows - m0 < kFmaBlockRows ? rows - m0 : kFmaBlockRows;
    U* ym = y + m0 * ys;
    int t = tm.share_begin(tiles);
    for (; t + 2 <= t1; t += 2) byte_block<F, 2>(w, t, xb.data(), a, m0, mr, panel, sc, zc, c, ym, ys, N, K);
    if (t < t1) byte_block<F, 1>(w, t, xb.data(), a, m0, mr, panel, sc, zc, c, ym, ys, N, K);
  }
}

}  // namespace quant
