/* Vector math shared by the CPU kernels (included by their .c files; build.py hashes the headers
 * beside a source into its cache key). Needs AVX-512F; INLINE as the including file defines it. */
#ifndef BATON_VEC_MATH_H
#define BATON_VEC_MATH_H
#if defined(__AVX512F__)
#include <immintrin.h>

/* exp(x), 16 lanes: Cephes' expf range reduction and polynomial, within ~1 ulp of expf. Inputs are
 * clamped to [-104, 89]: scalef makes the low end 0 (instead of wrapping the exponent) and the high
 * end infinity. */
static inline __attribute__((always_inline)) __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.f)), _mm512_set1_ps(89.f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_scalef_ps(p, n);
}
#endif
#endif
