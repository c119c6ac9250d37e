// The group kernel on AVX2 (quant_matmul.cpp includes it where the build has AVX2 but not AVX512BW): weight rows in
// tiles of 8, one output per 32-bit lane, as the AVX-512 path's tiles of 16 (quant_tiles.h runs the tiles). Each
// piece of the activations, broadcast, meets all 8 rows' weights of those inputs: 4-6-bit weights with the int16
// activations' two bytes in vpmaddubsw, 8-bit ones in int16 pairs in vpmaddwd. No horizontal sums, one scale vector
// per group for 8 rows, the 5- and 6-bit planes unpacked by shifts for 8 rows at once, and several rows of x share
// one unpacking. One row at a time (a weight row's 32 inputs in one vpmaddwd, then a horizontal sum per row and
// group) took about twice as long a decode step (docs/benchmarks.md, "The group kernel on AVX2").
#pragma once

#include <immintrin.h>

#include <vector>

#include "quant_format.h"

// AVX-VNNI's vpdpbusd (Intel client CPUs since Alder Lake; -mavxvnni), or its AVX512-VL form where the build has that
// (how a CPU without AVX-VNNI tests it): four unsigned-by-signed byte products a lane summed into int32, for 8-bit
// weights too, in one instruction. x86-64-v3 has neither: vpmaddubsw and vpmaddwd then
#if defined(__AVXVNNI__)
#define QUANT_DPBUSD256(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define QUANT_DPBUSD256(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#endif

namespace quant {

#if defined(QUANT_DPBUSD256)
constexpr bool kDpbusd = true;
#else
constexpr bool kDpbusd = false;
#endif

// Rows of activations, per group of 32: x ≈ d * q with q int16 in -kQMax..kQMax, laid out for the format's products
// (split): for 8-bit weights each 4 inputs 4c..4c+3 as int16 (4c, 4c + 2, 4c + 1, 4c + 3): a tile's 32-bit lane
// holds a row's 4 weight bytes of those inputs, whose even bytes (4c, 4c + 2) and odd bytes (4c + 1, 4c + 3) become
// int16 pairs by a mask and a shift, each meeting one broadcast pair in vpmaddwd. Narrower weights meet the q's two
// signed bytes q = 256 * h + l (h = (q + 128) >> 8 <= 127, l in -128..127, as the AVX-512 path splits them) in
// vpmaddubsw, four inputs' bytes broadcast: the group's 64 bytes hold its 32 h, then its 32 l. qs and xs: the sums of
// q and the exact sums of x over inputs 0..15 (qs0, xs0) and 16..31 (qs1, xs1), or with whole groups (no Half) over
// all 32 in qs0 and xs0. Narrow (kQMax8, split always): q is l alone (h would be 0), half the products
struct Pairs {
  bool split;  // h and l bytes (split_rows), else int16 pairs
  bool narrow;
  std::vector<int16_t> q;
  std::vector<float> d, xs0, xs1;
  std::vector<int32_t> qs0, qs1;
};

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {  // 8 bfloat16 as float: the 16 bits become the top half
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(b), 16));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// Whether the activations are split into bytes for these weights and rows: for vpdpbusd always, for vpmaddubsw with
// weights of fewer than 8 bits (two products of (2^Bits - 1) * 128 make an int16 sum; 8-bit weights would saturate
// it). With scales per 16 (two parts) each row of a block holds four sums: at four rows of x they overflow AVX2's 16
// registers, and vpmaddwd on pairs ran faster there (Q6_K: 0.79x)
template <typename F>
inline bool split_rows(int rows) {
  return (kDpbusd || F::kBits < 8) && (F::kParts == 1 || rows <= 2);
}

// Rows of x that share one unpacking of a tile's group (quant_tiles.h): 6 for 8-bit weights in int16 pairs (the
// Qwen2.5-0.5B file's Q8_0 head and q|k|v at 64 rows 1.26-1.28x against 4), else 4: the 16 registers hold no more
// (6 rows: Q5_0 0.98x, Q6_K 0.90x)
template <typename F>
constexpr int row_block() {
  return F::kBits == 8 && !F::kOff && !kDpbusd ? 6 : 4;
}

// Whether these weights have int8 products with int8 activations here: vpdpbusd takes any, vpmaddubsw those below 8
// bits (8-bit ones stay int16 pairs, so their activations stay int16)
template <typename F>
constexpr bool narrow_products() {
  return kDpbusd || F::kBits < 8;
}

// as_pairs: int16 pairs whatever the weights (quant_words.h's panels take them so)
template <typename F, typename T>
const Pairs& tile_acts(const T* x, int64_t xs, int rows, int K, bool narrow, bool as_pairs = false) {
  thread_local Pairs a;  // grown once: a step calls this ~120 times
  const int ng = K / kG;
  a.narrow = !as_pairs && narrow && narrow_products<F>();
  a.split = !as_pairs && (a.narrow || split_rows<F>(rows));  // (narrow: two sums a row and part, which AVX2's registers hold)
  const float qmax = a.narrow ? kQMax8 : kQMax;
  a.q.resize(static_cast<size_t>(rows) * K);
  a.d.resize(static_cast<size_t>(rows) * ng), a.xs0.resize(a.d.size()), a.xs1.resize(a.d.size());
  a.qs0.resize(a.d.size()), a.qs1.resize(a.d.size());
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  // within each 4 int16 (8 bytes): inputs 0, 2, 1, 3
  const __m256i pairs = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,  //
                                         0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < ng; ++g) {
      const T* xg = x + r * xs + g * kG;
      __m256 v[4];
      for (int i = 0; i < 4; ++i) v[i] = load8(xg + 8 * i);
      const __m256 m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                     _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
      const float mx = hmax(m);
      const int64_t at = static_cast<int64_t>(r) * ng + g;
      const __m256 inv = _mm256_set1_ps(mx > 0.f ? qmax / mx : 0.f);
      __m256i q[4];  // rounded to nearest, ties to even, as lrintf and the AVX-512 path round
      for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      a.d[at] = mx / qmax;
      const float x0 = hsum(_mm256_add_ps(v[0], v[1])), x1 = hsum(_mm256_add_ps(v[2], v[3]));
      const int32_t q0 = hsum_i32(_mm256_add_epi32(q[0], q[1])), q1 = hsum_i32(_mm256_add_epi32(q[2], q[3]));
      if (F::kHalf)
        a.xs0[at] = x0, a.xs1[at] = x1, a.qs0[at] = q0, a.qs1[at] = q1;
      else
        a.xs0[at] = x0 + x1, a.qs0[at] = q0 + q1;
      int16_t* qg = a.q.data() + static_cast<int64_t>(r) * K + g * kG;
      if (a.narrow) {  // the l bytes alone, where split's would be (h: 0)
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256i lb = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg + 16), _mm256_permutevar8x32_epi32(lb, order));
        continue;
      }
      if (a.split) {
        __m256i h[4], l[4];
        for (int i = 0; i < 4; ++i) {
          h[i] = _mm256_srai_epi32(_mm256_add_epi32(q[i], _mm256_set1_epi32(128)), 8);
          l[i] = _mm256_sub_epi32(q[i], _mm256_slli_epi32(h[i], 8));
        }
        // the packs interleave 128-bit lanes by 4-byte pieces: the permute puts the 32 bytes back in order
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256i hb = _mm256_packs_epi16(_mm256_packs_epi32(h[0], h[1]), _mm256_packs_epi32(h[2], h[3]));
        const __m256i lb = _mm256_packs_epi16(_mm256_packs_epi32(l[0], l[1]), _mm256_packs_epi32(l[2], l[3]));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg), _mm256_permutevar8x32_epi32(hb, order));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg + 16), _mm256_permutevar8x32_epi32(lb, order));
        continue;
      }
      for (int h = 0; h < 2; ++h) {  // packs interleaves 128-bit lanes: the permute puts inputs back in order
        const __m256i w = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2 * h], q[2 * h + 1]), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg + 16 * h), _mm256_shuffle_epi8(w, pairs));
      }
    }
  return a;
}

// v's 16-bit lanes shifted left by n (right by -n): a plane's bits moved to their place within each byte
inline __m256i shift16(__m256i v, int n) { return n >= 0 ? _mm256_slli_epi16(v, n) : _mm256_srli_epi16(v, -n); }

// Chunk c of a tile's group unpacked: lo lane r holds row r's values of inputs 4c..4c+3 as bytes, hi those of
// 16 + 4c..16 + 4c + 3 (one chunk at a time: the whole group's 8 vectors and the pairs made of them overflow the 16
// registers AVX2 has)
template <typename F>
HOT_INLINE void unpack_chunk(const uint8_t* wg, int c, __m256i& lo, __m256i& hi) {
  if (F::kBits == 8) {
    lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * c));
    hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * (c + 4)));
    return;
  }
  const __m256i m4 = _mm256_set1_epi8(0x0F), p = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 32 * c));
  lo = _mm256_and_si256(p, m4), hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), m4);
  for (int pl = 0; pl < F::kBits - 4; ++pl) {  // plane pl: bit c of a byte to bit 4 + pl of lo, bit 4 + c of hi
    const __m256i plane = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + 128 + 32 * pl));
    const __m256i bit = _mm256_set1_epi8(static_cast<char>(16 << pl));
    lo = _mm256_or_si256(lo, _mm256_and_si256(shift16(plane, 4 + pl - c), bit));
    hi = _mm256_or_si256(hi, _mm256_and_si256(shift16(plane, pl - c), bit));
  }
}

// A tile's 8 scales (kind 0) or offsets (1) of group g's part
template <typename F>
HOT_INLINE __m256 tile_scales(const Block<F>& b, int g, int part, int kind) {
  const uint8_t* p = kind ? b.offsets(g, part) : b.scales(g, part);
  if (!F::kSup) return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  return _mm256_mul_ps(v, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.factors(g, kind)))));
}

HOT_INLINE __m256i broadcast4(const void* p) {  // 4 bytes into every 32-bit lane
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// acc + a pair of int16 activations (broadcast) times the int16 weight pairs of every lane
HOT_INLINE __m256i dot2(__m256i acc, __m256i w, const int16_t* x2) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, broadcast4(x2)));
}

// int16 sums of vpmaddubsw's outputs (each at most 2 * (2^Bits - 1) * 128) that stay below 2^15
template <typename F>
constexpr int kSums = F::kBits < 8 ? 32767 / (2 * ((1 << F::kBits) - 1) * 128) : 0;

// Chunks of a group whose products a part's sums hold before they are widened into int32: every chunk with vpdpbusd
// (int32 already), else as many as kSums allows (a chunk adds two products a part with whole groups, one per 16)
template <typename F>
constexpr int kChunksHeld = kDpbusd ? 4 : kSums<F> / (F::kParts == 1 ? 2 : 1);

// acc + a lane's 4 weight bytes u times 4 activation bytes s4 (broadcast), summed: in int32 with vpdpbusd, else
// vpmaddubsw's two int16 pair sums a lane
HOT_INLINE __m256i dot_bytes(__m256i acc, __m256i u, const int8_t* s4) {
#if defined(QUANT_DPBUSD256)
  return QUANT_DPBUSD256(acc, u, broadcast4(s4));
#else
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(u, broadcast4(s4)));
#endif
}

// int8 activations with vpdpbusd and one part (whole groups): the lo and hi chunks' products in two int32 chains, not
// one, whose eight dependent vpdpbusd a row bound it by their latency (as on AVX-512)
template <typename F, bool Narrow>
constexpr bool kNarrowPair = Narrow && kDpbusd && F::kParts == 1;

// One tile's group against RB rows, with the activations' bytes (split_rows): per row and part, the h bytes' and l
// bytes' products summed (dot_bytes) for kChunksHeld chunks at a time, then 256 * sum(h products) + sum(l products)
// in int32
template <typename F, int RB, bool Narrow>
HOT_INLINE void split_sums(const uint8_t* wg, const int8_t* const* xg, __m256i (*s)[F::kParts]) {
  constexpr int P = F::kParts;
  __m256i sh[RB][P], sl[RB][P];
  for (int r = 0; r < RB; ++r)
    for (int p = 0; p < P; ++p) sh[r][p] = sl[r][p] = _mm256_setzero_si256();
  for (int c = 0; c < 4; ++c) {
    __m256i lo, hi;
    unpack_chunk<F>(wg, c, lo, hi);
    for (int r = 0; r < RB; ++r) {
      const int8_t* h = xg[r] + 4 * c;
      const int8_t* l = h + kG;
      if (kNarrowPair<F, Narrow>) {  // the hi chunks' products in sh, the second chain (see kNarrowPair)
        sl[r][0] = dot_bytes(sl[r][0], lo, l), sh[r][0] = dot_bytes(sh[r][0], hi, l + 16);
        continue;
      }
      sl[r][0] = dot_bytes(sl[r][0], lo, l), sl[r][P - 1] = dot_bytes(sl[r][P - 1], hi, l + 16);
      if (!Narrow) sh[r][0] = dot_bytes(sh[r][0], lo, h), sh[r][P - 1] = dot_bytes(sh[r][P - 1], hi, h + 16);
    }
    if ((c + 1) % kChunksHeld<F> != 0 && c != 3) continue;
    for (int r = 0; r < RB; ++r)  // into int32
      for (int p = 0; p < P; ++p) {
#if defined(QUANT_DPBUSD256)
        const __m256i t = kNarrowPair<F, Narrow> ? _mm256_add_epi32(sl[r][p], sh[r][p])
                          : Narrow ? sl[r][p] : _mm256_add_epi32(_mm256_slli_epi32(sh[r][p], 8), sl[r][p]);
#else
        const __m256i tl = _mm256_madd_epi16(sl[r][p], _mm256_set1_epi16(1));
        const __m256i t = Narrow ? tl : _mm256_add_epi32(_mm256_madd_epi16(sh[r][p], _mm256_set1_epi16(256)), tl);
#endif
        s[r][p] = _mm256_add_epi32(s[r][p], t);
        sh[r][p] = sl[r][p] = _mm256_setzero_si256();
      }
  }
}

// One tile against RB rows of x from row r0: y[r0.., n0..n0+7] (outputs past N are padding, not stored); the weights
// asked for `ahead` bytes on (prefetch_distance), as the AVX-512 path does
template <typename F, int RB, typename U>
void tile_rows(const Block<F>& b, const Pairs& a, int r0, int K, U* y, int64_t ys, int n0, int N, int ahead) {
  const int ng = K / kG;
  constexpr int P = F::kParts;
  const __m256i even = _mm256_set1_epi16(0x00FF);
  __m256 acc[RB], zacc[RB];  // two chains per row: the scale and the zero terms
  for (int r = 0; r < RB; ++r) acc[r] = _mm256_setzero_ps(), zacc[r] = _mm256_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    const uint8_t* wg = b.values(g);
    for (int c = 0; c < kTile * F::kRowBytes; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wg) + ahead + c, _MM_HINT_T0);
    __m256i s[RB][P];  // per row and part: sum(q * xq), exact in int32 (at most 32 * 255 * 32639 < 2^28)
    for (int r = 0; r < RB; ++r)
      for (int p = 0; p < P; ++p) s[r][p] = _mm256_setzero_si256();
    bool done = false;
    if constexpr (kDpbusd || F::kBits < 8) {
      if (a.split) {
        const int8_t* xg[RB];
        for (int r = 0; r < RB; ++r)
          xg[r] = reinterpret_cast<const int8_t*>(a.q.data() + static_cast<int64_t>(r0 + r) * K + g * kG);
        if (a.narrow)
          split_sums<F, RB, true>(wg, xg, s);
        else
          split_sums<F, RB, false>(wg, xg, s);
        done = true;
      }
    }
    for (int c = 0; c < 4 && !done; ++c) {
      __m256i lo, hi;
      unpack_chunk<F>(wg, c, lo, hi);
      // the bytes as int16 pairs: even inputs 4c, 4c + 2 and odd 4c + 1, 4c + 3 of each lane's row
      const __m256i lo_e = _mm256_and_si256(lo, even), lo_o = _mm256_srli_epi16(lo, 8);
      const __m256i hi_e = _mm256_and_si256(hi, even), hi_o = _mm256_srli_epi16(hi, 8);
      for (int r = 0; r < RB; ++r) {
        const int16_t* xq = a.q.data() + static_cast<int64_t>(r0 + r) * K + g * kG + 4 * c;
        s[r][0] = dot2(dot2(s[r][0], lo_e, xq), lo_o, xq + 2);
        s[r][P - 1] = dot2(dot2(s[r][P - 1], hi_e, xq + 16), hi_o, xq + 18);
      }
    }
    __m256 sc[P], zc[P];
    for (int p = 0; p < P; ++p) {
      sc[p] = tile_scales<F>(b, g, p, 0);
      if (F::kOff)  // the zero point
        zc[p] = _mm256_fmadd_ps(_mm256_set1_ps(F::kCentre), sc[p], tile_scales<F>(b, g, p, 1));
    }
    for (int r = 0; r < RB; ++r) {
      const int64_t at = static_cast<int64_t>(r0 + r) * ng + g;
      const __m256 d = _mm256_set1_ps(a.d[at]);
      for (int p = 0; p < P; ++p) {
        // sum((q - centre) * xq), then scale * d times it
        const int qs = p ? a.qs1[at] : a.qs0[at];
        const __m256i q = _mm256_sub_epi32(s[r][p], _mm256_set1_epi32(F::kCentre * qs));
        acc[r] = _mm256_fmadd_ps(sc[p], _mm256_mul_ps(_mm256_cvtepi32_ps(q), d), acc[r]);
        if (F::kOff) zacc[r] = _mm256_fmadd_ps(zc[p], _mm256_set1_ps(p ? a.xs1[at] : a.xs0[at]), zacc[r]);
      }
    }
  }
  const int valid = N - n0 < kTile ? N - n0 : kTile;
  for (int r = 0; r < RB; ++r) {
    alignas(32) float out[kTile];
    _mm256_store_ps(out, _mm256_add_ps(acc[r], zacc[r]));
    for (int i = 0; i < valid; ++i) store(y + (r0 + r) * ys + n0 + i, out[i]);
  }
}

}  // namespace quant
