/* bfloat16 linear layers on CPU: y [M, N] = x [M, K] @ W^T, on AVX512_BF16.
 *
 * At decode a linear layer sees a few dozen rows, where a library GEMM spends more time setting up
 * than computing (oneDNN: 30-100 us per call for 32 x 256 x 256..1536 on a 2-core Zen 4, a fraction
 * of it arithmetic). Here the weight is packed once, at load, into the operand layout of vdpbf16ps,
 * and a call is a plain loop nest, which also keeps up with oneDNN at prefill sizes:
 *
 *   packed [N/16][K/2][16][2]   for 16 outputs and one pair of inputs, the 16 outputs' two weights
 *                               side by side (one 64-byte vector per pair of inputs)
 *   tile   MR rows x NB blocks of 16 outputs, MR * NB float32 accumulators in registers; per pair of
 *          inputs: NB weight loads, MR broadcasts of the row's input pair, MR * NB dot products
 *
 * Tiles are spread over threads by parallel.h (torch's OpenMP team when called from torch, the
 * crew inside the native forward). Accumulation is in float32 (each product
 * exact, pairs summed, then added), and the result is rounded to bfloat16 once, as torch's bfloat16
 * GEMM rounds it. N must be a multiple of 16 and K even (the caller checks; other shapes keep
 * torch's GEMM). Without AVX512_BF16 the library builds but `packed_gemm_available` returns 0.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "vec_math.h" /* exp16 */
#endif
#include "parallel.h"

int packed_gemm_available(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* w [N, K] (bfloat16 bits) -> out [N/16][K/2][16][2]. */
void pack_bf16_weight(const uint16_t *w, int64_t n, int64_t k, uint16_t *out) {
    const int64_t pairs = k / 2;
    for (int64_t nb = 0; nb < n / 16; ++nb)
        for (int64_t kp = 0; kp < pairs; ++kp)
            for (int64_t j = 0; j < 16; ++j) {
                uint16_t *dst = out + ((nb * pairs + kp) * 16 + j) * 2;
                const uint16_t *src = w + (nb * 16 + j) * k + 2 * kp;
                dst[0] = src[0];
                dst[1] = src[1];
            }
}

#if defined(__AVX512BF16__)
#define INLINE static inline __attribute__((always_inline))

/* float32 -> the nearest bfloat16 -> float32 (what storing a GEMM's output as bfloat16 does). */
INLINE __m512 round_bf16(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

/* Rows [m0, m0 + MR) x output blocks [nb0, nb0 + NB) of y [M, ldy]. With GLU the weight is a
 * gated MLP's gate|up ([2I, K] packed: the gate's blocks, then the up's, `half` = I / 16 each) and
 * the tile is silu(gate) * up for its NB blocks of I: per pair of inputs NB gate and NB up weight
 * loads, MR broadcasts, 2 * MR * NB dot products; the epilogue rounds gate and up to bfloat16 as the
 * plain GEMM stores them, computes silu(g) * u in float32 and rounds once, as torch.compile's fused
 * kernel for `F.silu(gate) * up` does. */
INLINE void tile(const uint16_t *x, const uint16_t *packed, int64_t k, int64_t half, uint16_t *y, int64_t ldy,
                 int64_t m0, int64_t nb0, const int MR, const int NB, const int GLU) {
    const int nw = GLU ? 2 * NB : NB;  /* weight blocks per pair of inputs */
    __m512 acc[4][4];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < nw; ++c) acc[r][c] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    for (int64_t kp = 0; kp < pairs; ++kp) {
        __m512bh b[4];
        for (int c = 0; c < nw; ++c) {
            const int64_t block = c < NB ? nb0 + c : half + nb0 + c - NB;
            b[c] = (__m512bh)_mm512_loadu_si512((const void *)(packed + (block * pairs + kp) * 32));
        }
        for (int r = 0; r < MR; ++r) {
            uint32_t pair;
            memcpy(&pair, x + (m0 + r) * k + 2 * kp, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int c = 0; c < nw; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
        }
    }
    const __m512 one = _mm512_set1_ps(1.f);
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NB; ++c) {
            __m512 out = acc[r][c];
            if (GLU) {
                const __m512 g = round_bf16(out), u = round_bf16(acc[r][NB + c]);
                out = _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), g)))), u);
            }
            _mm256_storeu_si256((__m256i *)(y + (m0 + r) * ldy + (nb0 + c) * 16), (__m256i)_mm512_cvtneps_pbh(out));
        }
}

/* A GEMM's tiles: MR = 4 rows by up to `nb_max` blocks of 16 outputs (GLU: the fused silu(gate) * up
 * of tile(), `half` = blocks), numbered output block first, so that consecutive tiles share their
 * weights. */
typedef struct {
    const uint16_t *x, *packed;
    uint16_t *y;
    int64_t m, k, blocks, half, mtiles;
    int nb_max, glu;
} Tiles;

enum { TILE_MR = 4 };

static void run_tile_range(void *arg, int64_t begin, int64_t end, int slot) {
    (void)slot;
    const Tiles *t = arg;
    const uint16_t *x = t->x, *packed = t->packed;
    uint16_t *y = t->y;
    const int64_t m = t->m, k = t->k, blocks = t->blocks, half = t->half;
    for (int64_t i = begin; i < end; ++i) {
        const int64_t nt = i / t->mtiles, mt = i % t->mtiles;
        const int64_t m0 = mt * TILE_MR, nb0 = nt * t->nb_max;
        const int64_t mr = m - m0 < TILE_MR ? m - m0 : TILE_MR, nbs = blocks - nb0 < t->nb_max ? blocks - nb0 : t->nb_max;
#define T(R, C, G) tile(x, packed, k, half, y, blocks * 16, m0, nb0, R, C, G)
#define ROWS(C, G)                  \
    if (mr == 4) T(4, C, G);        \
    else if (mr == 3) T(3, C, G);   \
    else if (mr == 2) T(2, C, G);   \
    else T(1, C, G)
        if (t->glu) {  /* 2 x nbs weight blocks: at most 4 */
            if (nbs == 2) { ROWS(2, 1); }
            else { ROWS(1, 1); }
        } else if (nbs == 4) { ROWS(4, 0); }
        else if (nbs == 3) { ROWS(3, 0); }
        else if (nbs == 2) { ROWS(2, 0); }
        else { ROWS(1, 0); }
#undef ROWS
#undef T
    }
}

/* Every tile of y [M, blocks * 16] over the threads (parallel.h): OpenMP's threads a contiguous
 * range each, the crew's in guided chunks of at least two tiles. */
static void run_tiles(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t blocks, int64_t half,
                      uint16_t *y, int num_threads, const int nb_max, const int GLU) {
    Tiles t = {x, packed, y, m, k, blocks, half, (m + TILE_MR - 1) / TILE_MR, nb_max, GLU};
    par_for(num_threads, (blocks + nb_max - 1) / nb_max * t.mtiles, 2, 0, run_tile_range, &t);
}
#endif

/* x [M, K], y [M, N], contiguous bfloat16; packed from pack_bf16_weight. Returns 0, or 1 when this
 * build has no AVX512_BF16 or the shape is not supported (nothing written). */
int packed_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, uint16_t *y,
                    int num_threads) {
#if defined(__AVX512BF16__)
    if (m < 0 || k <= 0 || k % 2 || n <= 0 || n % 16) return 1;
    run_tiles(x, m, k, packed, n / 16, 0, y, num_threads, 4, 0);
    return 0;
#else
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)y; (void)num_threads;
    return 1;
#endif
}

/* y [M, N / 2] = silu(x @ W[:N/2]^T) * (x @ W[N/2:]^T) for a gate|up weight W [N, K] packed by
 * pack_bf16_weight; x contiguous bfloat16. N must be a multiple of 32 (each half whole blocks of 16)
 * and K even. Returns 0, or 1 as packed_gemm_bf16 does. */
int packed_gemm_silu_mul_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n,
                              uint16_t *y, int num_threads) {
#if defined(__AVX512BF16__)
    if (m < 0 || k <= 0 || k % 2 || n <= 0 || n % 32) return 1;
    run_tiles(x, m, k, packed, n / 32, n / 32, y, num_threads, 2, 1);  /* 2 blocks of gate and 2 of up */
    return 0;
#else
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)y; (void)num_threads;
    return 1;
#endif
}
