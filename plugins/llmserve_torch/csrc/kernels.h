// The team forms of the library's kernels (team.h): each member of a parallel region does its share of one call,
// and nothing waits for the others except where noted. Arguments as the llmserve_* C entry points that run them
// (elem_size 4: float32, 2: bfloat16).
#pragma once

#include <cstdint>
#include <vector>

#include "llmserve.h"
#include "team.h"

// How far ahead (bytes) a matmul's thread asks for its weights (each thread's are contiguous). The bytes in flight
// must cover a memory latency at the rate the kernel reads them, so with a few rows of activations (a kernel then
// reads fastest) it asks `few_rows` bytes ahead, each kernel its own distance (quant_matmul.cpp, decoder_ops.cpp);
// with more rows 4 KiB. The farther distances pay where the memory is fast, and cost nothing where it is slow
// (with the weights in huge pages: no TLB miss at each 4 KiB page; docs/benchmarks.md, "Prefetch distances").
inline int prefetch_distance(int rows, int few_rows) { return rows <= 4 ? few_rows : 4096; }

// Index of the first largest of x[0..n) (n > 0): the greedy token of a row of logits (llmserve_argmax_f32, and
// each member's share in the fused call's head)
inline int first_max(const float* x, int n) {
  float mx = x[0];
#pragma omp simd reduction(max : mx)
  for (int c = 0; c < n; ++c) mx = x[c] > mx ? x[c] : mx;
  for (int c = 0; c < n; ++c)
    if (x[c] == mx) return c;
  return 0;  // none equal (a NaN, under -ffast-math)
}

// A row's largest score in some share of it, and where (the first such): a member's share of the greedy or sampled
// token's search (decode_layers.cpp's head, race.cpp)
struct Best {
  float value;
  int64_t at;
};

// The exponential race (race.cpp): the largest x_i / t + Gumbel noise of (key, i) over chunks [c0, c1) of the row's
// kRaceChunk-entry chunks, x[0, n) float32 logits (masked entries -inf, or at most -1e30); at -1 where all are masked
constexpr int kRaceChunk = 64;
inline int race_chunk_count(int64_t n) { return static_cast<int>((n + kRaceChunk - 1) / kRaceChunk); }
Best race_chunks(const float* x, int64_t n, int c0, int c1, float t, uint64_t key);

// Whether top-k, top-p or min-p drops anything from an n-entry row (top_k 0: none, top_p 1: none, min_p 0: none)
inline bool row_filters(int top_k, float top_p, float min_p, int64_t n) {
  return (top_k > 0 && top_k < n) || top_p < 1.f || min_p > 0.f;
}

// y[0, n) = x / t with what top-k, top-p and min-p drop masked (race.cpp); a row's draw is then race_chunks over y at
// t = 1. cand: the caller's scratch (one per thread)
void filter_row(const float* x, int64_t n, float t, int top_k, float top_p, float min_p, float* y,
                std::vector<int32_t>& cand);

// A quantized linear's weight format (decode_layers.cpp's QLinear::kind, llmserve_quant_matmul's fmt): int8 with one
// scale per output row (decoder_ops.cpp), or a group format of quant_matmul.cpp: values of `bits` bits (4, 5, 6, 8)
// in groups of 32 inputs, with offsets or symmetric, scales per 16 inputs (half) or per 32, float16 or (sup) int8
// multiples of a float16 factor per 256 inputs
constexpr int kInt8Rows = LLMSERVE_KIND_INT8_ROWS;
constexpr int kGroupFormat = LLMSERVE_GROUP_FORMAT;
constexpr int quant_format(int bits, bool offsets, bool half, bool sup = false) {
  return kGroupFormat | bits | (offsets ? 0x10 : 0) | (half ? 0x20 : 0) | (sup ? 0x40 : 0);
}
inline bool is_group_format(int kind) { return (kind & kGroupFormat) != 0; }

// y = x · W^T for a group format (quant_matmul.cpp), y float32 (out_size 4) or, with bf16 x, bf16 (2); this member's
// tiles of outputs (share_begin / share_end); x's rows [0, narrow) rounded to int8 per group, not int16, where the
// path has int8 products (kQMax8)
void team_quant_matmul(const Team& tm, int fmt, const void* x, int64_t xs, int rows, const uint8_t* w, void* y,
                       int64_t ys, int N, int K, int elem_size, int out_size, int narrow = 0);
// Rows ids[0, rows) of an [N, K] group-format weight dequantized into y [rows, K] (row stride ys elements), float32
// (out_size 4) or bf16 (2) (quant_matmul.cpp); rows shared out. The caller has checked the ids
void team_quant_rows(const Team& tm, int fmt, const uint8_t* w, int K, const int64_t* ids, int rows, void* y,
                     int64_t ys, int out_size);
// The group layout's rows a tile (16 with AVX-512, 8 with AVX2, else 1), its tiles for N outputs (a member's share is
// whole tiles) and one tile's bytes for K inputs
int quant_tile();
int quant_tiles(int N);
int64_t quant_tile_bytes(int fmt, int K);
// y = x · W^T, int8 per output row, float32 out (decoder_ops.cpp); this member's outputs
// [tm.share_begin(N), tm.share_end(N))
void team_int8_matmul(const Team& tm, const void* x, int64_t xs, int rows, const int8_t* w, const float* scale,
                      float* y, int64_t ys, int N, int K, int elem_size);
// x += delta, out = rms_norm(x) * w (decoder_ops.cpp); rows shared out (with fewer rows than members, some get none)
void team_add_rms_norm(const Team& tm, void* x, int64_t xs, const void* delta, int64_t ds, const void* w, void* out,
                       int64_t os, int rows, int n, float eps, int elem_size);
// RoPE on the first `heads` heads of each row (decoder_ops.cpp); heads shared out. cos/sin: [rows, D/2], or with
// pos the tables [positions, D/2] read at row r's pos[r]
void team_rope(const Team& tm, void* qk, int64_t stride, int rows, int heads, int D, const float* cos,
               const float* sin, const int32_t* pos, int elem_size);
// silu(gate) * up (decoder_ops.cpp); columns shared out
void team_silu_mul(const Team& tm, const void* gu, int64_t gs, void* out, int64_t os, int rows, int inter,
                   int elem_size);
// K/V rows stored at their slots (paged_attention.cpp); tokens shared out
void team_write_kv(const Team& tm, const void* k, int64_t ks, const void* v, int64_t vs, void* kc, void* vc,
                   const int64_t* slots, int nt, int64_t row, int elem_size);
// Paged attention (paged_attention.cpp); the members meet once inside (shares of a token merged after all are
// done). part: attention_part(...) of the thread that opened the region. merge_all: where a token's keys are
// shared out, every member merges every head into its own `out` (else each its share of them into the one `out`)
void team_paged_attention(const Team& tm, const void* q, int64_t qs, const void* kc, const void* vc,
                          const int32_t* bt, int mb, const int32_t* tr, const int32_t* tp, void* out, int64_t os,
                          int nt, int H, int KVH, int D, int BS, float sc, float* part, int elem_size,
                          bool merge_all = false);
// How many shares paged attention splits each query token's keys into: one, unless there are fewer tokens than
// threads
inline int token_splits(int num_tokens, int threads) {
  return num_tokens >= threads ? 1 : (threads + num_tokens - 1) / num_tokens;
}
// The member of a team of `size` whose items of a paged attention call over `num_tokens` tokens read token t's
// newest key: the one with its last share of the keys (items go to the members round-robin)
inline int newest_key_member(int t, int num_tokens, int size) {
  const int splits = token_splits(num_tokens, size);
  return (t * splits + splits - 1) % size;
}
// The shares' scratch of a paged attention call on `threads` threads (grown once; null when tokens are not split)
float* attention_part(int nt, int H, int D, int threads);
