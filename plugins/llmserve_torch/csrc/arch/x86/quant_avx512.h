// The group kernel on AVX-512 (quant_matmul.cpp includes it where the build has AVX512BW): weight rows in tiles of
// 16, one output per lane (quant_tiles.h runs the tiles); vpdpbusd with AVX512-VNNI, vpmaddubsw without.
#pragma once

#include <immintrin.h>

#include <vector>

#include "quant_format.h"

namespace quant {

// A 4-byte piece of the activations, broadcast, meets all 16 rows in one vpdpbusd: no horizontal sums, no per-row
// tails (576 inputs are 18 groups: a per-row layout had 2 left over after blocks of four), one scale vector per
// group. A per-row layout was bound by its own arithmetic, not by memory (docs/benchmarks.md, "The kernels' choices").
// Rows of activations, per group of 32: x ≈ d * q with q in -kQMax..kQMax, each q as two signed bytes q = 256 * h +
// l (vpdpbusd multiplies unsigned by signed bytes: the weights 64 at a time, no widening, the same integer sums); qs
// and xs: the sums of q and the exact sums of x over inputs 0..15 (qs0, xs0) and 16..31 (qs1, xs1), or with whole
// groups (no Half) over all 32 in qs0 and xs0. Narrow (kQMax8): q is l alone, h is not written, half the products
struct Split {
  bool narrow;
  std::vector<int8_t> h, l;
  std::vector<float> d, xs0, xs1;
  std::vector<int32_t> qs0, qs1;
};

// Rows of x that share one unpacking of a tile's group (quant_tiles.h): 16 with the 32 registers for formats without
// offsets (each group's unpacking and scales then feed more rows: at 64 rows against 4, Q5_0 8-11 % faster, Q6_K 17 %;
// 16 against 8: a Qwen2.5-0.5B step's linears 2-5 % with int16 activations, 5 % with int8), 8 for those with, whose
// zero terms then take a pass of their own (zero_terms): against 4, Q4_K 7-8 % faster with int16 activations and
// 14 % with int8, Q4_1 3-5 % and 10 %; 16 rows ran a 49152-output Q4_1 head 6 % slower at 500 int16 rows
template <typename F>
constexpr int row_block() {
  return F::kOff ? 8 : 16;
}

// Every format has int8 products with int8 activations here (vpdpbusd, or vpmaddubsw on nibbles)
template <typename F>
constexpr bool narrow_products() {
  return true;
}

inline __m512 load16_half(const uint16_t* p) {  // 16 float16 as float
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 as float: the 16 bits become the top half
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

template <typename F, typename T>
const Split& tile_acts(const T* x, int64_t xs, int rows, int K, bool narrow) {
  thread_local Split a;  // grown once: a step calls this ~120 times
  const int ng = K / kG;
  const float qmax = narrow ? kQMax8 : kQMax;
  a.narrow = narrow;
  a.h.resize(static_cast<size_t>(rows) * K), a.l.resize(a.h.size());
  a.d.resize(static_cast<size_t>(rows) * ng), a.xs0.resize(a.d.size()), a.xs1.resize(a.d.size());
  a.qs0.resize(a.d.size()), a.qs1.resize(a.d.size());
  const __m512i c128 = _mm512_set1_epi32(128);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < ng; ++g) {
      const T* xg = x + r * xs + g * kG;
      const __m512 v0 = load16(xg), v1 = load16(xg + 16);
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const int64_t at = static_cast<int64_t>(r) * ng + g;
      const __m512 inv = _mm512_set1_ps(mx > 0.f ? qmax / mx : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      a.d[at] = mx / qmax;
      if (F::kHalf) {
        a.xs0[at] = _mm512_reduce_add_ps(v0), a.xs1[at] = _mm512_reduce_add_ps(v1);
        a.qs0[at] = _mm512_reduce_add_epi32(q0), a.qs1[at] = _mm512_reduce_add_epi32(q1);
      } else {
        a.xs0[at] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        a.qs0[at] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      }
      int8_t* h = a.h.data() + static_cast<int64_t>(r) * K + g * kG;
      int8_t* l = a.l.data() + static_cast<int64_t>(r) * K + g * kG;
      if (narrow) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(l), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(l + 16), _mm512_cvtepi32_epi8(q1));
        continue;
      }
      for (int half = 0; half < 2; ++half) {
        const __m512i q = half ? q1 : q0;
        const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(q, c128), 8);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(h + 16 * half), _mm512_cvtepi32_epi8(hi));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(l + 16 * half),
                         _mm512_cvtepi32_epi8(_mm512_sub_epi32(q, _mm512_slli_epi32(hi, 8))));
      }
    }
  return a;
}

// acc + the sums of four unsigned-by-signed byte products per lane (u: weights of Bits bits)
template <int Bits>
HOT_INLINE __m512i dot4(__m512i acc, __m512i u, const int8_t* s4) {
  int32_t v;
  std::memcpy(&v, s4, 4);
  const __m512i s = _mm512_set1_epi32(v);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  const __m512i ones = _mm512_set1_epi16(1);
  if (Bits < 8)  // |2 * 63 * 128| fits vpmaddubsw's saturating int16 pair sums
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), ones));
  // 8-bit weights would saturate them (2 * 255 * 128): each nibble on its own, the high one's sums times 16
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  const __m512i lo = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(u, m4), s), ones);
  const __m512i hi = _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_and_si512(_mm512_srli_epi16(u, 4), m4), s), ones);
  return _mm512_add_epi32(acc, _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 4)));
#endif
}

// v's 16-bit lanes shifted left by n (right by -n): a plane's bits moved to their place within each byte
inline __m512i shift16(__m512i v, int n) { return n >= 0 ? _mm512_slli_epi16(v, n) : _mm512_srli_epi16(v, -n); }

// A tile's group unpacked: lo[c] lane r holds row r's values of inputs 4c..4c+3, hi[c] those of 16 + 4c..16 + 4c + 3
template <typename F>
HOT_INLINE void unpack_tile(const uint8_t* wg, __m512i* lo, __m512i* hi) {
  if (F::kBits == 8) {
    for (int c = 0; c < 4; ++c)
      lo[c] = _mm512_loadu_si512(wg + 64 * c), hi[c] = _mm512_loadu_si512(wg + 64 * (c + 4));
    return;
  }
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  for (int c = 0; c < 4; ++c) {
    const __m512i p = _mm512_loadu_si512(wg + 64 * c);
    lo[c] = _mm512_and_si512(p, m4), hi[c] = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
  }
  for (int p = 0; p < F::kBits - 4; ++p) {  // plane p: bit c of a byte to bit 4 + p of lo[c], bit 4 + c of hi[c]
    const __m512i plane = _mm512_loadu_si512(wg + 256 + 64 * p), bit = _mm512_set1_epi8(static_cast<char>(16 << p));
    for (int c = 0; c < 4; ++c) {
      lo[c] = _mm512_or_si512(lo[c], _mm512_and_si512(shift16(plane, 4 + p - c), bit));
      hi[c] = _mm512_or_si512(hi[c], _mm512_and_si512(shift16(plane, p - c), bit));
    }
  }
}

// A tile's 16 scales (kind 0) or offsets (1) of group g's part
template <typename F>
HOT_INLINE __m512 tile_scales(const Block<F>& b, int g, int part, int kind) {
  const uint8_t* p = kind ? b.offsets(g, part) : b.scales(g, part);
  if (!F::kSup) return load16_half(reinterpret_cast<const uint16_t*>(p));
  const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  return _mm512_mul_ps(v, load16_half(b.factors(g, kind)));
}

// A tile's 16 zero points of group g's part, given its scales sc: centre * scale + offset
template <typename F>
HOT_INLINE __m512 tile_zero(const Block<F>& b, int g, int part, __m512 sc) {
  return _mm512_fmadd_ps(_mm512_set1_ps(F::kCentre), sc, tile_scales<F>(b, g, part, 1));
}

// zacc[r] += each group's zero point (the tile's, per lane) times row r0 + r's exact sum of x over the group: the
// same operations in the same order as tile_rows' own zero chain, so the same sums; a pass of its own for blocks of
// more than 4 rows, whose second chain a row would spill the registers the products need (the tile's scales and
// offsets, a few KiB, are still in L1)
template <typename F, int RB>
HOT_INLINE void zero_terms(const Block<F>& b, const Split& a, int r0, int K, __m512* zacc) {
  const int ng = K / kG;
  for (int g = 0; g < ng; ++g)
    for (int p = 0; p < F::kParts; ++p) {
      const __m512 zc = tile_zero<F>(b, g, p, tile_scales<F>(b, g, p, 0));
      for (int r = 0; r < RB; ++r) {
        const int64_t at = static_cast<int64_t>(r0 + r) * ng + g;
        zacc[r] = _mm512_fmadd_ps(zc, _mm512_set1_ps(p ? a.xs1[at] : a.xs0[at]), zacc[r]);
      }
    }
}

// One tile against RB rows of x from row r0: y[r0.., n0..n0+15] (outputs past N are padding, not stored). Each
// group asks for the weights `ahead` bytes on (prefetch_distance): the hardware prefetcher alone left a one-row
// matmul short of the machine's bandwidth (a step's 30 layers do not fit the L3)
template <typename F, int RB, typename U>
void tile_rows(const Block<F>& b, const Split& a, int r0, int K, U* y, int64_t ys, int n0, int N, int ahead) {
  const int ng = K / kG;
  constexpr int P = F::kParts;
  // two sums per row: the scale and the zero terms; the zero terms in a pass of their own after the products
  // (zero_terms) where a block has more than 4 rows, so the products' loop holds only one per row
  constexpr bool kZeroApart = F::kOff && RB > 4;
  __m512 acc[RB], zacc[RB];
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps(), zacc[r] = _mm512_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    const uint8_t* wg = b.values(g);
    for (int c = 0; c < kTile * F::kRowBytes; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wg) + ahead + c, _MM_HINT_T0);
    __m512i lo[4], hi[4];
    unpack_tile<F>(wg, lo, hi);
    __m512 sc[P], zc[P];
    for (int p = 0; p < P; ++p) {
      sc[p] = tile_scales<F>(b, g, p, 0);
      if (F::kOff && !kZeroApart)  // the zero point
        zc[p] = tile_zero<F>(b, g, p, sc[p]);
    }
    for (int r = 0; r < RB; ++r) {
      const int64_t row = r0 + r, at = row * ng + g;
      const int8_t* h = a.h.data() + row * K + g * kG;
      const int8_t* l = a.l.data() + row * K + g * kG;
      // per part: sum((q - centre) * xq), exact in int32 (at most 32 * 255 * 32639 < 2^28), from -centre * sum(xq):
      // the centre's term taken in the start value, not by a subtraction after (one vector op fewer a row); the low
      // activation bytes' products summed into it, the high ones' (none where narrow) apart, then 256 times them
      __m512i s[P];
      for (int p = 0; p < P; ++p) s[p] = _mm512_set1_epi32(-F::kCentre * (p ? a.qs1[at] : a.qs0[at]));
      if (a.narrow) {
        // two chains where the parts share one (P == 1): eight dependent vpdpbusd a row were its latency's bound;
        // four in blocks of 8 rows with plain scales (Q4_1, Q5_1), where the registers hold them
        __m512i t = P > 1 ? s[P - 1] : _mm512_setzero_si512();
        if (P == 1 && RB <= 8 && !F::kSup) {
          __m512i u0 = _mm512_setzero_si512(), u1 = _mm512_setzero_si512();
          for (int c = 0; c < 4; c += 2) {
            s[0] = dot4<F::kBits>(s[0], lo[c], l + 4 * c), t = dot4<F::kBits>(t, hi[c], l + 16 + 4 * c);
            u0 = dot4<F::kBits>(u0, lo[c + 1], l + 4 * c + 4), u1 = dot4<F::kBits>(u1, hi[c + 1], l + 20 + 4 * c);
          }
          s[0] = _mm512_add_epi32(_mm512_add_epi32(s[0], u0), _mm512_add_epi32(t, u1));
        } else {
          for (int c = 0; c < 4; ++c)
            s[0] = dot4<F::kBits>(s[0], lo[c], l + 4 * c), t = dot4<F::kBits>(t, hi[c], l + 16 + 4 * c);
          if (P > 1)
            s[P - 1] = t;
          else
            s[0] = _mm512_add_epi32(s[0], t);
        }
      } else {
        // four chains where the parts share two (P == 1), as the narrow sums above
        __m512i sh[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        __m512i t = P > 1 ? s[P - 1] : _mm512_setzero_si512();
        for (int c = 0; c < 4; ++c) {
          sh[0] = dot4<F::kBits>(sh[0], lo[c], h + 4 * c), s[0] = dot4<F::kBits>(s[0], lo[c], l + 4 * c);
          sh[1] = dot4<F::kBits>(sh[1], hi[c], h + 16 + 4 * c), t = dot4<F::kBits>(t, hi[c], l + 16 + 4 * c);
        }
        if (P > 1) {
          s[0] = _mm512_add_epi32(_mm512_slli_epi32(sh[0], 8), s[0]);
          s[P - 1] = _mm512_add_epi32(_mm512_slli_epi32(sh[1], 8), t);
        } else {
          s[0] = _mm512_add_epi32(_mm512_slli_epi32(_mm512_add_epi32(sh[0], sh[1]), 8), _mm512_add_epi32(s[0], t));
        }
      }
      const __m512 d = _mm512_set1_ps(a.d[at]);
      if constexpr (P == 2) {  // d * (sc0 * s0 + sc1 * s1): one multiply by d a row, not one a part
        const __m512 t = _mm512_fmadd_ps(sc[1], _mm512_cvtepi32_ps(s[1]), _mm512_mul_ps(sc[0], _mm512_cvtepi32_ps(s[0])));
        acc[r] = _mm512_fmadd_ps(t, d, acc[r]);
      } else {
        acc[r] = _mm512_fmadd_ps(sc[0], _mm512_mul_ps(_mm512_cvtepi32_ps(s[0]), d), acc[r]);
      }
      if (F::kOff && !kZeroApart)
        for (int p = 0; p < P; ++p)
          zacc[r] = _mm512_fmadd_ps(zc[p], _mm512_set1_ps(p ? a.xs1[at] : a.xs0[at]), zacc[r]);
    }
  }
  if constexpr (kZeroApart) zero_terms<F, RB>(b, a, r0, K, zacc);
  const int valid = N - n0 < kTile ? N - n0 : kTile;
  for (int r = 0; r < RB; ++r) {
    alignas(64) float out[kTile];
    _mm512_store_ps(out, _mm512_add_ps(acc[r], zacc[r]));
    for (int i = 0; i < valid; ++i) store(y + (r0 + r) * ys + n0 + i, out[i]);
  }
}

}  // namespace quant
