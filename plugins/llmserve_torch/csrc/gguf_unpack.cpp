// A GGUF file's quantized blocks unpacked at load: one byte a value plus each group's scales (and offsets), the form
// gguf_quant.py's QuantWeight holds before pack_own lays it out for the kernels (numpy's unpacking took 2.5 s of a
// Qwen2.5-0.5B Q4_K_M's first start). The block layouts are llama.cpp's (ggml-common.h); the values come out as
// gguf_quant.py's numpy fallback (where this library cannot be built) makes them, which the tests check.

#include <cstdint>
#include <cstring>

#include "bf16.h"
#include "llmserve.h"

namespace {

// ggml's type ids
enum Type { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return load_half(h);
}

// 16 bytes → 32 values: low nibbles are values 0..15, high nibbles 16..31
inline void nibbles(const uint8_t* qs, uint8_t* q) {
  for (int j = 0; j < 16; ++j) q[j] = qs[j] & 15, q[j + 16] = qs[j] >> 4;
}

// A 32-bit little-endian mask's bit j as value j's fifth bit
inline void fifth_bits(const uint8_t* qh, uint8_t* q) {
  for (int j = 0; j < 32; ++j) q[j] |= ((qh[j / 8] >> (j % 8)) & 1) << 4;
}

// Q4_K / Q5_K: sub-block j's 6-bit scale and min from the 12 packed bytes (llama.cpp's get_scale_min_k4)
inline void scale_min(const uint8_t* s, int j, int8_t* sc, int8_t* m) {
  if (j < 4) {
    *sc = static_cast<int8_t>(s[j] & 63), *m = static_cast<int8_t>(s[j + 4] & 63);
  } else {
    *sc = static_cast<int8_t>((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    *m = static_cast<int8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

}  // namespace

extern "C" {

int llmserve_gguf_unpack(int type, const uint8_t* blocks, int64_t n, uint8_t* q, float* scale, float* offset,
                         float* d, int8_t* sc, float* dneg, int8_t* m) {
  switch (type) {
    case kQ4_0:  // d, 16 bytes: (q - 8) * d
      for (int64_t b = 0; b < n; ++b, blocks += 18, q += 32) nibbles(blocks + 2, q), scale[b] = half_at(blocks);
      return 0;
    case kQ4_1:  // d, m, 16 bytes: q * d + m
      for (int64_t b = 0; b < n; ++b, blocks += 20, q += 32)
        nibbles(blocks + 4, q), scale[b] = half_at(blocks), offset[b] = half_at(blocks + 2);
      return 0;
    case kQ5_0:  // d, 32 fifth bits, 16 bytes: (q - 16) * d
      for (int64_t b = 0; b < n; ++b, blocks += 22, q += 32)
        nibbles(blocks + 6, q), fifth_bits(blocks + 2, q), scale[b] = half_at(blocks);
      return 0;
    case kQ5_1:  // d, m, 32 fifth bits, 16 bytes: q * d + m
      for (int64_t b = 0; b < n; ++b, blocks += 24, q += 32)
        nibbles(blocks + 8, q), fifth_bits(blocks + 4, q), scale[b] = half_at(blocks), offset[b] = half_at(blocks + 2);
      return 0;
    case kQ8_0:  // d, 32 signed bytes: q * d (stored + 128: a symmetric 8-bit group's centre)
      for (int64_t b = 0; b < n; ++b, blocks += 34, q += 32) {
        for (int j = 0; j < 32; ++j) q[j] = static_cast<uint8_t>(static_cast<int8_t>(blocks[2 + j]) + 128);
        scale[b] = half_at(blocks);
      }
      return 0;
    case kQ6_K:  // 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales, d: d * sc * (q - 32) per 16
      for (int64_t b = 0; b < n; ++b, blocks += 210, q += 256) {
        const uint8_t *ql = blocks, *qh = blocks + 128;
        for (int h = 0; h < 2; ++h)  // each half of 128 values: 64 low-nibble bytes, 32 high-bit bytes
          for (int i = 0; i < 128; ++i) {
            const int s = i / 64, l = i % 64, s4 = i / 32, l4 = i % 32;
            q[h * 128 + i] = static_cast<uint8_t>(((ql[h * 64 + l] >> (4 * s)) & 15) |
                                                  (((qh[h * 32 + l4] >> (2 * s4)) & 3) << 4));
          }
        d[b] = half_at(blocks + 208);
        for (int j = 0; j < 16; ++j) {
          sc[b * 16 + j] = static_cast<int8_t>(blocks[192 + j]);
          scale[b * 16 + j] = d[b] * static_cast<float>(sc[b * 16 + j]);
        }
      }
      return 0;
    case kQ4_K:  // d, dmin, 12 bytes of 6-bit scales and mins, (Q5_K: 32 bytes of fifth bits), 128 bytes
    case kQ5_K:  // 8 sub-blocks of 32: d * sc * q - dmin * m
      for (int64_t b = 0; b < n; ++b, q += 256) {
        const uint8_t* qs = blocks + (type == kQ5_K ? 48 : 16);
        for (int c = 0; c < 4; ++c)  // 32 bytes: the low nibbles are sub-block 2c, the high ones 2c + 1
          for (int l = 0; l < 32; ++l) q[c * 64 + l] = qs[c * 32 + l] & 15, q[c * 64 + 32 + l] = qs[c * 32 + l] >> 4;
        if (type == kQ5_K)  // sub-block i's fifth bits: bit i of each of the 32 bytes
          for (int i = 0; i < 8; ++i)
            for (int l = 0; l < 32; ++l) q[i * 32 + l] |= ((blocks[16 + l] >> i) & 1) << 4;
        d[b] = half_at(blocks), dneg[b] = -half_at(blocks + 2);
        for (int j = 0; j < 8; ++j) {
          scale_min(blocks + 4, j, sc + b * 8 + j, m + b * 8 + j);
          scale[b * 8 + j] = d[b] * static_cast<float>(sc[b * 8 + j]);
          offset[b * 8 + j] = dneg[b] * static_cast<float>(m[b * 8 + j]);
        }
        blocks += type == kQ5_K ? 176 : 144;
      }
      return 0;
    default:
      return -1;
  }
}

}  // extern "C"
