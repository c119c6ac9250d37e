// The group kernel's many-row form on AMX tiles (quant_matmul.cpp includes it, after the AVX-512 path, where the
// build has AMX-BF16: Intel Xeon from Sapphire Rapids on). A batch of many decodes (the narrow rows), and a prompt's
// rows, are bound by their integer products on the AVX-512 path: each row meets each group of each tile in eight
// vpdpbusd (sixteen for a prompt's int16, one per byte). Here a tile's group
// is dequantized once, with AVX-512, into bfloat16 (w = q * scale + offset, the value QuantWeight.dequantize holds,
// rounded to bf16 as a bf16 model's dense weight is), and 16 rows at a time meet it in one tdpbf16ps, which sums the
// products in float32 across every group: no activation is rounded to int8, no per-group sum leaves the tile.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <vector>

#include "arch/x86/quant_avx512.h"

namespace quant {

constexpr int kAmxRows = LLMSERVE_AMX_MIN_ROWS;  // fewer narrow rows than this stay on the AVX-512 path

// Whether the kernels may use the tiles: Linux hands a process the tiles' state only once asked
// (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA; without it the first tile instruction is SIGILL), and
// llmserve_quant_amx can turn them off (an A/B of the two paths in one process)
inline std::atomic<int>& amx_wanted() {
  static std::atomic<int> on{1};
  return on;
}
inline bool amx_granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}
inline bool amx_on() { return amx_wanted().load(std::memory_order_relaxed) && amx_granted(); }

// Tiles 0-3: float32 sums of four blocks of 16 rows against the tile's 16 outputs; 4, 6 and 7: blocks of rows of x
// (bf16, 32 inputs: one group), taken in turn so a load need not wait for the product that reads the tile before it;
// 5: the weights' group (16 pairs of inputs by 16 outputs). Every tile 16 rows of 64 bytes. The configuration is a
// constant in memory (one built on the stack can be optimized away by the compiler: llama.cpp's tiles crashed so), and
// loaded at each call: torch's oneDNN loads its own on the same threads
struct alignas(64) AmxConfig {
  uint8_t palette, start_row, reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};
inline constexpr AmxConfig kAmxConfig = {1, 0, {}, {64, 64, 64, 64, 64, 64, 64, 64}, {16, 16, 16, 16, 16, 16, 16, 16}};
inline void amx_configure() { _tile_loadconfig(&kAmxConfig); }

// Group g of a tile as tdpbf16ps's second operand: row k2 holds, for output r in 32-bit lane r, the bf16 pair of inputs
// 2 * k2 and 2 * k2 + 1. unpack_tile's lo[c] (hi[c]) lane r holds inputs 4c..4c+3 (16 + 4c..) of output r: byte j of
// each lane to float, times the lane's scale plus its offset (-centre * scale where the format has none), then two
// inputs' floats to one row of pairs
template <typename F>
HOT_INLINE void amx_weights(const Block<F>& b, int g, uint16_t* out) {
  __m512i lo[4], hi[4];
  unpack_tile<F>(b.values(g), lo, hi);
  constexpr int P = F::kParts;
  __m512 sc[P], zero[P];
  for (int p = 0; p < P; ++p) {
    sc[p] = tile_scales<F>(b, g, p, 0);
    zero[p] = F::kOff ? tile_scales<F>(b, g, p, 1) : _mm512_mul_ps(sc[p], _mm512_set1_ps(-F::kCentre));
  }
  const __m512i byte = _mm512_set1_epi32(0xFF);
  // cvtne2ps(b, a) holds a's 16 values, then b's: interleaved into 16 pairs (a_r, b_r)
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int half = 0; half < 2; ++half)
    for (int c = 0; c < 4; ++c) {
      const __m512i v = half ? hi[c] : lo[c];
      const int p = F::kHalf ? half : 0;
      __m512 e[4];
      for (int j = 0; j < 4; ++j) {
        const __m512i q = j == 3 ? _mm512_srli_epi32(v, 24) : _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), byte);
        e[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), sc[p], zero[p]);
      }
      uint16_t* row = out + (8 * half + 2 * c) * 32;
      _mm512_storeu_si512(row, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(e[1], e[0])));
      _mm512_storeu_si512(row + 32, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(e[3], e[2])));
    }
}

// x's rows as bf16 in the order the tiles read them: per 64 rows (amx_rows' blocks), group after group, each block of 16
// rows' 32 inputs of the group (1 KiB, one tileloadd of stride 64), so a call reads x in one stream (rows of x K apart,
// 4 KiB for K = 2048, fell into one set of the L1 and ran the tiles several times slower); the rows past `rows` zero
// (a tile always loads 16)
inline int64_t amx_act_at(int r, int g, int padded, int ng) {
  const int m0 = r & ~63, blocks = padded - m0 < 64 ? (padded - m0) / 16 : 4;
  return static_cast<int64_t>(m0) * ng * kG + (static_cast<int64_t>(g) * blocks + (r - m0) / 16) * 512 + (r % 16) * kG;
}

template <typename T>
const uint16_t* amx_acts(const T* x, int64_t xs, int rows, int K) {
  thread_local std::vector<uint16_t> a;  // grown once
  const int padded = (rows + 15) & ~15, ng = K / kG;
  a.resize(static_cast<size_t>(padded) * K);
  for (int r = 0; r < padded; ++r)
    for (int g = 0; g < ng; ++g) {
      uint16_t* to = a.data() + amx_act_at(r, g, padded, ng);
      if (r >= rows) {
        std::memset(to, 0, sizeof(uint16_t) * kG);
      } else if constexpr (sizeof(T) == 2) {
        std::memcpy(to, x + r * xs + g * kG, sizeof(uint16_t) * kG);
      } else {
        const __m512bh v = _mm512_cvtne2ps_pbh(load16(x + r * xs + g * kG + 16), load16(x + r * xs + g * kG));
        _mm512_storeu_si512(to, (__m512i)v);
      }
    }
  return a.data();
}

// A C tile's row: the outputs `valid` marks, float32 or rounded to bf16 (to nearest even, as bf16.h's store)
HOT_INLINE void store16(float* p, __m512 v, __mmask16 valid) { _mm512_mask_storeu_ps(p, valid, v); }
HOT_INLINE void store16(uint16_t* p, __m512 v, __mmask16 valid) {
  _mm256_mask_storeu_epi16(p, valid, (__m256i)_mm512_cvtneps_pbh(v));
}

// Blocks 0..MT-1 of 16 rows from row m0 against the tile whose groups wb holds (dequantized as they are needed, where
// `fresh`: one block of 64 rows or fewer, the group then still in L1), into y's outputs n0..n0+15
template <int MT, typename F, typename U>
void amx_rows(const Block<F>& b, const uint16_t* xa, int m0, int rows, int K, uint16_t* wb, bool fresh, U* y,
              int64_t ys, int n0, int N) {
  const int ng = K / kG;
  const uint16_t* xm = xa + static_cast<int64_t>(m0) * K;  // amx_acts' order: group g's block i at (g * MT + i) * 512
  constexpr int next = 512;
  _tile_zero(0);
  if (MT > 1) _tile_zero(1);
  if (MT > 2) _tile_zero(2);
  if (MT > 3) _tile_zero(3);
  for (int g = 0; g < ng; ++g) {
    uint16_t* wg = wb + g * 512;
    if (fresh) {
      const uint8_t* v = b.values(g);  // the weights a group on (the hardware prefetcher alone fell short in tile_rows)
      for (int c = 0; c < kTile * F::kRowBytes; c += 64) _mm_prefetch(reinterpret_cast<const char*>(v) + 4096 + c, _MM_HINT_T0);
      amx_weights<F>(b, g, wg);
    }
    const uint16_t* xg = xm + g * MT * 512;
    _tile_loadd(5, wg, 64);
    _tile_loadd(4, xg, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (MT > 1) {
      _tile_loadd(6, xg + 1 * next, 64);
      _tile_dpbf16ps(1, 6, 5);
    }
    if (MT > 2) {
      _tile_loadd(7, xg + 2 * next, 64);
      _tile_dpbf16ps(2, 7, 5);
    }
    if (MT > 3) {
      _tile_loadd(4, xg + 3 * next, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  alignas(64) float out[4][16 * 16];
  _tile_stored(0, out[0], 64);
  if (MT > 1) _tile_stored(1, out[1], 64);
  if (MT > 2) _tile_stored(2, out[2], 64);
  if (MT > 3) _tile_stored(3, out[3], 64);
  const __mmask16 valid = N - n0 < kTile ? static_cast<__mmask16>((1u << (N - n0)) - 1) : 0xFFFF;
  for (int i = 0; i < MT; ++i)
    for (int r = 0; r < 16 && m0 + 16 * i + r < rows; ++r)
      store16(y + (m0 + 16 * i + r) * ys + n0, _mm512_load_ps(out[i] + 16 * r), valid);
}

// This member's tiles (group_matmul's share) against every row of x
template <typename F, typename T, typename U>
void amx_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, U* y, int64_t ys, int N, int K) {
  const int ng = K / kG, padded = (rows + 15) & ~15;
  const uint16_t* xa = amx_acts(x, xs, rows, K);
  thread_local std::vector<uint16_t> wb;  // a tile's groups as bf16, 512 values a group
  wb.resize(static_cast<size_t>(ng) * 512);
  // past 64 rows the tile's groups are dequantized once, ahead, and read back for each block of 64 rows
  const bool ahead = padded > 64;
  amx_configure();
  const int tiles = quant_tiles(N);
  for (int t = tm.share_begin(tiles); t < tm.share_end(tiles); ++t) {
    const Block<F> b(w, t, K);
    if (ahead)
      for (int g = 0; g < ng; ++g) amx_weights<F>(b, g, wb.data() + g * 512);
    for (int m0 = 0; m0 < padded; m0 += 64) {
      switch ((padded - m0) / 16) {
        case 1: amx_rows<1>(b, xa, m0, rows, K, wb.data(), !ahead, y, ys, t * kTile, N); break;
        case 2: amx_rows<2>(b, xa, m0, rows, K, wb.data(), !ahead, y, ys, t * kTile, N); break;
        case 3: amx_rows<3>(b, xa, m0, rows, K, wb.data(), !ahead, y, ys, t * kTile, N); break;
        default: amx_rows<4>(b, xa, m0, rows, K, wb.data(), !ahead, y, ys, t * kTile, N); break;
      }
    }
  }
  _tile_release();
}

}  // namespace quant
