// Paged attention for CPU over a flattened batch of query tokens (prefill chunks and decodes mixed).
//
// Each query token t belongs to request tok_req[t] and sits at position tok_pos[t]; it attends to
// positions 0..tok_pos[t] of its request, read in place from the paged cache through the request's
// block table (no gather into a temporary buffer, no padding).
//
// A work item is one query token's heads over its keys, or (fewer tokens than threads: a decode step of one
// sequence) over a share of its blocks, the shares' softmax states merged after. Keys are taken kChunk at a time:
// the chunk's K and V rows are first streamed in with plain loads, then scores for every head, one online-softmax
// rescale per chunk (not per block), then the values. Each K/V row is read once for all heads, front to back.
//
// Cache layout: [num_blocks, block_size, kv_heads, head_dim] for one layer (contiguous).
// Built with -O3 -march=native -ffast-math -fopenmp (expf vectorizes through libmvec); plain C ABI,
// loaded with ctypes. libgomp is the one torch already loaded, so both share one thread pool.

#include <math.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "bf16.h"
#include "kernels.h"

namespace {

constexpr int kMaxQ = LLMSERVE_ATTN_MAX_Q;  // heads * head_dim
constexpr int kMaxHeads = LLMSERVE_ATTN_MAX_HEADS;
constexpr int kMaxBlock = LLMSERVE_ATTN_MAX_BLOCK;
constexpr int kChunk = 256;  // a multiple of every supported block size
// The most K/V bytes of a chunk streamed in before its loops: more would not stay in a core's L2 until they are
// read again, and a chunk read twice from memory costs more than the stream-in saves (GPT-2 float32's 6 KB rows)
constexpr int64_t kStreamInBytes = 256 << 10;

// Every key of a chunk of blocks [b0, b1): fn(pointer to the key's row at `base` elements in, index in the chunk).
// The last block of the context holds only its first ctx - b * block_size keys.
template <typename E, typename F>
inline void for_keys(const E* cache, const int32_t* bt, int b0, int b1, int nb, int ctx, int block_size, int64_t blk,
                     int64_t row, int64_t base, F&& fn) {
  for (int b = b0; b < b1; ++b) {
    const int n = (b == nb - 1) ? ctx - b * block_size : block_size;
    const E* kb = cache + bt[b] * blk + base;
    const int off = (b - b0) * block_size;
    for (int j = 0; j < n; ++j) fn(kb + j * row, off + j);
  }
}

// Read every K and V row of blocks [b0, b1) once with plain loads, so the chunk is in cache before the score and
// value loops (see paged_attention and kStreamInBytes); what is read goes to a volatile, so the loads stay
template <typename E>
inline void stream_in(const E* kc, const E* vc, const int32_t* bt, int b0, int b1, int nb, int ctx, int block_size,
                      int64_t blk, int64_t row) {
  static volatile uint64_t sink;
  uint64_t acc = 0;
  const int64_t words = row * static_cast<int64_t>(sizeof(E)) / 8;
  for (const E* cache : {kc, vc})
    for_keys(cache, bt, b0, b1, nb, ctx, block_size, blk, row, 0, [&](const E* r, int) {
      const uint64_t* w = reinterpret_cast<const uint64_t*>(r);
      for (int64_t i = 0; i < words; i += 8) acc |= w[i];  // one word of each 64 bytes
    });
  sink = acc;
}

// Item `it` of a call: its query token, the token's context and block table, and the item's share of the blocks
struct Item {
  int t, ctx, nb, first, last;  // blocks [first, last) of the context's nb
  const int32_t* bt;
  Item(int it, int splits, const int32_t* block_tables, int max_blocks, const int32_t* tok_req, const int32_t* tok_pos,
       int block_size)
      : t(it / splits), ctx(tok_pos[t] + 1), nb((ctx + block_size - 1) / block_size),
        first(it % splits * nb / splits), last((it % splits + 1) * nb / splits),
        bt(block_tables + static_cast<int64_t>(tok_req[t]) * max_blocks) {}
  // keys in blocks [b0, b1) (the context's last block holds only its first keys)
  int keys(int b0, int b1, int block_size) const {
    return (b1 * block_size < ctx ? b1 * block_size : ctx) - b0 * block_size;
  }
};

// The K/V of a member's next item (its first chunk, where it is streamed in: kStreamInBytes), asked for a few cache
// lines at a time from inside this item's score and value loops. Once an item's chunk is streamed in, those loops
// run from cache and the memory idles; a burst of prefetches instead stalls the core on its miss buffers. A chunk
// too large to stream in is read from memory by its loops, which these prefetches would only compete with (GPT-2's
// float32 heads). What it gains: docs/benchmarks.md, "The kernels' choices". A one-token step, with no next item,
// runs its loops without the steps (with_ahead).
struct Ahead {
  const char* cache[2];  // K, then V
  const int32_t* bt = nullptr;  // null: nothing to ask for
  int64_t block_bytes = 0, last_bytes = 0;  // a block's K (or V) bytes; the context's last block's
  int first = 0, end = 0, last_block = 0;   // the chunk's blocks [first, end)
  int lines = 0;                            // asked for at each step
  int c = 0, b = 0;
  int64_t off = 0;

  // The first chunk of `item`; `steps`: how often a key's loops step
  template <typename T>
  void plan(const Item& item, const T* kc, const T* vc, int block_size, int blocks_per_chunk, int64_t blk,
            int64_t row, int steps) {
    first = item.first;
    end = first + blocks_per_chunk < item.last ? first + blocks_per_chunk : item.last;
    const int64_t row_bytes = row * static_cast<int64_t>(sizeof(T));
    if (first == end || 2 * item.keys(first, end, block_size) * row_bytes > kStreamInBytes) return;  // read anyway
    bt = item.bt;
    cache[0] = reinterpret_cast<const char*>(kc), cache[1] = reinterpret_cast<const char*>(vc);
    block_bytes = blk * static_cast<int64_t>(sizeof(T));
    last_block = item.nb - 1, last_bytes = (item.ctx - last_block * block_size) * row_bytes;
    b = first;
    // a key's K and V rows over the score and value loops' steps (as many keys as this item's, about)
    lines = static_cast<int>((2 * row_bytes + 64 * 2 * steps - 1) / (64 * 2 * steps));
  }
  bool planned() const { return bt != nullptr; }
  void step() {
    for (int i = 0; i < lines && c < 2; ++i) {
      __builtin_prefetch(cache[c] + bt[b] * block_bytes + off);
      off += 64;
      if (off >= (b == last_block ? last_bytes : block_bytes)) {
        off = 0;
        if (++b == end) b = first, ++c;
      }
    }
  }
};

// fn(std::true_type) when `ahead` has lines to ask for, else fn(std::false_type): loops compiled without the steps
template <typename F>
inline void with_ahead(const Ahead& ahead, F&& fn) {
  if (ahead.planned())
    fn(std::true_type{});
  else
    fn(std::false_type{});
}

#if defined(__AVX512BF16__)
// bf16, head_dim 64: the chunk's scores for the G query heads of one KV head, q·k by vdpbf16ps (32 bf16 products
// an instruction, summed in float32: no conversion of K to float), then scaled
template <bool kAhead>  // whether to step `ahead` (with_ahead)
inline void scores_bf16_d64(const uint16_t* qg, int G, const uint16_t* kc, const int32_t* bt, int b0, int b1, int nb,
                            int ctx, int block_size, int64_t blk, int64_t row, int kvh, float scale, float* s,
                            Ahead& ahead) {
  for_keys(kc, bt, b0, b1, nb, ctx, block_size, blk, row, kvh * 64, [&](const uint16_t* kj, int j) {
    if constexpr (kAhead) ahead.step();
    const __m512i k0 = _mm512_loadu_si512(kj), k1 = _mm512_loadu_si512(kj + 32);
    for (int g = 0; g < G; ++g) {
      const __m512 d = _mm512_dpbf16_ps(_mm512_dpbf16_ps(_mm512_setzero_ps(), (__m512bh)_mm512_loadu_si512(qg + g * 64),
                                                         (__m512bh)k0),
                                        (__m512bh)_mm512_loadu_si512(qg + g * 64 + 32), (__m512bh)k1);
      s[g * kChunk + j] = _mm512_reduce_add_ps(d) * scale;
    }
  });
}

// bf16, head_dim 64: acc[g] += p[g][j] · v_j over the chunk's keys, four heads at a time held in registers (each V
// row converted to float once for all of them)
template <bool kAhead>
inline void values_bf16_d64(int G, const uint16_t* vc, const int32_t* bt, int b0, int b1, int nb, int ctx,
                            int block_size, int64_t blk, int64_t row, int kvh, const float* s, float* acc,
                            Ahead& ahead) {
  for (int g0 = 0; g0 < G; g0 += 4) {
    const int gb = G - g0 < 4 ? G - g0 : 4;
    __m512 a[4][4];
    for (int gi = 0; gi < 4; ++gi)
      for (int c = 0; c < 4; ++c) a[gi][c] = gi < gb ? _mm512_loadu_ps(acc + (g0 + gi) * 64 + c * 16) : _mm512_setzero_ps();
    for_keys(vc, bt, b0, b1, nb, ctx, block_size, blk, row, kvh * 64, [&](const uint16_t* vj, int j) {
      if constexpr (kAhead) ahead.step();
      __m512 v[4];
      for (int c = 0; c < 4; ++c)  // bf16 → float32: the 16 bits become the top half
        v[c] = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vj + c * 16))), 16));
      for (int gi = 0; gi < 4; ++gi) {
        if (gi >= gb) break;
        const __m512 p = _mm512_set1_ps(s[(g0 + gi) * kChunk + j]);
        for (int c = 0; c < 4; ++c) a[gi][c] = _mm512_fmadd_ps(p, v[c], a[gi][c]);
      }
    });
    for (int gi = 0; gi < gb; ++gi)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (g0 + gi) * 64 + c * 16, a[gi][c]);
  }
}
#endif

// DC: head_dim fixed at compile time (64, 128) so the inner loops unroll; 0 = runtime head_dim.
//
// Shares of the keys rather than items per KV head (what a one-sequence step ran before): a thread then reads
// whole rows, block after block, not a KV head's slice of each row. And each chunk is streamed in first: the
// score and value loops spend ~40 instructions on each 128-byte slice, so a core's reorder window held too few
// loads to keep the memory busy, while a plain load loop over contiguous rows lets the L2's stream prefetcher run
// ahead (software prefetches did not: on the AMD EPYC measured they fill the same miss buffers as the loads).
//
// Items go round-robin to the team's members (neighbouring query tokens of a prompt chunk have similar contexts;
// newest_key_member in kernels.h follows this).
template <typename T, int DC>
void paged_attention(const Team& tm, const T* q, int64_t q_stride, const T* kc, const T* vc,
                     const int32_t* block_tables, int max_blocks, const int32_t* tok_req, const int32_t* tok_pos,
                     T* out, int64_t out_stride, int num_tokens, int num_heads, int num_kv_heads, int head_dim,
                     int block_size, float scale, float* part, bool merge_all) {
  const int G = num_heads / num_kv_heads;
  const int D = DC > 0 ? DC : head_dim;
  const int64_t row = static_cast<int64_t>(num_kv_heads) * D;
  const int64_t blk = row * block_size;
  // keys are taken kChunk at a time (whole blocks): scores for every head, one softmax rescale, then values
  const int blocks_per_chunk = kChunk / block_size;
  const int splits = token_splits(num_tokens, tm.size);
  const int items = num_tokens * splits;
  const int GH = num_heads;
#if defined(__AVX512BF16__)
  constexpr bool kFastBf16 = sizeof(T) == 2 && DC == 64;
#else
  constexpr bool kFastBf16 = false;
#endif
  {
    alignas(64) float s[kMaxHeads * kChunk];  // the item's heads × kChunk scores
    for (int it = tm.id; it < items; it += tm.size) {
      const Item item(it, splits, block_tables, max_blocks, tok_req, tok_pos, block_size);
      const int t = item.t, ctx = item.ctx, nb = item.nb, first = item.first, last = item.last;
      const int32_t* bt = item.bt;
      alignas(64) float qf[kMaxQ];
      alignas(64) float acc[kMaxQ];
      float m[kMaxHeads], l[kMaxHeads];  // running max and sum per head
      const T* qt = q + t * q_stride;
      for (int i = 0; i < GH * D; ++i) {
        if constexpr (!kFastBf16) qf[i] = load(qt[i]) * scale;  // the bf16 path reads q as stored
        acc[i] = 0.f;
      }
      for (int g = 0; g < GH; ++g) {
        m[g] = -1e30f;  // finite: built with -ffast-math
        l[g] = 0.f;
      }
      Ahead ahead;  // the fast path steps once a KV head, the other once a key
      if (it + tm.size < items)
        ahead.plan(Item(it + tm.size, splits, block_tables, max_blocks, tok_req, tok_pos, block_size), kc, vc,
                   block_size, blocks_per_chunk, blk, row, kFastBf16 ? num_kv_heads : 1);
      for (int b0 = first; b0 < last; b0 += blocks_per_chunk) {
        const int b1 = b0 + blocks_per_chunk < last ? b0 + blocks_per_chunk : last;
        const int nc = item.keys(b0, b1, block_size);  // keys in this chunk
        if (2 * nc * row * static_cast<int64_t>(sizeof(T)) <= kStreamInBytes)
          stream_in(kc, vc, bt, b0, b1, nb, ctx, block_size, blk, row);
        // scores: stream each block's K rows once, every head per row
        if constexpr (kFastBf16) {
#if defined(__AVX512BF16__)
          for (int kvh = 0; kvh < num_kv_heads; ++kvh)
            with_ahead(ahead, [&](auto on) {
              scores_bf16_d64<decltype(on)::value>(reinterpret_cast<const uint16_t*>(qt) + kvh * G * 64, G,
                                                   reinterpret_cast<const uint16_t*>(kc), bt, b0, b1, nb, ctx,
                                                   block_size, blk, row, kvh, scale, s + kvh * G * kChunk, ahead);
            });
#endif
        } else {
          for_keys(kc, bt, b0, b1, nb, ctx, block_size, blk, row, 0, [&](const T* kj, int j) {
            ahead.step();
            for (int g = 0; g < GH; ++g) {
              const float* qh = qf + g * D;
              const T* kh = kj + (g / G) * D;
              float dot = 0.f;
              for (int d = 0; d < D; ++d) dot += qh[d] * load(kh[d]);
              s[g * kChunk + j] = dot;
            }
          });
        }
        // softmax update, once per chunk
        for (int g = 0; g < GH; ++g) {
          float* sh = s + g * kChunk;
          float mx = m[g];
          for (int j = 0; j < nc; ++j) mx = sh[j] > mx ? sh[j] : mx;
          const float corr = expf(m[g] - mx);
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int j = 0; j < nc; ++j) {
            const float p = expf(sh[j] - mx);
            sh[j] = p;
            sum += p;
          }
          l[g] = l[g] * corr + sum;
          m[g] = mx;
          if (corr != 1.f) {
            float* ah = acc + g * D;
            for (int d = 0; d < D; ++d) ah[d] *= corr;
          }
        }
        // values: stream each block's V rows once
        if constexpr (kFastBf16) {
#if defined(__AVX512BF16__)
          for (int kvh = 0; kvh < num_kv_heads; ++kvh)
            with_ahead(ahead, [&](auto on) {
              values_bf16_d64<decltype(on)::value>(G, reinterpret_cast<const uint16_t*>(vc), bt, b0, b1, nb, ctx,
                                                   block_size, blk, row, kvh, s + kvh * G * kChunk,
                                                   acc + kvh * G * 64, ahead);
            });
#endif
        } else {
          for_keys(vc, bt, b0, b1, nb, ctx, block_size, blk, row, 0, [&](const T* vj, int j) {
            ahead.step();
            for (int g = 0; g < GH; ++g) {
              const float p = s[g * kChunk + j];
              const T* vh = vj + (g / G) * D;
              float* ah = acc + g * D;
              for (int d = 0; d < D; ++d) ah[d] += p * load(vh[d]);
            }
          });
        }
      }
      if (splits == 1) {
        T* ot = out + t * out_stride;
        for (int g = 0; g < GH; ++g) {
          const float inv = 1.f / l[g];
          for (int d = 0; d < D; ++d) store(ot + g * D + d, acc[g * D + d] * inv);
        }
      } else {
        float* pi = part + static_cast<size_t>(it) * GH * (D + 2);
        for (int g = 0; g < GH; ++g) {
          pi[g * (D + 2)] = m[g], pi[g * (D + 2) + 1] = l[g];
          std::memcpy(pi + g * (D + 2) + 2, acc + g * D, D * sizeof(float));
        }
      }
    }
  }
  if (splits > 1) {  // each token's shares, rescaled to their common max and summed (every head: merge_all)
    tm.sync();
    const Team mt = merge_all ? Team{0, 1, nullptr} : tm;
    alignas(64) float o[kMaxQ];  // one head's D sums
    for (int tg = mt.begin(num_tokens * GH); tg < mt.end(num_tokens * GH); ++tg) {
      const int t = tg / GH, g = tg % GH;
      const float* p0 = part + (static_cast<size_t>(t) * splits * GH + g) * (D + 2);
      const size_t step = static_cast<size_t>(GH) * (D + 2);  // the next share's state for this head
      float mx = -1e30f;
      for (int sp = 0; sp < splits; ++sp) mx = p0[sp * step] > mx ? p0[sp * step] : mx;
      float l = 0.f;
      for (int sp = 0; sp < splits; ++sp) {
        const float* ps = p0 + sp * step;
        const float w = expf(ps[0] - mx);
        l += ps[1] * w;
        for (int d = 0; d < D; ++d) o[d] = sp == 0 ? ps[2 + d] * w : o[d] + ps[2 + d] * w;
      }
      T* ot = out + t * out_stride + static_cast<int64_t>(g) * D;
      for (int d = 0; d < D; ++d) store(ot + d, o[d] / l);
    }
  }
}

// Store each new token's K and V ([T, kv_heads*head_dim] rows, any row stride) at its slot; this member's tokens.
template <typename T>
void write_kv(const Team& tm, const T* k, int64_t k_stride, const T* v, int64_t v_stride, T* kc, T* vc,
              const int64_t* slots, int num_tokens, int64_t row) {
  for (int t = tm.begin(num_tokens); t < tm.end(num_tokens); ++t) {
    std::memcpy(kc + slots[t] * row, k + t * k_stride, row * sizeof(T));
    std::memcpy(vc + slots[t] * row, v + t * v_stride, row * sizeof(T));
  }
}

template <typename T>
void dispatch(const Team& tm, const T* q, int64_t qs, const T* kc, const T* vc, const int32_t* bt, int mb,
              const int32_t* tr, const int32_t* tp, T* out, int64_t os, int nt, int H, int KVH, int D, int BS, float sc,
              float* part, bool all) {
  if (D == 64) paged_attention<T, 64>(tm, q, qs, kc, vc, bt, mb, tr, tp, out, os, nt, H, KVH, D, BS, sc, part, all);
  else if (D == 128)
    paged_attention<T, 128>(tm, q, qs, kc, vc, bt, mb, tr, tp, out, os, nt, H, KVH, D, BS, sc, part, all);
  else paged_attention<T, 0>(tm, q, qs, kc, vc, bt, mb, tr, tp, out, os, nt, H, KVH, D, BS, sc, part, all);
}

// Both dtypes' attention on a region of its own
void attention(const void* q, int64_t qs, const void* kc, const void* vc, const int32_t* bt, int mb, const int32_t* tr,
               const int32_t* tp, void* out, int64_t os, int nt, int H, int KVH, int D, int BS, float sc, int th,
               int elem_size) {
  float* part = attention_part(nt, H, D, th);
  on_team(th, nt * token_splits(nt, th) > 1, [&](const Team& tm) {
    team_paged_attention(tm, q, qs, kc, vc, bt, mb, tr, tp, out, os, nt, H, KVH, D, BS, sc, part, elem_size);
  });
}
}  // namespace

extern "C" {

void llmserve_write_kv(const void* k, int64_t ks, const void* v, int64_t vs, void* kc, void* vc, const int64_t* slots,
                       int nt, int64_t row, int elem_size, int th) {
  on_team(th, nt > 64, [&](const Team& tm) { team_write_kv(tm, k, ks, v, vs, kc, vc, slots, nt, row, elem_size); });
}

void llmserve_argmax_f32(const float* x, int rows, int cols, int64_t stride, int64_t* out, int th) {
#pragma omp parallel for num_threads(th)
  for (int r = 0; r < rows; ++r) out[r] = first_max(x + r * stride, cols);
}

void llmserve_paged_attention_f32(const void* q, int64_t qs, const void* kc, const void* vc, const int32_t* bt,
                                  int mb, const int32_t* tr, const int32_t* tp, void* out, int64_t os, int nt, int H,
                                  int KVH, int D, int BS, float sc, int th) {
  attention(q, qs, kc, vc, bt, mb, tr, tp, out, os, nt, H, KVH, D, BS, sc, th, 4);
}

void llmserve_paged_attention_bf16(const void* q, int64_t qs, const void* kc, const void* vc, const int32_t* bt,
                                   int mb, const int32_t* tr, const int32_t* tp, void* out, int64_t os, int nt, int H,
                                   int KVH, int D, int BS, float sc, int th) {
  attention(q, qs, kc, vc, bt, mb, tr, tp, out, os, nt, H, KVH, D, BS, sc, th, 2);
}

}  // extern "C"

void team_write_kv(const Team& tm, const void* k, int64_t ks, const void* v, int64_t vs, void* kc, void* vc,
                   const int64_t* slots, int nt, int64_t row, int elem_size) {
  if (elem_size == 4)
    write_kv<float>(tm, static_cast<const float*>(k), ks, static_cast<const float*>(v), vs, static_cast<float*>(kc),
                    static_cast<float*>(vc), slots, nt, row);
  else
    write_kv<uint16_t>(tm, static_cast<const uint16_t*>(k), ks, static_cast<const uint16_t*>(v), vs,
                       static_cast<uint16_t*>(kc), static_cast<uint16_t*>(vc), slots, nt, row);
}

void team_paged_attention(const Team& tm, const void* q, int64_t qs, const void* kc, const void* vc,
                          const int32_t* bt, int mb, const int32_t* tr, const int32_t* tp, void* out, int64_t os,
                          int nt, int H, int KVH, int D, int BS, float sc, float* part, int elem_size,
                          bool merge_all) {
  if (elem_size == 4)
    dispatch<float>(tm, static_cast<const float*>(q), qs, static_cast<const float*>(kc),
                    static_cast<const float*>(vc), bt, mb, tr, tp, static_cast<float*>(out), os, nt, H, KVH, D, BS, sc,
                    part, merge_all);
  else
    dispatch<uint16_t>(tm, static_cast<const uint16_t*>(q), qs, static_cast<const uint16_t*>(kc),
                       static_cast<const uint16_t*>(vc), bt, mb, tr, tp, static_cast<uint16_t*>(out), os, nt, H, KVH,
                       D, BS, sc, part, merge_all);
}

float* attention_part(int nt, int H, int D, int threads) {
  // a share's state per head: its max, its sum and its unnormalised output, merged once every share is done
  thread_local std::vector<float> scratch;  // grown once; the calling thread's, shared with its region's members
  const int splits = token_splits(nt, threads);
  if (splits == 1) return nullptr;
  scratch.resize(static_cast<size_t>(nt) * splits * H * (D + 2));
  return scratch.data();
}
