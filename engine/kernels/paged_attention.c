/* Paged decode attention on CPU: one query token per request against its whole KV, read in place.
 *
 * The torch path gathers every request's K and V out of the pool into a padded [bs, max_len] copy
 * and then runs SDPA on it; at decode the copy costs as much as the attention. This kernel reads
 * each key and value row straight from the pool through the request's req_to_token row.
 *
 * Layouts (all contiguous; q in float32, bfloat16 or float16; k and v in one of those or in
 * float8 e5m2, the KV cache dtype, which may differ from q's):
 *   q        [bs, kv_heads, group, head_dim]   the query heads grouped by the KV head they share
 *   k, v     [num_slots, kv_heads, head_dim]   one layer's pool
 *   r2t      [r2t_rows, r2t_stride] int64      req_to_token
 *   rows     [bs] int64, lens [bs] int64       each request's row and sequence length
 *   out      [bs, kv_heads, group, head_dim]   float32
 * One task per request, spread over threads by parallel.h (torch's OpenMP team, or the native forward's crew):
 * scores for all keys, softmax in float32, then the weighted sum of values. Each slot's K (then V)
 * row of kv_heads * head_dim values is read once, contiguously, and later slots are prefetched.
 * Built with -march=native: on AVX-512 machines the common head sizes (32/64/128) take an
 * intrinsics path (one KV head at a time, a block of its query rows and their outputs in registers,
 * each row of the head loaded once per block, a vectorised exp); elsewhere the portable loops.
 * With AVX512_BF16 as well, bfloat16 queries over a bfloat16 cache take the bf16 dot-product path
 * (attend_avx512_bf16: no conversion of K/V; the scores by add trees, or by register transposes for
 * small heads and large groups; the values a block of keys at a time for small rows).
 * Returns 0, KERNEL_NO_MEMORY, or KERNEL_BAD_INDEX when a row, length or slot is out of range (that
 * request is left unwritten; nothing outside the inputs is ever read).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define KERNEL_NO_MEMORY 1
#define KERNEL_BAD_INDEX 2
#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_F16 2
#define DTYPE_E5M2 3 /* float8 e5m2: the high byte of a float16 */
#define PREFETCH_AHEAD 4
#define INLINE static inline __attribute__((always_inline))

#include "parallel.h"

typedef uint16_t bf16_t;
typedef uint16_t f16_t;

INLINE float bf16_to_f32(bf16_t x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE half -> float, exactly (subnormals, infinities and NaNs included), without F16C. */
INLINE float f16_to_f32(f16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
    uint32_t u;
    if (exp == 0x1Fu) {
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else {  /* zero or subnormal: man * 2^-24 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&u, &f, sizeof u);
        u |= sign;
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE int64_t elem_bytes(int dtype) { return dtype == DTYPE_F32 ? 4 : dtype == DTYPE_E5M2 ? 1 : 2; }

/* Row `index` of a [*, width] buffer as float32: read in place, or converted into buf. */
INLINE const float *row_f32(const void *base, int dtype, int64_t index, int64_t width, float *restrict buf) {
    if (dtype == DTYPE_F32) return (const float *)base + index * width;
    if (dtype == DTYPE_E5M2) {
        const uint8_t *src = (const uint8_t *)base + index * width;
        for (int64_t i = 0; i < width; ++i) buf[i] = f16_to_f32((f16_t)(src[i] << 8));
        return buf;
    }
    const uint16_t *src = (const uint16_t *)base + index * width;
    if (dtype == DTYPE_BF16) {
#pragma omp simd
        for (int64_t i = 0; i < width; ++i) buf[i] = bf16_to_f32(src[i]);
    } else {
        for (int64_t i = 0; i < width; ++i) buf[i] = f16_to_f32(src[i]);
    }
    return buf;
}

INLINE void prefetch_row(const void *base, int dtype, int64_t index, int64_t width) {
    __builtin_prefetch((const char *)base + index * width * elem_bytes(dtype));
}

INLINE float dot(const float *restrict a, const float *restrict b, int64_t n) {
    float s = 0.f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

INLINE void axpy(float *restrict y, float w, const float *restrict x, int64_t n) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}

/* In place: s[i] = exp(s[i] - max) / sum. */
static void softmax(float *restrict s, int64_t n) {
    float mx = -INFINITY, sum = 0.f;
    for (int64_t i = 0; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
    for (int64_t i = 0; i < n; ++i) {
        s[i] = expf(s[i] - mx);
        sum += s[i];
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

static int check_indices(const int64_t *r2t, int64_t r2t_rows, int64_t r2t_stride, int64_t row, int64_t len,
                         int64_t num_slots) {
    if (row < 0 || row >= r2t_rows || len < 0 || len > r2t_stride) return KERNEL_BAD_INDEX;
    const int64_t *slots = r2t + row * r2t_stride;
    int bad = 0;
    for (int64_t t = 0; t < len; ++t) bad |= slots[t] < 0 || slots[t] >= num_slots;
    return bad ? KERNEL_BAD_INDEX : 0;
}

/* One request. Always inlined with literal dtype and head_dim for the common cases, so the row
 * loops unroll into a few vector instructions instead of generic loops with remainders.
 * qf: [heads * head_dim], row: [kv_heads * head_dim], scores: [heads, len], o: [heads * head_dim]. */
INLINE void attend(const void *q, const int q_dtype, const void *k, const void *v, const int dtype, const int64_t *slots,
                   int64_t len, int64_t kv_heads, int64_t group, const int64_t head_dim, float scale,
                   float *restrict qf, float *restrict row, float *restrict scores, float *restrict o) {
    const int64_t heads = kv_heads * group, width = kv_heads * head_dim;
    const float *qrow = row_f32(q, q_dtype, 0, heads * head_dim, qf);
    for (int64_t i = 0; i < heads * head_dim; ++i) qf[i] = qrow[i] * scale;
    for (int64_t t = 0; t < len; ++t) {
        if (t + PREFETCH_AHEAD < len) prefetch_row(k, dtype, slots[t + PREFETCH_AHEAD], width);
        const float *kr = row_f32(k, dtype, slots[t], width, row);
        for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t g = 0; g < group; ++g)
                scores[(h * group + g) * len + t] = dot(qf + (h * group + g) * head_dim, kr + h * head_dim, head_dim);
    }
    for (int64_t i = 0; i < heads; ++i) softmax(scores + i * len, len);
    memset(o, 0, sizeof(float) * heads * head_dim);
    for (int64_t t = 0; t < len; ++t) {
        if (t + PREFETCH_AHEAD < len) prefetch_row(v, dtype, slots[t + PREFETCH_AHEAD], width);
        const float *vr = row_f32(v, dtype, slots[t], width, row);
        for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t g = 0; g < group; ++g)
                axpy(o + (h * group + g) * head_dim, scores[(h * group + g) * len + t], vr + h * head_dim, head_dim);
    }
}

#if defined(__AVX512F__)
/* 16 values as float32 from offset (float32, bfloat16, float16 or float8 e5m2 storage). */
INLINE __m512 load16(const void *base, int dtype, int64_t offset) {
    if (dtype == DTYPE_F32) return _mm512_loadu_ps((const float *)base + offset);
    if (dtype == DTYPE_E5M2) {
        const __m128i b = _mm_loadu_si128((const __m128i *)((const uint8_t *)base + offset));
        return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8));
    }
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)base + offset));
    if (dtype == DTYPE_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

#include "vec_math.h" /* exp16 */

/* In place over s[0, n): exp(s - max); returns the sum. */
static float exp_minus_max_avx512(float *restrict s, int64_t n) {
    __m512 mx = _mm512_set1_ps(-INFINITY), sum = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + i));
    const __mmask16 tail = (__mmask16)((1u << (n - i)) - 1);
    mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + i));
    const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    for (i = 0; i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + i), m));
        _mm512_storeu_ps(s + i, e);
        sum = _mm512_add_ps(sum, e);
    }
    const __m512 e = _mm512_maskz_mov_ps(tail, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + i), m)));
    _mm512_mask_storeu_ps(s + i, tail, e);
    return _mm512_reduce_add_ps(_mm512_add_ps(sum, e));
}

static void softmax_avx512(float *restrict s, int64_t n) {
    const __m512 inv = _mm512_set1_ps(1.f / exp_minus_max_avx512(s, n));
    int64_t i = 0;
    const __mmask16 tail = (__mmask16)((1u << (n % 16)) - 1);
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(s + i, _mm512_mul_ps(_mm512_loadu_ps(s + i), inv));
    _mm512_mask_storeu_ps(s + i, tail, _mm512_mul_ps(_mm512_maskz_loadu_ps(tail, s + i), inv));
}

/* One request, one KV head and a block of GB query rows of its group at a time: each key (then
 * value) row of the head is loaded once per block and used by every row in it, whose queries and
 * outputs stay in registers. Slots are scattered through the pool, so rows are prefetched about
 * PREFETCH_BYTES ahead (a step's K/V rarely stay in cache from the previous step: 16 keys ahead
 * of a 64-byte head, a compiled decode step spent most of its attention waiting on these loads). */
#define PREFETCH_BYTES 4096
#define PREFETCH_KEYS_MIN 8
#define PREFETCH_KEYS_MAX 64
INLINE void prefetch_head(const void *base, int dtype, int64_t offset, int64_t head_dim) {
    const char *p = (const char *)base + offset * elem_bytes(dtype);
    for (int64_t i = 0; i < head_dim * elem_bytes(dtype); i += 64) __builtin_prefetch(p + i);
}

/* Small rows (every KV head's part of one slot, up to WHOLE_ROW_MAX_BYTES) are fetched whole while
 * the first head is read, when the request's K and V fit WHOLE_ROWS_MAX_BYTES: the passes over the
 * other heads then find them in L2 instead of memory. (Larger rows, as 8 KV heads of 128 take, ran
 * 0-12% slower so: too many lines in flight at once.) */
#define WHOLE_ROW_MAX_BYTES 512
#define WHOLE_ROWS_MAX_BYTES (512 << 10)

/* The bfloat16 value pass (attend_avx512_bf16) takes blocks of keys of up to PV_BLOCK_BYTES (within
 * L1) when a row is at most PV_BLOCKED_ROW_MAX_BYTES and a pass does little work per row; measured
 * (scripts/attn_kernel_ab.py): 0.85-0.96x the time at 4 x 2 x 32, 3 x 3 x 64, 2 x 7 x 64, 4 x 7 x 128;
 * 1.04-1.27x with 2 KiB rows or 2 x 4 x 64, which keep a pass per head. */
#define PV_BLOCK_BYTES (16 << 10)
#define PV_BLOCKED_ROW_MAX_BYTES 1024

/* What the pass over head h, query block g0 prefetches of each row: `span` elements from `first`
 * (the whole row in the first block of the first head when the rows are small and fit, above; else
 * the head's part), `ahead` keys ahead (about PREFETCH_BYTES in flight). */
typedef struct {
    int64_t first, span, ahead;
} PrefetchPlan;

INLINE PrefetchPlan prefetch_plan(int64_t h, int64_t g0, int64_t len, int64_t width, int64_t head_dim, int dtype) {
    const int64_t row_bytes = width * elem_bytes(dtype);
    const int whole = h == 0 && g0 == 0 && row_bytes <= WHOLE_ROW_MAX_BYTES && 2 * len * row_bytes <= WHOLE_ROWS_MAX_BYTES;
    PrefetchPlan p = {whole ? 0 : h * head_dim, whole ? width : head_dim, 0};
    const int64_t keys = PREFETCH_BYTES / (p.span * elem_bytes(dtype));
    p.ahead = keys < PREFETCH_KEYS_MIN ? PREFETCH_KEYS_MIN : keys > PREFETCH_KEYS_MAX ? PREFETCH_KEYS_MAX : keys;
    return p;
}

/* In a pass that fetches whole rows, the first `ahead` of them before it starts (the pass prefetches
 * the rest ahead). A head's part only, as the other passes fetch, gained nothing so, or lost. */
INLINE void prefetch_start(const void *base, int dtype, const int64_t *slots, int64_t len, int64_t width,
                           PrefetchPlan pf) {
    if (pf.span != width) return;
    for (int64_t t = 0; t < len && t < pf.ahead; ++t) prefetch_head(base, dtype, slots[t] * width + pf.first, pf.span);
}

INLINE void attend_avx512(const void *q, const int q_dtype, const void *k, const void *v, const int dtype, const int64_t *slots,
                          int64_t len, int64_t kv_heads, int64_t group, const int64_t GB, const int64_t head_dim, float scale,
                          float *restrict scores, float *restrict o) {
    enum { MAX_REGS = 16 };  /* GB * head_dim / 16 <= MAX_REGS */
    const int64_t nv = head_dim / 16, width = kv_heads * head_dim;
    for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t g0 = 0; g0 < group; g0 += GB) {
            const int64_t qh0 = h * group + g0;
            const PrefetchPlan pf = prefetch_plan(h, g0, len, width, head_dim, dtype);
            __m512 qv[MAX_REGS], acc[MAX_REGS];
            for (int64_t g = 0; g < GB; ++g)
                for (int64_t j = 0; j < nv; ++j)
                    qv[g * nv + j] = _mm512_mul_ps(load16(q, q_dtype, (qh0 + g) * head_dim + j * 16), _mm512_set1_ps(scale));
            float *sg = scores + qh0 * len;
            prefetch_start(k, dtype, slots, len, width, pf);
            for (int64_t t = 0; t < len; ++t) {
                if (t + pf.ahead < len) prefetch_head(k, dtype, slots[t + pf.ahead] * width + pf.first, pf.span);
                const int64_t base = slots[t] * width + h * head_dim;
                __m512 kr[MAX_REGS];
                for (int64_t j = 0; j < nv; ++j) kr[j] = load16(k, dtype, base + j * 16);
                for (int64_t g = 0; g < GB; ++g) {
                    __m512 s = _mm512_mul_ps(qv[g * nv], kr[0]);
                    for (int64_t j = 1; j < nv; ++j) s = _mm512_fmadd_ps(qv[g * nv + j], kr[j], s);
                    sg[g * len + t] = _mm512_reduce_add_ps(s);
                }
            }
            for (int64_t g = 0; g < GB; ++g) softmax_avx512(sg + g * len, len);
            for (int64_t i = 0; i < GB * nv; ++i) acc[i] = _mm512_setzero_ps();
            prefetch_start(v, dtype, slots, len, width, pf);
            for (int64_t t = 0; t < len; ++t) {
                if (t + pf.ahead < len) prefetch_head(v, dtype, slots[t + pf.ahead] * width + pf.first, pf.span);
                const int64_t base = slots[t] * width + h * head_dim;
                for (int64_t j = 0; j < nv; ++j) {
                    const __m512 vr = load16(v, dtype, base + j * 16);
                    for (int64_t g = 0; g < GB; ++g)
                        acc[g * nv + j] = _mm512_fmadd_ps(_mm512_set1_ps(sg[g * len + t]), vr, acc[g * nv + j]);
                }
            }
            for (int64_t g = 0; g < GB; ++g)
                for (int64_t j = 0; j < nv; ++j) _mm512_storeu_ps(o + (qh0 + g) * head_dim + j * 16, acc[g * nv + j]);
        }
    }
}
#endif

#if defined(__AVX512F__)
/* In place: the 16 x 16 block r (row i = r[i]) becomes its transpose. */
INLINE void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* u[i + m], lane l: column 4l + m of rows i .. i + 3 */
        u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
        u[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
        u[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    }
    for (int m = 0; m < 4; ++m) {  /* gather lane l of u[m], u[4 + m], u[8 + m], u[12 + m] */
        const __m512 v02 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x88), v13 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xDD);
        const __m512 w02 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x88), w13 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xDD);
        r[m] = _mm512_shuffle_f32x4(v02, w02, 0x88);
        r[8 + m] = _mm512_shuffle_f32x4(v02, w02, 0xDD);
        r[4 + m] = _mm512_shuffle_f32x4(v13, w13, 0x88);
        r[12 + m] = _mm512_shuffle_f32x4(v13, w13, 0xDD);
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The pair of bfloat16 at p (p[0] low) in every 32-bit lane. */
INLINE __m512bh bcast_pair(const bf16_t *p) {
    uint32_t pair;
    memcpy(&pair, p, sizeof pair);
    return (__m512bh)_mm512_set1_epi32((int)pair);
}

/* Lane t of the result = the sum of v[t]'s 16 lanes: a transposing add tree (45 shuffles and adds
 * for 16 sums instead of 16 horizontal reductions). */
INLINE __m512 hsum16(const __m512 v[16]) {
    __m512 a[8], b[4];
    for (int i = 0; i < 8; ++i)  /* per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3] of v[2i], v[2i+1] */
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; ++i) {  /* per 128-bit lane: that lane's part of keys 4i .. 4i+3 */
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
    const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

/* Two value rows (v1 NULL: a zero row) of one KV head into the accumulators of GB query rows, whose
 * probabilities for the pair are at p, p + plen, ...: the rows interleaved (unpack), times the pair
 * of probabilities. The accumulators hold the outputs in unpack order. */
INLINE void pv_rows_bf16(const bf16_t *v0, const bf16_t *v1, const int64_t nq, const int64_t GB, const bf16_t *p,
                         int64_t plen, __m512 *acc) {
    for (int64_t j = 0; j < nq; ++j) {
        const __m512i a = _mm512_loadu_si512((const void *)(v0 + j * 32));
        const __m512i b = v1 ? _mm512_loadu_si512((const void *)(v1 + j * 32)) : _mm512_setzero_si512();
        const __m512bh lo = (__m512bh)_mm512_unpacklo_epi16(a, b), hi = (__m512bh)_mm512_unpackhi_epi16(a, b);
        for (int64_t g = 0; g < GB; ++g) {
            const __m512bh w = bcast_pair(p + g * plen);
            acc[(g * nq + j) * 2] = _mm512_dpbf16_ps(acc[(g * nq + j) * 2], lo, w);
            acc[(g * nq + j) * 2 + 1] = _mm512_dpbf16_ps(acc[(g * nq + j) * 2 + 1], hi, w);
        }
    }
}

/* The scores of every query row of one request (bfloat16 queries and cache), for the shapes where
 * the add trees cost more than transposes (small heads, larger groups; transposed_scores_pay):
 * 16 keys at a time, every KV head of them while their rows are in L1, each head's 16 x 32 block
 * transposed in registers into 16 vectors of one pair of dimensions across the 16 keys, then one
 * pair dot product per query row and pair, against the query's pair broadcast: the scores come out
 * 16 keys to a vector with no horizontal sums, and the rows are streamed once, whole, for all heads.
 * G: the group (1-8); C independent accumulators per row keep the dot products' pipes busy. */
INLINE void scores_transposed_bf16(const bf16_t *q, const bf16_t *k, const int64_t *slots, int64_t len,
                                   int64_t kv_heads, const int64_t G, const int64_t head_dim, float scale,
                                   float *restrict scores) {
    const int C = G >= 5 ? 1 : G >= 3 ? 2 : G == 2 ? 4 : 8;
    const int64_t width = kv_heads * head_dim, row_bytes = width * (int64_t)sizeof(bf16_t);
    int64_t ahead = PREFETCH_BYTES / row_bytes;
    ahead = ahead < PREFETCH_KEYS_MIN ? PREFETCH_KEYS_MIN : ahead > PREFETCH_KEYS_MAX ? PREFETCH_KEYS_MAX : ahead;
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t t = 0; t < len && t < ahead; ++t) prefetch_head(k, DTYPE_BF16, slots[t] * width, width);
    for (int64_t t0 = 0; t0 < len; t0 += 16) {
        const int64_t n = len - t0 < 16 ? len - t0 : 16;
        const bf16_t *kr[16];
        for (int64_t i = 0; i < 16; ++i) {
            kr[i] = i < n ? k + slots[t0 + i] * width : NULL;
            if (i < n && t0 + i + ahead < len) prefetch_head(k, DTYPE_BF16, slots[t0 + i + ahead] * width, width);
        }
        const __mmask16 m = (__mmask16)((1u << n) - 1);
        for (int64_t h = 0; h < kv_heads; ++h) {
            const bf16_t *qh = q + h * G * head_dim;
            __m512 acc[8][8];
            for (int64_t g = 0; g < G; ++g)
                for (int c = 0; c < C; ++c) acc[g][c] = _mm512_setzero_ps();
            for (int64_t c0 = 0; c0 < head_dim; c0 += 32) {
                __m512 r[16];
                for (int64_t i = 0; i < 16; ++i)
                    r[i] = kr[i] ? _mm512_castsi512_ps(_mm512_loadu_si512((const void *)(kr[i] + h * head_dim + c0)))
                                 : _mm512_setzero_ps();
                transpose16(r);
                for (int64_t d = 0; d < 16; ++d)
                    for (int64_t g = 0; g < G; ++g)
                        acc[g][d % C] = _mm512_dpbf16_ps(acc[g][d % C], (__m512bh)r[d],
                                                         bcast_pair(qh + g * head_dim + c0 + 2 * d));
            }
            for (int64_t g = 0; g < G; ++g) {
                __m512 sum = acc[g][0];
                for (int c = 1; c < C; ++c) sum = _mm512_add_ps(sum, acc[g][c]);
                _mm512_mask_storeu_ps(scores + (h * G + g) * len + t0, m, _mm512_mul_ps(sum, vs));
            }
        }
    }
}

/* Whether scores_transposed_bf16 beats the add trees for this shape: per 16 keys and KV head it
 * spends 48 shuffles per 32 dimensions where the add trees spend ~45 operations per query row, but
 * the add trees' loads run ahead better. Measured on Zen 4 (scripts/attn_kernel_ab.py, batch 32 of
 * 192 keys): 1.3-1.5x at head_dim 32 x group 2, 1.3-1.4x at 64 x 7, 1.2-1.3x at 128 x 7; even at
 * 64 x 3, 64 x 4 (0.93-1.01x) and 128 x 4. */
INLINE int transposed_scores_pay(int64_t group, int64_t head_dim) {
    return group <= 8 && group >= (head_dim <= 32 ? 2 : head_dim <= 64 ? 5 : 6);
}

/* bfloat16 queries against a bfloat16 cache, on AVX512_BF16's dot products (pairs of bfloat16
 * products summed into float32; the products are exact, so the scores equal the float32 path's up
 * to the order of the additions). Scores: 16 keys of one query row at a time, each key's
 * head_dim / 32 dot products summed by one add tree; then the float32 softmax; then the weighted sum
 * over pairs of keys: the two value rows interleaved (unpack), multiplied by the pair of
 * probabilities rounded to bfloat16, as torch's own CPU attention rounds them before its value
 * GEMM. The interleave permutes the output lanes; one permute per 16 outputs puts them back. */
INLINE void attend_avx512_bf16(const bf16_t *q, const bf16_t *k, const bf16_t *v, const int64_t *slots, int64_t len,
                               int64_t kv_heads, int64_t group, const int64_t GB, const int64_t head_dim, float scale,
                               const int scores_ready, float *restrict scores, bf16_t *restrict probs,
                               float *restrict o) {
    enum { MAX_REGS = 16, PV_BLOCK_MAX = 64 };  /* GB * head_dim / 16 <= MAX_REGS */
    const int64_t nq = head_dim / 32, width = kv_heads * head_dim, plen = len + 2;  /* a row of probs, padded */
    const int64_t rows = kv_heads * group;
    const __m512 vscale = _mm512_set1_ps(scale);
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t h = 0; h < kv_heads; ++h) {
        for (int64_t g0 = 0; g0 < group; g0 += GB) {
            const int64_t qh0 = h * group + g0;
            const PrefetchPlan pf = prefetch_plan(h, g0, len, width, head_dim, DTYPE_BF16);
            float *sg = scores + qh0 * len;
            if (!scores_ready) prefetch_start(k, DTYPE_BF16, slots, len, width, pf);
            for (int64_t g = 0; g < GB && !scores_ready; ++g) {
                __m512bh qv[4];
                for (int64_t j = 0; j < nq; ++j)
                    qv[j] = (__m512bh)_mm512_loadu_si512((const void *)(q + (qh0 + g) * head_dim + j * 32));
                for (int64_t t0 = 0; t0 < len; t0 += 16) {
                    const int64_t n = len - t0 < 16 ? len - t0 : 16;
                    __m512 part[16];
                    for (int64_t t = 0; t < 16; ++t) {
                        part[t] = _mm512_setzero_ps();
                        if (t >= n) continue;
                        if (g == 0 && t0 + t + pf.ahead < len)
                            prefetch_head(k, DTYPE_BF16, slots[t0 + t + pf.ahead] * width + pf.first, pf.span);
                        const bf16_t *kr = k + slots[t0 + t] * width + h * head_dim;
                        for (int64_t j = 0; j < nq; ++j)
                            part[t] = _mm512_dpbf16_ps(part[t], (__m512bh)_mm512_loadu_si512((const void *)(kr + j * 32)), qv[j]);
                    }
                    const __mmask16 m = (__mmask16)((1u << n) - 1);
                    _mm512_mask_storeu_ps(sg + g * len + t0, m, _mm512_mul_ps(hsum16(part), vscale));
                }
            }
            for (int64_t g = 0; g < GB; ++g) {
                float *s = sg + g * len;
                bf16_t *p = probs + (qh0 + g) * plen;
                softmax_avx512(s, len);
                int64_t t = 0;
                for (; t + 16 <= len; t += 16)
                    _mm256_storeu_si256((__m256i *)(p + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
                const __mmask16 tail = (__mmask16)((1u << (len - t)) - 1);
                _mm256_mask_storeu_epi16(p + t, tail, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, s + t)));
                p[len] = 0;  /* an odd last key pairs with a zero weight */
            }
        }
    }
    /* The values, into o in unpack order. */
    const int64_t row_bytes = width * (int64_t)sizeof(bf16_t), nacc = GB * 2 * nq;
    if (row_bytes > PV_BLOCKED_ROW_MAX_BYTES || GB * nq > 4) {
        /* a pass per KV head (and block of query rows) over all keys, its part of each row */
        for (int64_t h = 0; h < kv_heads; ++h)
            for (int64_t g0 = 0; g0 < group; g0 += GB) {
                const int64_t qh0 = h * group + g0;
                const PrefetchPlan pf = prefetch_plan(h, g0, len, width, head_dim, DTYPE_BF16);
                __m512 acc[MAX_REGS];
                for (int64_t i = 0; i < nacc; ++i) acc[i] = _mm512_setzero_ps();
                prefetch_start(v, DTYPE_BF16, slots, len, width, pf);
                for (int64_t t = 0; t < len; t += 2) {
                    if (t + pf.ahead < len) {
                        prefetch_head(v, DTYPE_BF16, slots[t + pf.ahead] * width + pf.first, pf.span);
                        if (t + 1 + pf.ahead < len)
                            prefetch_head(v, DTYPE_BF16, slots[t + 1 + pf.ahead] * width + pf.first, pf.span);
                    }
                    pv_rows_bf16(v + slots[t] * width + h * head_dim,
                                 t + 1 < len ? v + slots[t + 1] * width + h * head_dim : NULL, nq, GB,
                                 probs + qh0 * plen + t, plen, acc);
                }
                for (int64_t i = 0; i < nacc; ++i) _mm512_storeu_ps(o + qh0 * head_dim + i * 16, acc[i]);
            }
    } else {
        /* Small rows and little work per row: a block of keys at a time (PV_BLOCK_BYTES of rows, up
         * to 64 keys), the block's rows located once and used by every KV head while they sit in L1
         * (a pass per head spent most of its instructions on slot arithmetic there); each query
         * row's accumulators wait in o between blocks. */
        int64_t ahead = PREFETCH_BYTES / row_bytes, block = PV_BLOCK_BYTES / row_bytes / 2 * 2;
        ahead = ahead < PREFETCH_KEYS_MIN ? PREFETCH_KEYS_MIN : ahead > PREFETCH_KEYS_MAX ? PREFETCH_KEYS_MAX : ahead;
        block = block > PV_BLOCK_MAX ? PV_BLOCK_MAX : block;
        for (int64_t t = 0; t < len && t < ahead; ++t) prefetch_head(v, DTYPE_BF16, slots[t] * width, width);
        for (int64_t t0 = 0; t0 < len; t0 += block) {
            const int64_t n = len - t0 < block ? len - t0 : block;
            const bf16_t *vr[PV_BLOCK_MAX];
            for (int64_t i = 0; i < n; ++i) {
                vr[i] = v + slots[t0 + i] * width;
                if (t0 + i + ahead < len) prefetch_head(v, DTYPE_BF16, slots[t0 + i + ahead] * width, width);
            }
            for (int64_t h = 0; h < kv_heads; ++h)
                for (int64_t g0 = 0; g0 < group; g0 += GB) {
                    const int64_t qh0 = h * group + g0;
                    __m512 acc[MAX_REGS];
                    for (int64_t i = 0; i < nacc; ++i)
                        acc[i] = t0 ? _mm512_loadu_ps(o + qh0 * head_dim + i * 16) : _mm512_setzero_ps();
                    for (int64_t i = 0; i < n; i += 2)
                        pv_rows_bf16(vr[i] + h * head_dim, i + 1 < n ? vr[i + 1] + h * head_dim : NULL, nq, GB,
                                     probs + qh0 * plen + t0 + i, plen, acc);
                    for (int64_t i = 0; i < nacc; ++i) _mm512_storeu_ps(o + qh0 * head_dim + i * 16, acc[i]);
                }
        }
    }
    for (int64_t r = 0; r < rows; ++r)  /* the lanes back in order */
        for (int64_t j = 0; j < nq; ++j) {
            float *dst = o + r * head_dim + j * 32;
            const __m512 lo = _mm512_loadu_ps(dst), hi = _mm512_loadu_ps(dst + 16);
            _mm512_storeu_ps(dst, _mm512_permutex2var_ps(lo, lo_idx, hi));
            _mm512_storeu_ps(dst + 16, _mm512_permutex2var_ps(lo, hi_idx, hi));
        }
}
#endif

#define ATTEND(DTYPE, DIM) \
    attend(qb, q_dtype, k, v, DTYPE, slots, len, kv_heads, group, DIM, scale, qf, row, scores, o)

/* Instantiated per KV dtype and head size (the inner loops); the query's dtype is read once per
 * request, so it stays a runtime value. */
static void attend_dispatch(const void *qb, int q_dtype, const void *k, const void *v, int dtype,
                            const int64_t *slots, int64_t len, int64_t kv_heads, int64_t group, int64_t head_dim,
                            float scale, float *qf, float *row, float *scores, bf16_t *probs, float *o) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define BF16_GB(DIM, GB) attend_avx512_bf16((const bf16_t *)qb, (const bf16_t *)k, (const bf16_t *)v, slots, len, \
                                            kv_heads, group, GB, DIM, scale, ready, scores, probs, o)
#define SCORES_T(DIM, G) scores_transposed_bf16((const bf16_t *)qb, (const bf16_t *)k, slots, len, kv_heads, G, DIM, \
                                                scale, scores)
#define SCORES(DIM)                                                                                                 \
    switch (group) {                                                                                                \
    case 1: SCORES_T(DIM, 1); break; case 2: SCORES_T(DIM, 2); break; case 3: SCORES_T(DIM, 3); break;          \
    case 4: SCORES_T(DIM, 4); break; case 5: SCORES_T(DIM, 5); break; case 6: SCORES_T(DIM, 6); break;          \
    case 7: SCORES_T(DIM, 7); break; default: SCORES_T(DIM, 8); break;                                          \
    }
#define BF16(DIM)                                                                       \
    if (group % 8 == 0 && 8 * (DIM) <= 256) BF16_GB(DIM, 8);                            \
    else if (group % 4 == 0 && 4 * (DIM) <= 256) BF16_GB(DIM, 4);                       \
    else if (group % 2 == 0 && 2 * (DIM) <= 256) BF16_GB(DIM, 2);                       \
    else BF16_GB(DIM, 1)
    if (len > 0 && q_dtype == DTYPE_BF16 && dtype == DTYPE_BF16 && (head_dim == 32 || head_dim == 64 || head_dim == 128)) {
        const int ready = transposed_scores_pay(group, head_dim);
        if (ready) {
            switch (head_dim) {
            case 32: SCORES(32); break;
            case 64: SCORES(64); break;
            case 128: SCORES(128); break;
            }
        }
        switch (head_dim) {
        case 32: BF16(32); return;
        case 64: BF16(64); return;
        case 128: BF16(128); return;
        }
    }
#endif
#if defined(__AVX512F__)
/* The largest block of query rows (1, 2, 4 or 8) that divides the group and fits 16 registers. */
#define AVX512_GB(DTYPE, DIM, GB) attend_avx512(qb, q_dtype, k, v, DTYPE, slots, len, kv_heads, group, GB, DIM, scale, scores, o)
#define AVX512(DTYPE, DIM)                                                              \
    if (group % 8 == 0 && 8 * (DIM) <= 256) AVX512_GB(DTYPE, DIM, 8);                   \
    else if (group % 4 == 0 && 4 * (DIM) <= 256) AVX512_GB(DTYPE, DIM, 4);              \
    else if (group % 2 == 0 && 2 * (DIM) <= 256) AVX512_GB(DTYPE, DIM, 2);              \
    else AVX512_GB(DTYPE, DIM, 1)
#define AVX512_DIMS(DTYPE)                            \
    switch (head_dim) {                               \
    case 32: AVX512(DTYPE, 32); return;               \
    case 64: AVX512(DTYPE, 64); return;               \
    case 128: AVX512(DTYPE, 128); return;             \
    }
    if (len > 0) {
        if (dtype == DTYPE_F32) AVX512_DIMS(DTYPE_F32)
        else if (dtype == DTYPE_BF16) AVX512_DIMS(DTYPE_BF16)
        else if (dtype == DTYPE_F16) AVX512_DIMS(DTYPE_F16)
        else AVX512_DIMS(DTYPE_E5M2)
    }
#endif
#define ATTEND_DIMS(DTYPE)                            \
    switch (head_dim) {                               \
    case 32: ATTEND(DTYPE, 32); return;               \
    case 64: ATTEND(DTYPE, 64); return;               \
    case 128: ATTEND(DTYPE, 128); return;             \
    default: ATTEND(DTYPE, head_dim); return;         \
    }
    if (dtype == DTYPE_F32) ATTEND_DIMS(DTYPE_F32)
    if (dtype == DTYPE_BF16) ATTEND_DIMS(DTYPE_BF16)
    if (dtype == DTYPE_F16) ATTEND_DIMS(DTYPE_F16)
    ATTEND_DIMS(DTYPE_E5M2)
}

typedef struct {
    float *qf, *row, *scores;
    int64_t capacity;
} DecodeScratch;

typedef struct {
    const void *q, *k, *v;
    int q_dtype, kv_dtype, check;
    int64_t num_slots, r2t_rows, r2t_stride, kv_heads, group, head_dim, per_request, elem;
    const int64_t *r2t, *rows, *lens;
    float scale;
    float *out;
    DecodeScratch *scratch; /* [num_threads], one per slot */
    int failed;             /* KERNEL_* bits, or'ed atomically */
} DecodeJob;

static void decode_requests(void *arg, int64_t begin, int64_t end, int slot) {
    DecodeJob *j = arg;
    DecodeScratch *sc = j->scratch + slot;
    const int64_t kv_heads = j->kv_heads, group = j->group, head_dim = j->head_dim;
    if (!sc->qf) sc->qf = malloc(sizeof(float) * j->per_request);
    if (!sc->row) sc->row = malloc(sizeof(float) * kv_heads * head_dim);
    for (int64_t b = begin; b < end; ++b) {
        const int64_t len = j->lens[b];
        int err = j->check ? check_indices(j->r2t, j->r2t_rows, j->r2t_stride, j->rows[b], len, j->num_slots) : 0;
        /* the scores, then (as bfloat16, a row of len + 2 per query row) the probabilities */
        if (!err && kv_heads * group * (len + (len + 2) / 2 + 1) > sc->capacity) {
            free(sc->scores);
            sc->capacity = kv_heads * group * (len + (len + 2) / 2 + 1);
            sc->scores = malloc(sizeof(float) * sc->capacity);
            if (!sc->scores) sc->capacity = 0;
        }
        if (!err && (!sc->qf || !sc->row || (len && !sc->scores))) err = KERNEL_NO_MEMORY;
        if (err) {
            __atomic_fetch_or(&j->failed, err, __ATOMIC_RELAXED);
            continue;
        }
        attend_dispatch((const char *)j->q + b * j->per_request * j->elem, j->q_dtype, j->k, j->v, j->kv_dtype,
                        j->r2t + j->rows[b] * j->r2t_stride, len, kv_heads, group, head_dim, j->scale, sc->qf, sc->row,
                        sc->scores, sc->scores ? (bf16_t *)(sc->scores + kv_heads * group * len) : NULL,
                        j->out + b * j->per_request);
    }
}

/* paged_decode_attention below; `check` 0 skips the scan of every request's slots (a caller that
 * checked them once for all its layers: cpu_forward.c). One task per request (parallel.h). */
static int decode_attention(const void *q, int q_dtype, const void *k, const void *v, int kv_dtype, int64_t num_slots,
                            const int64_t *r2t, int64_t r2t_rows, int64_t r2t_stride, const int64_t *rows,
                            const int64_t *lens, int64_t bs, int64_t kv_heads, int64_t group, int64_t head_dim,
                            float scale, float *out, int num_threads, int check) {
    if (q_dtype != DTYPE_F32 && q_dtype != DTYPE_BF16 && q_dtype != DTYPE_F16) return KERNEL_BAD_INDEX;
    if (kv_dtype != DTYPE_F32 && kv_dtype != DTYPE_BF16 && kv_dtype != DTYPE_F16 && kv_dtype != DTYPE_E5M2)
        return KERNEL_BAD_INDEX;
    if (num_threads < 1) num_threads = 1;
    DecodeJob j = {q, k, v, q_dtype, kv_dtype, check, num_slots, r2t_rows, r2t_stride, kv_heads, group, head_dim,
                   kv_heads * group * head_dim, elem_bytes(q_dtype), r2t, rows, lens, scale, out,
                   calloc(num_threads, sizeof(DecodeScratch)), 0};
    if (!j.scratch) return KERNEL_NO_MEMORY;
    par_for(num_threads, bs, 1, 1, decode_requests, &j);
    for (int t = 0; t < num_threads; ++t) {
        free(j.scratch[t].qf);
        free(j.scratch[t].row);
        free(j.scratch[t].scores);
    }
    free(j.scratch);
    return j.failed;
}

/* q_dtype: float32, bfloat16 or float16; kv_dtype: one of those or float8 e5m2. */
int paged_decode_attention(const void *q, int q_dtype, const void *k, const void *v, int kv_dtype,
                           int64_t num_slots, const int64_t *r2t, int64_t r2t_rows, int64_t r2t_stride,
                           const int64_t *rows, const int64_t *lens, int64_t bs, int64_t kv_heads, int64_t group,
                           int64_t head_dim, float scale, float *out, int num_threads) {
    return decode_attention(q, q_dtype, k, v, kv_dtype, num_slots, r2t, r2t_rows, r2t_stride, rows, lens, bs, kv_heads,
                            group, head_dim, scale, out, num_threads, 1);
}

/* ---------------------------------------------------------------------------------------------
 * Paged extend (prefill) attention: every request's new tokens against its cached prefix and
 * themselves, causally, in one call for the whole batch, K/V read through req_to_token.
 *
 * Layouts (contiguous):
 *   q        [n, kv_heads * group, head_dim]     this pass's queries, request after request
 *   kn, vn   [n, kv_heads, head_dim]             this pass's keys and values, in q's dtype
 *   k, v     [num_slots, kv_heads, head_dim]     one layer's pool, where the cached prefixes are
 *   rows, prefix_lens, extend_lens, q_starts [bs] int64
 *            request b owns query tokens [q_starts[b], q_starts[b] + extend_lens[b]); its token j
 *            sits at position prefix_lens[b] + j and sees keys 0 .. prefix_lens[b] + j: the first
 *            prefix_lens[b] through its req_to_token row, the rest from kn / vn (as SDPA over the
 *            pass's own K/V would: unrounded when the KV cache has a narrower dtype)
 *   out      [n, kv_heads * group, head_dim]     float32
 * Tasks are (request, KV head, chunk of EXT_QCHUNK query tokens), spread over threads (parallel.h).
 * A task converts its head's K (transposed, [head_dim][keys]) and V ([keys][head_dim]) into float32
 * once, then every query row of the chunk and group computes its scores 16 keys per vector
 * (no horizontal sums), a softmax in float32 and the weighted sum of the values. bfloat16 queries
 * over a bfloat16 cache (head_dim a multiple of 32) keep K and V in bfloat16 instead, laid out for
 * AVX512_BF16's pair dot products (ext_task_bf16): 1.6-1.9x the float32 path.
 * ------------------------------------------------------------------------------------------- */
#define EXT_QCHUNK 64
#define EXT_KB 16 /* keys per score vector */

/* n values from offset as float32 into dst (float32, bfloat16, float16 or float8 e5m2 storage). */
INLINE void load_f32(const void *base, int dtype, int64_t offset, int64_t n, float *restrict dst) {
    if (dtype == DTYPE_F32) {
        memcpy(dst, (const float *)base + offset, sizeof(float) * n);
    } else if (dtype == DTYPE_BF16) {
        const uint16_t *src = (const uint16_t *)base + offset;
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
    } else if (dtype == DTYPE_F16) {
        const uint16_t *src = (const uint16_t *)base + offset;
        for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
    } else {
        const uint8_t *src = (const uint8_t *)base + offset;
        for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32((f16_t)(src[i] << 8));
    }
}

/* In place over s[0, n): exp(s - max); returns the sum. */
static float exp_minus_max(float *restrict s, int64_t n) {
#if defined(__AVX512F__)
    return exp_minus_max_avx512(s, n);
#else
    float mx = -INFINITY, sum = 0.f;
    for (int64_t i = 0; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
    for (int64_t i = 0; i < n; ++i) {
        s[i] = expf(s[i] - mx);
        sum += s[i];
    }
    return sum;
#endif
}

/* o = (sum over t < nk of p[t] * V[t]) * inv, from Vf [nk][head_dim]. */
INLINE void ext_values(const float *restrict p, const float *restrict Vf, int64_t nk, const int64_t head_dim, float inv,
                       float *restrict o) {
    float acc[128];
    for (int64_t d = 0; d < head_dim; ++d) acc[d] = 0.f;
    for (int64_t t = 0; t < nk; ++t) {
        const float pt = p[t];
        const float *restrict vr = Vf + t * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) acc[d] += pt * vr[d];
    }
#pragma omp simd
    for (int64_t d = 0; d < head_dim; ++d) o[d] = acc[d] * inv;
}

#if defined(__AVX512F__)
/* S[r][t] = q_r . K[:, t] for R query rows (qb [R][hd], scaled) and the keys of `npanels` panels of
 * Kp (panel p holds keys 16p .. 16p + 15 as [hd][16]). Four panels at a time: per dimension four
 * key vectors and R broadcasts feed 4R FMAs, with the 4R accumulators in registers. */
INLINE void ext_qk_avx512(const float *restrict qb, const float *restrict Kp, int64_t npanels, const int64_t hd,
                          const int R, float *restrict S, int64_t ld) {
    int64_t p = 0;
    for (; p + 4 <= npanels; p += 4) {
        __m512 acc[4][4];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
        const float *restrict kp = Kp + p * hd * 16;
        for (int64_t d = 0; d < hd; ++d) {
            __m512 kv[4];
            for (int i = 0; i < 4; ++i) kv[i] = _mm512_loadu_ps(kp + (i * hd + d) * 16);
            for (int r = 0; r < R; ++r) {
                const __m512 qd = _mm512_set1_ps(qb[r * hd + d]);
                for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(qd, kv[i], acc[r][i]);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) _mm512_storeu_ps(S + r * ld + (p + i) * 16, acc[r][i]);
    }
    for (; p < npanels; ++p) {
        __m512 acc[4];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        const float *restrict kp = Kp + p * hd * 16;
        for (int64_t d = 0; d < hd; ++d) {
            const __m512 kv = _mm512_loadu_ps(kp + d * 16);
            for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(qb[r * hd + d]), kv, acc[r]);
        }
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(S + r * ld + p * 16, acc[r]);
    }
}

/* o_r = (sum over t < nk of S[r][t] * V[t]) * inv[r] for R rows, from Vf [nk][hd]; 64 dimensions at
 * a time so the 4R accumulators stay in registers. */
INLINE void ext_pv_avx512(const float *restrict S, int64_t ld, const float *restrict Vf, int64_t nk, const int64_t hd,
                          const int R, const float *restrict inv, float *const *restrict o) {
    for (int64_t c0 = 0; c0 < hd; c0 += 64) {
        const int nv = hd - c0 >= 64 ? 4 : (int)((hd - c0) / 16);
        __m512 acc[4][4];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
        for (int64_t t = 0; t < nk; ++t) {
            __m512 vv[4];
            for (int i = 0; i < nv; ++i) vv[i] = _mm512_loadu_ps(Vf + t * hd + c0 + i * 16);
            for (int r = 0; r < R; ++r) {
                const __m512 pt = _mm512_set1_ps(S[r * ld + t]);
                for (int i = 0; i < nv; ++i) acc[r][i] = _mm512_fmadd_ps(pt, vv[i], acc[r][i]);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < nv; ++i)
                _mm512_storeu_ps(o[r] + c0 + i * 16, _mm512_mul_ps(acc[r][i], _mm512_set1_ps(inv[r])));
    }
}
#endif

#if defined(__AVX512F__)

/* Keys 0 .. L - 1 of KV head h as float32: K into panels of 16 keys ([hd][16], zero past L) through
 * 16 x 16 register transposes, V into rows. The prefix comes from the pool, the rest from kn / vn. */
static void ext_convert_avx512(int q_dtype, const void *kn, const void *vn, const void *k, const void *v, int dtype,
                               const int64_t *slots, int64_t prefix, int64_t q_start, int64_t L, int64_t h,
                               int64_t kv_heads, int64_t hd, float *restrict Kp, float *restrict Vf) {
    const int64_t width = kv_heads * hd;
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const void *src[16];
        int src_dtype[16];
        int64_t off[16];
        for (int i = 0; i < 16 && t0 + i < L; ++i) {
            const int64_t t = t0 + i;
            const int cached = t < prefix;
            src_dtype[i] = cached ? dtype : q_dtype;
            off[i] = cached ? slots[t] * width + h * hd : (q_start + t - prefix) * width + h * hd;
            src[i] = cached ? k : kn;
            if (cached && t + 16 < prefix) prefetch_head(k, dtype, slots[t + 16] * width + h * hd, hd);
            for (int64_t c = 0; c < hd; c += 16)
                _mm512_storeu_ps(Vf + t * hd + c, load16(cached ? v : vn, src_dtype[i], off[i] + c));
        }
        float *panel = Kp + t0 * hd;
        for (int64_t c = 0; c < hd; c += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; ++i)
                r[i] = t0 + i < L ? load16(src[i], src_dtype[i], off[i] + c) : _mm512_setzero_ps();
            transpose16(r);
            for (int dd = 0; dd < 16; ++dd) _mm512_storeu_ps(panel + (c + dd) * 16, r[dd]);
        }
    }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
/* The bfloat16 path of a task (bfloat16 queries over a bfloat16 cache, head_dim a multiple of 32),
 * on AVX512_BF16's pair dot products as torch's CPU flash attention computes in bfloat16: scores
 * q . k summed in float32 (the products are exact), times the scale; exp(s - max) in float32, its
 * sum in float32, the exp values rounded to bfloat16 for the value product; the output divided by
 * the sum at the end. Twice the float32 path's arithmetic per instruction and no conversion of K/V.
 * Layouts (per task): Kp [L/16][head_dim/2][16] pairs of dimensions of 16 keys (one 16 x 16
 * transpose of 32-bit lanes per 32 dimensions), Vp [L/2][head_dim] pairs of keys per dimension in
 * unpack order (as attend_avx512_bf16; one permute per 16 outputs puts the lanes back). */
static void ext_convert_bf16(const bf16_t *kn, const bf16_t *vn, const bf16_t *k, const bf16_t *v,
                             const int64_t *slots, int64_t prefix, int64_t q_start, int64_t L, int64_t h,
                             int64_t kv_heads, int64_t hd, uint32_t *restrict Kp, uint32_t *restrict Vp) {
    const int64_t width = kv_heads * hd, half = hd / 2;
    for (int64_t t0 = 0; t0 < L; t0 += 16) {
        const bf16_t *kr[16], *vr[16];
        for (int i = 0; i < 16; ++i) {
            const int64_t t = t0 + i;
            kr[i] = vr[i] = NULL;
            if (t >= L) continue;
            if (t < prefix) {
                const int64_t off = slots[t] * width + h * hd;
                kr[i] = k + off;
                vr[i] = v + off;
                if (t + 16 < prefix) {
                    prefetch_head(k, DTYPE_BF16, slots[t + 16] * width + h * hd, hd);
                    prefetch_head(v, DTYPE_BF16, slots[t + 16] * width + h * hd, hd);
                }
            } else {
                const int64_t off = (q_start + t - prefix) * width + h * hd;
                kr[i] = kn + off;
                vr[i] = vn + off;
            }
        }
        uint32_t *panel = Kp + t0 * half;
        for (int64_t c = 0; c < hd; c += 32) {
            __m512 r[16];
            for (int i = 0; i < 16; ++i)
                r[i] = kr[i] ? _mm512_castsi512_ps(_mm512_loadu_si512((const void *)(kr[i] + c))) : _mm512_setzero_ps();
            transpose16(r);
            for (int dd = 0; dd < 16; ++dd) _mm512_storeu_ps((float *)(panel + (c / 2 + dd) * 16), r[dd]);
        }
        for (int i = 0; i < 16; i += 2) {
            uint32_t *dst = Vp + (t0 + i) / 2 * hd;
            for (int64_t c = 0; c < hd; c += 32) {
                const __m512i a = vr[i] ? _mm512_loadu_si512((const void *)(vr[i] + c)) : _mm512_setzero_si512();
                const __m512i b = vr[i + 1] ? _mm512_loadu_si512((const void *)(vr[i + 1] + c)) : _mm512_setzero_si512();
                _mm512_storeu_si512((void *)(dst + c), _mm512_unpacklo_epi16(a, b));
                _mm512_storeu_si512((void *)(dst + c + 16), _mm512_unpackhi_epi16(a, b));
            }
        }
    }
}

/* S[r][t] = (q_r . k_t) * scale for R query rows (qp[r]: the row, read in pairs of bfloat16) over `npanels`
 * panels of Kp; four panels at a time, the 4R accumulators in registers. */
INLINE void ext_qk_bf16(const bf16_t *const *qp, const uint32_t *restrict Kp, int64_t npanels, const int64_t half,
                        const int R, float scale, float *restrict S, int64_t ld) {
    const __m512 vs = _mm512_set1_ps(scale);
    int64_t p = 0;
    for (; p + 4 <= npanels; p += 4) {
        __m512 acc[4][4];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
        const uint32_t *restrict kp = Kp + p * half * 16;
        for (int64_t d = 0; d < half; ++d) {
            __m512bh kv[4];
            for (int i = 0; i < 4; ++i) kv[i] = (__m512bh)_mm512_loadu_si512((const void *)(kp + (i * half + d) * 16));
            for (int r = 0; r < R; ++r) {
                const __m512bh qd = bcast_pair(qp[r] + 2 * d);
                for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], kv[i], qd);
            }
        }
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) _mm512_storeu_ps(S + r * ld + (p + i) * 16, _mm512_mul_ps(acc[r][i], vs));
    }
    for (; p < npanels; ++p) {
        __m512 acc[4];
        for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
        const uint32_t *restrict kp = Kp + p * half * 16;
        for (int64_t d = 0; d < half; ++d) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512((const void *)(kp + d * 16));
            for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], kv, bcast_pair(qp[r] + 2 * d));
        }
        for (int r = 0; r < R; ++r) _mm512_storeu_ps(S + r * ld + p * 16, _mm512_mul_ps(acc[r], vs));
    }
}

/* o_r = (sum over key pairs t2 < npairs of P[r][2 t2] V[2 t2] + P[r][2 t2 + 1] V[2 t2 + 1]) * inv[r]
 * for R rows, 64 dimensions at a time (the 4R accumulators in registers). */
INLINE void ext_pv_bf16(const bf16_t *restrict P, int64_t ldp, const uint32_t *restrict Vp, int64_t npairs,
                        const int64_t hd, const int R, const float *restrict inv, float *const *restrict o) {
    const __m512i lo_idx = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i hi_idx = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int64_t c0 = 0; c0 < hd; c0 += 64) {
        const int nv = hd - c0 >= 64 ? 4 : 2;
        __m512 acc[4][4];
        for (int r = 0; r < R; ++r)
            for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
        for (int64_t t2 = 0; t2 < npairs; ++t2) {
            __m512bh vv[4];
            for (int i = 0; i < nv; ++i) vv[i] = (__m512bh)_mm512_loadu_si512((const void *)(Vp + t2 * hd + c0 + i * 16));
            for (int r = 0; r < R; ++r) {
                const __m512bh w = bcast_pair(P + r * ldp + 2 * t2);
                for (int i = 0; i < nv; ++i) acc[r][i] = _mm512_dpbf16_ps(acc[r][i], vv[i], w);
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m512 s = _mm512_set1_ps(inv[r]);
            for (int i = 0; i < nv; i += 2) {
                float *dst = o[r] + c0 + i * 16;
                _mm512_storeu_ps(dst, _mm512_mul_ps(_mm512_permutex2var_ps(acc[r][i], lo_idx, acc[r][i + 1]), s));
                _mm512_storeu_ps(dst + 16, _mm512_mul_ps(_mm512_permutex2var_ps(acc[r][i], hi_idx, acc[r][i + 1]), s));
            }
        }
    }
}

/* ext_task for bfloat16 queries and cache, head_dim % 32 == 0 (buffers: Kp and Vp of ld * head_dim / 2
 * words each, S [4][ld] float32, P [4][ld + 2] bfloat16). */
static void ext_task_bf16(const bf16_t *q, const bf16_t *kn, const bf16_t *vn, const bf16_t *k, const bf16_t *v,
                          const int64_t *slots, int64_t prefix, int64_t q_start, int64_t j0, int64_t j1, int64_t h,
                          int64_t kv_heads, int64_t group, const int64_t head_dim, float scale, uint32_t *restrict Kp,
                          uint32_t *restrict Vp, float *restrict S, bf16_t *restrict P, float *restrict out) {
    enum { R = 4 };
    const int64_t L = prefix + j1, ld = (L + EXT_KB - 1) / EXT_KB * EXT_KB, ldp = ld + 2, half = head_dim / 2;
    const int64_t heads = kv_heads * group, nrows = (j1 - j0) * group;
    ext_convert_bf16(kn, vn, k, v, slots, prefix, q_start, L, h, kv_heads, head_dim, Kp, Vp);
    for (int64_t r0 = 0; r0 < nrows; r0 += R) {
        const int nr = nrows - r0 < R ? (int)(nrows - r0) : R;
        int64_t nk[R] = {0};
        float *o[R], inv[R];
        const bf16_t *qp[R];
        for (int r = 0; r < nr; ++r) {
            const int64_t j = j0 + (r0 + r) / group, g = (r0 + r) % group;
            const int64_t off = ((q_start + j) * heads + h * group + g) * head_dim;
            qp[r] = q + off;
            nk[r] = prefix + j + 1;
            o[r] = out + off;
        }
        const int64_t nk_max = nk[nr - 1], npanels = (nk_max + EXT_KB - 1) / EXT_KB, npairs = (nk_max + 1) / 2;
#define EXT_QK(NR) ext_qk_bf16(qp, Kp, npanels, half, NR, scale, S, ld)
        switch (nr) { case 4: EXT_QK(4); break; case 3: EXT_QK(3); break; case 2: EXT_QK(2); break; default: EXT_QK(1); }
#undef EXT_QK
        for (int r = 0; r < nr; ++r) {  /* causal: row r sees nk[r] keys; the rest weigh 0 */
            float *s = S + r * ld;
            bf16_t *p = P + r * ldp;
            inv[r] = 1.f / exp_minus_max(s, nk[r]);
            int64_t t = 0;
            for (; t + 16 <= nk[r]; t += 16)
                _mm256_storeu_si256((__m256i *)(p + t), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + t)));
            const __mmask16 tail = (__mmask16)((1u << (nk[r] - t)) - 1);
            _mm256_mask_storeu_epi16(p + t, tail, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(tail, s + t)));
            for (t = nk[r]; t < 2 * npairs; ++t) p[t] = 0;
        }
#define EXT_PV(NR) ext_pv_bf16(P, ldp, Vp, npairs, head_dim, NR, inv, o)
        switch (nr) { case 4: EXT_PV(4); break; case 3: EXT_PV(3); break; case 2: EXT_PV(2); break; default: EXT_PV(1); }
#undef EXT_PV
    }
}
#endif

/* One task: query tokens [j0, j1) of request b (positions prefix + j), KV head h. Its keys
 * 0 .. prefix + j1 - 1 are converted once into float32 panels Kp ([L/16][hd][16], zero-padded) and
 * rows Vf ([L][hd]); its query rows (token, group member) go R at a time. */
INLINE void ext_task(const void *q, int q_dtype, const void *kn, const void *vn, const void *k, const void *v, int dtype,
                     const int64_t *slots,
                     int64_t prefix, int64_t q_start, int64_t j0, int64_t j1, int64_t h, int64_t kv_heads, int64_t group,
                     const int64_t head_dim, float scale, float *restrict Kp, float *restrict Vf, float *restrict S,
                     float *restrict qb, float *restrict out) {
    enum { R = 4 };
    const int64_t L = prefix + j1, ld = (L + EXT_KB - 1) / EXT_KB * EXT_KB, width = kv_heads * head_dim;
    const int64_t heads = kv_heads * group, nrows = (j1 - j0) * group;
    float *row = qb + R * head_dim;  /* head_dim floats of scratch after the queries */
#if defined(__AVX512F__)
    if (head_dim % 16 == 0) {
        ext_convert_avx512(q_dtype, kn, vn, k, v, dtype, slots, prefix, q_start, L, h, kv_heads, head_dim, Kp, Vf);
    } else
#endif
    {
        for (int64_t t = 0; t < L; ++t) {  /* the prefix from the pool, this pass's tokens from kn / vn */
            const int cached = t < prefix;
            const int64_t off = cached ? slots[t] * width + h * head_dim : (q_start + t - prefix) * width + h * head_dim;
            if (t + PREFETCH_AHEAD < prefix) prefetch_row(k, dtype, slots[t + PREFETCH_AHEAD] * kv_heads + h, head_dim);
            load_f32(cached ? k : kn, cached ? dtype : q_dtype, off, head_dim, row);
            float *panel = Kp + (t / EXT_KB) * head_dim * EXT_KB + t % EXT_KB;
            for (int64_t d = 0; d < head_dim; ++d) panel[d * EXT_KB] = row[d];
            load_f32(cached ? v : vn, cached ? dtype : q_dtype, off, head_dim, Vf + t * head_dim);
        }
        for (int64_t t = L; t < ld; ++t) {
            float *panel = Kp + (t / EXT_KB) * head_dim * EXT_KB + t % EXT_KB;
            for (int64_t d = 0; d < head_dim; ++d) panel[d * EXT_KB] = 0.f;
        }
    }
    for (int64_t r0 = 0; r0 < nrows; r0 += R) {
        const int nr = nrows - r0 < R ? (int)(nrows - r0) : R;
        int64_t nk[R];
        float *o[R];
        float inv[R];
        for (int r = 0; r < nr; ++r) {
            const int64_t j = j0 + (r0 + r) / group, g = (r0 + r) % group;
            const int64_t off = ((q_start + j) * heads + h * group + g) * head_dim;
            load_f32(q, q_dtype, off, head_dim, qb + r * head_dim);
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) qb[r * head_dim + d] *= scale;
            nk[r] = prefix + j + 1;
            o[r] = out + off;
        }
        const int64_t nk_max = nk[nr - 1], npanels = (nk_max + EXT_KB - 1) / EXT_KB;
#if defined(__AVX512F__)
        if (head_dim % 16 == 0) {
#define EXT_QK(NR) ext_qk_avx512(qb, Kp, npanels, head_dim, NR, S, ld)
            switch (nr) { case 4: EXT_QK(4); break; case 3: EXT_QK(3); break; case 2: EXT_QK(2); break; default: EXT_QK(1); }
#undef EXT_QK
        } else
#endif
        {
            for (int r = 0; r < nr; ++r) {
                for (int64_t p = 0; p < npanels; ++p) {
                    float acc[EXT_KB] = {0};
                    const float *kp = Kp + p * head_dim * EXT_KB;
                    for (int64_t d = 0; d < head_dim; ++d) {
                        const float qd = qb[r * head_dim + d];
#pragma omp simd
                        for (int i = 0; i < EXT_KB; ++i) acc[i] += qd * kp[d * EXT_KB + i];
                    }
                    memcpy(S + r * ld + p * EXT_KB, acc, sizeof acc);
                }
            }
        }
        for (int r = 0; r < nr; ++r) {  /* causal: row r sees nk[r] keys; the rest weigh 0 */
            inv[r] = 1.f / exp_minus_max(S + r * ld, nk[r]);
            for (int64_t t = nk[r]; t < nk_max; ++t) S[r * ld + t] = 0.f;
        }
#if defined(__AVX512F__)
        if (head_dim % 16 == 0) {
#define EXT_PV(NR) ext_pv_avx512(S, ld, Vf, nk_max, head_dim, NR, inv, o)
            switch (nr) { case 4: EXT_PV(4); break; case 3: EXT_PV(3); break; case 2: EXT_PV(2); break; default: EXT_PV(1); }
#undef EXT_PV
            continue;
        }
#endif
        for (int r = 0; r < nr; ++r) ext_values(S + r * ld, Vf, nk_max, head_dim, inv[r], o[r]);
    }
}

typedef struct {
    float *Kt, *Vf, *s, *qf;
    bf16_t *pb;
    int ready; /* 1: allocated; -1: an allocation failed */
} ExtendScratch;

typedef struct {
    const void *q, *kn, *vn, *k, *v;
    int q_dtype, kv_dtype, bf16_path;
    const int64_t *r2t;
    int64_t r2t_stride;
    const int64_t *rows, *prefix_lens, *extend_lens, *q_starts, *task_b, *task_j;
    int64_t kv_heads, group, head_dim, ld_max;
    float scale;
    float *out;
    ExtendScratch *scratch; /* [num_threads], one per slot */
    int failed;
} ExtendJob;

/* Tasks [begin, end) of extend_attention: (request, chunk of query tokens) x KV head. */
static void extend_tasks(void *arg, int64_t begin, int64_t end, int slot) {
    ExtendJob *j = arg;
    ExtendScratch *sc = j->scratch + slot;
    const int64_t head_dim = j->head_dim, ld_max = j->ld_max, kv_heads = j->kv_heads;
    if (!sc->ready) {
        sc->Kt = malloc(sizeof(float) * (head_dim * ld_max + 1));
        sc->Vf = malloc(sizeof(float) * (head_dim * ld_max + 1));
        sc->s = malloc(sizeof(float) * (4 * ld_max + 1));
        sc->qf = malloc(sizeof(float) * 5 * head_dim);
        sc->pb = j->bf16_path ? malloc(sizeof(bf16_t) * (4 * (ld_max + 2))) : NULL;
        sc->ready = !sc->Kt || !sc->Vf || !sc->s || !sc->qf || (j->bf16_path && !sc->pb) ? -1 : 1;
    }
    if (sc->ready < 0) {
        __atomic_fetch_or(&j->failed, KERNEL_NO_MEMORY, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t i = begin; i < end; ++i) {
        const int64_t t = i / kv_heads, h = i % kv_heads, b = j->task_b[t], j0 = j->task_j[t];
        const int64_t j1 = j0 + EXT_QCHUNK < j->extend_lens[b] ? j0 + EXT_QCHUNK : j->extend_lens[b];
        const int64_t *slots = j->r2t + j->rows[b] * j->r2t_stride;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
        if (j->bf16_path) {
            ext_task_bf16((const bf16_t *)j->q, (const bf16_t *)j->kn, (const bf16_t *)j->vn, (const bf16_t *)j->k,
                          (const bf16_t *)j->v, slots, j->prefix_lens[b], j->q_starts[b], j0, j1, h, kv_heads, j->group,
                          head_dim, j->scale, (uint32_t *)sc->Kt, (uint32_t *)sc->Vf, sc->s, sc->pb, j->out);
            continue;
        }
#endif
#define EXT_TASK(DIM) ext_task(j->q, j->q_dtype, j->kn, j->vn, j->k, j->v, j->kv_dtype, slots, j->prefix_lens[b], \
                               j->q_starts[b], j0, j1, h, kv_heads, j->group, DIM, j->scale, sc->Kt, sc->Vf, sc->s, \
                               sc->qf, j->out)
        switch (head_dim) {
        case 32: EXT_TASK(32); break;
        case 64: EXT_TASK(64); break;
        case 128: EXT_TASK(128); break;
        default: EXT_TASK(head_dim);
        }
#undef EXT_TASK
    }
}

/* paged_extend_attention below; `check` as decode_attention's. */
static int extend_attention(const void *q, int q_dtype, const void *kn, const void *vn, const void *k, const void *v,
                            int kv_dtype, int64_t num_slots, const int64_t *r2t, int64_t r2t_rows, int64_t r2t_stride,
                            const int64_t *rows, const int64_t *prefix_lens, const int64_t *extend_lens,
                            const int64_t *q_starts, int64_t bs, int64_t kv_heads, int64_t group, int64_t head_dim,
                            float scale, float *out, int num_threads, int check) {
    if (q_dtype != DTYPE_F32 && q_dtype != DTYPE_BF16 && q_dtype != DTYPE_F16) return KERNEL_BAD_INDEX;
    if (kv_dtype != DTYPE_F32 && kv_dtype != DTYPE_BF16 && kv_dtype != DTYPE_F16 && kv_dtype != DTYPE_E5M2)
        return KERNEL_BAD_INDEX;
    if (head_dim <= 0 || head_dim > 128) return KERNEL_BAD_INDEX;
    /* validate every request up front; a bad one fails the call before any thread starts */
    int64_t ntasks = 0, max_len = 0;
    for (int64_t b = 0; b < bs; ++b) {
        if (prefix_lens[b] < 0 || extend_lens[b] < 0) return KERNEL_BAD_INDEX;
        const int64_t len = prefix_lens[b] + extend_lens[b];
        if (check && check_indices(r2t, r2t_rows, r2t_stride, rows[b], len, num_slots)) return KERNEL_BAD_INDEX;
        ntasks += (extend_lens[b] + EXT_QCHUNK - 1) / EXT_QCHUNK;
        max_len = len > max_len ? len : max_len;
    }
    int64_t *task_b = malloc(sizeof(int64_t) * (ntasks ? ntasks : 1)), *task_j = malloc(sizeof(int64_t) * (ntasks ? ntasks : 1));
    if (!task_b || !task_j) {
        free(task_b);
        free(task_j);
        return KERNEL_NO_MEMORY;
    }
    int64_t n = 0;
    for (int64_t b = 0; b < bs; ++b)
        for (int64_t j = 0; j < extend_lens[b]; j += EXT_QCHUNK) task_b[n] = b, task_j[n++] = j;
    const int64_t ld_max = (max_len + EXT_KB - 1) / EXT_KB * EXT_KB;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    const int bf16_path = q_dtype == DTYPE_BF16 && kv_dtype == DTYPE_BF16 && head_dim % 32 == 0;
#else
    const int bf16_path = 0;
#endif
    if (num_threads < 1) num_threads = 1;
    ExtendJob j = {q, kn, vn, k, v, q_dtype, kv_dtype, bf16_path, r2t, r2t_stride, rows, prefix_lens, extend_lens,
                   q_starts, task_b, task_j, kv_heads, group, head_dim, ld_max, scale, out,
                   calloc(num_threads, sizeof(ExtendScratch)), 0};
    if (j.scratch) par_for(num_threads, ntasks * kv_heads, 1, 1, extend_tasks, &j);
    else j.failed = KERNEL_NO_MEMORY;
    for (int t = 0; j.scratch && t < num_threads; ++t) {
        free(j.scratch[t].Kt);
        free(j.scratch[t].Vf);
        free(j.scratch[t].s);
        free(j.scratch[t].qf);
        free(j.scratch[t].pb);
    }
    free(j.scratch);
    free(task_b);
    free(task_j);
    return j.failed;
}

/* q_dtype: float32, bfloat16 or float16; kv_dtype: one of those or float8 e5m2; head_dim <= 128. */
int paged_extend_attention(const void *q, int q_dtype, const void *kn, const void *vn, const void *k, const void *v,
                           int kv_dtype, int64_t num_slots,
                           const int64_t *r2t, int64_t r2t_rows, int64_t r2t_stride, const int64_t *rows,
                           const int64_t *prefix_lens, const int64_t *extend_lens, const int64_t *q_starts, int64_t bs,
                           int64_t kv_heads, int64_t group, int64_t head_dim, float scale, float *out, int num_threads) {
    return extend_attention(q, q_dtype, kn, vn, k, v, kv_dtype, num_slots, r2t, r2t_rows, r2t_stride, rows, prefix_lens,
                            extend_lens, q_starts, bs, kv_heads, group, head_dim, scale, out, num_threads, 1);
}
