/* Sampling from a batch's logits on CPU: temperature, top-k, top-p, min-p and one draw per row.
 *
 * torch's way over a real vocabulary is most of a decode step: softmax, a full descending sort of
 * every row for top-k or top-p, a cumulative sum, then multinomial (32 rows x 49,152 tokens: tens to
 * hundreds of milliseconds on two cores). Here each row is a pass of exp over its logits, where
 * top-k or top-p cut a histogram of the weights and a sort of the one bucket the cut falls in, and
 * the draw: linear in the vocabulary.
 *
 * The semantics are the torch sampler's (engine/layers/sampler.py): probabilities softmax(l / T);
 * top-k keeps the k most probable tokens; top-p keeps the shortest prefix of those, most probable
 * first, whose mass before each kept token is at most p of the top-k mass; min-p drops tokens below
 * min_p times the most probable one; the draw is proportional to what is kept. Ties at a cut are
 * taken lowest token id first.
 *
 * The draw of row r is a function of (seeds[r], counters[r]) alone (splitmix64): a request that
 * draws from its own seed and its count of samples so far gets the same numbers whatever else is in
 * the batch, and the same sequence on every run.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "parallel.h"
#include "vec_math.h" /* exp16 */

#define SAMPLE_NO_MEMORY 1

/* The row's maximum (NaN ignored), then w = exp((w - max) / T) in place; returns their sum. */
static double softmax_weights(float *w, int64_t n, float inv_t, float *max_out) {
    int64_t i = 0;
    float mx = -INFINITY;
#if defined(__AVX512F__)
    __m512 vmax = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(w + i));
    mx = _mm512_reduce_max_ps(vmax);
#endif
    for (; i < n; ++i) mx = w[i] > mx ? w[i] : mx;
    *max_out = mx;
    if (!(mx > -INFINITY)) return 0.0;
    double mass = 0.0;
    i = 0;
#if defined(__AVX512F__)
    const __m512 vmx = _mm512_set1_ps(mx), vt = _mm512_set1_ps(inv_t);
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        const __m512 e = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(w + i), vmx), vt));
        _mm512_storeu_ps(w + i, e);
        acc = _mm512_add_ps(acc, e);
    }
    mass = _mm512_reduce_add_ps(acc);
#endif
    for (; i < n; ++i) {
        w[i] = expf((w[i] - mx) * inv_t);
        mass += w[i];
    }
    return mass;
}

static inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* A uniform double in [0, 1) for the counter-th draw of a seed. */
double uniform_draw(uint64_t seed, uint64_t counter) {
    return (double)(splitmix64(splitmix64(seed) ^ counter) >> 11) * 0x1.0p-53;
}

typedef struct {
    float w;
    int32_t id;
} Cand;

/* a before b in the order top-k and top-p cut: more probable first, then the lower id */
static inline int ranks_before(float wa, int32_t ia, float wb, int32_t ib) { return wa > wb || (wa == wb && ia < ib); }

static int cmp_cand(const void *x, const void *y) {
    const Cand *a = x, *b = y;
    return ranks_before(a->w, a->id, b->w, b->id) ? -1 : ranks_before(b->w, b->id, a->w, a->id) ? 1 : 0;
}

/* Buckets of weights in (0, 1] by their float bits (monotonic for positive floats): 5 bits of
 * mantissa, so a bucket spans ~3% of value; the weight 1 has the last one. */
#define BUCKET_SHIFT 18
#define NUM_BUCKETS ((0x3F800000u >> BUCKET_SHIFT) + 1)

static inline uint32_t bucket_of(float w) {
    uint32_t u;
    memcpy(&u, &w, sizeof u);
    const uint32_t b = u >> BUCKET_SHIFT;
    return b < NUM_BUCKETS ? b : NUM_BUCKETS - 1;
}

typedef struct {
    int32_t count[NUM_BUCKETS];
    double mass[NUM_BUCKETS];
    Cand *cand; /* [vocab] */
} Scratch;

/* The tokens of bucket b, in the order (most probable first, then lower id), into s->cand; their
 * number. */
static int64_t sorted_bucket(const float *w, int64_t vocab, uint32_t b, Scratch *s) {
    int64_t n = 0;
    for (int64_t i = 0; i < vocab; ++i)
        if (w[i] > 0.f && bucket_of(w[i]) == b) s->cand[n++] = (Cand){w[i], (int32_t)i};
    qsort(s->cand, (size_t)n, sizeof(Cand), cmp_cand);
    return n;
}

/* One row: w[vocab] is overwritten with exp((l - max) / T). Returns the token drawn.
 *
 * Top-k and top-p keep a prefix of the tokens in the order above, so what they keep is fixed by
 * its last token, the cut: a token is kept when it comes no later than the cut. The cut is found
 * without sorting the vocabulary: the bucket that holds it from the buckets' counts (top-k) or
 * masses (top-p), then that bucket's tokens sorted. */
static int64_t sample_row(float *w, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                          double u, Scratch *s) {
    float mx;
    const double mass = softmax_weights(w, vocab, 1.f / temperature, &mx); /* the best token's weight: 1 */
    if (!(mx > -INFINITY)) return 0; /* nothing can be drawn (every logit -inf or NaN): token 0 */
    const float floor_w = min_p > 0.f ? min_p : 0.f; /* min-p against the best token's weight, 1 */
    int cut = 0;              /* whether top-k or top-p cuts */
    float cut_w = 0.f;        /* the cut: the last kept token's weight and id */
    int32_t cut_id = 0;
    if ((top_k > 0 && top_k < vocab) || top_p < 1.f) {
        memset(s->count, 0, sizeof s->count);
        memset(s->mass, 0, sizeof s->mass);
        for (int64_t i = 0; i < vocab; ++i)
            if (w[i] > 0.f) {
                const uint32_t b = bucket_of(w[i]);
                s->count[b] += 1;
                s->mass[b] += w[i];
            }
        double top_mass = mass; /* what top-p takes a fraction of: the top-k mass */
        int64_t kb = -1, k_rank = 0;  /* top-k's cut: bucket, and rank within it (1-based) */
        if (top_k > 0 && top_k < vocab) {
            int64_t seen = 0;
            double above = 0.0;
            for (int64_t b = NUM_BUCKETS - 1; b >= 0; --b) {
                if (seen + s->count[b] >= top_k) {
                    kb = b;
                    k_rank = top_k - seen;
                    break;
                }
                seen += s->count[b];
                above += s->mass[b];
            }
            if (kb >= 0) { /* fewer positive tokens than k: no cut */
                sorted_bucket(w, vocab, (uint32_t)kb, s);
                cut = 1;
                cut_w = s->cand[k_rank - 1].w;
                cut_id = s->cand[k_rank - 1].id;
                top_mass = above;
                for (int64_t j = 0; j < k_rank; ++j) top_mass += s->cand[j].w;
            }
        }
        if (top_p < 1.f) {
            /* the first bucket (from the top) where the mass so far passes p: the cut is in it */
            const double limit = (double)top_p * top_mass;
            double above = 0.0;
            int64_t pb = -1;
            for (int64_t b = NUM_BUCKETS - 1; b >= 0; --b) {
                if (above + s->mass[b] > limit) {
                    pb = b;
                    break;
                }
                above += s->mass[b];
            }
            if (pb >= 0 && pb >= kb) { /* else top-k's cut comes first */
                const int64_t n = sorted_bucket(w, vocab, (uint32_t)pb, s);
                const int64_t stop = pb == kb ? k_rank : n; /* within top-k's bucket: not past its cut */
                double mass_before = above;
                int64_t j = 0;
                while (j < stop && mass_before <= limit) mass_before += s->cand[j++].w;
                /* j >= 1: the bucket's first token starts at `above`, within the limit */
                cut = 1;
                cut_w = s->cand[j - 1].w;
                cut_id = s->cand[j - 1].id;
            }
        }
    }
    /* the draw: in token order over the kept tokens (no later than the cut, at least min-p) */
    double kept = 0.0;
    for (int64_t i = 0; i < vocab; ++i)
        if (w[i] > 0.f && w[i] >= floor_w && (!cut || !ranks_before(cut_w, cut_id, w[i], (int32_t)i))) kept += w[i];
    const double target = u * kept;
    double acc = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < vocab; ++i) {
        if (!(w[i] > 0.f && w[i] >= floor_w && (!cut || !ranks_before(cut_w, cut_id, w[i], (int32_t)i)))) continue;
        acc += w[i];
        last = i;
        if (acc > target) return i;
    }
    return last;
}

/* The first index of the row's maximum, NaN counting as the maximum, as torch.argmax. */
static int64_t argmax_row(const float *x, int64_t n) {
    int64_t best = 0;
    float v = x[0];
    if (v != v) return 0;
    for (int64_t i = 1; i < n; ++i) {
        if (x[i] != x[i]) return i;
        if (x[i] > v) {
            v = x[i];
            best = i;
        }
    }
    return best;
}

/* logits [bs, vocab] float32, overwritten; per row: temperature (<= 0: the argmax), top_k (<= 0 or >= vocab: all),
 * top_p (>= 1: off), min_p (<= 0: off), and the draw's seed and counter. out [bs] int64. Returns 0
 * or SAMPLE_NO_MEMORY. */
typedef struct {
    float *logits;
    int64_t vocab;
    const float *temperatures, *top_ps, *min_ps;
    const int64_t *top_ks;
    const uint64_t *seeds, *counters;
    int64_t *out;
    Scratch **scratch; /* [num_threads], one per slot, made on first need */
    int failed;
} SampleJob;

static void sample_range(void *arg, int64_t begin, int64_t end, int slot) {
    SampleJob *j = arg;
    const int64_t vocab = j->vocab;
    for (int64_t r = begin; r < end; ++r) {
        if (!(j->temperatures[r] > 0.f)) {
            j->out[r] = argmax_row(j->logits + r * vocab, vocab);
            continue;
        }
        const int ordered = (j->top_ks[r] > 0 && j->top_ks[r] < vocab) || j->top_ps[r] < 1.f;
        Scratch *scratch = j->scratch[slot];
        if (ordered && !scratch) {
            scratch = malloc(sizeof(Scratch));
            if (scratch && !(scratch->cand = malloc(sizeof(Cand) * vocab))) {
                free(scratch);
                scratch = NULL;
            }
            if (!scratch) {
                __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
                continue;
            }
            j->scratch[slot] = scratch;
        }
        j->out[r] = sample_row(j->logits + r * vocab, vocab, j->temperatures[r], j->top_ks[r], j->top_ps[r],
                               j->min_ps[r], uniform_draw(j->seeds[r], j->counters[r]), scratch);
    }
}

int sample_rows(float *logits, int64_t bs, int64_t vocab, const float *temperatures, const int64_t *top_ks,
                const float *top_ps, const float *min_ps, const uint64_t *seeds, const uint64_t *counters,
                int64_t *out, int num_threads) {
    if (num_threads < 1 || bs <= 1 || vocab < 4096) num_threads = 1;
    SampleJob j = {logits, vocab, temperatures, top_ps, min_ps, top_ks, seeds, counters, out,
                   calloc(num_threads, sizeof(Scratch *)), 0};
    if (!j.scratch) return SAMPLE_NO_MEMORY;
    par_for(num_threads, bs, 1, 1, sample_range, &j);
    for (int t = 0; t < num_threads; ++t) {
        if (j.scratch[t]) free(j.scratch[t]->cand);
        free(j.scratch[t]);
    }
    free(j.scratch);
    return j.failed ? SAMPLE_NO_MEMORY : 0;
}

typedef struct {
    float *logits;
    int64_t vocab;
    const int64_t *rows;
    const int32_t *const *counts;
    const uint8_t *const *seen;
    const float *rep, *freq, *pres;
} PenaltyJob;

__attribute__((optimize("fp-contract=off"))) static void penalty_range(void *arg, int64_t begin, int64_t end,
                                                                       int slot) {
    (void)slot;
    const PenaltyJob *pj = arg;
    const int64_t vocab = pj->vocab;
    for (int64_t j = begin; j < end; ++j) {
        float *l = pj->logits + pj->rows[j] * vocab;
        const int32_t *c = pj->counts[j];
        const uint8_t *s = pj->seen[j];
        const float r = pj->rep[j], f = pj->freq[j], p = pj->pres[j];
        for (int64_t i = 0; i < vocab; ++i) {
            float x = l[i];
            if (s[i]) x = x > 0.f ? x / r : x * r;
            if (c[i]) {
                const float by_count = f * (float)c[i];
                x = x - by_count;
                x = x - p;
            }
            l[i] = x;
        }
    }
}

/* Token penalties on rows of logits [*, vocab], in place: row rows[j] with its request's output
 * counts[j] (int32 [vocab]) and seen[j] (bool [vocab]: prompt or output): a seen token's logit l
 * becomes l / rep[j] if l > 0 else l * rep[j] (HF's repetition penalty), then
 * l - freq[j] * count - pres[j] * (count > 0) (OpenAI's frequency and presence), rounded as the
 * torch version in engine/sampling/penalties.py rounds them (no fused multiply-add). */
void apply_penalty_rows(
    float *logits, int64_t vocab, int64_t n, const int64_t *rows, const int32_t *const *counts,
    const uint8_t *const *seen, const float *rep, const float *freq, const float *pres, int num_threads) {
    PenaltyJob j = {logits, vocab, rows, counts, seen, rep, freq, pres};
    par_for(n > 1 && vocab >= 4096 ? num_threads : 1, n, 1, 1, penalty_range, &j);
}
