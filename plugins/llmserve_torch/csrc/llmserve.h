/* The kernel library's C interface: its limits, the structs its calls take and every entry point.
 *
 * The one statement of it: the sources define these functions (the compiler holds them to it), and the Python side
 * (kernel_library.py) reads this file for its ctypes signatures, struct layouts and limits. So keep to what that
 * reader parses: `#define LLMSERVE_NAME <integer>`, `struct llmserve_x { <type> <name>; ... };` with one field a
 * declaration (nested structs by `struct llmserve_y name;`), and one `LLMSERVE_API <type> llmserve_f(<params>);` a
 * function, each ending at its `;`. Pointers are passed as addresses; elem_size 4 means float32, 2 bfloat16;
 * th is the number of threads a call may use.
 */
#ifndef LLMSERVE_H
#define LLMSERVE_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define LLMSERVE_API __attribute__((visibility("default")))

/* --- limits ---------------------------------------------------------------------------------------------------- */

/* The int8-per-row kernel (decoder_ops.cpp): at most this many activation rows, this many inputs */
#define LLMSERVE_INT8_MAX_ROWS 8
#define LLMSERVE_INT8_MAX_K 8192
/* Paged attention (paged_attention.cpp): heads * head_dim, heads and KV block size at most */
#define LLMSERVE_ATTN_MAX_Q 8192
#define LLMSERVE_ATTN_MAX_HEADS 128
#define LLMSERVE_ATTN_MAX_BLOCK 64
/* A quantized linear's kind (llmserve_qlinear.kind): int8 with one scale per output row, or a group format
 * (llmserve_quant_format's code, which has this bit set) */
#define LLMSERVE_KIND_INT8_ROWS 8
#define LLMSERVE_GROUP_FORMAT 0x100
/* The fewest narrow rows of a quantized matmul that run on AMX tiles, where the build and the OS have them */
#define LLMSERVE_AMX_MIN_ROWS 16
/* The fewest rows of a quantized matmul that run on panels, where the build is AVX2 without VNNI and the weights have
 * fewer than 8 bits: a prompt's rows (and narrow ones with scales per 16) in float32 FMA on dequantized weights, other
 * narrow rows in int8 products on unpacked bytes */
#define LLMSERVE_FMA_MIN_ROWS 24
/* Bytes of the state llmserve_model.balance points to (the caller's zeroed buffer, kept between calls) */
#define LLMSERVE_BALANCE_BYTES 192

/* --- the fused decoder call's tables (llmserve_decode_layers) --------------------------------------------------- */

/* y[rows, n] = x[rows, k] · W^T (+ bias) */
struct llmserve_qlinear {
  int32_t kind;       /* a group format (w, its scales inside), or LLMSERVE_KIND_INT8_ROWS (w, scale) */
  int32_t n;
  int32_t k;
  const void* w;
  const float* scale;
  const void* bias;   /* in the activations' dtype, or null */
};

struct llmserve_layer {
  struct llmserve_qlinear qkv;
  struct llmserve_qlinear o;
  struct llmserve_qlinear gate_up;
  struct llmserve_qlinear down;
  const void* in_norm;
  const void* post_norm;
  void* k_cache;      /* this layer's [slots, kv_heads * head_dim] */
  void* v_cache;
};

struct llmserve_model {
  int32_t layers;
  int32_t hidden;
  int32_t heads;
  int32_t kv_heads;
  int32_t head_dim;
  int32_t inter;
  int32_t block_size;
  int32_t elem_size;
  float eps;
  float attn_scale;
  const struct llmserve_layer* layer;
  struct llmserve_qlinear head;  /* the LM head, or kind 0 where the caller never asks for logits */
  const void* final_norm;
  const void* embed;  /* [vocab, hidden]: the step's ids' rows, in the activations' dtype, or with embed_format */
  int32_t embed_format; /* 0: embed is that dense table; else a group format: embed is a weight in it (the tied LM
                         * head's own packed bytes), its rows dequantized as they are read */
  int32_t vocab;
  void* balance;      /* LLMSERVE_BALANCE_BYTES of the caller's, kept between calls (null: equal shares) */
  int64_t wait_ahead; /* bytes of its next matmul's share a member asks for at most while it waits (0: none) */
};

/* Each [max rows, its width], contiguous, in the activations' dtype; f32: [max rows, widest int8 output] */
struct llmserve_scratch {
  void* h;
  void* qkv;
  void* attn;
  void* o;
  void* gu;
  void* act;
  void* down;
  float* f32;
};

struct llmserve_step {
  void* x;                 /* [rows, hidden]: the ids' embedding rows (copied in), the last layer's output out */
  const int64_t* ids;      /* [rows], the step's tokens */
  int32_t rows;
  const float* cos;        /* the model's tables [positions, head_dim / 2], read at tok_pos */
  const float* sin;
  const int64_t* slots;
  const int32_t* block_tables;
  int32_t max_blocks;
  const int32_t* tok_req;
  const int32_t* tok_pos;
  int32_t threads;
  double* stage_us;        /* null, or the stages' microsecond sums this call adds to (fused_stack.STAGES) */
  float* logits;           /* null, or [rows, head.n]: every row's float32 logits (the last forward's) */
  int64_t* tokens;         /* null, or [forwards, rows]: each row's token (with logits): greedy or drawn (temps) */
  /* forwards run back to back (a batch of decodes, with tokens): forward f reads the tokens of forward f - 1 as its
   * ids, each row a position further on, its K/V slot found in block_tables (which reach the last forward's) */
  int32_t forwards;
  /* null where every row is greedy, or [rows]: a row's temperature, 0 for a greedy row; a row with one > 0 draws its
   * token from softmax(logits / t) by the race (race.cpp) with keys[f * rows + r] */
  const float* temps;
  const uint64_t* keys;    /* [forwards, rows], with temps */
  /* null where no drawn row filters, or [3, rows]: each row's top_k (a whole number as a float; 0: none), top_p (1:
   * none) and min_p (0: none); filtered: [rows, vocab], room for a filtering row's logits */
  const float* filters;
  float* filtered;
  /* null, or where the call stores how many forwards' tokens are written so far (after each forward, with release
   * order); then a byte is written to notify_fd (where >= 0) each time, to wake a thread that hands them on while
   * the call runs (forward_relay.py's ForwardRelay) */
  int32_t* progress;
  int32_t notify_fd;
  /* rows [0, narrow) whose activations the group kernels round to int8 per group of 32, not int16
   * (llmserve_quant_matmul's narrow): a step's decodes, where at least backend.options.int8_decode_rows; 0: none */
  int32_t narrow;
};

/* --- entry points ----------------------------------------------------------------------------------------------- */

/* Every layer of a Llama-style model for one step of a few rows in one call (decode_layers.cpp): 0, or -1 (nothing
 * run) where an id is not a row of the embedding */
LLMSERVE_API int llmserve_decode_layers(const struct llmserve_model* m, const struct llmserve_scratch* s,
                                        const struct llmserve_step* st);

/* y = x · W^T for a group format (quant_matmul.cpp). x: [rows, K] float32 (elem_size 4) or bf16 (2), row stride xs;
 * K a multiple of 32; w as pack_own lays it out for llmserve_quant_tile(); y: [rows, N], float32 (out_size 4) or
 * bf16 (2, with bf16 x). x's rows [0, narrow) rounded to int8 per group of 32, not int16, where this build's tiles
 * have int8 products for the format (llmserve_quant_narrow), or where there are LLMSERVE_AMX_MIN_ROWS of them or more
 * and llmserve_quant_amx says so, computed in bf16 on AMX tiles; the rest int16. With bf16 x (elem_size 2) and
 * llmserve_quant_amx on, a call of LLMSERVE_AMX_MIN_ROWS rows or more runs every row on the tiles, narrow or not.
 * On AVX2 without VNNI, LLMSERVE_FMA_MIN_ROWS rows or more of weights below 8 bits run on panels (llmserve_quant_fma):
 * rows not narrow are not rounded there (float32 products) */
LLMSERVE_API void llmserve_quant_matmul(int fmt, const void* x, int64_t xs, int rows, const uint8_t* w, void* y,
                                        int64_t ys, int N, int K, int elem_size, int out_size, int th, int narrow);
/* 1 where llmserve_quant_matmul's narrow rows, LLMSERVE_AMX_MIN_ROWS or more (any such call's rows with bf16
 * activations), run in bf16 on AMX tiles (the weights
 * dequantized to bf16, the products summed in float32) instead of int8, else 0; want 0 turns that off, 1 on where the
 * build and the OS have the tiles, -1 only asks */
LLMSERVE_API int llmserve_quant_amx(int want);
/* 1 where llmserve_quant_matmul's calls of LLMSERVE_FMA_MIN_ROWS rows or more on weights below 8 bits run on panels
 * (AVX2 builds without VNNI): float32 FMA on dequantized weights (narrow rows too with Q6_K's scales per 16), other
 * narrow rows' int8 products on unpacked bytes; else 0 (the integer tiles). want 0 turns that off, 1 on where the build
 * has it, -1 only asks */
LLMSERVE_API int llmserve_quant_fma(int want);
/* 1 where llmserve_quant_matmul's narrow rounds activations to int8 for format fmt on this build, else 0 */
LLMSERVE_API int llmserve_quant_narrow(int fmt);
/* Rows ids[0, rows) of an [N, K] weight in group format fmt (as pack_own lays it out), dequantized into y [rows, K]
 * (row stride ys elements), float32 (out_size 4) or bf16 (2): an embedding table kept quantized. 0, or -1 (nothing
 * written) where an id is not a row */
LLMSERVE_API int llmserve_quant_rows(int fmt, const uint8_t* w, int N, int K, const int64_t* ids, int rows, void* y,
                                     int64_t ys, int out_size, int th);
/* A GGUF tensor's n blocks of one type (ggml's type id: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13,
 * Q6_K 14) unpacked (gguf_unpack.cpp): a byte a value q [n, values a block], each group's float32 scale [n, groups]
 * and offset (types with offsets) as QuantWeight holds them, and for a K-quant its factors: d [n], sc [n, groups],
 * with offsets dneg [n] and m [n, groups] (null where the type has none). 0, or -1 for another type */
LLMSERVE_API int llmserve_gguf_unpack(int type, const uint8_t* blocks, int64_t n, uint8_t* q, float* scale,
                                      float* offset, float* d, int8_t* sc, float* dneg, int8_t* m);
/* An [N, K] weight in group format fmt laid out as the kernels read it (quant_format.h's Block): one byte a value q
 * [N, K] (0 .. 2^bits - 1); each group's scales and offsets [N, K / 32 * parts] as float32 (stored as float16), or for
 * a format with super-block factors sc and m (int8, those shapes) and d and dneg [N, K / 256] (float32, stored as
 * float16); offsets, m and dneg null where the format has none. out: llmserve_quant_bytes(fmt, N, K) bytes, the rows
 * padded to a whole tile with zeros. 0, or -1 (unknown format, or a float16 that would not be finite) */
LLMSERVE_API int llmserve_pack_weight(int fmt, const uint8_t* q, const float* scale, const float* offset,
                                      const int8_t* sc, const int8_t* m, const float* d, const float* dneg, int N,
                                      int K, uint8_t* out);
/* The code of the group format with values of `bits` bits, offsets or not, scales per 16 inputs or per 32, float16
 * or int8 multiples of a float16 factor per 256 inputs (sup); -1 where the kernel has no such format */
LLMSERVE_API int llmserve_quant_format(int bits, int offsets, int half, int sup);
/* Bytes of an [N, K] weight in format fmt as pack_own lays it out for this build (rows padded to a whole tile) */
LLMSERVE_API int64_t llmserve_quant_bytes(int fmt, int N, int K);
/* The group formats' row tile of this build: 16 (AVX-512), 8 (AVX2) or 1 (rows in their natural packing) */
LLMSERVE_API int llmserve_quant_tile(void);
/* The integer SIMD this build's quantized kernels run on: avx512-vnni, avx512bw, avx2, neon-dotprod, neon, scalar */
LLMSERVE_API const char* llmserve_quant_isa(void);

/* y = x · W^T with int8 W and one scale per output row (decoder_ops.cpp); rows <= LLMSERVE_INT8_MAX_ROWS and
 * K <= LLMSERVE_INT8_MAX_K (the caller checks); float32 y */
LLMSERVE_API void llmserve_int8_matmul(const void* x, int64_t xs, int rows, const int8_t* w, const float* scale,
                                       float* y, int64_t ys, int N, int K, int elem_size, int th);
/* x += delta, out = rms_norm(x) * w (decoder_ops.cpp) */
LLMSERVE_API void llmserve_add_rms_norm(void* x, int64_t xs, const void* delta, int64_t ds, const void* w, void* out,
                                        int64_t os, int rows, int n, float eps, int elem_size, int th);
/* RoPE in place on the first `heads` heads of each row; cos/sin: [rows, D / 2] float32 (decoder_ops.cpp) */
LLMSERVE_API void llmserve_rope(void* qk, int64_t stride, int rows, int heads, int D, const float* cos,
                                const float* sin, int elem_size, int th);
/* out = silu(gate) * up, gu: [rows, 2 * inter] as gate|up (decoder_ops.cpp) */
LLMSERVE_API void llmserve_silu_mul(const void* gu, int64_t gs, void* out, int64_t os, int rows, int inter,
                                    int elem_size, int th);

/* Each token's K and V rows stored at its slot of the layer's caches (paged_attention.cpp) */
LLMSERVE_API void llmserve_write_kv(const void* k, int64_t ks, const void* v, int64_t vs, void* kc, void* vc,
                                    const int64_t* slots, int nt, int64_t row, int elem_size, int th);
/* Attention of each query token over its request's K/V, read in place through the block tables (paged_attention.cpp) */
LLMSERVE_API void llmserve_paged_attention_f32(const void* q, int64_t qs, const void* kc, const void* vc,
                                               const int32_t* bt, int mb, const int32_t* tr, const int32_t* tp,
                                               void* out, int64_t os, int nt, int H, int KVH, int D, int BS, float sc,
                                               int th);
LLMSERVE_API void llmserve_paged_attention_bf16(const void* q, int64_t qs, const void* kc, const void* vc,
                                                const int32_t* bt, int mb, const int32_t* tr, const int32_t* tp,
                                                void* out, int64_t os, int nt, int H, int KVH, int D, int BS, float sc,
                                                int th);

/* Index of the first maximum of each float32 row (torch's CPU argmax is a scalar loop) */
LLMSERVE_API void llmserve_argmax_f32(const float* x, int rows, int cols, int64_t stride, int64_t* out, int th);
/* Each row's token drawn from softmax over what top_k[r], top_p[r] and min_p[r] keep of x / temps[r] with keys[r]'s
 * noise (rows of `stride` floats, n logits each; top_k 0: none, top_p 1: none, min_p 0: none) (race.cpp) */
LLMSERVE_API void llmserve_sample_f32(const float* x, int rows, int n, int64_t stride, const float* temps,
                                      const int32_t* top_k, const float* top_p, const float* min_p,
                                      const uint64_t* keys, int64_t* out, int th);
/* Each row's filter alone into y ([rows, n]; masked entries -1e30): what the sampler's filters keep (race.cpp) */
LLMSERVE_API void llmserve_filter_f32(const float* x, int rows, int n, int64_t stride, const float* temps,
                                      const int32_t* top_k, const float* top_p, const float* min_p, float* y);

#ifdef __cplusplus
}
#endif

#endif /* LLMSERVE_H */
