// Weight-only matmuls on group-quantized weights: y[r, n] = sum_k x[r, k] * w[n, k], each quantized weight row
// read once from memory for all rows (torch's _weight_int4pack_mm_for_cpu read ~16 GB/s with bf16 activations, and
// took a slow path with float32 ones). A group format (Fmt) holds values of 4, 5, 6 or 8 bits in groups of 32 inputs
// with float16 scales (and offsets): a GGUF file's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 blocks each map
// onto one of them at the file's own bits (gguf_quant.py), so no value is rounded twice. Activations are quantized to
// int16 per group of 32, so the inner products run on integer SIMD: with AVX-512, weight rows in tiles of 16 meet
// each int16's two bytes in vpdpbusd (vpmaddubsw without VNNI); with AVX2, one row at a time through vpmaddwd; on
// ARM64 the same rows through NEON (vdotq_s32 on the two bytes with the dot product); a scalar loop without any
// (-march=native picks; pack_own in quant.py lays the weights out for the build's path).
// Not int8 as llama.cpp's Q8_1: SmolLM2's activations have outliers, a group's small values then round to zero, and
// greedy answers changed with a prefix-cache hit (the last prompt rows taking this kernel instead of the dense copy).
//
// Plain C ABI, loaded with ctypes together with the other CPU kernels (one library).

#include <math.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include <arm_neon.h>
#endif

#include "bf16.h"
#include "kernels.h"

namespace {

// The per-group helpers of the SIMD paths, inlined whatever the compiler's size heuristics say: with a dozen formats
// instantiated, g++ called the AVX2 path's out of line and a row at a time ran ~30 % slower
#define HOT_INLINE inline __attribute__((always_inline))

constexpr int kG = 32;  // a group: 32 inputs, llama.cpp's Q4_0 ... Q8_0 block and the K-quants' sub-block

// The largest |q| of an activation rounded to int16: 256 * 127 + 127, so that q splits into two signed bytes
// (xh = (q + 128) >> 8 stays <= 127) for the AVX-512 path
constexpr float kQMax = 32639.f;

// Rows a tile of the weights' layout holds: 16 with AVX-512 (one output per lane), else 1 (rows in order)
#if defined(__AVX512BW__)
constexpr int kTile = 16;
#else
constexpr int kTile = 1;
#endif

// A group format: 32 values q of Bits bits (0 .. 2^Bits - 1), then their scales and, with Off, offsets:
// w = q * scale + offset, or without Off w = (q - 2^(Bits-1)) * scale (symmetric: Q4_0, Q5_0, Q6_K, Q8_0 store no
// offset). With Half, scales and offsets are per 16 inputs (Q6_K's sub-blocks), else per 32. Scales and offsets are
// float16, or with Sup (the K-quants' own form, exact) int8 multiples of a float16 factor per super-block of 8 groups
// (256 inputs): scale = d * sc, offset = dneg * m. A row's group takes kRowBytes: its values as Bits 4-byte chunks
// (Bits < 8: a nibble plane of 16 bytes, byte j holding inputs j (low nibble) and j + 16 (high), then one 4-byte plane
// for each bit above the fourth, byte j's bit c holding input 4c + j's and bit 4 + c input 16 + 4c + j's; Bits 8: the
// 32 bytes in order), then its scales, then its offsets; with Sup a row's super-block also holds kHeadBytes of
// factors (d, then dneg).
template <int Bits, bool Off, bool Half, bool Sup = false>
struct Fmt {
  static constexpr int kBits = Bits;
  static constexpr bool kOff = Off, kHalf = Half, kSup = Sup;
  static constexpr int kCentre = 1 << (Bits - 1);  // the integer sums meet w - zero = (q - kCentre) * scale
  static constexpr int kParts = Half ? 2 : 1;      // scales (and offsets) a row's group
  static constexpr int kValueBytes = 4 * Bits;
  static constexpr int kScaleBytes = Sup ? 1 : 2;  // an int8 multiple, or a float16
  static constexpr int kRowBytes = kValueBytes + kScaleBytes * kParts * (Off ? 2 : 1);
  static constexpr int kSuperGroups = Sup ? 8 : 1;  // groups that share a row's factors
  static constexpr int kHeadBytes = Sup ? 2 * (Off ? 2 : 1) : 0;
  static constexpr int kCode = quant_format(Bits, Off, Half, Sup);
};

inline float to_float(int8_t v) { return static_cast<float>(v); }

// Tile t of pack_own's layout. In tiles of 16 rows, group after group: the group's values as chunks of 64 bytes,
// dword r of chunk c holding row r's 4-byte chunk c (so a tile's group is read in one sequential stream: values,
// scales and offsets in three regions of a tile ran 24 % slower at one row), then its scales [parts][16], then its
// offsets [parts][16]; with Sup each super-block of 8 groups starts with its factors d [16], then dneg [16]. Rows in
// order (kTile 1): a row's groups' values, then its scales [parts][groups], then its offsets [parts][groups] (the
// AVX2 path reads eight groups' scales at once), then with Sup its factors d [groups / 8], then dneg.
template <typename F>
struct Block {
  const uint8_t* base;
  int ng;
  static constexpr int64_t kSuperBytes = kTile * (F::kHeadBytes + F::kSuperGroups * F::kRowBytes);
  Block(const uint8_t* w, int64_t t, int K) : base(w + t * (K / kG / F::kSuperGroups) * kSuperBytes), ng(K / kG) {}
#if defined(__AVX512BW__)
  const uint8_t* head(int g) const { return base + (g / F::kSuperGroups) * kSuperBytes; }
  const uint8_t* values(int g) const {
    return head(g) + kTile * F::kHeadBytes + (g % F::kSuperGroups) * kTile * F::kRowBytes;
  }
  const uint8_t* scales(int g, int part) const {
    return values(g) + kTile * F::kValueBytes + part * kTile * F::kScaleBytes;
  }
  const uint8_t* offsets(int g, int part) const { return scales(g, 0) + (F::kParts + part) * kTile * F::kScaleBytes; }
  const uint16_t* factors(int g, int which) const {  // d (0) or dneg (1) of g's super-block
    return reinterpret_cast<const uint16_t*>(head(g)) + which * kTile;
  }
#else
  const uint8_t* values(int g) const { return base + g * F::kValueBytes; }
  const uint8_t* scales(int g, int part) const {
    return base + ng * F::kValueBytes + (part * ng + g) * F::kScaleBytes;
  }
  const uint8_t* offsets(int g, int part) const { return scales(g, part) + F::kParts * ng * F::kScaleBytes; }
  const uint16_t* factors(int g, int which) const {
    return reinterpret_cast<const uint16_t*>(base + ng * F::kRowBytes) + (which * ng + g) / F::kSuperGroups;
  }
#endif
  // group g's scale (kind 0) or offset (1) of a part, for row 0 of the block (the scalar path)
  float scalar(int g, int part, int kind) const {
    const uint8_t* p = kind ? offsets(g, part) : scales(g, part);
    if (F::kSup) return to_float(static_cast<int8_t>(*p)) * load_half(*factors(g, kind));
    uint16_t h;
    std::memcpy(&h, p, 2);
    return load_half(h);
  }
};

// One group's 32 values as integers (the scalar path and the AVX2 path's groups left over)
template <typename F>
inline void group_values(const uint8_t* v, int* q) {
  if (F::kBits == 8) {
    for (int i = 0; i < kG; ++i) q[i] = v[i];
    return;
  }
  for (int j = 0; j < 16; ++j) q[j] = v[j] & 15, q[j + 16] = v[j] >> 4;
  for (int p = 0; p < F::kBits - 4; ++p)
    for (int j = 0; j < 4; ++j)
      for (int c = 0; c < 4; ++c) {
        const int b = v[16 + 4 * p + j];
        q[4 * c + j] |= ((b >> c) & 1) << (4 + p);
        q[16 + 4 * c + j] |= ((b >> (4 + c)) & 1) << (4 + p);
      }
}

#if defined(__AVX512BW__)
// ---- AVX-512: weight rows in tiles of 16, one output per lane ---------------------------------------------------
//
// A 4-byte piece of the activations, broadcast, meets all 16 rows in one vpdpbusd: no horizontal sums, no per-row
// tails (576 inputs are 18 groups: a per-row layout had 2 left over after blocks of four), one scale vector per
// group. 120 SmolLM2-shaped int4 matrices at one row, from memory, 2 threads of a Zen 5 EPYC: 1.80 ms in the per-row
// layout (44 GB/s), 1.30 ms in tiles (61 GB/s).
constexpr int kRowBlock = 4;  // rows of x that share one unpacking of a tile's group

// Rows of activations, per group of 32: x ≈ d * q with q in -kQMax..kQMax, each q as two signed bytes q = 256 * h +
// l (vpdpbusd multiplies unsigned by signed bytes: the weights 64 at a time, no widening, the same integer sums); qs
// and xs: the sums of q and the exact sums of x over inputs 0..15 (qs0, xs0) and 16..31 (qs1, xs1), or with whole
// groups (no Half) over all 32 in qs0 and xs0
struct Split {
  std::vector<int8_t> h, l;
  std::vector<float> d, xs0, xs1;
  std::vector<int32_t> qs0, qs1;
};

inline __m512 load16_half(const uint16_t* p) {  // 16 float16 as float
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 as float: the 16 bits become the top half
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

template <bool Half, typename T>
const Split& split_rows(const T* x, int64_t xs, int rows, int K) {
  thread_local Split a;  // grown once: a step calls this ~120 times
  const int ng = K / kG;
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
      const __m512 inv = _mm512_set1_ps(mx > 0.f ? kQMax / mx : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      a.d[at] = mx / kQMax;
      if (Half) {
        a.xs0[at] = _mm512_reduce_add_ps(v0), a.xs1[at] = _mm512_reduce_add_ps(v1);
        a.qs0[at] = _mm512_reduce_add_epi32(q0), a.qs1[at] = _mm512_reduce_add_epi32(q1);
      } else {
        a.xs0[at] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
        a.qs0[at] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
      }
      int8_t* h = a.h.data() + static_cast<int64_t>(r) * K + g * kG;
      int8_t* l = a.l.data() + static_cast<int64_t>(r) * K + g * kG;
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

// One tile against RB rows of x from row r0: y[r0.., n0..n0+15] (outputs past N are padding, not stored). Each
// group asks for the weights `ahead` bytes on (prefetch_distance): the hardware prefetcher alone left a one-row
// matmul short of the machine's bandwidth (a step's 30 layers do not fit the L3)
template <typename F, int RB, typename U>
void tile_rows(const Block<F>& b, const Split& a, int r0, int K, U* y, int64_t ys, int n0, int N, int ahead) {
  const int ng = K / kG;
  constexpr int P = F::kParts;
  __m512 acc[RB], zacc[RB];  // two chains per row: the scale and the zero terms
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
      if (F::kOff)  // the zero point
        zc[p] = _mm512_fmadd_ps(_mm512_set1_ps(F::kCentre), sc[p], tile_scales<F>(b, g, p, 1));
    }
    for (int r = 0; r < RB; ++r) {
      const int64_t row = r0 + r, at = row * ng + g;
      const int8_t* h = a.h.data() + row * K + g * kG;
      const int8_t* l = a.l.data() + row * K + g * kG;
      __m512i sh[P], sl[P];  // per part: the high and low activation bytes' sums
      for (int p = 0; p < P; ++p) sh[p] = sl[p] = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        sh[0] = dot4<F::kBits>(sh[0], lo[c], h + 4 * c), sl[0] = dot4<F::kBits>(sl[0], lo[c], l + 4 * c);
        sh[P - 1] = dot4<F::kBits>(sh[P - 1], hi[c], h + 16 + 4 * c);
        sl[P - 1] = dot4<F::kBits>(sl[P - 1], hi[c], l + 16 + 4 * c);
      }
      const __m512 d = _mm512_set1_ps(a.d[at]);
      for (int p = 0; p < P; ++p) {
        // sum((q - centre) * xq), exact in int32 (at most 32 * 255 * 32639 < 2^28), then scale * d times it
        const int qs = p ? a.qs1[at] : a.qs0[at];
        const __m512i s = _mm512_sub_epi32(_mm512_add_epi32(_mm512_slli_epi32(sh[p], 8), sl[p]),
                                           _mm512_set1_epi32(F::kCentre * qs));
        acc[r] = _mm512_fmadd_ps(sc[p], _mm512_mul_ps(_mm512_cvtepi32_ps(s), d), acc[r]);
        if (F::kOff) zacc[r] = _mm512_fmadd_ps(zc[p], _mm512_set1_ps(p ? a.xs1[at] : a.xs0[at]), zacc[r]);
      }
    }
  }
  const int valid = N - n0 < kTile ? N - n0 : kTile;
  for (int r = 0; r < RB; ++r) {
    alignas(64) float out[kTile];
    _mm512_store_ps(out, _mm512_add_ps(acc[r], zacc[r]));
    for (int i = 0; i < valid; ++i) store(y + (r0 + r) * ys + n0 + i, out[i]);
  }
}

// This member's tiles; every member quantizes x itself into its own buffers, at the same time (one thread did it
// before the others started, which took as long, and a shared copy would need a barrier)
template <typename F, typename T, typename U>
void group_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, U* y, int64_t ys, int N, int K) {
  const int tiles = quant_tiles(N);
  const Split& a = split_rows<F::kHalf>(x, xs, rows, K);
  // SmolLM2's fused layers, builds alternated in one process (2 threads of a Zen 5 EPYC, weights in huge pages), 8
  // KiB against 4 KiB where the VM read ~90 GB/s: 0.91-0.94 at one sequence, 0.95 at two, 0.98 at three and four,
  // 1.02 at eight (so more rows keep 4 KiB); where it read ~55: 0.97-1.01 at one to four (docs/benchmarks.md)
  const int ahead = prefetch_distance(rows, 8192);
  const int t0 = tm.share_begin(tiles), t1 = tm.share_end(tiles);
  for (int t = t0; t < t1; ++t) {
    const Block<F> b(w, t, K);
    int r0 = 0;
    for (; r0 + kRowBlock <= rows; r0 += kRowBlock) tile_rows<F, kRowBlock>(b, a, r0, K, y, ys, t * kTile, N, ahead);
    switch (rows - r0) {
      case 3: tile_rows<F, 3>(b, a, r0, K, y, ys, t * kTile, N, ahead); break;
      case 2: tile_rows<F, 2>(b, a, r0, K, y, ys, t * kTile, N, ahead); break;
      case 1: tile_rows<F, 1>(b, a, r0, K, y, ys, t * kTile, N, ahead); break;
      default: break;
    }
  }
}

#else
// ---- AVX2, NEON and scalar: one weight row at a time, in its natural packing ------------------------------------

// One row of activations, per group of 32: x ≈ d * q with q in -kQMax..kQMax; qs and xs: the sums of q and the
// exact sums of x (the zero term needs no rounding: llama.cpp's Q8_1 keeps d * sum(q) there instead) over inputs
// 0..15 (qs0, xs0) and over all 32 (qs, xs)
struct Acts {
  std::vector<int16_t> q;
  std::vector<float> d, xs0, xs;
  std::vector<int32_t> qs0, qs;
};

#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
// With ARM's dot product (vdotq_s32 multiplies signed bytes only), each group's q is kept as two signed bytes, q =
// 256 * h + l as the AVX-512 path splits it (|q| <= kQMax: h = (q + 128) >> 8 stays <= 127, l in -128..127): the
// group's 64 bytes in Acts::q then hold its 32 h, then its 32 l, in place of its 32 int16 (nothing else reads them).
inline void split_bytes(std::vector<int16_t>& q) {
  for (size_t i = 0; i < q.size(); i += kG) {
    int8_t hl[2 * kG];
    for (int j = 0; j < kG; j += 8) {
      const int16x8_t v = vld1q_s16(q.data() + i + j);
      const int16x8_t h = vshrq_n_s16(vaddq_s16(v, vdupq_n_s16(128)), 8);
      vst1_s8(hl + j, vmovn_s16(h));
      vst1_s8(hl + kG + j, vmovn_s16(vsubq_s16(v, vshlq_n_s16(h, 8))));
    }
    std::memcpy(q.data() + i, hl, sizeof(hl));
  }
}
#endif

template <typename T>
const Acts& quantize_rows(const T* x, int64_t xs, int rows, int K) {
  thread_local Acts a;  // grown once: a step calls this ~120 times
  const int ng = K / kG;
  a.q.resize(static_cast<size_t>(rows) * K);
  for (auto* v : {&a.d, &a.xs0, &a.xs}) v->resize(static_cast<size_t>(rows) * ng);
  a.qs0.resize(a.d.size()), a.qs.resize(a.d.size());
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < ng; ++g) {
      const T* xg = x + r * xs + g * kG;
      float mx = 0.f, sum[2] = {0.f, 0.f};
      for (int i = 0; i < kG; ++i) {
        mx = fmaxf(mx, fabsf(load(xg[i])));
        sum[i >= 16] += load(xg[i]);
      }
      const float inv = mx > 0.f ? kQMax / mx : 0.f;
      int16_t* qg = a.q.data() + static_cast<int64_t>(r) * K + g * kG;
      int qsum[2] = {0, 0};
      for (int i = 0; i < kG; ++i) {
        qg[i] = static_cast<int16_t>(lrintf(load(xg[i]) * inv));
        qsum[i >= 16] += qg[i];
      }
      const int at = r * ng + g;
      a.d[at] = mx / kQMax;
      a.xs0[at] = sum[0], a.xs[at] = sum[0] + sum[1];
      a.qs0[at] = qsum[0], a.qs[at] = qsum[0] + qsum[1];
    }
  }
#if defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  split_bytes(a.q);
#endif
  return a;
}

// What group g adds to an output, given s: the integer sums of q * xq over its inputs 0..15 and 16..31: per part,
// scale * d * sum((q - centre) * xq) (+ zero * the exact sum of x)
template <typename F>
float group_term(const Block<F>& b, int g, const int* s, const float* d, const int32_t* qs0, const int32_t* qs,
                 const float* xs0, const float* xs) {
  const int part_s[2] = {F::kHalf ? s[0] : s[0] + s[1], s[1]};
  const int part_qs[2] = {F::kHalf ? qs0[g] : qs[g], qs[g] - qs0[g]};
  const float part_xs[2] = {F::kHalf ? xs0[g] : xs[g], xs[g] - xs0[g]};
  float sum = 0.f;
  for (int p = 0; p < F::kParts; ++p) {
    const float scale = b.scalar(g, p, 0);
    sum += scale * d[g] * static_cast<float>(part_s[p] - F::kCentre * part_qs[p]);
    if (F::kOff) sum += (F::kCentre * scale + b.scalar(g, p, 1)) * part_xs[p];
  }
  return sum;
}

// What an output's groups [g0, g1) add, one value at a time (the scalar path)
template <typename F>
float groups_term(const Block<F>& b, const int16_t* x, const float* d, const int32_t* qs0, const int32_t* qs,
                  const float* xs0, const float* xs, int g0, int g1) {
  float sum = 0.f;
  for (int g = g0; g < g1; ++g) {
    int q[kG];
    group_values<F>(b.values(g), q);
    const int16_t* xg = x + g * kG;
    int s[2] = {0, 0};
    for (int i = 0; i < kG; ++i) s[i >= 16] += q[i] * xg[i];
    sum += group_term(b, g, s, d, qs0, qs, xs0, xs);
  }
  return sum;
}

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// lane i: the sum of v[i]'s eight lanes
inline __m256i hsum8(const __m256i* v) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

inline __m256 load8_half(const uint16_t* p) {  // 8 float16 as float
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = load_half(p[i]);
  return _mm256_load_ps(f);
#endif
}

// Groups g..g+7's scales (kind 0) or offsets (1) of a part (with Sup g is a super-block's first group)
template <typename F>
HOT_INLINE __m256 row_scales8(const Block<F>& b, int g, int part, int kind) {
  const uint8_t* p = kind ? b.offsets(g, part) : b.scales(g, part);
  if (!F::kSup) return load8_half(reinterpret_cast<const uint16_t*>(p));
  const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  return _mm256_mul_ps(v, _mm256_set1_ps(load_half(*b.factors(g, kind))));
}

// One group's values as bytes: lo inputs 0..15, hi 16..31
template <typename F>
HOT_INLINE void unpack_row(const uint8_t* v, __m128i& lo, __m128i& hi) {
  if (F::kBits == 8) {
    lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
    hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16));
    return;
  }
  const __m128i m4 = _mm_set1_epi8(0x0F), p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));
  lo = _mm_and_si128(p, m4), hi = _mm_and_si128(_mm_srli_epi16(p, 4), m4);
  // input 4c + j's bit is bit c of plane byte j: byte i of the spread plane is byte i % 4, tested against bit i / 4
  const __m128i spread = _mm_setr_epi8(0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  const __m128i sel = _mm_setr_epi8(1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8), sel_hi = _mm_slli_epi16(sel, 4);
  for (int pl = 0; pl < F::kBits - 4; ++pl) {
    int32_t bits;
    std::memcpy(&bits, v + 16 + 4 * pl, 4);
    const __m128i b = _mm_shuffle_epi8(_mm_cvtsi32_si128(bits), spread), bit = _mm_set1_epi8(static_cast<char>(16 << pl));
    lo = _mm_or_si128(lo, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, sel), sel), bit));
    hi = _mm_or_si128(hi, _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, sel_hi), sel_hi), bit));
  }
}

// One group's products with the int16 activations xg: eight int32 partial sums over inputs 0..15 (lo) and 16..31 (hi)
template <typename F>
HOT_INLINE void group_dots(const uint8_t* v, const int16_t* xg, __m256i& lo_sums, __m256i& hi_sums) {
  __m128i lo, hi;
  unpack_row<F>(v, lo, hi);
  lo_sums = _mm256_madd_epi16(_mm256_cvtepu8_epi16(lo), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg)));
  hi_sums = _mm256_madd_epi16(_mm256_cvtepu8_epi16(hi), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xg + 16)));
}

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}
#endif

#if defined(__ARM_NEON) && defined(__aarch64__)
// ---- NEON (ARM64): the same rows in order, one group at a time --------------------------------------------------
//
// Each group's sum of (q - centre) * xq in integer SIMD: exact, so the results are the scalar path's (groups_term:
// the same integers meet the same scales), and its bound holds. Checked under qemu (test_kernels_cross.py); how fast
// it runs on an ARM core is not measured.

// One group's values as bytes, lo inputs 0..15, hi 16..31 (group_values' and unpack_row's order)
template <typename F>
inline void neon_unpack(const uint8_t* v, uint8x16_t& lo, uint8x16_t& hi) {
  if (F::kBits == 8) {
    lo = vld1q_u8(v), hi = vld1q_u8(v + 16);
    return;
  }
  const uint8x16_t p = vld1q_u8(v);
  lo = vandq_u8(p, vdupq_n_u8(0x0F)), hi = vshrq_n_u8(p, 4);
  // Input 4c + j's bit is bit c of plane byte j (16 + 4c + j's bit 4 + c): the plane's 4 bytes repeated (byte i of
  // the vector is plane byte i % 4), each byte tested against its bit i / 4, gives 0xFF where the input's bit is set
  static const uint8_t kSel[16] = {1, 1, 1, 1, 2, 2, 2, 2, 4, 4, 4, 4, 8, 8, 8, 8};
  const uint8x16_t sel = vld1q_u8(kSel), sel_hi = vshlq_n_u8(sel, 4);
  for (int pl = 0; pl < F::kBits - 4; ++pl) {
    uint32_t bits;
    std::memcpy(&bits, v + 16 + 4 * pl, 4);
    const uint8x16_t b = vreinterpretq_u8_u32(vdupq_n_u32(bits)), bit = vdupq_n_u8(static_cast<uint8_t>(16 << pl));
    lo = vorrq_u8(lo, vandq_u8(vtstq_u8(b, sel), bit));
    hi = vorrq_u8(hi, vandq_u8(vtstq_u8(b, sel_hi), bit));
  }
}

// The values minus the centre, as signed bytes: q - 2^(Bits-1) is in -128..127 for every format, so the centre needs
// no term of its own (the scalar path subtracts centre * sum(xq) afterwards)
template <typename F>
inline void neon_centred(const uint8_t* v, int8x16_t& lo, int8x16_t& hi) {
  uint8x16_t u_lo, u_hi;
  neon_unpack<F>(v, u_lo, u_hi);
  const uint8x16_t c = vdupq_n_u8(static_cast<uint8_t>(F::kCentre));  // wraps mod 256: 200 - 128 = 72, 3 - 8 = -5
  lo = vreinterpretq_s8_u8(vsubq_u8(u_lo, c)), hi = vreinterpretq_s8_u8(vsubq_u8(u_hi, c));
}

#if defined(__ARM_FEATURE_DOTPROD)
// sum(w * xq) over 16 inputs, xq as split_bytes keeps it: each byte half in vdotq_s32 (four products a lane), then
// (sum of h's << 8) + sum of l's. Exact: |sum h| <= 16 * 128 * 127, so shifted it stays far below 2^31
inline int32_t neon_dot16(int8x16_t w, const int8_t* h, const int8_t* l) {
  const int32x4_t sh = vdotq_s32(vdupq_n_s32(0), w, vld1q_s8(h)), sl = vdotq_s32(vdupq_n_s32(0), w, vld1q_s8(l));
  return vaddvq_s32(vaddq_s32(vshlq_n_s32(sh, 8), sl));
}

// A group's two halves' sums of (q - centre) * xq: s[0] inputs 0..15, s[1] 16..31 (xg: 32 h bytes, then 32 l)
template <typename F>
inline void neon_group_sums(const uint8_t* v, const int16_t* xg, int32_t* s) {
  int8x16_t lo, hi;
  neon_centred<F>(v, lo, hi);
  const int8_t* hl = reinterpret_cast<const int8_t*>(xg);
  s[0] = neon_dot16(lo, hl, hl + kG), s[1] = neon_dot16(hi, hl + 16, hl + kG + 16);
}
#else
// sum(w * xq) over 16 inputs: the weights widened to int16, products widened to int32 (vmull / vmlal). Exact: each
// product at most 128 * 32639, sixteen of them below 2^27
inline int32_t neon_dot16(int8x16_t w, const int16_t* x) {
  const int16x8_t w0 = vmovl_s8(vget_low_s8(w)), w1 = vmovl_high_s8(w), x0 = vld1q_s16(x), x1 = vld1q_s16(x + 8);
  int32x4_t acc = vmull_s16(vget_low_s16(w0), vget_low_s16(x0));
  acc = vmlal_high_s16(acc, w0, x0);
  acc = vmlal_s16(acc, vget_low_s16(w1), vget_low_s16(x1));
  acc = vmlal_high_s16(acc, w1, x1);
  return vaddvq_s32(acc);
}

// A group's two halves' sums of (q - centre) * xq: s[0] inputs 0..15, s[1] 16..31
template <typename F>
inline void neon_group_sums(const uint8_t* v, const int16_t* xg, int32_t* s) {
  int8x16_t lo, hi;
  neon_centred<F>(v, lo, hi);
  s[0] = neon_dot16(lo, xg), s[1] = neon_dot16(hi, xg + 16);
}
#endif

// groups_term over all of a row's groups, its integer sums from NEON (the same sums, already centred: no
// centre * sum(q) term), then the same float steps in the same order
template <typename F>
float neon_groups_term(const Block<F>& b, const int16_t* x, const float* d, const float* xs0, const float* xs, int ng) {
  float sum = 0.f;
  for (int g = 0; g < ng; ++g) {
    int32_t s[2];
    neon_group_sums<F>(b.values(g), x + g * kG, s);
    if (!F::kHalf) s[0] += s[1];
    const float part_xs[2] = {F::kHalf ? xs0[g] : xs[g], xs[g] - xs0[g]};
    for (int p = 0; p < F::kParts; ++p) {
      const float scale = b.scalar(g, p, 0);
      sum += scale * d[g] * static_cast<float>(s[p]);
      if (F::kOff) sum += (F::kCentre * scale + b.scalar(g, p, 1)) * part_xs[p];
    }
  }
  return sum;
}
#endif

// One output: the groups' terms (groups_term). With AVX2, eight groups at a time: their int32 sums meet their eight
// scales in one vector (not one broadcast each); the groups left over (576 inputs are 18 groups) one at a time
template <typename F>
HOT_INLINE float row_dot(const Block<F>& b, const int16_t* x, const float* d, const int32_t* qs0, const int32_t* qs,
                     const float* xs0, const float* xs, int ng) {
  int g = 0;
  float sum = 0.f;
#if defined(__AVX2__)
  constexpr int P = F::kParts;
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= ng; g += 8) {
    __m256i v[P][8];  // per part, per group: eight int32 partial sums of q * xq (exact: at most 32 * 255 * 32767)
    for (int j = 0; j < 8; ++j) {
      __m256i dl, dh;
      group_dots<F>(b.values(g + j), x + (g + j) * kG, dl, dh);
      if (P == 2)
        v[0][j] = dl, v[P - 1][j] = dh;
      else
        v[0][j] = _mm256_add_epi32(dl, dh);
    }
    const __m256i q_all = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + g));
    const __m256i q_lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs0 + g));
    const __m256 x_all = _mm256_loadu_ps(xs + g), x_lo = _mm256_loadu_ps(xs0 + g), dg = _mm256_loadu_ps(d + g);
    for (int p = 0; p < P; ++p) {
      const __m256i qp = P == 1 ? q_all : (p ? _mm256_sub_epi32(q_all, q_lo) : q_lo);
      const __m256i s = _mm256_sub_epi32(hsum8(v[p]), _mm256_mullo_epi32(qp, _mm256_set1_epi32(F::kCentre)));
      const __m256 scale = row_scales8(b, g, p, 0);
      acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(scale, dg), acc);
      if (F::kOff) {
        const __m256 zero = _mm256_fmadd_ps(_mm256_set1_ps(F::kCentre), scale, row_scales8(b, g, p, 1));
        acc = _mm256_fmadd_ps(zero, P == 1 ? x_all : (p ? _mm256_sub_ps(x_all, x_lo) : x_lo), acc);
      }
    }
  }
  sum = hsum(acc);
  for (; g < ng; ++g) {  // the groups left over (576 inputs are 18 groups): their sums still in SIMD
    __m256i dl, dh;
    group_dots<F>(b.values(g), x + g * kG, dl, dh);
    const int s[2] = {hsum_i32(dl), hsum_i32(dh)};
    sum += group_term(b, g, s, d, qs0, qs, xs0, xs);
  }
#elif defined(__ARM_NEON) && defined(__aarch64__)
  sum = neon_groups_term(b, x, d, xs0, xs, ng), g = ng;  // every group: none left for groups_term
#endif
  return sum + groups_term(b, x, d, qs0, qs, xs0, xs, g, ng);
}

// Each weight row is read from memory once for all rows of x.
template <typename F, typename T, typename U>
void group_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, U* y, int64_t ys, int N, int K) {
  const int ng = K / kG;
  const Acts& a = quantize_rows(x, xs, rows, K);
  // Each thread asks for its rows 4 KiB ahead at one row of x. More rows redo the unpacking for each, so arithmetic
  // binds this path (8 GB/s at four rows) and prefetches only cost instructions. 48 int4 matrices of 3072 x 576 from
  // memory, the x86-64-v3 build on a Zen 5 EPYC, against no prefetch: 0.82-0.95 at one row (8 KiB no better);
  // asked at every row count, 0.99-1.05 at two to eight rows (this test's noise: ~3 %)
  const bool ask = rows == 1;
  const int n0 = tm.share_begin(N), n1 = tm.share_end(N);
  for (int n = n0; n < n1; ++n) {
    const Block<F> b(w, n, K);
    if (ask)
      for (int c = 0; c < ng * F::kRowBytes; c += 64) __builtin_prefetch(b.base + 4096 + c);
    for (int r = 0; r < rows; ++r) {
      const int64_t at = static_cast<int64_t>(r) * ng;
      store(y + r * ys + n, row_dot(b, a.q.data() + static_cast<int64_t>(r) * K, a.d.data() + at, a.qs0.data() + at,
                                    a.qs.data() + at, a.xs0.data() + at, a.xs.data() + at, ng));
    }
  }
}
#endif

// The formats gguf_quant.py and cat_rows make: each GGUF type's own (Q4_0 4 bits symmetric, Q4_1 4 with offsets,
// Q5_0 5 symmetric, Q5_1 5 with offsets, Q8_0 8 symmetric; with super-block factors Q4_K and Q5_K 4 and 5 with offsets,
// Q6_K 6 symmetric per 16), and where a fused q|k|v or gate|up meets two of them, the one that holds both exactly
template <typename Fn>
bool with_format(int fmt, Fn&& fn) {
  switch (fmt) {
    case Fmt<4, false, false>::kCode: fn(Fmt<4, false, false>{}); return true;
    case Fmt<4, true, false>::kCode: fn(Fmt<4, true, false>{}); return true;
    case Fmt<5, false, false>::kCode: fn(Fmt<5, false, false>{}); return true;
    case Fmt<5, true, false>::kCode: fn(Fmt<5, true, false>{}); return true;
    case Fmt<6, false, true>::kCode: fn(Fmt<6, false, true>{}); return true;
    case Fmt<6, true, true>::kCode: fn(Fmt<6, true, true>{}); return true;
    case Fmt<8, false, false>::kCode: fn(Fmt<8, false, false>{}); return true;
    case Fmt<8, true, false>::kCode: fn(Fmt<8, true, false>{}); return true;
    case Fmt<8, false, true>::kCode: fn(Fmt<8, false, true>{}); return true;
    case Fmt<8, true, true>::kCode: fn(Fmt<8, true, true>{}); return true;
    case Fmt<4, true, false, true>::kCode: fn(Fmt<4, true, false, true>{}); return true;
    case Fmt<5, true, false, true>::kCode: fn(Fmt<5, true, false, true>{}); return true;
    case Fmt<6, false, true, true>::kCode: fn(Fmt<6, false, true, true>{}); return true;
    case Fmt<6, true, true, true>::kCode: fn(Fmt<6, true, true, true>{}); return true;
    default: return false;
  }
}

}  // namespace

int quant_tile() { return kTile; }
int quant_tiles(int N) { return (N + kTile - 1) / kTile; }

int64_t quant_tile_bytes(int fmt, int K) {
  int64_t bytes = -1;
  with_format(fmt, [&](auto f) {
    using F = decltype(f);
    bytes = K % (kG * F::kSuperGroups) ? -1 : static_cast<int64_t>(K / kG / F::kSuperGroups) * Block<F>::kSuperBytes;
  });
  return bytes;
}

void team_quant_matmul(const Team& tm, int fmt, const void* x, int64_t xs, int rows, const uint8_t* w, void* y,
                       int64_t ys, int N, int K, int elem_size, int out_size) {
  with_format(fmt, [&](auto f) {
    using F = decltype(f);
    if (elem_size == 4)
      group_matmul<F>(tm, static_cast<const float*>(x), xs, rows, w, static_cast<float*>(y), ys, N, K);
    else if (out_size == 4)
      group_matmul<F>(tm, static_cast<const uint16_t*>(x), xs, rows, w, static_cast<float*>(y), ys, N, K);
    else
      group_matmul<F>(tm, static_cast<const uint16_t*>(x), xs, rows, w, static_cast<uint16_t*>(y), ys, N, K);
  });
}

extern "C" {

// The integer SIMD this build's quantized kernels run on (for /stats and the start-up log): the group kernel
// vpdpbusd on weight tiles where AVX512-VNNI exists (vpmaddubsw with AVX512BW alone), the int8 one vpdpwssd; both
// vpmaddwd with AVX2. On ARM64 the group kernel's rows in order run on NEON, with vdotq_s32 where the build has the
// dot product (-march=armv8.2-a+dotprod and later); the int8 kernel stays scalar there. Scalar code elsewhere.
const char* llmserve_quant_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512-vnni";
#elif defined(__AVX512BW__)
  return "avx512bw";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__aarch64__) && defined(__ARM_FEATURE_DOTPROD)
  return "neon-dotprod";
#elif defined(__ARM_NEON) && defined(__aarch64__)
  return "neon";
#else
  return "scalar";
#endif
}

// The group formats' row tile of this build: 16 (AVX-512: tiles, see kTile) or 1 (rows in their natural packing)
int llmserve_quant_tile() { return quant_tile(); }

// The code of the group format with values of `bits` bits, offsets or not, scales per 16 inputs or per 32, float16
// or int8 multiples of super-block factors (sup); -1 where the kernel has no such format
int llmserve_quant_format(int bits, int offsets, int half, int sup) {
  const int fmt = quant_format(bits, offsets != 0, half != 0, sup != 0);
  return with_format(fmt, [](auto) {}) ? fmt : -1;
}

// Bytes of an [N, K] weight in format fmt as pack_own lays it out for this build (rows padded to a whole tile)
int64_t llmserve_quant_bytes(int fmt, int N, int K) { return quant_tiles(N) * quant_tile_bytes(fmt, K); }

// x: [rows, K] float32 (elem_size 4) or bf16 (2), row stride xs; K a multiple of 32; w as pack_own lays it out for
// llmserve_quant_tile(); y: [rows, N], float32 (out_size 4) or bf16 (2, with bf16 x): a bf16 model's linears then need
// no cast after each call.
void llmserve_quant_matmul(int fmt, const void* x, int64_t xs, int rows, const uint8_t* w, void* y, int64_t ys, int N,
                           int K, int elem_size, int out_size, int th) {
  on_team(th, true, [&](const Team& tm) { team_quant_matmul(tm, fmt, x, xs, rows, w, y, ys, N, K, elem_size, out_size); });
}

}  // extern "C"
