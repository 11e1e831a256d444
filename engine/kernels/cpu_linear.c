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
 * Tiles are spread over the OpenMP threads torch uses. Accumulation is in float32 (each product
 * exact, pairs summed, then added), and the result is rounded to bfloat16 once, as torch's bfloat16
 * GEMM rounds it. N must be a multiple of 16 and K even (the caller checks; other shapes keep
 * torch's GEMM). Without AVX512_BF16 the library builds but `packed_gemm_available` returns 0.
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

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

/* Rows [m0, m0 + MR) x output blocks [nb0, nb0 + NB). */
INLINE void tile(const uint16_t *x, const uint16_t *packed, int64_t k, int64_t n, uint16_t *y, int64_t m0,
                 int64_t nb0, const int MR, const int NB) {
    __m512 acc[4][4];
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_setzero_ps();
    const int64_t pairs = k / 2;
    const uint16_t *w = packed + nb0 * pairs * 32;
    for (int64_t kp = 0; kp < pairs; ++kp) {
        __m512bh b[4];
        for (int c = 0; c < NB; ++c) b[c] = (__m512bh)_mm512_loadu_si512((const void *)(w + (c * pairs + kp) * 32));
        for (int r = 0; r < MR; ++r) {
            uint32_t pair;
            memcpy(&pair, x + (m0 + r) * k + 2 * kp, sizeof pair);
            const __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int c = 0; c < NB; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], a, b[c]);
        }
    }
    for (int r = 0; r < MR; ++r)
        for (int c = 0; c < NB; ++c)
            _mm256_storeu_si256((__m256i *)(y + (m0 + r) * n + (nb0 + c) * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}
#endif

/* x [M, K], y [M, N], contiguous bfloat16; packed from pack_bf16_weight. Returns 0, or 1 when this
 * build has no AVX512_BF16 or the shape is not supported (nothing written). */
int packed_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, const uint16_t *packed, int64_t n, uint16_t *y,
                    int num_threads) {
#if defined(__AVX512BF16__)
    enum { MR = 4, NB = 4 };
    if (m < 0 || k <= 0 || k % 2 || n <= 0 || n % 16) return 1;
    const int64_t blocks = n / 16, ntiles = (blocks + NB - 1) / NB, mtiles = (m + MR - 1) / MR;
#pragma omp parallel for num_threads(num_threads) schedule(static) collapse(2)
    for (int64_t nt = 0; nt < ntiles; ++nt)
        for (int64_t mt = 0; mt < mtiles; ++mt) {
            const int64_t m0 = mt * MR, nb0 = nt * NB;
            const int64_t mr = m - m0 < MR ? m - m0 : MR, nbs = blocks - nb0 < NB ? blocks - nb0 : NB;
#define T(R, C) tile(x, packed, k, n, y, m0, nb0, R, C)
#define ROWS(C)           \
    if (mr == 4) T(4, C); \
    else if (mr == 3) T(3, C); \
    else if (mr == 2) T(2, C); \
    else T(1, C)
            if (nbs == 4) { ROWS(4); }
            else if (nbs == 3) { ROWS(3); }
            else if (nbs == 2) { ROWS(2); }
            else { ROWS(1); }
#undef ROWS
#undef T
        }
    return 0;
#else
    (void)x; (void)m; (void)k; (void)packed; (void)n; (void)y; (void)num_threads;
    return 1;
#endif
}
