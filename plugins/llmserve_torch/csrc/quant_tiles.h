// The group kernel over weight tiles (quant_matmul.cpp includes it after the ISA's path where the build has tiles:
// arch/x86/quant_avx512.h, arch/x86/quant_avx2.h). The path supplies tile_acts (each row of x quantized its way),
// tile_rows (one tile against a block of rows of x) and row_block (the rows a block holds); this shares the tiles out
// and blocks the rows.
#pragma once

#include "quant_format.h"

namespace quant {

// How far ahead a member asks for its weights with up to four rows of x: 8 KiB for AVX-512's tiles of 16 (a kernel
// reading few rows reads fastest, so it needs more bytes in flight), 4 KiB for AVX2's tiles of 8, which read about
// half as fast (the head of the Qwen2.5-0.5B file 3-6 % faster at one row than with 8 KiB)
constexpr int kFewRowsAhead = kTile == 16 ? 8192 : 4096;

// This member's tiles; every member quantizes x itself into its own buffers, at the same time (one thread did it
// before the others started, which took as long, and a shared copy would need a barrier)
template <typename F, typename T, typename U>
void group_matmul(const Team& tm, const T* x, int64_t xs, int rows, const uint8_t* w, U* y, int64_t ys, int N, int K,
                  bool narrow) {
  const int tiles = quant_tiles(N);
  const auto& a = tile_acts<F>(x, xs, rows, K, narrow);
  // kFewRowsAhead with up to four rows of x, 4 KiB with more, where the farther distance no longer paid
  // (docs/benchmarks.md, "Prefetch distances")
  const int ahead = prefetch_distance(rows, kFewRowsAhead);
  const int t0 = tm.share_begin(tiles), t1 = tm.share_end(tiles);
  for (int t = t0; t < t1; ++t) {
    const Block<F> b(w, t, K);
    int r0 = 0;
    constexpr int RB = row_block<F>();
    for (; r0 + RB <= rows; r0 += RB) tile_rows<F, RB>(b, a, r0, K, y, ys, t * kTile, N, ahead);
    if (RB > 8 && rows - r0 >= 8) tile_rows<F, 8>(b, a, r0, K, y, ys, t * kTile, N, ahead), r0 += 8;
    if (RB > 4 && rows - r0 >= 4) tile_rows<F, 4>(b, a, r0, K, y, ys, t * kTile, N, ahead), r0 += 4;
    switch (rows - r0) {
      case 3: tile_rows<F, 3>(b, a, r0, K, y, ys, t * kTile, N, ahead); break;
      case 2: tile_rows<F, 2>(b, a, r0, K, y, ys, t * kTile, N, ahead); break;
      case 1: tile_rows<F, 1>(b, a, r0, K, y, ys, t * kTile, N, ahead); break;
      default: break;
    }
  }
}

}  // namespace quant
