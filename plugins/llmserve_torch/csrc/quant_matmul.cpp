// The int4 weight-only matmul: y[r, n] = sum_k x[r, k] * w[n, k], each quantized weight row read once from
// memory for all rows (torch's _weight_int4pack_mm_for_cpu read ~16 GB/s with bf16 activations, and took a
// slow path with float32 ones). Activations are quantized to int16 per group of 32, so the inner products run
// on integer SIMD: with AVX-512, weight rows in tiles of 16 meet each int16's two bytes in vpdpbusd (vpmaddubsw
// without VNNI); with AVX2, one row at a time through vpmaddwd; a scalar loop without either (-march=native
// picks; pack_int4_own in quant.py lays the weights out for the build's path). Not int8 as llama.cpp's
// Q8_1: SmolLM2's activations have outliers, a group's small values then round to zero, and greedy answers
// changed with a prefix-cache hit (the last prompt rows taking this kernel instead of the dense copy).
//
// Plain C ABI, loaded with ctypes together with the other CPU kernels (one library).

#include <math.h>

#include <cstdint>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kernels.h"

namespace {

constexpr int kG4 = 32;  // int4 group: one scale and zero per 32 inputs (llama.cpp's Q4_0/Q4_1 block)

// The largest |q| of an activation rounded to int16: 256 * 127 + 127, so that q splits into two signed bytes
// (xh = (q + 128) >> 8 stays <= 127) for the AVX-512 path
constexpr float kQMax = 32639.f;

// Rows a tile of the weights' layout holds: 16 with AVX-512 (one output per lane), else 1 (rows in order)
#if defined(__AVX512BW__)
constexpr int kTile = 16;
#else
constexpr int kTile = 1;
#endif
// Tile t of pack_int4_own's layout: 20 bytes a row and group, as llama.cpp's Q4_1 block. In tiles of 16, group
// after group: its values (16 bytes a row), its float16 scales [16], its offsets [16], so a tile is read in one
// sequential stream (values, scales and offsets in three regions of a tile ran 24 % slower at one row). Rows in
// order (kTile 1): a row's values, then its scales, then its offsets (the AVX2 path reads eight groups' scales
// at once).
constexpr int kGroupBytes = kTile * 20;  // a tile's group: values, scales, offsets

struct Block {
  const uint8_t* base;
  int ng;
  Block(const uint8_t* w, int64_t t, int K) : base(w + t * (K / kG4) * kGroupBytes), ng(K / kG4) {}
#if defined(__AVX512BW__)
  const uint8_t* values(int g) const { return base + g * kGroupBytes; }
  const uint16_t* scales(int g) const { return reinterpret_cast<const uint16_t*>(values(g) + 256); }
  const uint16_t* offsets(int g) const { return scales(g) + 16; }
#else
  const uint8_t* values(int g) const { return base + g * 16; }
  const uint16_t* scales(int g) const { return reinterpret_cast<const uint16_t*>(base + ng * 16) + g; }
  const uint16_t* offsets(int g) const { return scales(g) + ng; }
#endif
};

#if defined(__AVX512BW__)
// ---- AVX-512: weight rows in tiles of 16, one output per lane ---------------------------------------------------
//
// The layout (pack_int4_own in quant.py makes it): rows in tiles of kTile, the last padded with zero rows; a tile's
// group g is 256 bytes, four 64-byte chunks, dword r of chunk c holding bytes 4c..4c+3 of row r's group (so the
// low nibbles are inputs 4c..4c+3 and the high ones 16 + 4c..16 + 4c + 3), then the group's 16 float16 scales and
// 16 offsets (Block).
// A 4-byte piece of the activations, broadcast, meets all 16 rows in one vpdpbusd: no horizontal sums, no
// per-row tails (576 inputs are 18 groups: a per-row layout had 2 left over after blocks of four), one scale
// vector per group. 120 SmolLM2-shaped matrices at one row, from memory, 2 threads of a Zen 5 EPYC: 1.80 ms in
// the per-row layout (44 GB/s), 1.30 ms in tiles (61 GB/s).
constexpr int kRowBlock = 4;  // rows of x that share one unpacking of a tile's group

// Rows of activations, per group of 32: x ≈ d * q with q in -kQMax..kQMax, each q as two signed bytes q = 256 * h +
// l (vpdpbusd multiplies unsigned by signed bytes: the 4-bit weights 64 at a time, no widening, the same integer
// sums), c = -8 * d * sum(q) (the weights' centring: w - zero = (q - 8) * scale), xsum = the exact sum of x
struct Split {
  std::vector<int8_t> h, l;
  std::vector<float> d, c, xsum;
};

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16_half(const uint16_t* p) {  // 16 float16 as float
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 as float: the 16 bits become the top half
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

template <typename T>
const Split& split_rows(const T* x, int64_t xs, int rows, int K) {
  thread_local Split a;  // grown once: a step calls this ~120 times
  const int ng = K / kG4;
  a.h.resize(static_cast<size_t>(rows) * K), a.l.resize(a.h.size());
  a.d.resize(static_cast<size_t>(rows) * ng), a.c.resize(a.d.size()), a.xsum.resize(a.d.size());
  const __m512i c128 = _mm512_set1_epi32(128);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < ng; ++g) {
      const T* xg = x + r * xs + g * kG4;
      const __m512 v0 = load16(xg), v1 = load16(xg + 16);
      const float mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const int64_t at = static_cast<int64_t>(r) * ng + g;
      a.xsum[at] = _mm512_reduce_add_ps(_mm512_add_ps(v0, v1));
      const __m512 inv = _mm512_set1_ps(mx > 0.f ? kQMax / mx : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      a.d[at] = mx / kQMax;
      a.c[at] = -8.f * a.d[at] * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1)));
      int8_t* h = a.h.data() + static_cast<int64_t>(r) * K + g * kG4;
      int8_t* l = a.l.data() + static_cast<int64_t>(r) * K + g * kG4;
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

// acc + the sums of four unsigned-by-signed byte products per lane
inline __m512i dot4(__m512i acc, __m512i u, const int8_t* s4) {
  int32_t v;
  std::memcpy(&v, s4, 4);
#if defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, u, _mm512_set1_epi32(v));
#else  // |15 * 127 + 15 * 128| fits the pairs' int16 sums: no saturation
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, _mm512_set1_epi32(v)), _mm512_set1_epi16(1)));
#endif
}

// One tile against RB rows of x from row r0: y[r0.., n0..n0+15] (outputs past N are padding, not stored). Each
// group asks for the weights `ahead` bytes on (prefetch_distance): the hardware prefetcher alone left a one-row
// matmul short of the machine's bandwidth (a step's 30 layers do not fit the L3)
template <int RB, typename T>
void tile_rows(const Block& b, const Split& a, int r0, int K, T* y, int64_t ys, int n0, int N, int ahead) {
  const int ng = K / kG4;
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  __m512 acc[RB], zacc[RB];  // two chains per row: the scale and the zero terms
  for (int r = 0; r < RB; ++r) acc[r] = _mm512_setzero_ps(), zacc[r] = _mm512_setzero_ps();
  for (int g = 0; g < ng; ++g) {
    const uint8_t* wg = b.values(g);
    for (int c = 0; c < kGroupBytes; c += 64)
      _mm_prefetch(reinterpret_cast<const char*>(wg) + ahead + c, _MM_HINT_T0);
    __m512i lo[4], hi[4];
    for (int c = 0; c < 4; ++c) {
      const __m512i p = _mm512_loadu_si512(wg + 64 * c);
      lo[c] = _mm512_and_si512(p, m4), hi[c] = _mm512_and_si512(_mm512_srli_epi16(p, 4), m4);
    }
    const __m512 sc = load16_half(b.scales(g));
    const __m512 zc = _mm512_fmadd_ps(_mm512_set1_ps(8.f), sc, load16_half(b.offsets(g)));  // the zero point
    for (int r = 0; r < RB; ++r) {
      const int64_t row = r0 + r, at = row * ng + g;
      const int8_t* h = a.h.data() + row * K + g * kG4;
      const int8_t* l = a.l.data() + row * K + g * kG4;
      __m512i sh = _mm512_setzero_si512(), sl = _mm512_setzero_si512();
      for (int c = 0; c < 4; ++c) {
        sh = dot4(dot4(sh, lo[c], h + 4 * c), hi[c], h + 16 + 4 * c);
        sl = dot4(dot4(sl, lo[c], l + 4 * c), hi[c], l + 16 + 4 * c);
      }
      const __m512 s = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(sh, 8), sl));
      // scale * d * (s - 8 * qsum) + zero * xsum
      acc[r] = _mm512_fmadd_ps(sc, _mm512_fmadd_ps(s, _mm512_set1_ps(a.d[at]), _mm512_set1_ps(a.c[at])), acc[r]);
      zacc[r] = _mm512_fmadd_ps(zc, _mm512_set1_ps(a.xsum[at]), zacc[r]);
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
template <typename T>
void int4_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, T* y, int64_t ys, int N, int K) {
  const int tiles = int4_tiles(N);
  const Split& a = split_rows(x, xs, rows, K);
  // SmolLM2's fused layers, builds alternated in one process (2 threads of a Zen 5 EPYC, weights in huge pages), 8
  // KiB against 4 KiB where the VM read ~90 GB/s: 0.91-0.94 at one sequence, 0.95 at two, 0.98 at three and four,
  // 1.02 at eight (so more rows keep 4 KiB); where it read ~55: 0.97-1.01 at one to four (docs/benchmarks.md)
  const int ahead = prefetch_distance(rows, 8192);
  const int t0 = tm.share_begin(tiles), t1 = tm.share_end(tiles);
  for (int t = t0; t < t1; ++t) {
    const Block b(w, t, K);
    int r0 = 0;
    for (; r0 + kRowBlock <= rows; r0 += kRowBlock) tile_rows<kRowBlock>(b, a, r0, K, y, ys, t * kTile, N, ahead);
    switch (rows - r0) {
      case 3: tile_rows<3>(b, a, r0, K, y, ys, t * kTile, N, ahead); break;
      case 2: tile_rows<2>(b, a, r0, K, y, ys, t * kTile, N, ahead); break;
      case 1: tile_rows<1>(b, a, r0, K, y, ys, t * kTile, N, ahead); break;
      default: break;
    }
  }
}

#else
// ---- AVX2 and scalar: one weight row at a time, in its natural packing ------------------------------------------

// One row of activations, per group of 32: x ≈ d * q with q in -kQMax..kQMax, qsum = sum(q), xsum = the exact sum
// (the zero term needs no rounding: llama.cpp's Q8_1 keeps d * sum(q) there instead)
struct Acts {
  std::vector<int16_t> q;
  std::vector<float> d, xsum;
  std::vector<int32_t> qsum;
};

template <typename T>
const Acts& quantize_rows(const T* x, int64_t xs, int rows, int K) {
  thread_local Acts a;  // grown once: a step calls this ~120 times
  const int ng = K / kG4;
  a.q.resize(static_cast<size_t>(rows) * K);
  a.d.resize(static_cast<size_t>(rows) * ng), a.xsum.resize(a.d.size()), a.qsum.resize(a.d.size());
  for (int r = 0; r < rows; ++r) {
    for (int g = 0; g < ng; ++g) {
      const T* xg = x + r * xs + g * kG4;
      float mx = 0.f, sum = 0.f;
      for (int i = 0; i < kG4; ++i) {
        mx = fmaxf(mx, fabsf(load(xg[i])));
        sum += load(xg[i]);
      }
      const float inv = mx > 0.f ? kQMax / mx : 0.f;
      int16_t* qg = a.q.data() + static_cast<int64_t>(r) * K + g * kG4;
      int qsum = 0;
      for (int i = 0; i < kG4; ++i) {
        qg[i] = static_cast<int16_t>(lrintf(load(xg[i]) * inv));
        qsum += qg[i];
      }
      a.d[r * ng + g] = mx / kQMax;
      a.xsum[r * ng + g] = sum;
      a.qsum[r * ng + g] = qsum;
    }
  }
  return a;
}

// One group's term of an output: s = sum((q - 8) * xq) in integers, rescaled by the weight scale and the activation
// step d, plus the zero point times the exact sum of the group's activations
inline float group_term(int s, float scale, float d, float zero, float xsum) { return s * scale * d + zero * xsum; }

#if defined(__AVX2__)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// lane i: the sum of v[i]'s eight lanes
inline __m256i hsum8(const __m256i* v) {
  const __m256i ab = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i cd = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(ab, cd, 0x20), _mm256_permute2x128_si256(ab, cd, 0x31));
}

// one group: eight int32 partial sums of q * x, q the 4-bit values 0..15 and x int16 (the group's whole sum is
// at most 32 * 15 * 32767 < 2^24: exact in int32 and in its float conversion)
inline __m256i group_dot(const uint8_t* p16, const int16_t* x32) {
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p16));
  const __m256i lo = _mm256_cvtepu8_epi16(_mm_and_si128(p, m4));                     // q[0..15]
  const __m256i hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(p, 4), m4));  // q[16..31]
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x32));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x32 + 16));
  return _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
}
#endif

// A group's zero point: w = q * scale + offset = (q - 8) * scale + zero
inline float zero_point(float scale, float offset) { return 8.f * scale + offset; }

#if defined(__AVX2__)
inline __m256 load8_half(const uint16_t* p) {  // 8 float16 as float
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = load_half(p[i]);
  return _mm256_load_ps(f);
#endif
}
#endif

// One output: sum over groups of scale * d * (sum(q * x) - 8 * qsum) + zero * xsum. The -8 centres the weights
// exactly (integers): the rounded activations meet w - zero = (q - 8) * scale, half as large as q * scale + min.
inline float row_dot(const Block& b, const int16_t* x, const float* d, const int32_t* qsum, const float* xsum,
                     int ng) {
  int g = 0;
  float tail = 0.f;
#if defined(__AVX2__)
  // eight groups at a time: their int32 sums meet their eight scales in one vector (not one broadcast each)
  __m256 acc = _mm256_setzero_ps();
  for (; g + 8 <= ng; g += 8) {
    __m256i v[8];
    for (int j = 0; j < 8; ++j) v[j] = group_dot(b.values(g + j), x + (g + j) * kG4);
    const __m256i qs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qsum + g));
    const __m256i s = _mm256_sub_epi32(hsum8(v), _mm256_slli_epi32(qs, 3));
    const __m256 scale = load8_half(b.scales(g));
    const __m256 zero = _mm256_fmadd_ps(_mm256_set1_ps(8.f), scale, load8_half(b.offsets(g)));
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(scale, _mm256_loadu_ps(d + g)), acc);
    acc = _mm256_fmadd_ps(zero, _mm256_loadu_ps(xsum + g), acc);
  }
  for (; g < ng; ++g) {  // the groups left over (576 inputs are 18 groups): one at a time, still in SIMD
    const float scale = load_half(*b.scales(g));
    tail += group_term(hsum_i32(group_dot(b.values(g), x + g * kG4)) - 8 * qsum[g], scale, d[g],
                       zero_point(scale, load_half(*b.offsets(g))), xsum[g]);
  }
  tail += hsum(acc);
#endif
  for (; g < ng; ++g) {
    const uint8_t* p = b.values(g);
    const int16_t* xg = x + g * kG4;
    int s = 0;
    for (int j = 0; j < 16; ++j) s += (p[j] & 15) * xg[j] + (p[j] >> 4) * xg[j + 16];
    const float scale = load_half(*b.scales(g));
    tail += group_term(s - 8 * qsum[g], scale, d[g], zero_point(scale, load_half(*b.offsets(g))), xsum[g]);
  }
  return tail;
}

// w[n, 32g + j] = q * scale[n, g] + offset[n, g], q in 0..15 packed two per byte, byte j of a group holding
// j (low nibble) and j + 16 (high nibble); a row's groups, then its float16 scales, then its offsets (Block). Each
// weight row is read from memory once for all rows of x.
template <typename T>
void int4_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, T* y, int64_t ys, int N, int K) {
  const int ng = K / kG4;
  const Acts& a = quantize_rows(x, xs, rows, K);
  // Each thread asks for its rows 4 KiB ahead at one row of x. More rows redo the unpacking for each, so arithmetic
  // binds this path (8 GB/s at four rows) and prefetches only cost instructions. 48 matrices of 3072 x 576 from
  // memory, the x86-64-v3 build on a Zen 5 EPYC, against no prefetch: 0.82-0.95 at one row (8 KiB no better);
  // asked at every row count, 0.99-1.05 at two to eight rows (this test's noise: ~3 %)
  const bool ask = rows == 1;
  const int n0 = tm.share_begin(N), n1 = tm.share_end(N);
  for (int n = n0; n < n1; ++n) {
    const Block b(w, n, K);
    if (ask)
      for (int c = 0; c < ng * kGroupBytes; c += 64) __builtin_prefetch(b.base + 4096 + c);
    for (int r = 0; r < rows; ++r)
      store(y + r * ys + n, row_dot(b, a.q.data() + static_cast<int64_t>(r) * K, a.d.data() + r * ng,
                                    a.qsum.data() + r * ng, a.xsum.data() + r * ng, ng));
  }
}
#endif

}  // namespace

extern "C" {

// The integer SIMD this build's quantized kernels run on (for /stats and the start-up log): the int4 kernel
// vpdpbusd on weight tiles where AVX512-VNNI exists (vpmaddubsw with AVX512BW alone), the int8 one vpdpwssd; both
// vpmaddwd with AVX2, scalar code elsewhere.
const char* llmserve_quant_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512-vnni";
#elif defined(__AVX512BW__)
  return "avx512bw";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

// The int4 weights' row tile of this build: 16 (AVX-512: tiles, see kTile) or 1 (rows in their natural packing)
int llmserve_int4_tile() { return kTile; }

// x: [rows, K] float32 (elem_size 4) or bf16 (2), row stride xs; K a multiple of 32; w as pack_int4_own lays it out
// for llmserve_int4_tile() (N rows, padded to a whole tile); y: [rows, N] in x's dtype (a bf16 model's linears then
// need no cast after each call).
void llmserve_int4_matmul(const void* x, int64_t xs, int rows, const uint8_t* w, void* y, int64_t ys, int N, int K,
                          int elem_size, int th) {
  on_team(th, true, [&](const Team& tm) { team_int4_matmul(tm, x, xs, rows, w, y, ys, N, K, elem_size); });
}

}  // extern "C"

int int4_tiles(int N) { return (N + kTile - 1) / kTile; }
int64_t int4_tile_bytes(int K) { return static_cast<int64_t>(K / kG4) * kGroupBytes; }

void team_int4_matmul(const Team& tm, const void* x, int64_t xs, int rows, const uint8_t* w, void* y, int64_t ys,
                      int N, int K, int elem_size) {
  if (elem_size == 4)
    int4_matmul<float>(tm, static_cast<const float*>(x), xs, rows, w, static_cast<float*>(y), ys, N, K);
  else
    int4_matmul<uint16_t>(tm, static_cast<const uint16_t*>(x), xs, rows, w, static_cast<uint16_t*>(y), ys, N, K);
}
