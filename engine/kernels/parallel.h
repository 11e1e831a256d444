/* par_for: how the CPU kernels spread a loop over threads.
 *
 *   par_for(num_threads, n, grain, dynamic, body, ctx)
 *
 * runs body(ctx, begin, end, slot) over [0, n) in chunks of `grain` items on up to num_threads
 * threads and returns when every chunk has run. `slot` (0 .. num_threads - 1) names the thread
 * running the chunk, for per-thread scratch; the calling thread is slot 0. num_threads <= 1, one
 * chunk, or a call from inside a body runs the whole range on the calling thread.
 *
 * Two backends:
 *
 * OpenMP (the default). The kernels' own libraries (paged_attention.c, cpu_linear.c,
 * cpu_sampling.c) run between torch's ops, and torch's OpenMP team is the one that should run them:
 * a second set of threads beside libgomp's spinning ones would fight them for the cores. `dynamic`
 * picks schedule(dynamic, 1) over the chunks; otherwise each thread takes one contiguous range.
 *
 * The crew (BATON_CREW defined: cpu_forward.c, whose native forward runs a whole step without
 * torch). An OpenMP region ends in a barrier that waits for every thread of the team: on a machine
 * with no spare core, one team thread preempted by anything else (the scheduler's Python, the HTTP
 * server, the detokenizer) stalls the region for the length of a time slice. The crew has no such
 * barrier. A job is a counter of items; the caller publishes it, claims chunks itself, and waits
 * only for chunks that others actually claimed. A claim takes 1 / (2 * num_threads) of what is
 * left, at least `grain` items (guided scheduling): few claims, and small ones at the end, so no
 * thread waits long for another's last chunk. Whoever is free joins: the crew's own helper threads
 * (num_threads - 1 of them, started on first use), or, for a job of the forward stream's thread,
 * the thread waiting on that stream (stream_wait in cpu_forward.c) in place of one helper. So the
 * overlap loop's scheduler thread does its Python while the forward runs on the other core, and
 * lends its own core to the forward once it has nothing else to do: at any moment as many threads
 * compute as there are cores, and none of them is a barrier's hostage.
 *
 * Publication is a seqlock over one 64-bit word (generation << 32 | next item): a joiner reads the
 * job, then claims a chunk by compare-and-swap on the word it read, which fails if anything changed
 * since, so a late joiner can never run a chunk of a job that is over. Idle helpers spin for
 * CREW_SPIN_NS, then sleep on a futex; a publication wakes them only when they sleep.
 */
#ifndef BATON_PARALLEL_H
#define BATON_PARALLEL_H
#include <stdint.h>

typedef void (*par_body)(void *ctx, int64_t begin, int64_t end, int slot);

#ifndef BATON_CREW
#include <omp.h>

static void par_for(int num_threads, int64_t n, int64_t grain, int dynamic, par_body body, void *ctx) {
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int64_t chunks = (n + grain - 1) / grain;
    if (num_threads <= 1 || chunks <= 1) {
        body(ctx, 0, n, 0);
        return;
    }
    if (dynamic) {
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
        for (int64_t c = 0; c < chunks; ++c) body(ctx, c * grain, c * grain + grain < n ? c * grain + grain : n, omp_get_thread_num());
        return;
    }
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t c0 = chunks * t / nt, c1 = chunks * (t + 1) / nt;
        if (c1 > c0) body(ctx, c0 * grain, c1 * grain < n ? c1 * grain : n, (int)t);
    }
}

#else /* BATON_CREW */
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define CREW_MAX_HELPERS 63
#define CREW_WRITING 0xFFFFFFFFu /* the low half of the state word while a job is being written */
#define CREW_SPIN_NS 50000       /* an idle helper's spin before it sleeps */
#define CREW_ROLE_CALLER (-1)
#define CREW_ROLE_WAITER (-2)

typedef struct {
    _Atomic uint64_t state;  /* generation << 32 | next item to claim */
    _Atomic int64_t done;    /* items of the current job that have run */
    /* the job, written between its generation's CREW_WRITING mark and its publication */
    _Atomic(par_body) body;
    _Atomic(void *) ctx;
    _Atomic int64_t n, grain, divisor;
    _Atomic int dedicated; /* helpers 0 .. dedicated - 1 may join (slots 1 .. dedicated) */
    _Atomic int waiter;    /* the stream's waiter may join (slot dedicated + 1) */
    /* futex words, bumped by a publication the sleepers may join (and, for the waiter, a stream step's end) */
    _Atomic uint32_t helper_seq, waiter_seq;
    _Atomic int helper_sleepers, waiter_sleeping;
    _Atomic int busy;        /* a caller owns the crew: another caller runs its range itself */
    _Atomic int waiter_busy; /* one waiter at a time */
    int helpers;             /* helper threads started (under lock) */
    pthread_mutex_t lock;
} Crew;

static Crew crew = {.lock = PTHREAD_MUTEX_INITIALIZER};
static __thread int crew_depth;     /* > 0 inside a body: a nested par_for runs inline */
static __thread int crew_on_stream; /* this thread is a forward stream's: its jobs take the waiter in */

static inline void crew_pause(void) { __builtin_ia32_pause(); }

static inline int64_t crew_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void crew_futex_wait(_Atomic uint32_t *word, uint32_t expected) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAIT_PRIVATE, expected, NULL, NULL, 0);
}

static void crew_futex_wake(_Atomic uint32_t *word) {
    syscall(SYS_futex, (uint32_t *)word, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
}

/* Claim and run chunks of the published job while there are any this role may take. Returns the
 * state word it last saw (to wait for a change of). */
static uint64_t crew_work(int role) {
    for (;;) {
        const uint64_t s = atomic_load_explicit(&crew.state, memory_order_acquire);
        const uint32_t k = (uint32_t)s;
        if (k == CREW_WRITING) return s;
        const par_body body = atomic_load_explicit(&crew.body, memory_order_relaxed);
        void *const ctx = atomic_load_explicit(&crew.ctx, memory_order_relaxed);
        const int64_t n = atomic_load_explicit(&crew.n, memory_order_relaxed);
        const int64_t grain = atomic_load_explicit(&crew.grain, memory_order_relaxed);
        const int64_t divisor = atomic_load_explicit(&crew.divisor, memory_order_relaxed);
        const int dedicated = atomic_load_explicit(&crew.dedicated, memory_order_relaxed);
        const int waiter = atomic_load_explicit(&crew.waiter, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if ((int64_t)k >= n) return s;
        int slot = 0;
        if (role == CREW_ROLE_WAITER) {
            if (!waiter) return s;
            slot = dedicated + 1;
        } else if (role >= 0) {
            if (role >= dedicated) return s;
            slot = role + 1;
        }
        /* guided: a share of what is left, at least a grain, so the last chunks are small */
        const int64_t left = n - (int64_t)k, share = (left + divisor - 1) / divisor;
        const int64_t take = share > grain ? share : grain < left ? grain : left;
        /* the CAS fails if the word moved since it was read: a claim, or a new job being written */
        uint64_t expected = s;
        if (!atomic_compare_exchange_weak_explicit(&crew.state, &expected, s + (uint64_t)take, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        ++crew_depth;
        body(ctx, (int64_t)k, (int64_t)k + take, slot);
        --crew_depth;
        atomic_fetch_add_explicit(&crew.done, take, memory_order_release);
    }
}

/* Return once the state word differs from `last` (or *stop is set): spin for spin_ns, then sleep on
 * `word` (its sleeper count `sleepers`) until a publication bumps it. */
static void crew_idle(uint64_t last, int64_t spin_ns, _Atomic uint32_t *word, _Atomic int *sleepers,
                      const int *stop) {
    const int64_t start = spin_ns > 0 ? crew_now_ns() : 0;
    for (int i = 0; spin_ns > 0; ++i) {
        if (atomic_load_explicit(&crew.state, memory_order_acquire) != last) return;
        if (stop && __atomic_load_n(stop, __ATOMIC_ACQUIRE)) return;
        crew_pause();
        if ((i & 63) == 63 && crew_now_ns() - start > spin_ns) break;
    }
    for (;;) {
        atomic_fetch_add(sleepers, 1);
        const uint32_t seen = atomic_load(word);
        if (atomic_load(&crew.state) != last || (stop && __atomic_load_n(stop, __ATOMIC_SEQ_CST))) {
            atomic_fetch_sub(sleepers, 1);
            return;
        }
        crew_futex_wait(word, seen);
        atomic_fetch_sub(sleepers, 1);
        if (atomic_load(&crew.state) != last || (stop && __atomic_load_n(stop, __ATOMIC_ACQUIRE))) return;
    }
}

static void *crew_helper(void *arg) {
    const int index = (int)(intptr_t)arg;
    for (;;) {
        const uint64_t last = crew_work(index);
        /* not wanted by this job (a stream's job has the waiter instead): sleep until the next one */
        const int wanted = index < atomic_load_explicit(&crew.dedicated, memory_order_relaxed);
        crew_idle(last, wanted ? CREW_SPIN_NS : 0, &crew.helper_seq, &crew.helper_sleepers, NULL);
    }
    return NULL;
}

/* A forked child has the parent's memory but none of its threads. */
static void crew_after_fork(void) {
    crew.helpers = 0;
    atomic_store(&crew.busy, 0);
    atomic_store(&crew.waiter_busy, 0);
    atomic_store(&crew.helper_sleepers, 0);
    atomic_store(&crew.waiter_sleeping, 0);
    pthread_mutex_init(&crew.lock, NULL);
}

__attribute__((constructor)) static void crew_init(void) { pthread_atfork(NULL, NULL, crew_after_fork); }

/* Start helpers up to `wanted`; returns how many there are (fewer if a thread could not start). */
static int crew_start_helpers(int wanted) {
    if (wanted <= __atomic_load_n(&crew.helpers, __ATOMIC_ACQUIRE)) return wanted;
    pthread_mutex_lock(&crew.lock);
    while (crew.helpers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        const int err = pthread_create(&thread, &attr, crew_helper, (void *)(intptr_t)crew.helpers);
        pthread_attr_destroy(&attr);
        if (err) break;
        __atomic_store_n(&crew.helpers, crew.helpers + 1, __ATOMIC_RELEASE);
    }
    const int have = crew.helpers;
    pthread_mutex_unlock(&crew.lock);
    return have < wanted ? have : wanted;
}

/* Wake the stream's waiter if it sleeps (a publication it may join; a step it waits for ended). */
static void crew_wake_waiter(void) {
    atomic_fetch_add(&crew.waiter_seq, 1);
    if (atomic_load(&crew.waiter_sleeping)) crew_futex_wake(&crew.waiter_seq);
}

static void par_for(int num_threads, int64_t n, int64_t grain, int dynamic, par_body body, void *ctx) {
    (void)dynamic; /* the crew's chunks always go to whoever claims them first */
    if (n <= 0) return;
    if (grain < 1) grain = 1;
    const int64_t chunks = (n + grain - 1) / grain;
    if (num_threads <= 1 || chunks <= 1 || n >= CREW_WRITING || crew_depth ||
        atomic_exchange_explicit(&crew.busy, 1, memory_order_acquire)) {
        body(ctx, 0, n, 0);
        return;
    }
    const int waiter = crew_on_stream;
    int dedicated = num_threads - 1 - waiter;
    dedicated = dedicated < 0 ? 0 : dedicated > CREW_MAX_HELPERS ? CREW_MAX_HELPERS : dedicated;
    dedicated = crew_start_helpers(dedicated);
    const uint64_t gen = (atomic_load_explicit(&crew.state, memory_order_relaxed) >> 32) + 1;
    atomic_store_explicit(&crew.state, gen << 32 | CREW_WRITING, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    atomic_store_explicit(&crew.body, body, memory_order_relaxed);
    atomic_store_explicit(&crew.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&crew.n, n, memory_order_relaxed);
    atomic_store_explicit(&crew.grain, grain, memory_order_relaxed);
    atomic_store_explicit(&crew.divisor, 2 * (int64_t)num_threads, memory_order_relaxed);
    atomic_store_explicit(&crew.dedicated, dedicated, memory_order_relaxed);
    atomic_store_explicit(&crew.waiter, waiter, memory_order_relaxed);
    atomic_store_explicit(&crew.done, 0, memory_order_relaxed);
    atomic_store_explicit(&crew.state, gen << 32, memory_order_seq_cst);
    if (dedicated) {
        atomic_fetch_add(&crew.helper_seq, 1);
        if (atomic_load(&crew.helper_sleepers)) crew_futex_wake(&crew.helper_seq);
    }
    if (waiter) crew_wake_waiter();
    crew_work(CREW_ROLE_CALLER);
    /* the chunks others claimed: short, unless their thread was preempted mid-chunk */
    for (int i = 0; atomic_load_explicit(&crew.done, memory_order_acquire) < n; ++i)
        if ((i & 1023) == 1023) sched_yield();
        else crew_pause();
    atomic_store_explicit(&crew.busy, 0, memory_order_release);
}

/* The stream's waiter: help the stream thread's jobs until *flag is set (the step it waits for has
 * ended; crew_wake_waiter follows the flag's store). Returns at once when another thread is the
 * waiter already. */
static void crew_help_until(const int *flag) {
    /* The scheduler's thread has just sent a step's outputs and launched the next: let a runnable
     * frontend process (the detokenizer, the HTTP server) on this core go first. Measured served
     * (three A/B runs of 6-12 rounds): ITL p50 -1% to -19%, throughput +1% to +9%. */
    sched_yield();
    if (atomic_exchange(&crew.waiter_busy, 1)) return;
    while (!__atomic_load_n(flag, __ATOMIC_ACQUIRE)) {
        const uint64_t last = crew_work(CREW_ROLE_WAITER);
        if (__atomic_load_n(flag, __ATOMIC_ACQUIRE)) break;
        crew_idle(last, CREW_SPIN_NS, &crew.waiter_seq, &crew.waiter_sleeping, flag);
    }
    atomic_store(&crew.waiter_busy, 0);
}
#endif /* BATON_CREW */
#endif /* BATON_PARALLEL_H */
