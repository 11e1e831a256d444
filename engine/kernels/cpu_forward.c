/* The forward of a dense Llama-family model (Llama, Qwen2, Qwen3) on CPU, one call per step:
 * decode_step (one token per request) and extend_step (prefill chunks, after cached prefixes).
 *
 * A compiled decode step of a small model spends as long outside its kernels as inside them: the
 * guards, Inductor's Python wrapper, the dispatch of every custom op and its Python body (~0.7 ms of
 * a 2.5 ms step at batch 16 of the bench model, one thread). This file runs the whole forward from
 * the token ids to the final norm in C, with the engine's own kernels: the packed bfloat16 GEMM
 * (cpu_linear.c, the gate|up one with silu(gate) * up fused) and the paged decode and extend
 * attention (paged_attention.c), both included here so the forward is one library. What lies
 * between them (the norms, the bias, q/k norms, RoPE, the KV store, the residual adds) is a few
 * thousand elements per token: a decode batch's run on the calling thread, an extend's (at least
 * PARALLEL_ROWS tokens) over the threads, as the GEMMs and the attention always do. The threads are
 * parallel.h's crew, not OpenMP's (BATON_CREW): no barrier waits on a thread that is not running,
 * and the overlap loop's waiting scheduler thread joins in (stream_wait).
 *
 * Numerics follow the eager bfloat16 model op by op: every op's output is rounded to bfloat16
 * where eager stores a bfloat16 tensor (RMSNorm: x in float32, x * rsqrt(mean(x^2) + eps) rounded,
 * times the weight, rounded; the residual adds; the bias add; RoPE's four products and two sums, with
 * cos/sin rounded to bfloat16 as `.to(q.dtype)` does), and the RMSNorm's sum of squares is added in
 * torch's order (sum_squares).
 *
 * Layouts: every weight is the model's own tensor (bfloat16, contiguous) or its packed copy
 * (pack_bf16_weight); the KV pools are [slots, kv_heads, head_dim] bfloat16; cos/sin are the rotary
 * tables [max_positions, head_dim / 2] float32.
 */
#define BATON_CREW /* parallel.h's own threads, not OpenMP's: see there */
#include "cpu_linear.c"
#include "cpu_sampling.c"
#include "paged_attention.c"

typedef struct {
    const bf16_t *input_norm, *post_norm; /* [hidden] */
    const bf16_t *q_norm, *k_norm;        /* [head_dim], or NULL (Qwen3 has them) */
    const uint16_t *qkv, *o, *gate_up, *down; /* packed; gate_up laid out [gate | up] */
    const bf16_t *qkv_bias;               /* [q + 2 kv], or NULL */
    bf16_t *k_cache, *v_cache;            /* [num_slots, kv_heads, head_dim] */
} LayerWeights;

typedef struct {
    int64_t layers, hidden, heads, kv_heads, head_dim, intermediate, vocab, max_positions, num_slots;
    int64_t r2t_rows, r2t_stride;
    float eps, scale;
    const bf16_t *embed;      /* [vocab, hidden] */
    const bf16_t *final_norm; /* [hidden] */
    const float *cos, *sin;   /* [max_positions, head_dim / 2] */
    const int64_t *r2t;       /* req_to_token [r2t_rows, r2t_stride] */
    const LayerWeights *layer; /* [layers] */
} NativeModel;

/* float32 -> bfloat16, round to nearest even (NaN stays NaN), as torch's conversion. */
static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7FFFu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

static inline float round_f32(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* Rows at least this many run their elementwise loops over the threads (an extend's tokens; a
 * decode batch stays on the calling thread), PARALLEL_GRAIN rows a chunk. */
#define PARALLEL_ROWS 64
#define PARALLEL_GRAIN 16

/* The sum of x[i]^2 over n bfloat16 values, added in the order torch's float32 sum of a contiguous
 * row takes (ATen's SumKernel, vectorized_inner_sum): 8-lane vectors into 4 interleaved accumulators,
 * a cascade of 4 levels flushed every 2^max(4, ceil(log2(m)) / 4) steps of m = n / 32, the leftover
 * vectors, the scalar tail, then the 8 lanes in order. So RMSNorm's variance is eager's bit for bit
 * (checked against torch for n from 32 to 5000; the squares of bfloat16 values are exact in float32),
 * and the native forward's logits are the eager model's. */
static float sum_squares(const bf16_t *x, int64_t n) {
    enum { W = 8, ILP = 4, LEVELS = 4 };
    const int64_t vs = n / W, m = vs / ILP;
    int64_t log2m = 0;
    while (((int64_t)1 << log2m) < m) ++log2m;
    const int64_t power = log2m / LEVELS > 4 ? log2m / LEVELS : 4, step = (int64_t)1 << power, mask = step - 1;
    __m256 acc[LEVELS][ILP];
    for (int j = 0; j < LEVELS; ++j)
        for (int k = 0; k < ILP; ++k) acc[j][k] = _mm256_setzero_ps();
#define SQ(i) _mm256_mul_ps(bf16x8((i) * W), bf16x8((i) * W))
#define bf16x8(off) \
    _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(x + (off)))), 16))
    int64_t i = 0;
    while (i + step <= m) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], SQ(ILP * i + k));
        for (int j = 1; j < LEVELS; ++j) {
            for (int k = 0; k < ILP; ++k) {
                acc[j][k] = _mm256_add_ps(acc[j][k], acc[j - 1][k]);
                acc[j - 1][k] = _mm256_setzero_ps();
            }
            if (i & (mask << (j * power))) break;
        }
    }
    for (; i < m; ++i)
        for (int k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], SQ(ILP * i + k));
    for (int j = 1; j < LEVELS; ++j)
        for (int k = 0; k < ILP; ++k) acc[0][k] = _mm256_add_ps(acc[0][k], acc[j][k]);
    for (int64_t v = m * ILP; v < vs; ++v) acc[0][0] = _mm256_add_ps(acc[0][0], SQ(v));
    for (int k = 1; k < ILP; ++k) acc[0][0] = _mm256_add_ps(acc[0][0], acc[0][k]);
#undef SQ
#undef bf16x8
    float total = 0.f, lanes[W];
    for (int64_t t = vs * W; t < n; ++t) total += bf16_to_f32(x[t]) * bf16_to_f32(x[t]);
    _mm256_storeu_ps(lanes, acc[0][0]);
    for (int k = 0; k < W; ++k) total += lanes[k];
    return total;
}

typedef struct {
    const bf16_t *x, *w, *b;
    bf16_t *y;
    int64_t ld_x, ld_y, ld_b, n;
    float eps;
} RowsJob;

static void rms_norm_range(void *arg, int64_t begin, int64_t end, int slot) {
    (void)slot;
    const RowsJob *j = arg;
    const int64_t n = j->n;
    const bf16_t *w = j->w;
    for (int64_t r = begin; r < end; ++r) {
        const bf16_t *xr = j->x + r * j->ld_x;
        bf16_t *yr = j->y + r * j->ld_y;
        const float inv = 1.f / sqrtf(sum_squares(xr, n) / (float)n + j->eps);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) yr[i] = f32_to_bf16(bf16_to_f32(w[i]) * round_f32(bf16_to_f32(xr[i]) * inv));
    }
}

/* rows of n elements (row stride ld_x / ld_y): y = w * bf16(x * rsqrt(mean(x^2) + eps)). In place
 * when y == x. */
static void rms_norm(const bf16_t *x, int64_t ld_x, bf16_t *y, int64_t ld_y, int64_t rows, int64_t n,
                     const bf16_t *w, float eps, int num_threads) {
    RowsJob j = {.x = x, .w = w, .y = y, .ld_x = ld_x, .ld_y = ld_y, .n = n, .eps = eps};
    par_for(rows >= PARALLEL_ROWS ? num_threads : 1, rows, PARALLEL_GRAIN, 0, rms_norm_range, &j);
}

static void add_rows_range(void *arg, int64_t begin, int64_t end, int slot) {
    (void)slot;
    const RowsJob *j = arg;
    for (int64_t r = begin; r < end; ++r) {
        bf16_t *ar = j->y + r * j->ld_y;
        const bf16_t *br = j->b + r * j->ld_b;
#pragma omp simd
        for (int64_t i = 0; i < j->n; ++i) ar[i] = f32_to_bf16(bf16_to_f32(ar[i]) + bf16_to_f32(br[i]));
    }
}

/* a += b, elementwise, rounded (a residual add; a bias add with b's stride 0 across rows). */
static void add_rows(bf16_t *a, int64_t ld_a, const bf16_t *b, int64_t ld_b, int64_t rows, int64_t n,
                     int num_threads) {
    RowsJob j = {.b = b, .y = a, .ld_y = ld_a, .ld_b = ld_b, .n = n};
    par_for(rows >= PARALLEL_ROWS ? num_threads : 1, rows, PARALLEL_GRAIN, 0, add_rows_range, &j);
}

/* RoPE on `heads` heads of one token, in place: the halves (x1, x2) -> (x1 c - x2 s, x2 c + x1 s). */
static void rope_heads(bf16_t *x, int64_t heads, int64_t head_dim, const float *cos, const float *sin) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; ++h) {
        bf16_t *xh = x + h * head_dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
            const float c = round_f32(cos[i]), s = round_f32(sin[i]);
            const float x1 = bf16_to_f32(xh[i]), x2 = bf16_to_f32(xh[i + half]);
            xh[i] = f32_to_bf16(round_f32(x1 * c) - round_f32(x2 * s));
            xh[i + half] = f32_to_bf16(round_f32(x2 * c) + round_f32(x1 * s));
        }
    }
}

#define FORWARD_UNSUPPORTED 3

/* The tokens' own checks: ids, positions and slots in range (before anything is written). */
static int check_tokens(const NativeModel *m, const int64_t *ids, const int64_t *positions, const int64_t *loc,
                        int64_t n) {
    for (int64_t i = 0; i < n; ++i)
        if (ids[i] < 0 || ids[i] >= m->vocab || positions[i] < 0 || positions[i] >= m->max_positions ||
            loc[i] < 0 || loc[i] >= m->num_slots)
            return KERNEL_BAD_INDEX;
    return 0;
}

/* One layer's per-token work between the GEMMs, over a range of tokens. */
typedef struct {
    const NativeModel *m;
    const LayerWeights *L;
    const int64_t *positions, *loc;
    bf16_t *qkv, *q, *kn, *vn; /* kn, vn: an extend's own keys and values */
    int extend;
    const float *att;
    bf16_t *a;
} LayerJob;

/* Qwen3's q/k norms, RoPE, the queries out to q, the keys and values into the pool (and kn / vn). */
static void rope_and_store(void *arg, int64_t begin, int64_t end, int slot) {
    (void)slot;
    const LayerJob *j = arg;
    const NativeModel *m = j->m;
    const LayerWeights *L = j->L;
    const int64_t D = m->head_dim, Q = m->heads * D, KV = m->kv_heads * D, QKV = Q + 2 * KV, half = D / 2;
    for (int64_t i = begin; i < end; ++i) {
        bf16_t *row = j->qkv + i * QKV, *kr = row + Q;
        if (L->q_norm) {
            rms_norm(row, D, row, D, m->heads, D, L->q_norm, m->eps, 1);
            rms_norm(kr, D, kr, D, m->kv_heads, D, L->k_norm, m->eps, 1);
        }
        const float *c = m->cos + j->positions[i] * half, *s = m->sin + j->positions[i] * half;
        rope_heads(row, m->heads, D, c, s);
        rope_heads(kr, m->kv_heads, D, c, s);
        memcpy(j->q + i * Q, row, sizeof(bf16_t) * Q);
        memcpy(L->k_cache + j->loc[i] * KV, kr, sizeof(bf16_t) * KV);
        memcpy(L->v_cache + j->loc[i] * KV, kr + KV, sizeof(bf16_t) * KV);
        if (j->extend) {
            memcpy(j->kn + i * KV, kr, sizeof(bf16_t) * KV);
            memcpy(j->vn + i * KV, kr + KV, sizeof(bf16_t) * KV);
        }
    }
}

/* The attention's float32 output, rounded to bfloat16 for the o projection. */
static void attention_to_bf16(void *arg, int64_t begin, int64_t end, int slot) {
    (void)slot;
    const LayerJob *j = arg;
    const int64_t Q = j->m->heads * j->m->head_dim;
    for (int64_t i = begin * Q; i < end * Q; ++i) j->a[i] = f32_to_bf16(j->att[i]);
}

#if defined(__AVX512BF16__)
/* The forward over n tokens: decode (one token per request, `lens` its KV length with it) when
 * prefix_lens is NULL, else an extend (request b: extend_lens[b] tokens from q_starts[b], after a
 * cached prefix of prefix_lens[b]). Inputs already checked. */
static int forward(const NativeModel *m, const int64_t *ids, const int64_t *positions, const int64_t *loc, int64_t n,
                   const int64_t *rows, const int64_t *lens, const int64_t *prefix_lens, const int64_t *extend_lens,
                   const int64_t *q_starts, int64_t bs, bf16_t *out, int num_threads) {
    const int64_t H = m->hidden, D = m->head_dim, Q = m->heads * D, KV = m->kv_heads * D, I = m->intermediate;
    const int64_t QKV = Q + 2 * KV;
    /* h: the residual stream; x: a norm's output; qkv; q: the rotated queries, contiguous; kv: an
     * extend's rotated keys and values, contiguous; att: the attention's float32 output, then as
     * bfloat16 in a; t: a GEMM's output; act: silu(gate) * up */
    const int extend = prefix_lens != NULL;
    bf16_t *h = malloc(sizeof(bf16_t) * n * (2 * H + QKV + Q + (extend ? 2 * KV : 0) + Q + H + I));
    float *att = malloc(sizeof(float) * n * Q);
    if (!h || !att) {
        free(h);
        free(att);
        return KERNEL_NO_MEMORY;
    }
    bf16_t *x = h + n * H, *qkv = x + n * H, *q = qkv + n * QKV, *kn = q + n * Q, *vn = kn + (extend ? n * KV : 0);
    bf16_t *a = vn + (extend ? n * KV : 0), *t = a + n * Q, *act = t + n * H;
    const int par = n >= PARALLEL_ROWS;
    int err = 0;
    for (int64_t i = 0; i < n; ++i) memcpy(h + i * H, m->embed + ids[i] * H, sizeof(bf16_t) * H);
    for (int64_t l = 0; l < m->layers && !err; ++l) {
        const LayerWeights *L = m->layer + l;
        rms_norm(h, H, x, H, n, H, L->input_norm, m->eps, num_threads);
        packed_gemm_bf16(x, n, H, L->qkv, QKV, qkv, num_threads);
        if (L->qkv_bias) add_rows(qkv, QKV, L->qkv_bias, 0, n, QKV, num_threads);
        LayerJob lj = {m, L, positions, loc, qkv, q, kn, vn, extend, att, a};
        par_for(par ? num_threads : 1, n, PARALLEL_GRAIN, 0, rope_and_store, &lj);
        /* the requests' slots were checked once for the step (decode_step, extend_step) */
        if (extend)
            err = extend_attention(q, DTYPE_BF16, kn, vn, L->k_cache, L->v_cache, DTYPE_BF16, m->num_slots, m->r2t,
                                   m->r2t_rows, m->r2t_stride, rows, prefix_lens, extend_lens, q_starts, bs,
                                   m->kv_heads, m->heads / m->kv_heads, D, m->scale, att, num_threads, 0);
        else
            err = decode_attention(q, DTYPE_BF16, L->k_cache, L->v_cache, DTYPE_BF16, m->num_slots, m->r2t, m->r2t_rows,
                                   m->r2t_stride, rows, lens, bs, m->kv_heads, m->heads / m->kv_heads, D, m->scale,
                                   att, num_threads, 0);
        par_for(par ? num_threads : 1, n, PARALLEL_GRAIN, 0, attention_to_bf16, &lj);
        packed_gemm_bf16(a, n, Q, L->o, H, t, num_threads);
        add_rows(h, H, t, H, n, H, num_threads);
        rms_norm(h, H, x, H, n, H, L->post_norm, m->eps, num_threads);
        packed_gemm_silu_mul_bf16(x, n, H, L->gate_up, 2 * I, act, num_threads);
        packed_gemm_bf16(act, n, I, L->down, H, t, num_threads);
        add_rows(h, H, t, H, n, H, num_threads);
    }
    if (!err) rms_norm(h, H, out, H, n, H, m->final_norm, m->eps, num_threads);
    free(h);
    free(att);
    return err;
}
#endif

/* A decode step. ids, positions, rows (req_to_token rows), lens (KV length with this token), loc
 * (this token's slot): [bs] int64. out: [bs, hidden] bfloat16, the final norm's output. Returns 0,
 * or KERNEL_BAD_INDEX (an id, position, slot or row out of range; nothing written to the pools),
 * KERNEL_NO_MEMORY, or FORWARD_UNSUPPORTED (this build has no AVX512_BF16). */
int decode_step(const NativeModel *m, const int64_t *ids, const int64_t *positions, const int64_t *rows,
                const int64_t *lens, const int64_t *loc, int64_t bs, bf16_t *out, int num_threads) {
#if defined(__AVX512BF16__)
    if (check_tokens(m, ids, positions, loc, bs)) return KERNEL_BAD_INDEX;
    for (int64_t b = 0; b < bs; ++b)
        if (lens[b] < 1 || check_indices(m->r2t, m->r2t_rows, m->r2t_stride, rows[b], lens[b], m->num_slots))
            return KERNEL_BAD_INDEX;
    if (bs == 0) return 0;
    return forward(m, ids, positions, loc, bs, rows, lens, NULL, NULL, NULL, bs, out, num_threads);
#else
    (void)m; (void)ids; (void)positions; (void)rows; (void)lens; (void)loc; (void)bs; (void)out; (void)num_threads;
    return FORWARD_UNSUPPORTED;
#endif
}

/* An extend (prefill) pass over n tokens of bs requests, request after request: ids, positions,
 * loc [n]; rows, prefix_lens (tokens already cached), extend_lens (this pass's tokens) [bs], the
 * extend_lens summing to n. out: [n, hidden] bfloat16. Returns as decode_step does. */
int extend_step(const NativeModel *m, const int64_t *ids, const int64_t *positions, const int64_t *loc, int64_t n,
                const int64_t *rows, const int64_t *prefix_lens, const int64_t *extend_lens, int64_t bs, bf16_t *out,
                int num_threads) {
#if defined(__AVX512BF16__)
    if (m->head_dim > 128) return FORWARD_UNSUPPORTED;  /* the extend attention kernel's limit */
    if (check_tokens(m, ids, positions, loc, n)) return KERNEL_BAD_INDEX;
    int64_t *q_starts = malloc(sizeof(int64_t) * (bs ? bs : 1)), total = 0;
    if (!q_starts) return KERNEL_NO_MEMORY;
    for (int64_t b = 0; b < bs; ++b) {
        q_starts[b] = total;
        total += extend_lens[b];
        if (prefix_lens[b] < 0 || extend_lens[b] < 0 ||
            check_indices(m->r2t, m->r2t_rows, m->r2t_stride, rows[b], prefix_lens[b] + extend_lens[b], m->num_slots)) {
            free(q_starts);
            return KERNEL_BAD_INDEX;
        }
    }
    int err = total != n ? KERNEL_BAD_INDEX
              : n == 0   ? 0
                         : forward(m, ids, positions, loc, n, rows, NULL, prefix_lens, extend_lens, q_starts, bs, out,
                                   num_threads);
    free(q_starts);
    return err;
#else
    (void)m; (void)ids; (void)positions; (void)loc; (void)n; (void)rows; (void)prefix_lens; (void)extend_lens; (void)bs;
    (void)out; (void)num_threads;
    return FORWARD_UNSUPPORTED;
#endif
}

typedef struct {
    const bf16_t *y;
    float *out;
} Widen;

static void widen_range(void *arg, int64_t begin, int64_t end, int slot) {
    (void)slot;
    const Widen *w = arg;
    for (int64_t i = begin; i < end; ++i) w->out[i] = bf16_to_f32(w->y[i]);
}

/* The LM head over rows of the final norm's output: logits [rows, vocab] float32 = hidden [rows,
 * hidden] bfloat16 times the packed head ([vocab, hidden], vocab a multiple of 16), rounded to
 * bfloat16 as the eager head's GEMM stores them, then widened (its `.float()`). Returns 0,
 * KERNEL_NO_MEMORY or FORWARD_UNSUPPORTED. */
int logits_step(const NativeModel *m, const bf16_t *hidden, int64_t rows, const uint16_t *lm_head, float *out,
                int num_threads) {
#if defined(__AVX512BF16__)
    const int64_t n = rows * m->vocab;
    if (m->vocab % 16) return FORWARD_UNSUPPORTED;
    if (n == 0) return 0;
    bf16_t *y = malloc(sizeof(bf16_t) * n);
    if (!y) return KERNEL_NO_MEMORY;
    run_tiles(hidden, rows, m->hidden, lm_head, m->vocab / 16, 0, y, num_threads, 4, 0);
    Widen w = {y, out};
    par_for(n >= (1 << 16) ? num_threads : 1, n, 1 << 14, 0, widen_range, &w);
    free(y);
    return 0;
#else
    (void)m; (void)hidden; (void)rows; (void)lm_head; (void)out; (void)num_threads;
    return FORWARD_UNSUPPORTED;
#endif
}

/* The RMSNorm above on its own (for the tests): rows x n bfloat16, contiguous. */
void rms_norm_bf16(const bf16_t *x, int64_t rows, int64_t n, const bf16_t *w, float eps, bf16_t *y) {
    rms_norm(x, n, y, n, rows, n, w, eps, 1);
}

/* ---------------------------------------------------------------------------------------------
 * Model steps and the forward stream.
 *
 * A model step is a whole step of a batch up to its logits: the overlap loop's placeholder ids
 * resolved from its future map, the forward (decode or extend), the LM head over each request's
 * last token. A greedy one goes on to the argmax, a sampling one to cpu_sampling.c's draw, and
 * either stores the sampled ids in the future map for the next step's placeholders; another
 * (penalties, logprobs, grammars) leaves its logits to a Python callback that samples. The
 * C part touches no Python object, so it can run on a thread of its own while the scheduler's
 * thread (holding the GIL) processes the previous step's result: the CPU's counterpart of a CUDA
 * stream. A stream is one such thread running its steps (and bare Python calls) in submission
 * order; the overlap loop submits step N+1 before it waits for step N (engine/scheduler/tp_worker.py).
 * ------------------------------------------------------------------------------------------- */
#include <omp.h>
#include <pthread.h>

#define STEP_BAD_FUTURE 4 /* a placeholder id outside the future map */

typedef struct ModelStep {
    const NativeModel *model;
    const uint16_t *lm_head;           /* packed [vocab, hidden] */
    int64_t n, bs;                     /* tokens, requests */
    int64_t *ids;                      /* [n], resolved in place: an id < 0 is -slot of the future map */
    const int64_t *positions, *loc;    /* [n] */
    const int64_t *rows;               /* [bs] req_to_token rows */
    const int64_t *lens;               /* decode: [bs] KV lengths with this token; NULL for an extend */
    const int64_t *prefix_lens, *extend_lens; /* extend: [bs] (every extend_len >= 1); NULL for decode */
    int64_t *future_map;               /* [future_len] token slots, or NULL */
    int64_t future_len;
    const int64_t *future_slots;       /* [bs]: where this step's tokens go (with future_map) */
    int64_t *next_ids;                 /* [bs] out: the argmax of each request's last row (greedy) */
    float *logits;                     /* not NULL: the logits [bs, vocab] go here, no argmax, no future store */
    /* not NULL: each row is sampled (cpu_sampling.c's sample_rows; temperature <= 0: the argmax) */
    const float *temperatures, *top_ps, *min_ps;
    const int64_t *top_ks;
    const uint64_t *seeds, *counters;
    int num_threads;
    int err;                           /* out */
    int done;                          /* set by the stream, under its lock */
    struct ModelStep *next;           /* the stream's queue */
    int (*call)(void);                 /* a Python callback the stream runs after the step (or alone, */
                                       /* model NULL); it returns 0 */
} ModelStep;

/* Run one model step. Returns 0 (the logits, or next_ids and the future map's slots, written), or an
 * error before anything is written: STEP_BAD_FUTURE, or decode_step's / extend_step's codes. */
int model_step(ModelStep *s) {
    const NativeModel *m = s->model;
    const int64_t n = s->n, bs = s->bs, H = m->hidden;
    if (bs == 0) return 0;
    if (s->future_map) {
        for (int64_t i = 0; i < n; ++i) {
            if (s->ids[i] >= 0) continue;
            const int64_t slot = -s->ids[i];
            if (slot >= s->future_len) return STEP_BAD_FUTURE;
            s->ids[i] = s->future_map[slot];
        }
        for (int64_t b = 0; b < bs; ++b)
            if (s->future_slots[b] < 0 || s->future_slots[b] >= s->future_len) return STEP_BAD_FUTURE;
    }
    if (!s->lens)
        for (int64_t b = 0; b < bs; ++b)
            if (s->extend_lens[b] < 1) return KERNEL_BAD_INDEX; /* every request needs a last token */
    bf16_t *hidden = malloc(sizeof(bf16_t) * n * H);
    float *logits = s->logits ? s->logits : malloc(sizeof(float) * bs * m->vocab);
    int err = !hidden || !logits ? KERNEL_NO_MEMORY : 0;
    if (!err && s->lens)
        err = decode_step(m, s->ids, s->positions, s->rows, s->lens, s->loc, bs, hidden, s->num_threads);
    else if (!err) {
        err = extend_step(m, s->ids, s->positions, s->loc, n, s->rows, s->prefix_lens, s->extend_lens, bs, hidden,
                          s->num_threads);
        /* each request's last row, packed to the front (rows only move down: end - 1 >= b) */
        for (int64_t b = 0, end = 0; !err && b < bs; ++b) {
            end += s->extend_lens[b];
            if (end - 1 != b) memcpy(hidden + b * H, hidden + (end - 1) * H, sizeof(bf16_t) * H);
        }
    }
    if (!err) err = logits_step(m, hidden, bs, s->lm_head, logits, s->num_threads);
    if (!err && !s->logits && s->temperatures)
        err = sample_rows(logits, bs, m->vocab, s->temperatures, s->top_ks, s->top_ps, s->min_ps, s->seeds,
                          s->counters, s->next_ids, s->num_threads);
    else if (!err && !s->logits)
        for (int64_t b = 0; b < bs; ++b) s->next_ids[b] = argmax_row(logits + b * m->vocab, m->vocab);
    if (!err && !s->logits && s->future_map)
        for (int64_t b = 0; b < bs; ++b) s->future_map[s->future_slots[b]] = s->next_ids[b];
    free(hidden);
    if (logits != s->logits) free(logits);
    return err;
}

typedef struct {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    ModelStep *head, *tail; /* submitted, not yet run */
    int stop, num_threads;
} ForwardStream;

static void *stream_main(void *arg) {
    ForwardStream *st = arg;
    omp_set_num_threads(st->num_threads); /* for the OpenMP regions of its Python callbacks (torch's ops) */
    crew_on_stream = 1;                   /* its jobs take the stream's waiter in */
    pthread_mutex_lock(&st->mu);
    for (;;) {
        while (!st->head && !st->stop) pthread_cond_wait(&st->work, &st->mu);
        if (!st->head) break; /* stopped, and nothing left to run */
        ModelStep *s = st->head;
        pthread_mutex_unlock(&st->mu);
        int err = s->model ? model_step(s) : 0;
        if (!err && s->call) err = s->call();
        pthread_mutex_lock(&st->mu);
        s->err = err;
        __atomic_store_n(&s->done, 1, __ATOMIC_SEQ_CST);
        st->head = s->next;
        if (!st->head) st->tail = NULL;
        pthread_cond_broadcast(&st->done);
        pthread_mutex_unlock(&st->mu);
        crew_wake_waiter(); /* a waiter helping the crew (crew_help_until) */
        pthread_mutex_lock(&st->mu);
    }
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

ForwardStream *stream_create(int num_threads) {
    ForwardStream *st = calloc(1, sizeof *st);
    if (!st) return NULL;
    st->num_threads = num_threads > 0 ? num_threads : 1;
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->work, NULL);
    pthread_cond_init(&st->done, NULL);
    if (pthread_create(&st->thread, NULL, stream_main, st)) {
        free(st);
        return NULL;
    }
    return st;
}

/* In the thread that created a stream: free this thread's idle OpenMP team and run its own regions
 * on one thread from now on. libgomp shortens every team's spin-wait to almost nothing once it
 * manages more threads than there are CPUs, and a second team (the stream's) beside the creating
 * thread's idle one crosses that line on a small machine: each parallel region then wakes its
 * threads through the kernel (measured: a decode step of the bench model 1.1 -> 2.1 ms on 2 CPUs).
 * Returns omp_pause_resource_all's result (0: freed). */
int openmp_hand_over(void) {
    const int err = omp_pause_resource_all(omp_pause_soft);
    omp_set_num_threads(1);
    return err;
}

/* Queue a step behind those already submitted; it must stay alive until stream_wait returns. */
void stream_submit(ForwardStream *st, ModelStep *s) {
    s->done = 0;
    s->next = NULL;
    pthread_mutex_lock(&st->mu);
    if (st->tail) st->tail->next = s;
    else st->head = s;
    st->tail = s;
    pthread_cond_signal(&st->work);
    pthread_mutex_unlock(&st->mu);
}

/* Block until the step has run; its error code (0: its next_ids are there). Meanwhile the calling
 * thread works on the step's parallel loops, in place of one of the crew's helpers (parallel.h). */
int stream_wait(ForwardStream *st, ModelStep *s) {
    crew_help_until(&s->done);
    pthread_mutex_lock(&st->mu);
    while (!s->done) pthread_cond_wait(&st->done, &st->mu);
    pthread_mutex_unlock(&st->mu);
    return s->err;
}

/* Run what was submitted, then end the thread and free the stream. */
void stream_destroy(ForwardStream *st) {
    pthread_mutex_lock(&st->mu);
    st->stop = 1;
    pthread_cond_signal(&st->work);
    pthread_mutex_unlock(&st->mu);
    pthread_join(st->thread, NULL);
    pthread_cond_destroy(&st->work);
    pthread_cond_destroy(&st->done);
    pthread_mutex_destroy(&st->mu);
    free(st);
}

/* ---------------------------------------------------------------------------------------------
 * The crew's own check (tests/engine/test_cpu_forward.py): par_for over n items, each item's hits
 * counted and the slot that ran it recorded. When the loop is split (n > grain), its first chunk
 * calls par_for again (nested in a crew job: inline on its thread; a loop of one chunk runs inline
 * outside the crew, so a par_for inside it may use the crew) and, with wait_ms > 0, waits (up to
 * wait_ms) until another slot has run an item, so a test can show that another thread joined (a
 * helper, or a stream's waiter). */
typedef struct {
    int32_t *hits, *slots;
    int64_t n, grain;
    int wait_ms, num_threads;
    int others; /* items run by a slot other than 0 */
} SelfTest;

static void selftest_nested(void *arg, int64_t begin, int64_t end, int slot) {
    int32_t *seen = arg;
    for (int64_t i = begin; i < end; ++i) __atomic_fetch_add(&seen[i], slot + 1, __ATOMIC_RELAXED);
}

static void selftest_body(void *arg, int64_t begin, int64_t end, int slot) {
    SelfTest *t = arg;
    if (begin == 0 && t->n > t->grain) {
        int32_t nested[4] = {0, 0, 0, 0}; /* slot + 1 of whoever ran each: all inline, as slot 0 */
        par_for(t->num_threads, 4, 1, 0, selftest_nested, nested);
        for (int i = 0; i < 4; ++i)
            if (nested[i] != 1) __atomic_fetch_add(&t->hits[0], 1000, __ATOMIC_RELAXED);
        const int64_t deadline = crew_now_ns() + (int64_t)t->wait_ms * 1000000;
        while (t->wait_ms > 0 && !__atomic_load_n(&t->others, __ATOMIC_ACQUIRE) && crew_now_ns() < deadline)
            crew_pause();
    }
    for (int64_t i = begin; i < end; ++i) {
        __atomic_fetch_add(&t->hits[i], 1, __ATOMIC_RELAXED);
        t->slots[i] = slot;
    }
    if (slot != 0) __atomic_fetch_add(&t->others, (int)(end - begin), __ATOMIC_RELEASE);
}

/* Returns the number of items run by slots other than 0. */
int par_selftest(int num_threads, int64_t n, int64_t grain, int wait_ms, int32_t *hits, int32_t *slots) {
    SelfTest t = {hits, slots, n, grain, wait_ms, num_threads, 0};
    par_for(num_threads, n, grain, 0, selftest_body, &t);
    return t.others;
}
