// All-reduce (sum) of one tensor over the TP ranks of one machine through a shared memory segment.
//
// gloo on loopback takes ~1 ms per all-reduce of a few KB on a small VM; a decode step makes two
// per layer. Here each rank copies its part into its own slot of the segment, publishes a sequence
// number, waits until every rank has published it, and sums all slots in rank order (so every
// rank computes the same bits). SGLang's CPU backend does the same for TP on Xeon sockets.
//
// Segment layout (`base`, made by TP rank 0 and mapped by every rank):
//   flags  int64[size], one 64-byte line each        rank r's last published sequence number
//   data   2 buffers x size slots x slot_bytes        buffer (seq & 1), slot r: rank r's chunk
// Two buffers make one barrier per round enough: a rank writes buffer b again at seq + 2, after
// every rank published seq + 1, which each did only after it had finished reading round seq.
//
// Tensors larger than a slot go in slot-sized rounds. bfloat16 and float16 are summed in float32
// and rounded to nearest even once, per element.
//
// All-gather (the vocab-parallel LM head's logits) uses the same slots and flags: each round every
// rank copies its next slot-sized piece into its slot, and once all have published, copies every
// rank's piece out to that rank's part of the output.
//
// The same file carries the driver's step broadcast (scheduler/tp_step.py), in a region of its own
// (`bbase`):
//   published  int64, one line                       the driver's last written round
//   acks       int64[size], one line each            follower r's last consumed round
//   data       2 buffers x buf_bytes                 round s is in buffer (s & 1)
// The driver writes buffer b again at round s + 2 only once every follower acknowledged round s.
// A follower waits for the next round as long as the engine is idle: it spins briefly, then
// yields, then sleeps in steps growing to 1 ms, so an idle engine's followers cost ~nothing.
#define _GNU_SOURCE
#include <immintrin.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#define DTYPE_F32 0
#define DTYPE_BF16 1
#define DTYPE_F16 2
#define FLAG_STRIDE 8  // int64s per flag: one cache line each, no false sharing between ranks
#define SPINS_BEFORE_YIELD 4096

static inline volatile int64_t *flag_of(char *base, int rank) { return (volatile int64_t *)base + rank * FLAG_STRIDE; }

static inline char *slot_of(char *base, int size, int64_t slot_bytes, int64_t seq, int rank) {
    char *data = base + (int64_t)size * FLAG_STRIDE * sizeof(int64_t);
    return data + ((seq & 1) * size + rank) * slot_bytes;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// 0 when every rank published `seq`, 1 after timeout_s (a peer is gone).
static int wait_all(char *base, int size, int64_t seq, double timeout_s) {
    for (int r = 0; r < size; r++) {
        long spins = 0;
        double start = 0.0;
        while (__atomic_load_n(flag_of(base, r), __ATOMIC_ACQUIRE) < seq) {
            _mm_pause();
            if (++spins % SPINS_BEFORE_YIELD == 0) {
                // more ranks than free cores (a busy VM): let the rank we wait for run
                sched_yield();
                if (start == 0.0) start = now_s();
                else if (now_s() - start > timeout_s) return 1;
            }
        }
    }
    return 0;
}

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {  // round to nearest even; NaN stays NaN
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static void sum_f32(char *base, int size, int64_t slot_bytes, int64_t seq, float *out, int64_t n) {
    const float *s0 = (const float *)slot_of(base, size, slot_bytes, seq, 0);
    for (int64_t i = 0; i < n; i++) out[i] = s0[i];
    for (int r = 1; r < size; r++) {
        const float *s = (const float *)slot_of(base, size, slot_bytes, seq, r);
        for (int64_t i = 0; i < n; i++) out[i] += s[i];
    }
}

static void sum_half(char *base, int size, int64_t slot_bytes, int64_t seq, uint16_t *out, int64_t n, int dtype) {
    float acc[256];
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
        int64_t m = n - i0 < 256 ? n - i0 : 256;
        for (int r = 0; r < size; r++) {
            const uint16_t *s = (const uint16_t *)slot_of(base, size, slot_bytes, seq, r) + i0;
            for (int64_t i = 0; i < m; i++) {
                float v = dtype == DTYPE_BF16 ? bf16_to_f32(s[i]) : _cvtsh_ss(s[i]);
                acc[i] = r == 0 ? v : acc[i] + v;
            }
        }
        for (int64_t i = 0; i < m; i++)
            out[i0 + i] = dtype == DTYPE_BF16 ? f32_to_bf16(acc[i]) : _cvtss_sh(acc[i], _MM_FROUND_TO_NEAREST_INT);
    }
}

// Sums `data` (numel elements of dtype) over the ranks, in place. *seq is this rank's round counter
// (the same on every rank; advanced once per round). Returns 0, or 1 when a peer did not arrive
// within timeout_s.
int shm_allreduce(char *base, int rank, int size, int64_t slot_bytes, void *data, int64_t numel, int dtype,
                  int64_t *seq, double timeout_s) {
    int64_t elem = dtype == DTYPE_F32 ? 4 : 2;
    int64_t per_round = slot_bytes / elem;
    char *bytes = (char *)data;
    for (int64_t done = 0; done < numel; done += per_round) {
        int64_t n = numel - done < per_round ? numel - done : per_round;
        int64_t s = ++*seq;
        memcpy(slot_of(base, size, slot_bytes, s, rank), bytes + done * elem, n * elem);
        __atomic_store_n(flag_of(base, rank), s, __ATOMIC_RELEASE);
        if (wait_all(base, size, s, timeout_s)) return 1;
        if (dtype == DTYPE_F32)
            sum_f32(base, size, slot_bytes, s, (float *)(bytes + done * elem), n);
        else
            sum_half(base, size, slot_bytes, s, (uint16_t *)(bytes + done * elem), n, dtype);
    }
    return 0;
}

// Every rank's `nbytes` of `data`, rank after rank, into `out` (size * nbytes bytes). *seq and the
// return value as in shm_allreduce (one counter for both: every rank calls them in the same order).
int shm_allgather(char *base, int rank, int size, int64_t slot_bytes, const void *data, int64_t nbytes, void *out,
                  int64_t *seq, double timeout_s) {
    const char *in = (const char *)data;
    char *dst = (char *)out;
    for (int64_t done = 0; done < nbytes; done += slot_bytes) {
        int64_t n = nbytes - done < slot_bytes ? nbytes - done : slot_bytes;
        int64_t s = ++*seq;
        memcpy(slot_of(base, size, slot_bytes, s, rank), in + done, n);
        __atomic_store_n(flag_of(base, rank), s, __ATOMIC_RELEASE);
        if (wait_all(base, size, s, timeout_s)) return 1;
        for (int r = 0; r < size; r++) memcpy(dst + r * nbytes + done, slot_of(base, size, slot_bytes, s, r), n);
    }
    return 0;
}

static inline volatile int64_t *bcast_published(char *bbase) { return (volatile int64_t *)bbase; }
static inline volatile int64_t *bcast_ack(char *bbase, int rank) {
    return (volatile int64_t *)bbase + (1 + rank) * FLAG_STRIDE;
}
static inline char *bcast_buffer(char *bbase, int size, int64_t buf_bytes, int64_t seq) {
    return bbase + (int64_t)(1 + size) * FLAG_STRIDE * sizeof(int64_t) + (seq & 1) * buf_bytes;
}

// Driver (rank 0): sends nbytes of data to every follower. Returns 0, or 1 when a follower did not
// take a round within timeout_s (it is gone).
int shm_bcast_send(char *bbase, int size, int64_t buf_bytes, const void *data, int64_t nbytes, int64_t *seq,
                   double timeout_s) {
    const char *bytes = (const char *)data;
    for (int64_t done = 0; done < nbytes; done += buf_bytes) {
        int64_t n = nbytes - done < buf_bytes ? nbytes - done : buf_bytes;
        int64_t s = ++*seq;
        for (int r = 1; r < size; r++) {  // the buffer of round s - 2 must have been read by all
            long spins = 0;
            double start = 0.0;
            while (__atomic_load_n(bcast_ack(bbase, r), __ATOMIC_ACQUIRE) < s - 2) {
                _mm_pause();
                if (++spins % SPINS_BEFORE_YIELD == 0) {
                    sched_yield();
                    if (start == 0.0) start = now_s();
                    else if (now_s() - start > timeout_s) return 1;
                }
            }
        }
        memcpy(bcast_buffer(bbase, size, buf_bytes, s), bytes + done, n);
        __atomic_store_n(bcast_published(bbase), s, __ATOMIC_RELEASE);
    }
    return 0;
}

// Follower: receives nbytes into out, waiting for the driver as long as it takes.
void shm_bcast_recv(char *bbase, int rank, int size, int64_t buf_bytes, void *out, int64_t nbytes, int64_t *seq) {
    char *bytes = (char *)out;
    for (int64_t done = 0; done < nbytes; done += buf_bytes) {
        int64_t n = nbytes - done < buf_bytes ? nbytes - done : buf_bytes;
        int64_t s = ++*seq;
        long spins = 0, sleep_ns = 20000;
        while (__atomic_load_n(bcast_published(bbase), __ATOMIC_ACQUIRE) < s) {
            if (++spins < 16 * SPINS_BEFORE_YIELD) {
                _mm_pause();
                if (spins % SPINS_BEFORE_YIELD == 0) sched_yield();
            } else {
                struct timespec ts = {0, sleep_ns};
                nanosleep(&ts, NULL);
                if (sleep_ns < 1000000) sleep_ns *= 2;
            }
        }
        memcpy(bytes + done, bcast_buffer(bbase, size, buf_bytes, s), n);
        __atomic_store_n(bcast_ack(bbase, rank), s, __ATOMIC_RELEASE);
    }
}
