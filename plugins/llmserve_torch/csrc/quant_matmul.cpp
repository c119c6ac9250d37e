// Weight-only matmuls on group-quantized weights: y[r, n] = sum_k x[r, k] * w[n, k], each quantized weight row read
// once from memory for all rows (torch's _weight_int4pack_mm_for_cpu reads far below the memory's bandwidth with bf16
// activations, and takes a slow path with float32 ones). A group format (Fmt) holds values of 4, 5, 6 or 8 bits in
// groups of 32 inputs with float16 scales (and offsets): a GGUF file's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K and
// Q8_0 blocks each map onto one of them at the file's own bits (gguf_quant.py), so no value is rounded twice.
// Activations are quantized to int16 per group of 32, so the inner products run on integer SIMD: with AVX-512, weight
// rows in tiles of 16 meet each int16's two bytes in vpdpbusd (vpmaddubsw without VNNI); with AVX2, rows in tiles of
// 8 meet pairs of int16 in vpmaddwd; on ARM64 rows in order through NEON (vdotq_s32 on the two bytes with the dot
// product); a scalar loop without any (-march=native picks; pack_own in quant.py lays the weights out for the build's
// path).
// Not int8 as llama.cpp's Q8_1: SmolLM2's activations have outliers, a group's small values then round to zero, and
// greedy answers changed with a prefix-cache hit (the last prompt rows taking this kernel instead of the dense copy).
// Only a large batch of decodes asks for int8 (narrow, kQMax8): there the products bind the step, and int8 halves
// them (a prompt never does, so the KV cache and a prefix-cache hit are int16's). Where the CPU has AMX, many rows run
// in bf16 on its tiles instead (quant_amx.h): narrow ones, and with bf16 activations every row of a call of many.
//
// Plain C ABI, loaded with ctypes together with the other CPU kernels (one library).

// Each ISA's path in its own file: arch/x86/quant_avx512.h or arch/x86/quant_avx2.h (tiles, run by quant_tiles.h),
// else quant_rows.h (rows in order, with arch/arm/quant_neon.h); the formats and layout they share in quant_format.h.

#include <cstdint>
#include <cstring>

#if defined(__AVX512BW__)
#include "arch/x86/quant_avx512.h"
#include "quant_tiles.h"
#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BF16__) && defined(__linux__)
#define QUANT_AMX 1
#include "arch/x86/quant_amx.h"
#endif
#elif defined(__AVX2__)
#include "arch/x86/quant_avx2.h"
#include "quant_tiles.h"
#if !defined(QUANT_DPBUSD256)
#define QUANT_FMA 1
#include "arch/x86/quant_fma.h"
#include "arch/x86/quant_bytes.h"
#include "arch/x86/quant_words.h"
#endif
#else
#include "quant_rows.h"
#endif

namespace quant {

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

// Group g's scale (kind 0) or offset (1) of a part, for row r of the block's tile (0 where rows are in order)
template <typename F>
float row_param(const Block<F>& b, int g, int part, int kind, int r) {
  const uint8_t* p = (kind ? b.offsets(g, part) : b.scales(g, part)) + r * F::kScaleBytes;
  if (F::kSup) return to_float(static_cast<int8_t>(*p)) * load_half(b.factors(g, kind)[r]);
  uint16_t h;
  std::memcpy(&h, p, 2);
  return load_half(h);
}

// Row n of an [N, K] weight as pack_own lays it out, as T: each value as QuantWeight.dequantize computes it in
// float32 (q * scale is exact there, so a fused multiply-add rounds the same), then rounded to T
template <typename F, typename T>
void dequant_row(const uint8_t* w, int K, int64_t n, T* y) {
  const Block<F> b(w, n / kTile, K);
  const int r = static_cast<int>(n % kTile);
  for (int g = 0; g < K / kG; ++g) {
    uint8_t v[F::kValueBytes];  // row r's 4-byte chunks of the group, gathered from the tile's interleaving
    for (int c = 0; c < F::kBits; ++c) std::memcpy(v + 4 * c, b.values(g) + (c * kTile + r) * 4, 4);
    int q[kG];
    group_values<F>(v, q);
    for (int p = 0; p < F::kParts; ++p) {
      const float scale = row_param(b, g, p, 0, r), offset = F::kOff ? row_param(b, g, p, 1, r) : 0.f;
      for (int i = p * kG / F::kParts; i < (p + 1) * kG / F::kParts; ++i)
        store(y + g * kG + i, F::kOff ? static_cast<float>(q[i]) * scale + offset
                                      : static_cast<float>(q[i] - F::kCentre) * scale);
    }
  }
}

}  // namespace quant

using namespace quant;

void team_quant_rows(const Team& tm, int fmt, const uint8_t* w, int K, const int64_t* ids, int rows, void* y,
                     int64_t ys, int out_size) {
  with_format(fmt, [&](auto f) {
    using F = decltype(f);
    for (int r = tm.begin(rows); r < tm.end(rows); ++r)
      if (out_size == 4)
        dequant_row<F>(w, K, ids[r], static_cast<float*>(y) + r * ys);
      else
        dequant_row<F>(w, K, ids[r], static_cast<uint16_t*>(y) + r * ys);
  });
}

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
                       int64_t ys, int N, int K, int elem_size, int out_size, int narrow) {
  narrow = narrow < 0 ? 0 : narrow > rows ? rows : narrow;
#if defined(QUANT_AMX)
  // bf16 activations lose nothing on the tiles (they take bf16 as it is), so then a call of many rows, a prompt's
  // among them, is one pass there whatever narrow says: a prompt's rows are bound by their products as a big batch
  // of decodes is
  if (elem_size == 2 && rows >= kAmxRows && amx_on()) {
    with_format(fmt, [&](auto f) {
      const auto* xt = static_cast<const uint16_t*>(x);
      if (out_size == 4)
        amx_matmul<decltype(f)>(tm, xt, xs, rows, w, static_cast<float*>(y), ys, N, K);
      else
        amx_matmul<decltype(f)>(tm, xt, xs, rows, w, static_cast<uint16_t*>(y), ys, N, K);
    });
    return;
  }
#endif
  // rows [0, narrow) and [narrow, rows) as two passes over this member's tiles (no barrier: the same outputs'
  // columns); the weights are read twice, little beside the products of the many rows narrow is for
  auto pass = [&](auto xt, auto yt, int r0, int n, bool int8) {
    if (n > 0)
      with_format(fmt, [&](auto f) {
#if defined(QUANT_AMX)
        // many narrow rows of float32 activations: bf16 on AMX tiles, where the products bind the step (quant_amx.h)
        if (int8 && n >= kAmxRows && amx_on())
          return amx_matmul<decltype(f)>(tm, xt + r0 * xs, xs, n, w, yt + r0 * ys, ys, N, K);
#endif
#if defined(QUANT_FMA)
        // many rows meet panels made once per block of rows, one kind per format and width
        const bool panels = n >= kFmaRows && fma_wanted().load(std::memory_order_relaxed);
        // 8-bit weights, a prompt's of those with scales per 32: int16 pairs on panels of words (quant_words.h)
        if (panels && word_rows_of<decltype(f)>(int8))
          return word_matmul<decltype(f)>(tm, xt + r0 * xs, xs, n, w, yt + r0 * ys, ys, N, K);
        // narrow rows of weights below 8 bits: int8 products on panels of unpacked bytes (quant_bytes.h)
        if (panels && int8 && byte_rows_of<decltype(f)>())
          return byte_matmul<decltype(f)>(tm, xt + r0 * xs, xs, n, w, yt + r0 * ys, ys, N, K);
        // weights with scales per 16: float32 FMA on dequantized panels (quant_fma.h)
        if (panels && fma_rows_of<decltype(f)>())
          return fma_matmul<decltype(f)>(tm, xt + r0 * xs, xs, n, w, yt + r0 * ys, ys, N, K);
#endif
        group_matmul<decltype(f)>(tm, xt + r0 * xs, xs, n, w, yt + r0 * ys, ys, N, K, int8);
      });
  };
  auto both = [&](auto xt, auto yt) { pass(xt, yt, 0, narrow, true), pass(xt, yt, narrow, rows - narrow, false); };
  if (elem_size == 4)
    both(static_cast<const float*>(x), static_cast<float*>(y));
  else if (out_size == 4)
    both(static_cast<const uint16_t*>(x), static_cast<float*>(y));
  else
    both(static_cast<const uint16_t*>(x), static_cast<uint16_t*>(y));
}

extern "C" {

// The integer SIMD this build's quantized kernels run on (for /stats and the start-up log): the group kernel
// vpdpbusd on weight tiles where AVX512-VNNI exists (vpmaddubsw with AVX512BW alone), the int8 one vpdpwssd. With
// AVX2 the group kernel's tiles of 8 rows run vpmaddubsw and vpmaddwd, or vpdpbusd where the build has AVX-VNNI
// (avx2-vnni); the int8 one vpmaddwd. On ARM64 the group kernel's rows in order run on NEON, with vdotq_s32 where the
// build has the dot product (-march=armv8.2-a+dotprod and later); the int8 kernel stays scalar there. Scalar code
// elsewhere.
const char* llmserve_quant_isa() {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return "avx512-vnni";
#elif defined(__AVX512BW__)
  return "avx512bw";
#elif defined(__AVX2__) && defined(QUANT_DPBUSD256)
  return "avx2-vnni";
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

// Whether a call's narrow rows, LLMSERVE_AMX_MIN_ROWS or more, run in bf16 on AMX tiles: where the build has them and
// Linux grants the process their state; want 0 turns them off, 1 back on, -1 only asks
int llmserve_quant_amx(int want) {
#if defined(QUANT_AMX)
  if (want >= 0) amx_wanted().store(want != 0);
  return amx_on() ? 1 : 0;
#else
  (void)want;
  return 0;
#endif
}

// Whether a call of LLMSERVE_FMA_MIN_ROWS rows or more runs in float32 FMA on dequantized panels: where the build is
// AVX2 without VNNI; want 0 turns that off (the integer tiles then), 1 back on, -1 only asks
int llmserve_quant_fma(int want) {
#if defined(QUANT_FMA)
  if (want >= 0) fma_wanted().store(want != 0);
  return fma_wanted().load() ? 1 : 0;
#else
  (void)want;
  return 0;
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

// 1 where llmserve_quant_matmul's narrow rounds activations to int8 for format fmt on this build (the tiles' int8
// products: every format with AVX-512, with AVX2 those below 8 bits or all with AVX-VNNI), else 0: int16 whatever
int llmserve_quant_narrow(int fmt) {
  int narrow = 0;
  with_format(fmt, [&](auto f) { narrow = narrow_products<decltype(f)>() ? 1 : 0; });
  return narrow;
}

// Bytes of an [N, K] weight in format fmt as pack_own lays it out for this build (rows padded to a whole tile)
int64_t llmserve_quant_bytes(int fmt, int N, int K) { return quant_tiles(N) * quant_tile_bytes(fmt, K); }

// x: [rows, K] float32 (elem_size 4) or bf16 (2), row stride xs; K a multiple of 32; w as pack_own lays it out for
// llmserve_quant_tile(); y: [rows, N], float32 (out_size 4) or bf16 (2, with bf16 x): a bf16 model's linears then need
// no cast after each call.
void llmserve_quant_matmul(int fmt, const void* x, int64_t xs, int rows, const uint8_t* w, void* y, int64_t ys, int N,
                           int K, int elem_size, int out_size, int th, int narrow) {
  on_team(th, true, [&](const Team& tm) {
    team_quant_matmul(tm, fmt, x, xs, rows, w, y, ys, N, K, elem_size, out_size, narrow);
  });
}

// pack_own's layout, written through the same Block accessors the kernels read it by (torch's pads, permutes and
// concatenations took 2 s of a Qwen2.5-0.5B Q4_K_M's first start)
int llmserve_pack_weight(int fmt, const uint8_t* q, const float* scale, const float* offset, const int8_t* sc,
                         const int8_t* m, const float* d, const float* dneg, int N, int K, uint8_t* out) {
  const int64_t tile_bytes = quant_tile_bytes(fmt, K);
  if (tile_bytes < 0) return -1;
  std::memset(out, 0, static_cast<size_t>(quant_tiles(N) * tile_bytes));  // (a padded tile's rows stay zero)
  bool finite = true;
  auto half_of = [&](float v) {
    const uint16_t h = store_half(v);
    finite &= (h & 0x7C00u) != 0x7C00u;
    return h;
  };
  with_format(fmt, [&](auto f) {
    using F = decltype(f);
    const int groups = K / kG;
    for (int64_t n = 0; n < N; ++n) {
      Block<F> b(out, n / kTile, K);
      const int r = static_cast<int>(n % kTile);
      for (int g = 0; g < groups; ++g) {
        uint8_t v[F::kValueBytes];
        pack_group_values(q + n * K + g * kG, F::kBits, v);
        for (int c = 0; c < F::kBits; ++c) std::memcpy(const_cast<uint8_t*>(b.values(g)) + (c * kTile + r) * 4, v + 4 * c, 4);
        for (int p = 0; p < F::kParts; ++p) {
          const int64_t at = n * groups * F::kParts + g * F::kParts + p;
          for (int kind = 0; kind < (F::kOff ? 2 : 1); ++kind) {
            uint8_t* dst = const_cast<uint8_t*>(kind ? b.offsets(g, p) : b.scales(g, p)) + r * F::kScaleBytes;
            if (F::kSup) {
              *dst = static_cast<uint8_t>((kind ? m : sc)[at]);
            } else {
              const uint16_t h = half_of((kind ? offset : scale)[at]);
              std::memcpy(dst, &h, 2);
            }
          }
        }
        if (F::kSup && g % F::kSuperGroups == 0)
          for (int kind = 0; kind < (F::kOff ? 2 : 1); ++kind)
            const_cast<uint16_t*>(b.factors(g, kind))[r] = half_of((kind ? dneg : d)[n * (groups / 8) + g / 8]);
      }
    }
  });
  return finite ? 0 : -1;
}

// Rows ids[0, rows) of an [N, K] group-format weight, dequantized into y (float32 or bf16): the embedding lookup of a
// table kept in its file's format. 0, or -1 (nothing written) where an id is not a row or fmt is unknown
int llmserve_quant_rows(int fmt, const uint8_t* w, int N, int K, const int64_t* ids, int rows, void* y, int64_t ys,
                        int out_size, int th) {
  for (int r = 0; r < rows; ++r)
    if (ids[r] < 0 || ids[r] >= N) return -1;
  if (quant_tile_bytes(fmt, K) < 0) return -1;
  on_team(th, rows > 64, [&](const Team& tm) { team_quant_rows(tm, fmt, w, K, ids, rows, y, ys, out_size); });
  return 0;
}

}  // extern "C"
