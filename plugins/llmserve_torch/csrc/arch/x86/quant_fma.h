// The group kernel's many-row form on AVX2 without VNNI for weights with scales per 16, Q6_K (quant_matmul.cpp
// includes it after the AVX2 path): a prompt's rows and a large batch of decodes are bound by their integer products
// there (each row meets each group of a tile of 8 in eight vpmaddubsw for int16's two bytes, four for int8), about
// 33-40 G multiply-adds/s on two Zen 3 cores against the 95 G their FMA units do. Here a pair of tiles' groups is
// dequantized once per block of rows into a float32 panel (w = q * scale + offset, the value QuantWeight.dequantize
// holds), and 6 rows of x at a time meet it in 12 vfmadd231ps a input: exact float32 products, no activation rounded
// to integers.
#pragma once

#include <immintrin.h>

#include <atomic>
#include <vector>

#include "arch/x86/quant_avx2.h"

namespace quant {

constexpr int kFmaRows = LLMSERVE_FMA_MIN_ROWS;  // fewer rows than this stay on the integer tiles
// llmserve_quant_fma's switch (an A/B of the two paths in one process, and the tests of the integer tiles' many rows)
inline std::atomic<int>& fma_wanted() {
  static std::atomic<int> on{1};
  return on;
}
// Whether many rows of x meet these weights here, from kFmaRows rows on: weights below 8 bits with scales per 16
// (Q6_K), a large batch of decodes (1.12-1.20x the tiles' int8 products, Zen 3) and a prompt's int16 rows (their two
// bytes are two products a weight on the tiles; the word panels ran these 1.00-1.04x, and the FMA's are exact). The
// others' rows run faster on byte panels (narrow, quant_bytes.h) or word panels (quant_words.h)
template <typename F>
constexpr bool fma_rows_of() {
  return F::kBits < 8 && F::kParts == 2;
}

constexpr int kPanelGroups = 8;  // inputs a panel holds: 256 (16 KiB of float32 for 16 outputs), in L1 beside x's rows
constexpr int kMicroRows = 6;    // rows of x a microkernel holds: 12 sums, two weight vectors and a broadcast, of 16
// Rows of x a block spans: the panels are dequantized once per block (about 4 % of the products at 128 rows), and a
// block's rows, K apart, are read again for each pair of tiles (from L2, or L3 past about 1 MiB)
constexpr int kFmaBlockRows = 128;

// Groups g0..g0+ng of tile b's 8 outputs into panel columns [col, col + 8) of rows 16 apart (input k's row at 16 * k):
// byte j of each lane of unpack_chunk's lo (inputs 4c + j) and hi (16 + 4c + j) to float, times the lane's scale plus
// its offset (w - centre times the scale where the format has none, as dequant_row rounds it)
template <typename F>
HOT_INLINE void fma_panel(const Block<F>& b, int g0, int ng, float* panel, int col) {
  const __m256i byte = _mm256_set1_epi32(0xFF), centre = _mm256_set1_epi32(F::kCentre);
  for (int g = g0; g < g0 + ng; ++g) {
    const uint8_t* wg = b.values(g);
    constexpr int P = F::kParts;
    __m256 sc[P], off[P];
    for (int p = 0; p < P; ++p) {
      sc[p] = tile_scales<F>(b, g, p, 0);
      off[p] = F::kOff ? tile_scales<F>(b, g, p, 1) : _mm256_setzero_ps();
    }
    float* pg = panel + (g - g0) * kG * 16 + col;
    for (int c = 0; c < 4; ++c) {
      __m256i lo, hi;
      unpack_chunk<F>(wg, c, lo, hi);
      for (int half = 0; half < 2; ++half) {
        const __m256i v = half ? hi : lo;
        const int p = F::kHalf ? half : 0;
        for (int j = 0; j < 4; ++j) {
          __m256i q = j == 3 ? _mm256_srli_epi32(v, 24) : _mm256_and_si256(_mm256_srli_epi32(v, 8 * j), byte);
          const __m256 e = F::kOff ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), sc[p], off[p])
                                   : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, centre)), sc[p]);
          _mm256_store_ps(pg + (16 * half + 4 * c + j) * 16, e);
        }
      }
    }
  }
}

// Rows 0..MR of x (row r at xr + r * xs, inputs from the panel's first) against NT tiles' panel of kn inputs (16
// floats an input), the outputs n0.. of each: the sums carried between panels in c (the block's [rows][16] float32,
// in L1), the last panel's stored into y (outputs past N are padding). One function, every loop over registers
// unrolled: with the sums passed to a helper, or a loop left rolled, g++ kept them on the stack, at half the rate
template <int MR, int NT, typename U>
HOT_INLINE void fma_rows(const float* xr, int64_t xs, const float* panel, int kn, bool first, bool last, float* c,
                         U* y, int64_t ys, int n0, int N) {
  __m256 acc[MR][NT];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) acc[r][t] = first ? _mm256_setzero_ps() : _mm256_load_ps(c + 16 * r + 8 * t);
  for (int k = 0; k < kn; ++k) {
    __m256 w[NT];
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) w[t] = _mm256_load_ps(panel + 16 * k + 8 * t);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(xr + r * xs + k);
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_fmadd_ps(xb, w[t], acc[r][t]);
    }
  }
  if (!last) {
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
      for (int t = 0; t < NT; ++t) _mm256_store_ps(c + 16 * r + 8 * t, acc[r][t]);
    return;
  }
  const int valid = N - n0 < 8 * NT ? N - n0 : 8 * NT;
  alignas(32) float out[MR][16];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 2
    for (int t = 0; t < NT; ++t) _mm256_store_ps(out[r] + 8 * t, acc[r][t]);
  for (int r = 0; r < MR; ++r) {
    if constexpr (sizeof(U) == 4) {
      if (valid == 8 * NT) {
        std::memcpy(y + r * ys + n0, out[r], sizeof(float) * 8 * NT);
        continue;
      }
    }
    for (int i = 0; i < valid; ++i) store(y + r * ys + n0 + i, out[r][i]);
  }
}

// Every row of a block (rows from x, K apart as xs says) against NT tiles from t0, panel after panel
template <typename F, int NT, typename U>
void fma_block(const uint8_t* w, int t0, const float* x, int64_t xs, int rows, float* panel, float* c, U* y,
               int64_t ys, int N, int K) {
  const int ng = K / kG;
  for (int g0 = 0; g0 < ng; g0 += kPanelGroups) {
    const int pg = ng - g0 < kPanelGroups ? ng - g0 : kPanelGroups, kn = pg * kG;
    for (int t = 0; t < NT; ++t) fma_panel<F>(Block<F>(w, t0 + t, K), g0, pg, panel, 8 * t);
    const bool first = g0 == 0, last = g0 + pg == ng;
    const float* xk = x + g0 * kG;
    int r = 0;
    for (; r + kMicroRows <= rows; r += kMicroRows)
      fma_rows<kMicroRows, NT>(xk + r * xs, xs, panel, kn, first, last, c + 16 * r, y + r * ys, ys, t0 * kTile, N);
    switch (rows - r) {
      case 5: fma_rows<5, NT>(xk + r * xs, xs, panel, kn, first, last, c + 16 * r, y + r * ys, ys, t0 * kTile, N); break;
      case 4: fma_rows<4, NT>(xk + r * xs, xs, panel, kn, first, last, c + 16 * r, y + r * ys, ys, t0 * kTile, N); break;
      case 3: fma_rows<3, NT>(xk + r * xs, xs, panel, kn, first, last, c + 16 * r, y + r * ys, ys, t0 * kTile, N); break;
      case 2: fma_rows<2, NT>(xk + r * xs, xs, panel, kn, first, last, c + 16 * r, y + r * ys, ys, t0 * kTile, N); break;
      case 1: fma_rows<1, NT>(xk + r * xs, xs, panel, kn, first, last, c + 16 * r, y + r * ys, ys, t0 * kTile, N); break;
      default: break;
    }
  }
}

// n floats of v's, 32-byte aligned (vector's own storage is 16-aligned: every other 32-byte load would cross a line)
inline float* aligned32(std::vector<float>& v, size_t n) {
  v.resize(n + 8);
  const uintptr_t at = reinterpret_cast<uintptr_t>(v.data());
  return reinterpret_cast<float*>((at + 31) & ~static_cast<uintptr_t>(31));
}

// x as float32: itself, or bf16 widened once into this member's buffer (exact; each member widens every row, as
// tile_acts quantizes them: a shared copy would need a barrier)
inline const float* fma_acts(const float* x, int64_t& xs, int, int) { return x; }
inline const float* fma_acts(const uint16_t* x, int64_t& xs, int rows, int K) {
  thread_local std::vector<float> a;  // grown once
  a.resize(static_cast<size_t>(rows) * K);
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < K; k += 8) _mm256_storeu_ps(a.data() + static_cast<int64_t>(r) * K + k, load8(x + r * xs + k));
  xs = K;
  return a.data();
}

// This member's tiles (group_matmul's share) against every row of x, in pairs of tiles and blocks of rows
template <typename F, typename T, typename U>
void fma_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, U* y, int64_t ys, int N, int K) {
  const float* xf = fma_acts(x, xs, rows, K);
  thread_local std::vector<float> panel_store, c_store;  // grown once
  float* panel = aligned32(panel_store, kPanelGroups * kG * 16);
  float* c = aligned32(c_store, kFmaBlockRows * 16);
  const int tiles = quant_tiles(N), t1 = tm.share_end(tiles);
  for (int m0 = 0; m0 < rows; m0 += kFmaBlockRows) {
    const int mr = rows - m0 < kFmaBlockRows ? rows - m0 : kFmaBlockRows;
    const float* xm = xf + m0 * xs;
    U* ym = y + m0 * ys;
    int t = tm.share_begin(tiles);
    for (; t + 2 <= t1; t += 2) fma_block<F, 2>(w, t, xm, xs, mr, panel, c, ym, ys, N, K);
    if (t < t1) fma_block<F, 1>(w, t, xm, xs, mr, panel, c, ym, ys, N, K);
  }
}

}  // namespace quant
