// The group formats of the quantized matmul (quant_matmul.cpp): what a format is, how pack_own (quant.py) lays a
// weight out for this build's path, and a group's values as integers. Every ISA's path (arch/) reads these.
#pragma once

#include <math.h>

#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "kernels.h"

namespace quant {

// The per-group helpers of the SIMD paths, inlined whatever the compiler's size heuristics say: with a dozen formats
// instantiated, g++ called the AVX2 path's out of line, and a row at a time ran markedly slower
#define HOT_INLINE inline __attribute__((always_inline))

constexpr int kG = 32;  // a group: 32 inputs, llama.cpp's Q4_0 ... Q8_0 block and the K-quants' sub-block

// The largest |q| of an activation rounded to int16: 256 * 127 + 127, so that q splits into two signed bytes
// (xh = (q + 128) >> 8 stays <= 127) for the AVX-512 path
constexpr float kQMax = 32639.f;
// The largest |q| of an activation rounded to int8 (narrow: llama.cpp's Q8 activations, half the integer products, a
// group's small values rounded coarser beside its largest: a batch of decodes past the caller's threshold)
constexpr float kQMax8 = 127.f;

// Rows a tile of the weights' layout holds: one output per 32-bit lane, 16 with AVX-512, 8 with AVX2; else 1 (rows in
// order: the NEON and scalar paths)
#if defined(__AVX512BW__)
constexpr int kTile = 16;
#define QUANT_TILES 1
#elif defined(__AVX2__)
constexpr int kTile = 8;
#define QUANT_TILES 1
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

// Tile t of pack_own's layout. In tiles of kTile rows, group after group: the group's values as chunks of 4 * kTile
// bytes, dword r of chunk c holding row r's 4-byte chunk c (so a tile's group is read in one sequential stream: values,
// scales and offsets in three regions of a tile were three streams, and slower), then its scales [parts][kTile], then
// its offsets [parts][kTile]; with Sup each super-block of 8 groups starts with its factors d [kTile], then dneg
// [kTile]. Rows in order (kTile 1): a row's groups' values, then its scales [parts][groups], then its offsets
// [parts][groups], then with Sup its factors d [groups / 8], then dneg.
template <typename F>
struct Block {
  const uint8_t* base;
  int ng;
  static constexpr int64_t kSuperBytes = kTile * (F::kHeadBytes + F::kSuperGroups * F::kRowBytes);
  Block(const uint8_t* w, int64_t t, int K) : base(w + t * (K / kG / F::kSuperGroups) * kSuperBytes), ng(K / kG) {}
#if defined(QUANT_TILES)
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

// One group's 32 values of `bits` bits as the format's 4 * bits bytes (what group_values reads back): a nibble plane,
// then a 4-byte plane for each bit above the fourth; 8 bits as they are
inline void pack_group_values(const uint8_t* q, int bits, uint8_t* v) {
  if (bits == 8) {
    std::memcpy(v, q, kG);
    return;
  }
  for (int j = 0; j < 16; ++j) v[j] = static_cast<uint8_t>((q[j] & 15) | ((q[j + 16] & 15) << 4));
  for (int p = 0; p < bits - 4; ++p)
    for (int j = 0; j < 4; ++j) {
      int b = 0;
      for (int c = 0; c < 4; ++c)
        b |= ((q[4 * c + j] >> (4 + p)) & 1) << c | ((q[16 + 4 * c + j] >> (4 + p)) & 1) << (4 + c);
      v[16 + 4 * p + j] = static_cast<uint8_t>(b);
    }
}

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

}  // namespace quant
