/* The compiled hot path of the shm backend (backends.shm._native).
 *
 * It speaks the protocol of backends/shm/{ops,reduce,futex,segment}.py word for word
 * (same layout, same phases, same doorbells), so a group may mix it with the Python
 * code around it; Python keeps everything that raises. What moves here:
 *
 *  - publication and waiting: `arrived` is stored with release order after the data
 *    and fingerprints, and read with acquire order before the data is read, so the
 *    protocol no longer leans on x86-64's TSO; the wait spins, yields, then sleeps on
 *    this rank's doorbell (FUTEX_WAIT), all with the GIL released, and returns a
 *    status to Python (done / budget spent / a peer failed or closed / mismatch)
 *    instead of raising;
 *  - doorbells: one counter for every ring of the group (so a waiter never sees the
 *    value it slept on come back) and an atomic count of this rank's sleepers;
 *  - the reduction in rank order for every dtype the backend supports, float16 and
 *    bfloat16 computed in float32 and rounded to nearest-even after every step, as
 *    numpy and ml_dtypes do (float32 has 2p+2 bits for both, so this is also the
 *    correctly rounded result): bitwise what the Python path computes;
 *  - the one-phase small all_reduce/reduce, from input to result in one call (the
 *    all_reduce also entering its phase and fingerprinting it: small_all_reduce, so
 *    this file keeps the group's phase counter while the group is on the core);
 *  - the pipelined large all_reduce/reduce and the all_reduce in symmetric memory,
 *    each one call through its phases that returns to Python only where a wait
 *    outlasts its budget (and is called again to go on);
 *  - the single-copy all_reduce's reads of a peer's memory and writes into it
 *    (process_vm_readv / process_vm_writev).
 *
 * Control block of rank r (segment.py): uint64 words at ctrl + r * 128: 0 arrived,
 * 1..4 fingerprints (parity 0 at 1, 2; parity 1 at 3, 4), 6 state, 9 sleepers; the
 * uint32 doorbell at byte 64. Slots: data + (bank * n + r) * chunk.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>
#endif

#define CTRL_STRIDE 128
#define W_ARRIVED 0
#define W_FP 1
#define W_STATE 6
#define W_SLEEPERS 9
#define W_PUSHING 10
#define BELL_BYTE 64
#define STATE_FAILED 2
#define STATE_CLOSED 3

enum { DONE = 1, BUDGET = 0, PEER = 2, MISMATCH = 3 };
#define DECLINED 4   /* done, but not by this call: see sym_all_reduce and all_to_all */
enum { R_SUM = 1, R_AVG = 2, R_PROD = 3, R_MIN = 4, R_MAX = 5 };
/* ops._DTYPE_CODE: 1 + the index in collectives.buffers.SUPPORTED_DTYPES. */
enum { T_F16 = 1, T_BF16, T_F32, T_F64, T_I8, T_U8, T_I16, T_I32, T_I64, T_BOOL };

typedef _Atomic uint64_t au64;
typedef _Atomic uint32_t au32;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ------------------------------------------------------------------ float16/bfloat16 */
static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

static inline float h2f(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    if (exp == 0x1f) return u2f(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {  /* zero or subnormal: man x 2^-24, exact in float */
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    return u2f(sign | ((exp + 112) << 23) | (man << 13));
}

static inline uint16_t f2h(float f) {  /* round to nearest, ties to even */
    uint32_t x = f2u(f), ax = x & 0x7fffffffu;
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    if (ax > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((ax >> 13) & 0x1ff);  /* NaN */
    if (ax >= 0x477ff000u) return sign | 0x7c00u;        /* >= 65520: infinity */
    if (ax >= 0x38800000u)                                /* normal: carry may bump exp */
        return sign | (uint16_t)((ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u)) >> 13);
    if (ax <= 0x33000000u) return sign;                   /* <= 2^-25 rounds to 0 */
    return sign | (uint16_t)lrintf(u2f(ax) * 0x1p24f);   /* subnormal (1024: min normal) */
}

static inline float b2f(uint16_t b) { return u2f((uint32_t)b << 16); }

static inline uint16_t f2b(float f) {
    uint32_t x = f2u(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);  /* NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

/* ------------------------------------------------------------------------ kernels */
/* out = s0 (op) s1 (op) ... (op) s_{k-1}, in that order, element by element, then AVG
 * divides by n. Blocked, so that `out` may be one of the sources (each block reads all
 * its sources before it writes). Integers wrap (unsigned arithmetic), as numpy's do. */
#define BLOCK 1024

/* NaN propagates; on a tie (-0 against +0) numpy's float32/float64 loops and
 * ml_dtypes' bfloat16 return the second operand, numpy's float16 loop the first. */
#define FMIN(a, b) (((a) < (b) || (a) != (a)) ? (a) : (b))
#define FMAX(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))
#define HMIN(a, b) (((a) <= (b) || (a) != (a)) ? (a) : (b))
#define HMAX(a, b) (((a) >= (b) || (a) != (a)) ? (a) : (b))
#define IMIN(a, b) ((a) < (b) ? (a) : (b))
#define IMAX(a, b) ((a) > (b) ? (a) : (b))

/* AVG over a power-of-two number of ranks multiplies by the reciprocal instead of
 * dividing: 1/n is then exact, and x * 2^-k rounds the same exact value x / 2^k does
 * (subnormal results included), so the bits are the division's, at a fifth of the
 * time (a divide is the slowest step of the whole reduction: 31 against 13 us for
 * two halves of DDP's 0.87 MB bucket, in cache). */
#define POW2(n) ((n) > 0 && ((n) & ((n) - 1)) == 0)

/* dst[i] = a[i] (op) b[i] for i < m: one step of the float kernels. */
#define FLOAT_STEP(op, dst, a, b, m, i)                                                \
    switch (op) {                                                                      \
    case R_SUM: for (i = 0; i < m; i++) dst[i] = a[i] + b[i]; break;                   \
    case R_PROD: for (i = 0; i < m; i++) dst[i] = a[i] * b[i]; break;                  \
    case R_MIN: for (i = 0; i < m; i++) dst[i] = FMIN(a[i], b[i]); break;              \
    default: for (i = 0; i < m; i++) dst[i] = FMAX(a[i], b[i]); break;                 \
    }

/* AVG: the sums in rank order, the last one and the division in one pass (each still
 * rounded on its own: no FMA contraction in this file); kept apart from the other
 * operators so that their loops compile exactly as before. */
#define FLOAT_AVG_KERNEL(NAME, T)                                                      \
    static void NAME(T *out, char **srcs, int k, Py_ssize_t count, int n) {            \
        T acc[BLOCK];                                                                  \
        const int exact = POW2(n);                                                     \
        const T d = (T)n, inv = (T)1 / d;                                              \
        for (Py_ssize_t base = 0; base < count; base += BLOCK) {                       \
            Py_ssize_t m = count - base < BLOCK ? count - base : BLOCK, i;             \
            const T *restrict s0 = (const T *)srcs[0] + base;                          \
            const T *restrict last = (const T *)srcs[k - 1] + base;                    \
            if (k == 1) {                                                              \
                if (exact) for (i = 0; i < m; i++) acc[i] = s0[i] * inv;               \
                else for (i = 0; i < m; i++) acc[i] = s0[i] / d;                       \
            } else if (k == 2) {                                                       \
                if (exact) for (i = 0; i < m; i++) acc[i] = (s0[i] + last[i]) * inv;   \
                else for (i = 0; i < m; i++) acc[i] = (s0[i] + last[i]) / d;           \
            } else {                                                                   \
                const T *restrict s1 = (const T *)srcs[1] + base;                      \
                for (i = 0; i < m; i++) acc[i] = s0[i] + s1[i];                        \
                for (int r = 2; r < k - 1; r++) {                                      \
                    const T *restrict s = (const T *)srcs[r] + base;                   \
                    for (i = 0; i < m; i++) acc[i] = acc[i] + s[i];                    \
                }                                                                      \
                if (exact) for (i = 0; i < m; i++) acc[i] = (acc[i] + last[i]) * inv;  \
                else for (i = 0; i < m; i++) acc[i] = (acc[i] + last[i]) / d;          \
            }                                                                          \
            memcpy(out + base, acc, (size_t)m * sizeof(T));                            \
        }                                                                              \
    }

#define FLOAT_KERNEL(NAME, T)                                                          \
    FLOAT_AVG_KERNEL(NAME##_avg, T)                                                    \
    static void NAME(void *out_, char **srcs, int k, Py_ssize_t count, int op, int n) { \
        T *out = (T *)out_;                                                            \
        T acc[BLOCK];                                                                  \
        if (op == R_AVG) {                                                             \
            NAME##_avg(out, srcs, k, count, n);                                        \
            return;                                                                    \
        }                                                                              \
        for (Py_ssize_t base = 0; base < count; base += BLOCK) {                       \
            Py_ssize_t m = count - base < BLOCK ? count - base : BLOCK, i;             \
            const T *restrict s0 = (const T *)srcs[0] + base;                          \
            if (k == 1) memcpy(acc, s0, (size_t)m * sizeof(T));                        \
            for (int r = 1; r < k; r++) {                                              \
                /* step 1 reads s0 itself (no copy into acc first), later steps acc */ \
                const T *restrict s = (const T *)srcs[r] + base;                       \
                if (r == 1) FLOAT_STEP(op, acc, s0, s, m, i)                           \
                else FLOAT_STEP(op, acc, acc, s, m, i)                                 \
            }                                                                          \
            memcpy(out + base, acc, (size_t)m * sizeof(T));                            \
        }                                                                              \
    }

#define INT_KERNEL(NAME, T, UT, MT)                                                    \
    static void NAME(void *out_, char **srcs, int k, Py_ssize_t count, int op, int n) { \
        T *out = (T *)out_;                                                            \
        T acc[BLOCK];                                                                  \
        (void)n;                                                                       \
        for (Py_ssize_t base = 0; base < count; base += BLOCK) {                       \
            Py_ssize_t m = count - base < BLOCK ? count - base : BLOCK, i;             \
            memcpy(acc, (T *)srcs[0] + base, (size_t)m * sizeof(T));                   \
            for (int r = 1; r < k; r++) {                                              \
                const T *restrict s = (const T *)srcs[r] + base;                       \
                switch (op) {                                                          \
                case R_SUM: for (i = 0; i < m; i++) acc[i] = (T)(UT)((UT)acc[i] + (UT)s[i]); break; \
                case R_PROD:                                                           \
                    for (i = 0; i < m; i++) acc[i] = (T)(UT)((MT)(UT)acc[i] * (MT)(UT)s[i]); \
                    break;                                                             \
                case R_MIN: for (i = 0; i < m; i++) acc[i] = IMIN(acc[i], s[i]); break; \
                default: for (i = 0; i < m; i++) acc[i] = IMAX(acc[i], s[i]); break;   \
                }                                                                      \
            }                                                                          \
            memcpy(out + base, acc, (size_t)m * sizeof(T));                            \
        }                                                                              \
    }

/* float16 and bfloat16: each step in float32, rounded back to 16 bits (numpy's
 * half(float(a) + float(b)); ml_dtypes' likewise), the divisor itself a 16-bit value. */
#define HALF_KERNEL(NAME, TOF, FROMF, MN, MX)                                          \
    static void NAME(void *out_, char **srcs, int k, Py_ssize_t count, int op, int n) { \
        uint16_t *out = (uint16_t *)out_;                                              \
        float acc[BLOCK];                                                              \
        for (Py_ssize_t base = 0; base < count; base += BLOCK) {                       \
            Py_ssize_t m = count - base < BLOCK ? count - base : BLOCK, i;             \
            const uint16_t *s0 = (const uint16_t *)srcs[0] + base;                     \
            for (i = 0; i < m; i++) acc[i] = TOF(s0[i]);                               \
            for (int r = 1; r < k; r++) {                                              \
                const uint16_t *restrict s = (const uint16_t *)srcs[r] + base;         \
                for (i = 0; i < m; i++) {                                              \
                    float a = acc[i], b = TOF(s[i]), c;                                \
                    switch (op) {                                                      \
                    case R_SUM: case R_AVG: c = a + b; break;                          \
                    case R_PROD: c = a * b; break;                                     \
                    case R_MIN: c = MN(a, b); break;                                   \
                    default: c = MX(a, b); break;                                      \
                    }                                                                  \
                    acc[i] = TOF(FROMF(c));                                            \
                }                                                                      \
            }                                                                          \
            if (op == R_AVG) {                                                         \
                const float d = TOF(FROMF((float)n));                                  \
                if (POW2(n) && d == (float)n) {  /* exact, as in FLOAT_KERNEL */      \
                    const float inv = 1.0f / d;                                        \
                    for (i = 0; i < m; i++) acc[i] = acc[i] * inv;                     \
                } else {                                                               \
                    for (i = 0; i < m; i++) acc[i] = acc[i] / d;                       \
                }                                                                      \
            }                                                                          \
            for (i = 0; i < m; i++) out[base + i] = FROMF(acc[i]);                     \
        }                                                                              \
    }

FLOAT_KERNEL(k_f32, float)
FLOAT_KERNEL(k_f64, double)
INT_KERNEL(k_i8, int8_t, uint8_t, uint32_t)
INT_KERNEL(k_u8, uint8_t, uint8_t, uint32_t)
INT_KERNEL(k_i16, int16_t, uint16_t, uint32_t)
INT_KERNEL(k_i32, int32_t, uint32_t, uint32_t)
INT_KERNEL(k_i64, int64_t, uint64_t, uint64_t)
HALF_KERNEL(k_f16, h2f, f2h, HMIN, HMAX)
HALF_KERNEL(k_bf16, b2f, f2b, FMIN, FMAX)

typedef void (*kernel_fn)(void *, char **, int, Py_ssize_t, int, int);

static const struct { kernel_fn fn; int itemsize; } KERNELS[] = {
    [T_F16] = {k_f16, 2}, [T_BF16] = {k_bf16, 2}, [T_F32] = {k_f32, 4}, [T_F64] = {k_f64, 8},
    [T_I8] = {k_i8, 1}, [T_U8] = {k_u8, 1}, [T_I16] = {k_i16, 2}, [T_I32] = {k_i32, 4},
    [T_I64] = {k_i64, 8},
};

static int check_kernel(int code, int op) {
    if (code < T_F16 || code > T_I64) {
        PyErr_Format(PyExc_TypeError, "shm native reduce: no reduction on dtype code %d", code);
        return -1;
    }
    if (op < R_SUM || op > R_MAX || (op == R_AVG && code >= T_I8)) {
        PyErr_Format(PyExc_ValueError, "shm native reduce: op code %d on dtype code %d",
                     op, code);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------- futex */
static void futex_wait(au32 *addr, uint32_t expected, double seconds) {
#ifdef __linux__
    struct timespec ts;
    if (seconds < 0) seconds = 0;
    ts.tv_sec = (time_t)seconds;
    ts.tv_nsec = (long)((seconds - (double)ts.tv_sec) * 1e9);
    syscall(SYS_futex, (void *)addr, FUTEX_WAIT, expected, &ts, NULL, 0);
#else
    struct timespec ts = {0, 50000};
    (void)addr; (void)expected; (void)seconds;
    nanosleep(&ts, NULL);
#endif
}

static void futex_wake_all(au32 *addr) {
#ifdef __linux__
    syscall(SYS_futex, (void *)addr, FUTEX_WAKE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

/* ------------------------------------------------------------------------- Group */
typedef struct {
    PyObject_HEAD
    Py_buffer map;          /* the segment's mapping: held, so it cannot be unmapped */
    char *ctrl, *data;
    Py_ssize_t chunk;
    int rank, size, use_futex;
    uint32_t counter;       /* every ring of this rank: one sequence (no ABA) */
    double spin_s, yield_s, slice_s;
    /* Point to point, bound once by bind_p2p (byte offsets into the mapping, per peer):
     * the rings this rank writes and reads, and their head and tail words. */
    Py_ssize_t ring_bytes;
    Py_ssize_t *p2p;        /* 6 x size: out ring, in ring, out head, out tail, in head, in tail */
    uint32_t magic;
    /* The last phase this rank entered (shm's Python `_phase` reads and writes it while
     * the group is on the core), and the one-phase reduce's limit (bytes). */
    unsigned long long phase;
    Py_ssize_t small_limit;
} Group;

static inline au64 *word(Group *g, int r, int w) {
    return (au64 *)(g->ctrl + (Py_ssize_t)r * CTRL_STRIDE + 8 * w);
}
static inline au32 *bell(Group *g, int r) {
    return (au32 *)(g->ctrl + (Py_ssize_t)r * CTRL_STRIDE + BELL_BYTE);
}
static inline char *slot(Group *g, int bank, int r) {
    return g->data + ((Py_ssize_t)bank * g->size + r) * g->chunk;
}

static int Group_init(Group *g, PyObject *args, PyObject *kw) {
    PyObject *mm;
    Py_ssize_t ctrl_off, data_off, chunk;
    int rank, size, use_futex;
    double spin_s, yield_s, slice_s;
    static char *names[] = {"mapping", "ctrl_off", "data_off", "chunk", "rank", "size",
                            "spin_s", "yield_s", "slice_s", "futex", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Onnniidddp", names, &mm, &ctrl_off,
                                     &data_off, &chunk, &rank, &size, &spin_s, &yield_s,
                                     &slice_s, &use_futex))
        return -1;
    if (size < 1 || rank < 0 || rank >= size || chunk <= 0) {
        PyErr_SetString(PyExc_ValueError, "shm native Group: bad rank, size or chunk");
        return -1;
    }
    if (g->map.obj != NULL) PyBuffer_Release(&g->map);
    if (PyObject_GetBuffer(mm, &g->map, PyBUF_WRITABLE) < 0) return -1;
    if (data_off + 2 * (Py_ssize_t)size * chunk > g->map.len ||
        ctrl_off + (Py_ssize_t)size * CTRL_STRIDE > g->map.len) {
        PyBuffer_Release(&g->map);
        PyErr_SetString(PyExc_ValueError, "shm native Group: layout beyond the mapping");
        return -1;
    }
    g->ctrl = (char *)g->map.buf + ctrl_off;
    g->data = (char *)g->map.buf + data_off;
    g->chunk = chunk;
    g->rank = rank;
    g->size = size;
    g->spin_s = spin_s;
    g->yield_s = yield_s;
    g->slice_s = slice_s;
    g->use_futex = use_futex;
    return 0;
}

static void Group_dealloc(Group *g) {
    if (g->map.obj != NULL) PyBuffer_Release(&g->map);
    PyMem_Free(g->p2p);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

/* Ring `ranks` (a bitmask is not enough past 64 ranks: a list of ranks, or -1 for all
 * peers): new doorbell value, a full fence (the doorbell stores before the sleeper
 * loads: the sleeper stores its count, then the kernel loads the doorbell), wake. */
static void ring_ranks(Group *g, const int *ranks, int k) {
    g->counter = (g->counter + 1) & 0xFFFFFu;
    uint32_t value = ((uint32_t)(g->rank & 0xFFF) << 20) | g->counter;
    for (int i = 0; i < k; i++) atomic_store_explicit(bell(g, ranks[i]), value,
                                                      memory_order_release);
    if (!g->use_futex) return;
    atomic_thread_fence(memory_order_seq_cst);
    for (int i = 0; i < k; i++)
        if (atomic_load_explicit(word(g, ranks[i], W_SLEEPERS), memory_order_relaxed))
            futex_wake_all(bell(g, ranks[i]));
}

static void ring_peers(Group *g) {
    int stack[64], *peers = stack, k = 0;
    if (g->size > 64 && !(peers = PyMem_RawMalloc(sizeof(int) * (size_t)g->size))) return;
    for (int r = 0; r < g->size; r++)
        if (r != g->rank) peers[k++] = r;
    ring_ranks(g, peers, k);
    if (peers != stack) PyMem_RawFree(peers);
}

/* Sleep on this rank's doorbell while it holds `expected` (GIL released by caller). */
static void doze(Group *g, uint32_t expected, double seconds) {
    if (!g->use_futex) {
        struct timespec ts = {0, (long)(seconds < 1e-3 ? seconds * 1e9 : 1e6)};
        nanosleep(&ts, NULL);
        return;
    }
    au64 *sleepers = word(g, g->rank, W_SLEEPERS);
    atomic_fetch_add_explicit(sleepers, 1, memory_order_seq_cst);
    futex_wait(bell(g, g->rank), expected, seconds);
    atomic_fetch_sub_explicit(sleepers, 1, memory_order_seq_cst);
}

/* One step of every wait of this file at time t (GIL released by the caller): spin until
 * spin_end, then sched_yield until yield_end, then sleep on the doorbell (still holding
 * `expected`, read before the waiter's last check) in slices, at most until end. */
static void backoff(Group *g, double t, double spin_end, double yield_end, double end,
                    uint32_t expected) {
    if (t < spin_end) {
        for (int i = 0; i < 16; i++) cpu_relax();
    } else if (t < yield_end) {
        sched_yield();
    } else {
        double left = end - t;
        doze(g, expected, left < g->slice_s ? left : g->slice_s);
    }
}

static int all_arrived(Group *g, uint64_t q) {
    for (int r = 0; r < g->size; r++)
        if (atomic_load_explicit(word(g, r, W_ARRIVED), memory_order_acquire) < q) return 0;
    return 1;
}

/* A rank still missing from phase q that failed or closed: Python names it. */
static int missing_peer_down(Group *g, uint64_t q) {
    for (int r = 0; r < g->size; r++) {
        if (atomic_load_explicit(word(g, r, W_ARRIVED), memory_order_acquire) >= q) continue;
        uint64_t s = atomic_load_explicit(word(g, r, W_STATE), memory_order_acquire);
        if (s == STATE_FAILED || s == STATE_CLOSED) return 1;
    }
    return 0;
}

/* Wait (GIL released) until every rank arrived at q, at most `budget` seconds: spin,
 * then sched_yield, then the futex in slices. DONE, BUDGET or PEER. */
static int wait_phase(Group *g, uint64_t q, double budget) {
    if (all_arrived(g, q)) return DONE;
    int status = BUDGET;
    Py_BEGIN_ALLOW_THREADS
    double start = now_s(), spin_end = start + g->spin_s;
    double yield_end = spin_end + g->yield_s, end = start + budget;
    for (;;) {
        uint32_t expected = atomic_load_explicit(bell(g, g->rank), memory_order_acquire);
        if (all_arrived(g, q)) { status = DONE; break; }
        double t = now_s();
        if (t >= spin_end && missing_peer_down(g, q)) { status = PEER; break; }
        if (t >= end) break;
        backoff(g, t, spin_end, yield_end, end, expected);
    }
    Py_END_ALLOW_THREADS
    return status;
}

static int fingerprints_match(Group *g, uint64_t q, uint64_t fp0, uint64_t fp1) {
    int w = W_FP + 2 * (int)(q & 1);
    for (int r = 0; r < g->size; r++)
        if (atomic_load_explicit(word(g, r, w), memory_order_relaxed) != fp0 ||
            atomic_load_explicit(word(g, r, w + 1), memory_order_relaxed) != fp1)
            return 0;
    return 1;
}

/* Publish phase q (every store before it is visible first) and ring the others if
 * this rank is the last to arrive. Two ranks arriving at once both store, fence, load
 * (Dekker): at least one of them sees everybody and rings. */
static void arrive(Group *g, uint64_t q) {
    atomic_store_explicit(word(g, g->rank, W_ARRIVED), q, memory_order_release);
    atomic_thread_fence(memory_order_seq_cst);
    if (all_arrived(g, q)) ring_peers(g);
}

static void store_fp(Group *g, uint64_t q, uint64_t fp0, uint64_t fp1) {
    int w = W_FP + 2 * (int)(q & 1);
    atomic_store_explicit(word(g, g->rank, w), fp0, memory_order_relaxed);
    atomic_store_explicit(word(g, g->rank, w + 1), fp1, memory_order_relaxed);
}

/* Store this rank's fingerprints for phase q and publish it. */
static void publish(Group *g, uint64_t q, uint64_t fp0, uint64_t fp1) {
    store_fp(g, q, fp0, fp1);
    arrive(g, q);
}

/* wait_phase, then compare every rank's fingerprints with (fp0, fp1): DONE, MISMATCH,
 * BUDGET or PEER. */
static int wait_checked(Group *g, uint64_t q, uint64_t fp0, uint64_t fp1, double budget) {
    int status = wait_phase(g, q, budget);
    return status == DONE && !fingerprints_match(g, q, fp0, fp1) ? MISMATCH : status;
}

/* Word 0 of a phase's fingerprint: codes.py's fingerprint(), computed alike. */
static uint64_t fingerprint0(int opcode, int op, int code, int root, uint64_t seq) {
    return (uint64_t)(opcode & 0xF) | ((uint64_t)(op & 0xF) << 4)
           | ((uint64_t)(code & 0xFF) << 8) | ((uint64_t)((root + 1) & 0xFFFF) << 16)
           | ((seq & 0xFFFFFFFFu) << 32);
}

/* ------------------------------------------------------------------- arguments */
static int arg_u64(PyObject *o, uint64_t *v) {
    *v = (uint64_t)PyLong_AsUnsignedLongLongMask(o);
    return (*v == (uint64_t)-1 && PyErr_Occurred()) ? -1 : 0;
}
static int arg_int(PyObject *o, int *v) {
    long x = PyLong_AsLong(o);
    if (x == -1 && PyErr_Occurred()) return -1;
    *v = (int)x;
    return 0;
}
static int arg_double(PyObject *o, double *v) {
    *v = PyFloat_AsDouble(o);
    return (*v == -1.0 && PyErr_Occurred()) ? -1 : 0;
}
#define NARGS(name, want)                                                          \
    if (nargs != (want)) {                                                         \
        PyErr_Format(PyExc_TypeError, "shm native " name ": %d arguments expected", \
                     (int)(want));                                                 \
        return NULL;                                                               \
    }

/* ---------------------------------------------------------------------- methods */
static PyObject *G_bell(Group *g, PyObject *unused) {
    return PyLong_FromUnsignedLong(atomic_load_explicit(bell(g, g->rank),
                                                        memory_order_acquire));
}

static PyObject *G_sleepers(Group *g, PyObject *unused) {
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(word(g, g->rank, W_SLEEPERS),
                                                            memory_order_relaxed));
}

static PyObject *G_fence(Group *g, PyObject *unused) {
    atomic_thread_fence(memory_order_seq_cst);
    Py_RETURN_NONE;
}

/* ring(ranks): ranks an iterable of ints. */
static PyObject *G_ring(Group *g, PyObject *ranks) {
    PyObject *seq = PySequence_Fast(ranks, "shm native ring: a sequence of ranks");
    if (seq == NULL) return NULL;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    int stack[64], *rs = k <= 64 ? stack : PyMem_Malloc(sizeof(int) * (size_t)k);
    if (rs == NULL) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (Py_ssize_t i = 0; i < k; i++) {
        long r = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (r < 0 || r >= g->size) {
            if (!PyErr_Occurred())
                PyErr_Format(PyExc_ValueError, "shm native ring: rank %ld outside the group", r);
            if (rs != stack) PyMem_Free(rs);
            Py_DECREF(seq);
            return NULL;
        }
        rs[i] = (int)r;
    }
    ring_ranks(g, rs, (int)k);
    if (rs != stack) PyMem_Free(rs);
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

/* sleep(expected, seconds): until the doorbell changes, a wake, or the time is up. */
static PyObject *G_sleep(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t expected;
    double seconds;
    NARGS("sleep", 2);
    if (arg_u64(args[0], &expected) < 0 || arg_double(args[1], &seconds) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    doze(g, (uint32_t)expected, seconds);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* arrived(r) / state(r): acquire loads of rank r's words, for Python's peer checks. */
static PyObject *G_arrived(Group *g, PyObject *r) {
    int rank;
    if (arg_int(r, &rank) < 0) return NULL;
    if (rank < 0 || rank >= g->size) return PyErr_Format(PyExc_ValueError, "bad rank %d", rank);
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(word(g, rank, W_ARRIVED),
                                                            memory_order_acquire));
}

static PyObject *G_state(Group *g, PyObject *r) {
    int rank;
    if (arg_int(r, &rank) < 0) return NULL;
    if (rank < 0 || rank >= g->size) return PyErr_Format(PyExc_ValueError, "bad rank %d", rank);
    return PyLong_FromUnsignedLongLong(atomic_load_explicit(word(g, rank, W_STATE),
                                                            memory_order_acquire));
}

/* exchange(q, fp0, fp1, budget, published) -> status. Unless `published`, publish phase q
 * (the fingerprints for it are already stored); then wait at most `budget` seconds and
 * compare everybody's fingerprints with (fp0, fp1). */
static PyObject *G_exchange(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t q, fp0, fp1;
    double budget;
    int published;
    NARGS("exchange", 5);
    if (arg_u64(args[0], &q) < 0 || arg_u64(args[1], &fp0) < 0 || arg_u64(args[2], &fp1) < 0
        || arg_double(args[3], &budget) < 0 || (published = PyObject_IsTrue(args[4])) < 0)
        return NULL;
    if (!published) arrive(g, q);
    return PyLong_FromLong(wait_checked(g, q, fp0, fp1, budget));
}

static int get_array(PyObject *o, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(o, view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "shm native %s: a contiguous%s array expected", what,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

/* ---------------------------------------------------------------- reductions */
/* The arrays of one rank-order reduction: `out`, k sources (out may be one of them) and
 * c copies that receive the result too, piece by piece while it is in cache (the
 * symmetric all_reduce's owner pushes its reduced piece into every peer's buffer, the
 * pipelined one into its array and its slot). Held as buffers from reduction_get to
 * reduction_release; reduction_run needs no GIL. */
#define COPY_PIECE (16 << 10)
#define REDUCTION_STACK 16

typedef struct {
    Py_buffer out, stack_views[REDUCTION_STACK], *views;  /* k sources, then c copies */
    char *stack_ptrs[2 * REDUCTION_STACK], **ptrs;  /* k sources, k shifted, c copies */
    Py_ssize_t k, c, held;                          /* held: views acquired */
} Reduction;

static void reduction_release(Reduction *R) {
    for (Py_ssize_t i = 0; i < R->held; i++) PyBuffer_Release(&R->views[i]);
    PyBuffer_Release(&R->out);
    if (R->views != R->stack_views) PyMem_Free(R->views);
    if (R->ptrs != R->stack_ptrs) PyMem_Free(R->ptrs);
}

/* 0, or -1 with an exception set (and nothing held). `copies` may be None. */
static int reduction_get(Reduction *R, PyObject *out, PyObject *srcs, PyObject *copies,
                         const char *what) {
    PyObject *seq = NULL, *cseq = NULL;
    R->views = R->stack_views;
    R->ptrs = R->stack_ptrs;
    R->held = 0;
    if (!(seq = PySequence_Fast(srcs, "shm native reduction: a sequence of arrays")))
        return -1;
    if (copies != Py_None &&
        !(cseq = PySequence_Fast(copies, "shm native reduction: a sequence of copies"))) {
        Py_DECREF(seq);
        return -1;
    }
    R->k = PySequence_Fast_GET_SIZE(seq);
    R->c = cseq ? PySequence_Fast_GET_SIZE(cseq) : 0;
    if (R->k < 1) {
        PyErr_Format(PyExc_ValueError, "shm native %s: no sources", what);
        goto fail_seq;
    }
    if (R->k + R->c > REDUCTION_STACK) {
        R->views = PyMem_Malloc(sizeof(Py_buffer) * (size_t)(R->k + R->c));
        R->ptrs = PyMem_Malloc(sizeof(char *) * (size_t)(2 * R->k + R->c));
        if (!R->views || !R->ptrs) { PyErr_NoMemory(); goto fail_alloc; }
    }
    if (get_array(out, &R->out, 1, what) < 0) goto fail_alloc;
    for (Py_ssize_t i = 0; i < R->k + R->c; i++) {
        int is_copy = i >= R->k;
        PyObject *o = is_copy ? PySequence_Fast_GET_ITEM(cseq, i - R->k)
                              : PySequence_Fast_GET_ITEM(seq, i);
        if (get_array(o, &R->views[i], is_copy, what) < 0) goto fail_views;
        R->held++;
        if (R->views[i].len != R->out.len) {
            PyErr_Format(PyExc_ValueError, "shm native %s: %s %zd has %zd bytes, out %zd",
                         what, is_copy ? "copy" : "source", is_copy ? i - R->k : i,
                         R->views[i].len, R->out.len);
            goto fail_views;
        }
        R->ptrs[is_copy ? R->k + i : i] = R->views[i].buf;   /* (copies after the shifted) */
    }
    Py_DECREF(seq);
    Py_XDECREF(cseq);
    return 0;
fail_views:
    reduction_release(R);
    goto fail_seq;
fail_alloc:
    if (R->views != R->stack_views) PyMem_Free(R->views);
    if (R->ptrs != R->stack_ptrs) PyMem_Free(R->ptrs);
fail_seq:
    Py_DECREF(seq);
    Py_XDECREF(cseq);
    return -1;
}

/* Before writing into rank r's memory (its array, its symmetric buffer), which r may
 * hand back to its caller as it leaves a call with an error: store "writing into r" in
 * this rank's W_PUSHING word, then load r's state; 0 where r has failed or closed (write
 * nothing), 1 where the write may go ahead (then call push_end after it). A rank that
 * leaves with an error stores its failed state, then loads every peer's W_PUSHING and
 * waits while one names it (phases.py's Phases.await_pushers): one of the two sees the other. */
static int push_begin(Group *g, int r) {
    atomic_store_explicit(word(g, g->rank, W_PUSHING), (uint64_t)r + 1, memory_order_seq_cst);
    uint64_t state = atomic_load_explicit(word(g, r, W_STATE), memory_order_seq_cst);
    if (state == STATE_FAILED || state == STATE_CLOSED) {
        atomic_store_explicit(word(g, g->rank, W_PUSHING), 0, memory_order_release);
        return 0;
    }
    return 1;
}

static void push_end(Group *g) {
    atomic_store_explicit(word(g, g->rank, W_PUSHING), 0, memory_order_release);
}

/* out = srcs[0..k) in rank order (op), and the same `count` elements into each of
 * copies[0..c), COPY_PIECE bytes at a time; `shifted` has room for k pointers. With
 * `peers` (not NULL) the copies are the memory of that group's other ranks, in rank
 * order (copy i is rank i + (i >= rank)), and each piece's copy is fenced by
 * push_begin/push_end. 0, or -1 where a peer had failed or closed (nothing more is
 * written then). */
static int reduce_pieces(int code, int op, int n, char *out, char **srcs, int k,
                         char **shifted, char **copies, Py_ssize_t c, Py_ssize_t count,
                         Group *peers) {
    int itemsize = KERNELS[code].itemsize;
    if (c == 0) {
        KERNELS[code].fn(out, srcs, k, count, op, n);
        return 0;
    }
    Py_ssize_t piece = COPY_PIECE / itemsize;
    for (Py_ssize_t lo = 0; lo < count; lo += piece) {
        Py_ssize_t m = count - lo < piece ? count - lo : piece, off = lo * itemsize;
        for (int i = 0; i < k; i++) shifted[i] = srcs[i] + off;
        KERNELS[code].fn(out + off, shifted, k, m, op, n);
        for (Py_ssize_t i = 0; i < c; i++) {
            if (peers && !push_begin(peers, (int)i + (i >= peers->rank))) return -1;
            memcpy(copies[i] + off, out + off, (size_t)(m * itemsize));
            if (peers) push_end(peers);
        }
    }
    return 0;
}

/* reduce_pieces over R's arrays (peers: as there). */
static int reduction_run(Reduction *R, int code, int op, int n, Group *peers) {
    return reduce_pieces(code, op, n, R->out.buf, R->ptrs, (int)R->k, R->ptrs + R->k,
                         R->ptrs + 2 * R->k, R->c, R->out.len / KERNELS[code].itemsize,
                         peers);
}

/* dst = the n slots of `bank`, each from byte `off` on, reduced in rank order (op):
 * `count` elements. -1 where out of memory (more than 64 ranks). No GIL needed. */
static int reduce_slots(Group *g, int bank, Py_ssize_t off, char *dst, Py_ssize_t count,
                        int code, int op) {
    char *stack[64], **srcs = stack;
    if (g->size > 64 && !(srcs = PyMem_RawMalloc(sizeof(char *) * (size_t)g->size)))
        return -1;
    for (int r = 0; r < g->size; r++) srcs[r] = slot(g, bank, r) + off;
    KERNELS[code].fn(dst, srcs, g->size, count, op, g->size);
    if (srcs != stack) PyMem_RawFree(srcs);
    return 0;
}

/* The one-phase all_reduce/reduce of `len` bytes at `a`: unless `published`, copy them
 * into this rank's slot of bank q % 2, store the fingerprints and publish q; wait at most
 * `budget` seconds; once every rank arrived with the same fingerprint, and if `result`,
 * reduce the n slots in rank order into `a`. The status, as exchange's. */
static int small_phase(Group *g, char *a, Py_ssize_t len, uint64_t q, uint64_t fp0,
                       uint64_t fp1, int code, int op, int result, double budget,
                       int published) {
    int bank = (int)(q & 1);
    if (!published) {
        memcpy(slot(g, bank, g->rank), a, (size_t)len);
        publish(g, q, fp0, fp1);
    }
    int status = wait_checked(g, q, fp0, fp1, budget);
    if (status == DONE && result && len) {
        Py_ssize_t count = len / KERNELS[code].itemsize;
        int rc;
        if (len > 16384) {
            Py_BEGIN_ALLOW_THREADS
            rc = reduce_slots(g, bank, 0, a, count, code, op);
            Py_END_ALLOW_THREADS
        } else {
            rc = reduce_slots(g, bank, 0, a, count, code, op);
        }
        if (rc < 0) return -1;
    }
    return status;
}

/* small_reduce(a, q, fp0, fp1, dtype, op, result, budget, published) -> status: the
 * one-phase path (small_phase) for Python's own calls (reduce, persistent rounds, and
 * waits resumed after small_all_reduce). */
static PyObject *G_small_reduce(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t q, fp0, fp1;
    int code, op, result, published;
    double budget;
    Py_buffer a;
    NARGS("small_reduce", 9);
    if (arg_u64(args[1], &q) < 0 || arg_u64(args[2], &fp0) < 0 || arg_u64(args[3], &fp1) < 0
        || arg_int(args[4], &code) < 0 || arg_int(args[5], &op) < 0
        || (result = PyObject_IsTrue(args[6])) < 0 || arg_double(args[7], &budget) < 0
        || (published = PyObject_IsTrue(args[8])) < 0)
        return NULL;
    if (check_kernel(code, op) < 0) return NULL;
    /* (a rank that wants no result only reads its input: it may be read-only) */
    if (get_array(args[0], &a, result, "small_reduce") < 0) return NULL;
    if (a.len > g->chunk || a.len % KERNELS[code].itemsize) {
        PyBuffer_Release(&a);
        return PyErr_Format(PyExc_ValueError, "shm native small_reduce: %zd bytes do not "
                            "fit a slot of %zd", a.len, g->chunk);
    }
    int status = small_phase(g, a.buf, a.len, q, fp0, fp1, code, op, result, budget,
                             published);
    PyBuffer_Release(&a);
    return status < 0 ? PyErr_NoMemory() : PyLong_FromLong(status);
}

/* The one-phase moves of the gather and scatter families, each a whole collective whose
 * message fits a slot (core.py's PythonCore path, in one call). `m` bytes are one rank's part.
 *   M_GATHER:  every rank publishes `inp` (m bytes); a rank given `out` (n x m) copies
 *              slot r into part r (all_gather everywhere, gather at the root).
 *   M_BROADCAST: the root publishes `inp`; every other rank copies its slot into `out`.
 *   M_SCATTER: the root publishes `inp` (n x m); rank k copies part k of its slot.
 *   M_REDUCE_SCATTER: every rank publishes `inp` (n x m); rank k reduces part k of every
 *              slot in rank order into `out` (m bytes), as reduce_scatter's Python path.
 * The slots are laid out as in the Python path, so a wait resumed there (published) and
 * any error read the same words. */
enum { M_GATHER = 0, M_BROADCAST = 1, M_SCATTER = 2, M_REDUCE_SCATTER = 3 };

static int move_phase(Group *g, int kind, const Py_buffer *inp, const Py_buffer *out,
                      Py_ssize_t m, int root, int code, int op, uint64_t q, uint64_t fp0,
                      uint64_t fp1, double budget, int published) {
    int bank = (int)(q & 1), n = g->size, me = g->rank;
    if (!published) {
        if (inp) memcpy(slot(g, bank, me), inp->buf, (size_t)inp->len);
        publish(g, q, fp0, fp1);
    }
    int status = wait_checked(g, q, fp0, fp1, budget);
    if (status != DONE || out == NULL || m == 0) return status;
    char *dst = out->buf;
    int release = out->len > 16384;
    PyThreadState *ts = release ? PyEval_SaveThread() : NULL;
    if (kind == M_GATHER) {
        for (int r = 0; r < n; r++) memcpy(dst + r * m, slot(g, bank, r), (size_t)m);
    } else if (kind == M_BROADCAST) {
        memcpy(dst, slot(g, bank, root), (size_t)m);
    } else if (kind == M_SCATTER) {
        memcpy(dst, slot(g, bank, root) + (Py_ssize_t)me * m, (size_t)m);
    } else if (reduce_slots(g, bank, (Py_ssize_t)me * m, dst, m / KERNELS[code].itemsize,
                            code, op) < 0) {
        status = -1;
    }
    if (ts) PyEval_RestoreThread(ts);
    return status;
}

/* The buffers of one move and one rank's part `m`, checked against each other and the
 * slot (move_get) and held until move_release. */
typedef struct {
    Py_buffer in_view, out_view, *inp, *out;
    Py_ssize_t m;
} Move;

static void move_release(Move *mv) {
    if (mv->inp) PyBuffer_Release(mv->inp);
    if (mv->out) PyBuffer_Release(mv->out);
    mv->inp = mv->out = NULL;
}

/* `in_obj` (None where this rank publishes nothing: broadcast and scatter off the root)
 * and `out_obj` (None where it receives nothing: gather off the root, broadcast at the
 * root) of a move of `kind`, checked: every size the kind implies (a wrong one would
 * read or write past a slot or an array), the root, and for M_REDUCE_SCATTER the
 * kernel. -1 with an exception. */
static int move_get(Group *g, Move *mv, int kind, int root, int code, int op,
                    PyObject *in_obj, PyObject *out_obj) {
    mv->inp = mv->out = NULL;
    mv->m = -1;
    if (kind < M_GATHER || kind > M_REDUCE_SCATTER || root < -1 || root >= g->size
        || ((kind == M_BROADCAST || kind == M_SCATTER) && root < 0)) {
        PyErr_Format(PyExc_ValueError, "shm native small_move: kind %d, root %d", kind, root);
        return -1;
    }
    if (kind == M_REDUCE_SCATTER && check_kernel(code, op) < 0) return -1;
    if (in_obj != Py_None) {
        if (get_array(in_obj, &mv->in_view, 0, "small_move") < 0) return -1;
        mv->inp = &mv->in_view;
    }
    if (out_obj != Py_None) {
        if (get_array(out_obj, &mv->out_view, 1, "small_move") < 0) {
            move_release(mv);
            return -1;
        }
        mv->out = &mv->out_view;
    }
    Py_buffer *inp = mv->inp, *out = mv->out;
    Py_ssize_t n = g->size, m = -1;
    int ok = 1;
    if (kind == M_GATHER) {
        m = inp ? inp->len : -1;
        ok = inp && (!out || out->len == n * m);
    } else if (kind == M_BROADCAST) {
        m = inp ? inp->len : (out ? out->len : -1);
        ok = (inp != NULL) != (out != NULL);
    } else {
        m = out ? out->len : -1;
        ok = out && (!inp || inp->len == n * m);
        if (kind == M_REDUCE_SCATTER)
            ok = ok && inp && m % KERNELS[code].itemsize == 0;
    }
    /* every byte read from or written to a slot lies in it: a rank's part (m), or n of
     * them where a slot holds the whole input (scatter, reduce_scatter) */
    Py_ssize_t in_slot = (kind == M_SCATTER || kind == M_REDUCE_SCATTER) ? n * m : m;
    if (!ok || m < 0 || in_slot > g->chunk || (inp && inp->len > g->chunk)) {
        PyErr_Format(PyExc_ValueError, "shm native small_move: kind %d with %zd input and "
                     "%zd output bytes (a slot holds %zd)", kind,
                     inp ? inp->len : (Py_ssize_t)-1, out ? out->len : (Py_ssize_t)-1,
                     g->chunk);
        move_release(mv);
        return -1;
    }
    mv->m = m;
    return 0;
}

/* small_move(kind, inp, out, q, fp0, fp1, root, dtype, op, budget, published) -> status
 * as exchange: move_phase for Python's own calls (a wait resumed after move, and any
 * call move did not take); `dtype` and `op` are codes, read for M_REDUCE_SCATTER. */
static PyObject *G_small_move(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t q, fp0, fp1;
    int kind, root, code, op, published;
    double budget;
    Move mv;
    NARGS("small_move", 11);
    if (arg_int(args[0], &kind) < 0 || arg_u64(args[3], &q) < 0
        || arg_u64(args[4], &fp0) < 0 || arg_u64(args[5], &fp1) < 0
        || arg_int(args[6], &root) < 0 || arg_int(args[7], &code) < 0
        || arg_int(args[8], &op) < 0 || arg_double(args[9], &budget) < 0
        || (published = PyObject_IsTrue(args[10])) < 0)
        return NULL;
    if (move_get(g, &mv, kind, root, code, op, args[1], args[2]) < 0) return NULL;
    int status = move_phase(g, kind, mv.inp, mv.out, mv.m, root, code, op, q, fp0, fp1,
                            budget, published);
    move_release(&mv);
    return status < 0 ? PyErr_NoMemory() : PyLong_FromLong(status);
}

/* The all_to_all's first phase (moves.py's all_to_all, word for word): each rank's
 * slot holds its 2n counts (int64: what it sends to each rank, then what it expects from
 * each) and, from byte `head` on, its whole input where it fits the rest of the slot.
 * a2a_take, once the phase is done: DONE with this rank's parts copied into `out`;
 * DECLINED (nothing copied) where the counts disagree or some rank's input did not fit,
 * and Python goes on from the counts (it raises, or runs further phases); -1 where `out`
 * does not hold what this rank expects (a bug of the caller's). */
static int a2a_take(Group *g, uint64_t q, char *out, Py_ssize_t out_len, Py_ssize_t head,
                    int itemsize) {
    int bank = (int)(q & 1), n = g->size, me = g->rank;
    Py_ssize_t room = (g->chunk - head) / itemsize, total = 0;
    for (int j = 0; j < n; j++) {
        const int64_t *row = (const int64_t *)slot(g, bank, j);
        int64_t sent = 0;
        for (int k = 0; k < n; k++) {
            /* (compared with what is left of the room, not summed first: counts near
             * 2^63 that a corrupt peer published must not wrap the sum) */
            if (row[k] < 0 || row[k] > room - sent
                || row[k] != ((const int64_t *)slot(g, bank, k))[n + j])
                return DECLINED;
            sent += row[k];
        }
    }
    const int64_t *mine = (const int64_t *)slot(g, bank, me);
    for (int r = 0; r < n; r++) total += mine[n + r];
    if (total * itemsize != out_len) return -1;
    Py_ssize_t at_out = 0;
    PyThreadState *ts = out_len > 16384 ? PyEval_SaveThread() : NULL;
    for (int r = 0; r < n; r++) {
        const int64_t *row = (const int64_t *)slot(g, bank, r);
        Py_ssize_t at = 0, c = mine[n + r];
        for (int k = 0; k < me; k++) at += row[k];
        memcpy(out + at_out * itemsize, slot(g, bank, r) + head + at * itemsize,
               (size_t)(c * itemsize));
        at_out += c;
    }
    if (ts) PyEval_RestoreThread(ts);
    return DONE;
}

static int a2a_args(Group *g, Py_ssize_t head, int itemsize) {
    if (itemsize < 1 || itemsize > 16 || head < 16 * (Py_ssize_t)g->size || head % 64
        || head > g->chunk) {
        PyErr_Format(PyExc_ValueError, "shm native all_to_all: head %zd, itemsize %d",
                     head, itemsize);
        return -1;
    }
    return 0;
}

/* all_to_all(inp, out, counts, q, fp0, fp1, head, itemsize, budget) -> status: publish
 * phase q (the 2n `counts`, then `inp` at `head` if it fits), wait at most `budget`
 * seconds, check the fingerprints and a2a_take. BUDGET or PEER: Python waits the phase
 * out (exchange, published) and calls all_to_all_take. */
static PyObject *G_all_to_all(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t q, fp0, fp1;
    Py_ssize_t head;
    int itemsize;
    double budget;
    Py_buffer inp, out;
    NARGS("all_to_all", 9);
    if (arg_u64(args[3], &q) < 0 || arg_u64(args[4], &fp0) < 0 || arg_u64(args[5], &fp1) < 0
        || (head = PyLong_AsSsize_t(args[6])) == -1 || arg_int(args[7], &itemsize) < 0
        || arg_double(args[8], &budget) < 0)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "all_to_all: head");
    if (a2a_args(g, head, itemsize) < 0) return NULL;
    if (!PyList_Check(args[2]) || PyList_GET_SIZE(args[2]) != 2 * (Py_ssize_t)g->size)
        return PyErr_Format(PyExc_TypeError, "shm native all_to_all: a list of %d counts "
                            "expected", 2 * g->size);
    if (get_array(args[0], &inp, 0, "all_to_all") < 0) return NULL;
    if (get_array(args[1], &out, 1, "all_to_all") < 0) {
        PyBuffer_Release(&inp);
        return NULL;
    }
    int bank = (int)(q & 1);
    int64_t *hdr = (int64_t *)slot(g, bank, g->rank);
    for (Py_ssize_t i = 0; i < 2 * (Py_ssize_t)g->size; i++) {
        PyObject *item = PyList_GET_ITEM(args[2], i);
        long long c = PyLong_CheckExact(item) ? PyLong_AsLongLong(item) : -1;
        if (c < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "shm native all_to_all: counts must be "
                                "non-negative ints");
            PyBuffer_Release(&inp);
            PyBuffer_Release(&out);
            return NULL;
        }
        hdr[i] = (int64_t)c;
    }
    if (inp.len <= g->chunk - head) memcpy(slot(g, bank, g->rank) + head, inp.buf, (size_t)inp.len);
    publish(g, q, fp0, fp1);
    int status = wait_checked(g, q, fp0, fp1, budget);
    if (status == DONE) status = a2a_take(g, q, out.buf, out.len, head, itemsize);
    PyBuffer_Release(&inp);
    PyBuffer_Release(&out);
    if (status < 0)
        return PyErr_Format(PyExc_ValueError, "shm native all_to_all: the output does not "
                            "hold what this rank expects");
    return PyLong_FromLong(status);
}

/* all_to_all_take(out, q, head, itemsize) -> DONE or DECLINED: a2a_take once phase q is
 * done (its fingerprints checked by exchange). */
static PyObject *G_all_to_all_take(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t q;
    Py_ssize_t head;
    int itemsize;
    Py_buffer out;
    NARGS("all_to_all_take", 4);
    if (arg_u64(args[1], &q) < 0 || (head = PyLong_AsSsize_t(args[2])) == -1
        || arg_int(args[3], &itemsize) < 0)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "all_to_all: head");
    if (a2a_args(g, head, itemsize) < 0) return NULL;
    if (get_array(args[0], &out, 1, "all_to_all_take") < 0) return NULL;
    int status = a2a_take(g, q, out.buf, out.len, head, itemsize);
    PyBuffer_Release(&out);
    if (status < 0)
        return PyErr_Format(PyExc_ValueError, "shm native all_to_all: the output does not "
                            "hold what this rank expects");
    return PyLong_FromLong(status);
}

/* The ReduceOp members by code (1..5) and numpy dtype -> code, set once by native.py
 * (bind_codes): small_all_reduce tells its arguments by them without Python. */
static PyObject *REDUCE_OPS[R_MAX + 1];
static PyObject *DTYPE_CODES_BY_DTYPE;
#define OP_ALL_REDUCE_CODE 3   /* codes.py's OP_ALL_REDUCE (native.py checks it) */

/* The code (1..R_MAX) of a ReduceOp member, by identity; 0 for anything else. */
static int redop_code(PyObject *o) {
    for (int r = 1; r <= R_MAX; r++)
        if (o == REDUCE_OPS[r]) return r;
    return 0;
}

/* The dtype code of `arr`'s dtype into *code: 1, or 0 where the table does not know it
 * (or is not bound yet), or -1 with an exception. */
static int dtype_code_of(PyObject *arr, int *code) {
    if (DTYPE_CODES_BY_DTYPE == NULL) return 0;
    PyObject *dtype = PyObject_GetAttrString(arr, "dtype");
    if (dtype == NULL) return -1;
    PyObject *found = PyDict_GetItemWithError(DTYPE_CODES_BY_DTYPE, dtype);
    Py_DECREF(dtype);
    if (found == NULL) return PyErr_Occurred() ? -1 : 0;
    return arg_int(found, code) < 0 ? -1 : 1;
}

/* small_all_reduce(a, op, seq, budget) -> status, or NOT_TAKEN: the whole all_reduce
 * of a one-phase message, called by the group's fast path (through one line of
 * Python: NativeCore.all_reduce). Finds the codes of `a`'s dtype and of `op`,
 * enters the next phase (the `phase` member), computes the fingerprint Python's
 * _small_reduce_native would, and runs small_phase. NOT_TAKEN (nothing done, the phase
 * unchanged) for an array past `small_limit` or a dtype or operator it does not know:
 * Python's path then runs. Any other status but DONE: Python waits the phase out. */
#define NOT_TAKEN 5

static PyObject *G_small_all_reduce(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    int op = 0, code;
    uint64_t seq;
    double budget;
    Py_buffer a;
    NARGS("small_all_reduce", 4);
    if (!(op = redop_code(args[1]))) return PyLong_FromLong(NOT_TAKEN);
    if (arg_u64(args[2], &seq) < 0 || arg_double(args[3], &budget) < 0) return NULL;
    int known = dtype_code_of(args[0], &code);
    if (known <= 0) return known < 0 ? NULL : PyLong_FromLong(NOT_TAKEN);
    if (code < T_F16 || code > T_I64 || (op == R_AVG && code >= T_I8))
        return PyLong_FromLong(NOT_TAKEN);
    if (PyObject_GetBuffer(args[0], &a, PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        return PyLong_FromLong(NOT_TAKEN);
    }
    if (a.len > g->small_limit || a.len > g->chunk || a.len % KERNELS[code].itemsize) {
        PyBuffer_Release(&a);
        return PyLong_FromLong(NOT_TAKEN);
    }
    uint64_t q = ++g->phase;
    uint64_t fp0 = fingerprint0(OP_ALL_REDUCE_CODE, op, code, -1, seq);
    int status = small_phase(g, a.buf, a.len, q, fp0, (uint64_t)a.len, code, op, 1, budget, 0);
    PyBuffer_Release(&a);
    return status < 0 ? PyErr_NoMemory() : PyLong_FromLong(status);
}

/* move(kind, opcode, inp, out, seq, root, op, budget) -> status as exchange, or
 * NOT_TAKEN: a whole one-phase move for moves.py's functions (NativeCore.move),
 * as small_all_reduce is the all_reduce's: finds the dtype code of the array given (inp,
 * else out) and the code of `op` (a ReduceOp member, or None), enters the next phase
 * (`phase`), computes the fingerprint Phases.start would (fp1: one rank's part) and
 * runs move_phase. NOT_TAKEN (nothing done, the phase unchanged) for a dtype or an
 * operator it does not know: Python computes them and calls small_move. Any other
 * status but DONE: Python waits the phase out. */
static PyObject *G_move(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    int kind, opcode, root, op = 0, code;
    uint64_t seq;
    double budget;
    Move mv;
    NARGS("move", 8);
    if (arg_int(args[0], &kind) < 0 || arg_int(args[1], &opcode) < 0
        || arg_u64(args[4], &seq) < 0 || arg_int(args[5], &root) < 0
        || arg_double(args[7], &budget) < 0)
        return NULL;
    if (args[6] != Py_None && !(op = redop_code(args[6]))) return PyLong_FromLong(NOT_TAKEN);
    int known = dtype_code_of(args[2] != Py_None ? args[2] : args[3], &code);
    if (known <= 0) return known < 0 ? NULL : PyLong_FromLong(NOT_TAKEN);
    if (move_get(g, &mv, kind, root, code, op, args[2], args[3]) < 0) return NULL;
    uint64_t q = ++g->phase;
    int status = move_phase(g, kind, mv.inp, mv.out, mv.m, root, code, op, q,
                            fingerprint0(opcode, op, code, root, seq), (uint64_t)mv.m,
                            budget, 0);
    move_release(&mv);
    return status < 0 ? PyErr_NoMemory() : PyLong_FromLong(status);
}

/* barrier(opcode, seq, budget) -> status as exchange: a whole barrier (one empty
 * phase) in one call, as small_all_reduce is the all_reduce's: enters the next phase
 * (`phase`), publishes the fingerprint Phases.start would give it (no dtype, no
 * root, 0 bytes), waits and compares. Any status but DONE: Python waits the phase out. */
static PyObject *G_barrier(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    int opcode;
    uint64_t seq;
    double budget;
    NARGS("barrier", 3);
    if (arg_int(args[0], &opcode) < 0 || arg_u64(args[1], &seq) < 0
        || arg_double(args[2], &budget) < 0)
        return NULL;
    uint64_t q = ++g->phase, fp0 = fingerprint0(opcode, 0, 0, -1, seq);
    publish(g, q, fp0, 0);
    return PyLong_FromLong(wait_checked(g, q, fp0, 0, budget));
}

/* bind_codes(ops, dtypes): the ReduceOp members in code order (a sequence of R_MAX) and
 * a dict numpy dtype -> dtype code, for small_all_reduce. */
static PyObject *m_bind_codes(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    NARGS("bind_codes", 2);
    PyObject *ops = PySequence_Fast(args[0], "shm native bind_codes: a sequence of ops");
    if (ops == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(ops) != R_MAX || !PyDict_Check(args[1])) {
        Py_DECREF(ops);
        return PyErr_Format(PyExc_ValueError, "shm native bind_codes: %d ops and a dict",
                            R_MAX);
    }
    for (int r = 1; r <= R_MAX; r++) {
        Py_XSETREF(REDUCE_OPS[r], Py_NewRef(PySequence_Fast_GET_ITEM(ops, r - 1)));
    }
    Py_DECREF(ops);
    Py_XSETREF(DTYPE_CODES_BY_DTYPE, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

/* sym_all_reduce(piece, sources, copies, q, vote_fp0, fp0, fp1, vote0, vote1, dtype, op,
 * budget, resume) -> (status, phase): symmetric.py's all_reduce in one call. Unless
 * `resume`: store the vote (vote0, vote1) in this rank's slot of bank q % 2 and the
 * fingerprints (vote_fp0, fp1), publish q and wait at most `budget` seconds (phase 0 of
 * the call: q). Once q is done: DECLINED unless every rank voted the same nonzero pair;
 * else piece = sources in rank order (op), pushed into every copy, then publish q + 1
 * with (fp0, fp1) and wait for it (phase 1). `piece` None: this rank owns nothing.
 * BUDGET or PEER say which phase is still awaited: Python waits it out (exchange with
 * `published`) and, for phase 0, calls again with `resume`; CANCELED: a peer had failed
 * before this rank's push into it. */
/* A peer had failed or closed before this rank's write into it (push_begin): nothing
 * was written there, this rank published nothing more, and Python names the peer. */
#define CANCELED 6

static PyObject *G_sym_all_reduce(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t q, vfp0, fp0, fp1, vote0, vote1;
    int code, op, resume;
    double budget;
    NARGS("sym_all_reduce", 13);
    if (arg_u64(args[3], &q) < 0 || arg_u64(args[4], &vfp0) < 0 || arg_u64(args[5], &fp0) < 0
        || arg_u64(args[6], &fp1) < 0 || arg_u64(args[7], &vote0) < 0
        || arg_u64(args[8], &vote1) < 0 || arg_int(args[9], &code) < 0
        || arg_int(args[10], &op) < 0 || arg_double(args[11], &budget) < 0
        || (resume = PyObject_IsTrue(args[12])) < 0)
        return NULL;
    if (check_kernel(code, op) < 0) return NULL;
    int bank = (int)(q & 1), status;
    if (!resume) {
        uint64_t *mine = (uint64_t *)slot(g, bank, g->rank);
        mine[0] = vote0;   /* published by arrive()'s release store */
        mine[1] = vote1;
        publish(g, q, vfp0, fp1);
        if ((status = wait_phase(g, q, budget)) != DONE) return Py_BuildValue("(ii)", status, 0);
    }
    if (!fingerprints_match(g, q, vfp0, fp1)) return Py_BuildValue("(ii)", MISMATCH, 0);
    for (int r = 0; r < g->size; r++) {
        const uint64_t *theirs = (const uint64_t *)slot(g, bank, r);
        if (vote0 == 0 || theirs[0] != vote0 || theirs[1] != vote1)
            return Py_BuildValue("(ii)", DECLINED, 0);
    }
    if (args[0] != Py_None) {
        Reduction R;
        int pushed;
        if (reduction_get(&R, args[0], args[1], args[2], "sym_all_reduce") < 0) return NULL;
        if (R.c != g->size - 1) {
            reduction_release(&R);
            return PyErr_Format(PyExc_ValueError, "shm native sym_all_reduce: %zd copies, "
                                "one per peer expected", R.c);
        }
        Py_BEGIN_ALLOW_THREADS
        pushed = reduction_run(&R, code, op, g->size, g);
        Py_END_ALLOW_THREADS
        reduction_release(&R);
        if (pushed < 0) return Py_BuildValue("(ii)", CANCELED, 1);   /* q + 1 not published */
    }
    publish(g, q + 1, fp0, fp1);
    return Py_BuildValue("(ii)", wait_checked(g, q + 1, fp0, fp1, budget), 1);
}

/* pipelined(a, q0, fp0, fp1, dtype, op, result, j, budget) -> (status, j): reduce.py's
 * pipelined all_reduce/reduce of `a` (flat, at least one chunk), its steps from j on,
 * over the same slots and in the same pieces as the Python path (so that a group may
 * mix ranks on either). Step j of K + 1 (phase q0 + j): copy into this rank's slot the
 * pieces of chunk j that others own; reduce this rank's piece of chunk j - 1 from the
 * previous bank's slots into the slot's output part (and into `a` where `result`);
 * where `result`, copy the others' reduced pieces of chunk j - 2 out into `a`; publish
 * q0 + j with (fp0, fp1) and wait at most `budget` s. After the last step, chunk K - 1
 * is copied out. Returns (DONE, K + 1) when all is done, else the status and the step
 * whose phase is still awaited: Python waits it out and calls again from the next. */
static void chunk_bounds(Py_ssize_t total, Py_ssize_t C, Py_ssize_t P, Py_ssize_t align,
                         int n, Py_ssize_t j, Py_ssize_t k, Py_ssize_t *lo, Py_ssize_t *k0,
                         Py_ssize_t *k1) {
    Py_ssize_t c = total - j * C < C ? total - j * C : C;
    Py_ssize_t part = ((c + n - 1) / n + align - 1) / align * align;
    if (part > P) part = P;
    *lo = j * C;
    *k0 = k * part < c ? k * part : c;
    *k1 = (k + 1) * part < c ? (k + 1) * part : c;
}

static void copy_out_chunk(Group *g, char *a, int bank, Py_ssize_t total, Py_ssize_t C,
                           Py_ssize_t P, Py_ssize_t align, Py_ssize_t j, int itemsize) {
    for (int r = 0; r < g->size; r++) {
        Py_ssize_t lo, k0, k1;
        if (r == g->rank) continue;
        chunk_bounds(total, C, P, align, g->size, j, r, &lo, &k0, &k1);
        if (k1 > k0)
            memcpy(a + (lo + k0) * itemsize, slot(g, bank, r) + C * itemsize,
                   (size_t)((k1 - k0) * itemsize));
    }
}

/* Bumped whenever a call of this module changes its arguments or meaning, so that
 * native.py refuses a stale build (LAYOUT) instead of failing inside a collective. 2:
 * Group.cma_reduce (writing the reduced piece into the peers, fenced by W_PUSHING)
 * replaces the module's, and cma_write. 3: sym_all_reduce's pushes fenced alike (its
 * CANCELED status). 4: move and small_move (the gather and scatter families' one-phase
 * moves) and all_to_all / all_to_all_take (its first phase). */
#define CORE_REVISION 5

/* The pipelined reduce's largest piece (reduce.py's PIECE_MAX_BYTES, checked at load):
 * a phase's copies and reduction then stay within a core's L2 (see reduce.py). */
#define PIECE_MAX_BYTES (64 * 1024)

static PyObject *G_pipelined(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t q0, fp0, fp1;
    int code, op, result, n = g->size, me = g->rank, status = DONE;
    Py_ssize_t j;
    double budget;
    Py_buffer view;
    NARGS("pipelined", 9);
    if (arg_u64(args[1], &q0) < 0 || arg_u64(args[2], &fp0) < 0 || arg_u64(args[3], &fp1) < 0
        || arg_int(args[4], &code) < 0 || arg_int(args[5], &op) < 0
        || (result = PyObject_IsTrue(args[6])) < 0 || (j = PyLong_AsSsize_t(args[7])) < 0
        || arg_double(args[8], &budget) < 0)
        return PyErr_Occurred() ? NULL : PyErr_Format(PyExc_ValueError, "pipelined: j < 0");
    if (check_kernel(code, op) < 0) return NULL;
    /* (a rank that wants no result only reads its input: it may be read-only) */
    if (get_array(args[0], &view, result, "pipelined") < 0) return NULL;
    int itemsize = KERNELS[code].itemsize;
    /* reduce.py's _piece_layout: pieces of P elements, chunks of n pieces */
    Py_ssize_t piece_bytes = g->chunk / (n + 1) / 64 * 64, align = 64 / itemsize;
    if (piece_bytes > PIECE_MAX_BYTES) piece_bytes = PIECE_MAX_BYTES;
    Py_ssize_t P = piece_bytes / itemsize > 0 ? piece_bytes / itemsize : 1, C = n * P;
    if (align < 1) align = 1;
    Py_ssize_t total = view.len / itemsize, K = (total + C - 1) / C;
    char *a = view.buf, *stack[48], **srcs = stack;   /* n sources, n shifted, 1 copy */
    if (view.len % itemsize || K < 1) {
        PyBuffer_Release(&view);
        return PyErr_Format(PyExc_ValueError, "shm native pipelined: %zd bytes of an "
                            "itemsize of %d", view.len, itemsize);
    }
    if (3 * n > 48 && !(srcs = PyMem_Malloc(sizeof(char *) * (size_t)(3 * n)))) {
        PyBuffer_Release(&view);
        return PyErr_NoMemory();
    }
    char **shifted = srcs + n, **copies = srcs + 2 * n;
    for (; j <= K; j++) {
        uint64_t q = q0 + (uint64_t)j;
        int bank = (int)(q & 1);
        char *slot_in = slot(g, bank, me);
        Py_ssize_t lo, k0, k1, c;
        Py_BEGIN_ALLOW_THREADS
        if (j < K) {                               /* 1. copy in others' pieces of chunk j */
            chunk_bounds(total, C, P, align, n, j, me, &lo, &k0, &k1);
            c = total - lo < C ? total - lo : C;
            if (k0 > 0) memcpy(slot_in, a + lo * itemsize, (size_t)(k0 * itemsize));
            if (k1 < c)
                memcpy(slot_in + k1 * itemsize, a + (lo + k1) * itemsize,
                       (size_t)((c - k1) * itemsize));
        }
        if (j >= 1) {                              /* 2. reduce my piece of chunk j - 1 */
            chunk_bounds(total, C, P, align, n, j - 1, me, &lo, &k0, &k1);
            if (k1 > k0) {
                char *mine = a + (lo + k0) * itemsize, *published = slot_in + C * itemsize;
                for (int r = 0; r < n; r++)
                    srcs[r] = r == me ? mine : slot(g, bank ^ 1, r) + k0 * itemsize;
                copies[0] = published;
                reduce_pieces(code, op, n, result ? mine : published, srcs, n, shifted,
                              copies, result ? 1 : 0, k1 - k0, NULL);
            }
        }
        if (j >= 2 && result)                      /* 3. copy out chunk j - 2 */
            copy_out_chunk(g, a, bank ^ 1, total, C, P, align, j - 2, itemsize);
        Py_END_ALLOW_THREADS
        publish(g, q, fp0, fp1);
        status = wait_checked(g, q, fp0, fp1, budget);
        if (status != DONE) break;
    }
    if (status == DONE && result) {               /* chunk K - 1, from the last bank */
        Py_BEGIN_ALLOW_THREADS
        copy_out_chunk(g, a, (int)((q0 + (uint64_t)K) & 1), total, C, P, align, K - 1,
                       itemsize);
        Py_END_ALLOW_THREADS
    }
    if (srcs != stack) PyMem_Free(srcs);
    PyBuffer_Release(&view);
    return Py_BuildValue("(in)", status, j);
}

/* --------------------------------------------------------------- point to point */
/* The ring src -> dst of channels.py: R bytes at `ring`, head (bytes ever written, by
 * the sender) and tail (bytes ever consumed, by the receiver) in their own words. A
 * message is a 32-byte header (tag u64, nbytes u64, dtype u32, magic u32, 8 pad) and
 * its payload. send and recv move one whole message when it fits (send) or when it is
 * complete and matches (recv), and otherwise leave everything to the Python engine. */
static inline au64 *at_u64(Group *g, Py_ssize_t off) {
    return (au64 *)((char *)g->map.buf + off);
}

static void ring_write(char *ring, Py_ssize_t R, uint64_t pos, const char *src, Py_ssize_t k) {
    Py_ssize_t at = (Py_ssize_t)(pos % (uint64_t)R), first = k < R - at ? k : R - at;
    memcpy(ring + at, src, (size_t)first);
    if (first < k) memcpy(ring, src + first, (size_t)(k - first));
}

static void ring_read(const char *ring, Py_ssize_t R, uint64_t pos, char *dst, Py_ssize_t k) {
    Py_ssize_t at = (Py_ssize_t)(pos % (uint64_t)R), first = k < R - at ? k : R - at;
    memcpy(dst, ring + at, (size_t)first);
    if (first < k) memcpy(dst + first, ring, (size_t)(k - first));
}

static int p2p_offsets(Group *g, Py_ssize_t ring_off, Py_ssize_t R, Py_ssize_t head_off,
                       Py_ssize_t tail_off) {
    if (ring_off < 0 || R < 64 || ring_off + R > g->map.len || head_off < 0 || tail_off < 0
        || head_off + 8 > g->map.len || tail_off + 8 > g->map.len) {
        PyErr_SetString(PyExc_ValueError, "shm native p2p: ring or counters beyond the mapping");
        return -1;
    }
    return 0;
}

/* bind_p2p(R, magic, offsets): offsets a sequence of 6 x size byte offsets, six per peer
 * (out ring, in ring, out head, out tail, in head, in tail; this rank's own entries are
 * ignored), checked against the mapping once, so that send and recv take a peer. */
static PyObject *G_bind_p2p(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t R;
    uint64_t magic;
    NARGS("bind_p2p", 3);
    if ((R = PyLong_AsSsize_t(args[0])) == -1 && PyErr_Occurred()) return NULL;
    if (arg_u64(args[1], &magic) < 0) return NULL;
    PyObject *seq = PySequence_Fast(args[2], "shm native bind_p2p: a sequence of offsets");
    if (seq == NULL) return NULL;
    if (PySequence_Fast_GET_SIZE(seq) != 6 * (Py_ssize_t)g->size) {
        Py_DECREF(seq);
        return PyErr_Format(PyExc_ValueError, "shm native bind_p2p: 6 x %d offsets expected",
                            g->size);
    }
    if (g->p2p != NULL) {   /* a concurrent send or recv may be using the table */
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "shm native bind_p2p: already bound");
        return NULL;
    }
    Py_ssize_t *table = PyMem_Malloc(sizeof(Py_ssize_t) * 6 * (size_t)g->size);
    if (table == NULL) { Py_DECREF(seq); return PyErr_NoMemory(); }
    for (int r = 0; r < g->size; r++) {
        Py_ssize_t *t = table + 6 * r;
        for (int i = 0; i < 6; i++) {
            t[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq, 6 * r + i));
            if (t[i] == -1 && PyErr_Occurred()) goto fail;
        }
        if (r != g->rank && (p2p_offsets(g, t[0], R, t[2], t[3]) < 0 ||
                             p2p_offsets(g, t[1], R, t[4], t[5]) < 0))
            goto fail;
    }
    Py_DECREF(seq);
    g->p2p = table;
    g->ring_bytes = R;
    g->magic = (uint32_t)magic;
    Py_RETURN_NONE;
fail:
    PyMem_Free(table);
    Py_DECREF(seq);
    return NULL;
}

static const Py_ssize_t *p2p_peer(Group *g, PyObject *o, int *peer) {
    if (arg_int(o, peer) < 0) return NULL;
    if (g->p2p == NULL || *peer < 0 || *peer >= g->size || *peer == g->rank) {
        PyErr_Format(PyExc_ValueError, "shm native p2p: no ring with rank %d", *peer);
        return NULL;
    }
    return g->p2p + 6 * *peer;
}

/* send(dst, head, tag, dtype, payload) -> the new head, or -1 where header and payload do
 * not fit the free space of the ring to dst now; rings dst's doorbell. One call from a
 * blocking send on a free ring to the bytes in it, over the offsets of bind_p2p. */
static PyObject *G_send(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    int dst;
    uint64_t head, tag, code;
    Py_buffer p;
    NARGS("send", 5);
    const Py_ssize_t *t = p2p_peer(g, args[0], &dst);
    if (t == NULL || arg_u64(args[1], &head) < 0 || arg_u64(args[2], &tag) < 0 ||
        arg_u64(args[3], &code) < 0)
        return NULL;
    if (get_array(args[4], &p, 0, "send") < 0) return NULL;
    Py_ssize_t R = g->ring_bytes;
    uint64_t tail = atomic_load_explicit(at_u64(g, t[3]), memory_order_acquire);
    Py_ssize_t need = 32 + p.len;
    /* (head - tail > R: a counter overwritten; never write past the ring) */
    if (head - tail > (uint64_t)R || (uint64_t)need > (uint64_t)R - (head - tail)) {
        PyBuffer_Release(&p);
        return PyLong_FromLong(-1);
    }
    char header[32] = {0};
    uint64_t nbytes = (uint64_t)p.len;
    uint32_t code32 = (uint32_t)code;
    memcpy(header, &tag, 8);
    memcpy(header + 8, &nbytes, 8);
    memcpy(header + 16, &code32, 4);
    memcpy(header + 20, &g->magic, 4);
    char *ring = (char *)g->map.buf + t[0];
    ring_write(ring, R, head, header, 32);
    if (p.len > 65536) {
        Py_BEGIN_ALLOW_THREADS
        ring_write(ring, R, head + 32, p.buf, p.len);
        Py_END_ALLOW_THREADS
    } else {
        ring_write(ring, R, head + 32, p.buf, p.len);
    }
    PyBuffer_Release(&p);
    head += (uint64_t)need;
    atomic_store_explicit(at_u64(g, t[2]), head, memory_order_release);
    ring_ranks(g, &dst, 1);
    return PyLong_FromUnsignedLongLong(head);
}

/* recv(src, tail, tag, out, budget) -> the new tail once the next message from src is
 * complete, has `tag` and len(out) bytes (copied into out; src's doorbell rung, as it
 * may wait for room); -1 if it is not all there within `budget` seconds (spin, yield,
 * then, for a budget past the wait policy's window, sleep on this rank's doorbell, the
 * GIL released); -2 at once if the next message is another one (tag, size or header) or
 * larger than the ring: the Python engine decides then. */
static PyObject *G_recv(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    int src;
    uint64_t tail, tag;
    double budget;
    Py_buffer out;
    NARGS("recv", 5);
    const Py_ssize_t *t = p2p_peer(g, args[0], &src);
    if (t == NULL || arg_u64(args[1], &tail) < 0 || arg_u64(args[2], &tag) < 0 ||
        arg_double(args[4], &budget) < 0)
        return NULL;
    if (get_array(args[3], &out, 1, "recv") < 0) return NULL;
    au64 *headw = at_u64(g, t[4]);
    const char *ring = (const char *)g->map.buf + t[1];
    Py_ssize_t R = g->ring_bytes;
    uint64_t need = 32 + (uint64_t)out.len, head;
    /* 0: not yet, 1: complete, -2: another message, or one that never fits the ring at
     * once (the engine streams it: waiting here would only stall the sender) */
    long status = need > (uint64_t)R ? -2 : 0;
    char header[32];
#define CHECK_RING()                                                                  \
    head = atomic_load_explicit(headw, memory_order_acquire);                         \
    if (head - tail >= 32) {                                                          \
        uint64_t mtag, nbytes;                                                        \
        uint32_t magic32;                                                             \
        ring_read(ring, R, tail, header, 32);                                         \
        memcpy(&mtag, header, 8);                                                     \
        memcpy(&nbytes, header + 8, 8);                                               \
        memcpy(&magic32, header + 20, 4);                                             \
        if (magic32 != g->magic || mtag != tag || nbytes != (uint64_t)out.len ||      \
            head - tail > (uint64_t)R)                                                \
            status = -2;                                                              \
        else if (head - tail >= need)                                                 \
            status = 1;                                                               \
    }
    if (status == 0) { CHECK_RING() }
    if (status == 0 && budget > 0) {
        Py_BEGIN_ALLOW_THREADS
        double start = now_s(), spin_end = start + g->spin_s;
        double yield_end = spin_end + g->yield_s, end = start + budget;
        for (;;) {
            uint32_t expected = atomic_load_explicit(bell(g, g->rank), memory_order_acquire);
            CHECK_RING()
            if (status != 0) break;
            double now = now_s();
            if (now >= end) break;
            backoff(g, now, spin_end, yield_end, end, expected);
        }
        Py_END_ALLOW_THREADS
    }
#undef CHECK_RING
    if (status != 1) {
        PyBuffer_Release(&out);
        return PyLong_FromLong(status == 0 ? -1 : -2);
    }
    if (out.len > 65536) {
        Py_BEGIN_ALLOW_THREADS
        ring_read(ring, R, tail + 32, out.buf, out.len);
        Py_END_ALLOW_THREADS
    } else {
        ring_read(ring, R, tail + 32, out.buf, out.len);
    }
    PyBuffer_Release(&out);
    tail += need;
    atomic_store_explicit(at_u64(g, t[5]), tail, memory_order_release);
    ring_ranks(g, &src, 1);
    return PyLong_FromUnsignedLongLong(tail);
}

/* wait_change(word_off, old, budget) -> DONE once the u64 at word_off differs from old,
 * BUDGET after `budget` seconds: spin, yield, then sleep on this rank's doorbell (which
 * whoever changes the word rings), the GIL released. */
static PyObject *G_wait_change(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t off;
    uint64_t old;
    double budget;
    NARGS("wait_change", 3);
    if ((off = PyLong_AsSsize_t(args[0])) == -1 && PyErr_Occurred()) return NULL;
    if (arg_u64(args[1], &old) < 0 || arg_double(args[2], &budget) < 0) return NULL;
    if (off < 0 || off + 8 > g->map.len) return PyErr_Format(PyExc_ValueError, "bad offset");
    au64 *w = at_u64(g, off);
    if (atomic_load_explicit(w, memory_order_acquire) != old) return PyLong_FromLong(DONE);
    int status = BUDGET;
    Py_BEGIN_ALLOW_THREADS
    double start = now_s(), spin_end = start + g->spin_s;
    double yield_end = spin_end + g->yield_s, end = start + budget;
    for (;;) {
        uint32_t expected = atomic_load_explicit(bell(g, g->rank), memory_order_acquire);
        if (atomic_load_explicit(w, memory_order_acquire) != old) { status = DONE; break; }
        double t = now_s();
        if (t >= end) break;
        backoff(g, t, spin_end, yield_end, end, expected);
    }
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(status);
}

static PyObject *G_cma_reduce(Group *g, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef Group_methods[] = {
    {"bell", (PyCFunction)G_bell, METH_NOARGS, "This rank's doorbell value."},
    {"sleepers", (PyCFunction)G_sleepers, METH_NOARGS, "Threads of this rank asleep."},
    {"fence", (PyCFunction)G_fence, METH_NOARGS, "A full memory barrier."},
    {"ring", (PyCFunction)G_ring, METH_O, "ring(ranks): new doorbell value, wake sleepers."},
    {"sleep", (PyCFunction)(void (*)(void))G_sleep, METH_FASTCALL,
     "sleep(expected, seconds): FUTEX_WAIT on this rank's doorbell, GIL released."},
    {"arrived", (PyCFunction)G_arrived, METH_O, "arrived(r): rank r's last phase."},
    {"state", (PyCFunction)G_state, METH_O, "state(r): rank r's state word."},
    {"exchange", (PyCFunction)(void (*)(void))G_exchange, METH_FASTCALL,
     "exchange(q, fp0, fp1, budget, published) -> 1 done, 0 budget spent, 2 a missing "
     "peer failed or closed, 3 fingerprint mismatch."},
    {"small_reduce", (PyCFunction)(void (*)(void))G_small_reduce, METH_FASTCALL,
     "small_reduce(a, q, fp0, fp1, dtype, op, result, budget, published) -> status as "
     "exchange."},
    {"barrier", (PyCFunction)(void (*)(void))G_barrier, METH_FASTCALL,
     "barrier(opcode, seq, budget) -> status as exchange: one empty phase, entered here."},
    {"move", (PyCFunction)(void (*)(void))G_move, METH_FASTCALL,
     "move(kind, opcode, inp, out, seq, root, op, budget) -> status as exchange, or 5: "
     "not taken (a one-phase move from its arguments alone)."},
    {"small_move", (PyCFunction)(void (*)(void))G_small_move, METH_FASTCALL,
     "small_move(kind, inp, out, q, fp0, fp1, root, dtype, op, budget, published) -> "
     "status as exchange: a one-phase gather (0), broadcast (1), scatter (2) or "
     "reduce_scatter (3)."},
    {"all_to_all", (PyCFunction)(void (*)(void))G_all_to_all, METH_FASTCALL,
     "all_to_all(inp, out, counts, q, fp0, fp1, head, itemsize, budget) -> status as "
     "exchange, or 4 (DECLINED): the phase is done and Python goes on from the counts."},
    {"all_to_all_take", (PyCFunction)(void (*)(void))G_all_to_all_take, METH_FASTCALL,
     "all_to_all_take(out, q, head, itemsize) -> 1 (copied) or 4 (DECLINED)."},
    {"sym_all_reduce", (PyCFunction)(void (*)(void))G_sym_all_reduce, METH_FASTCALL,
     "sym_all_reduce(piece, sources, copies, q, vote_fp0, fp0, fp1, vote0, vote1, dtype, "
     "op, budget, resume) -> (status, phase): the symmetric all_reduce in one call."},
    {"pipelined", (PyCFunction)(void (*)(void))G_pipelined, METH_FASTCALL,
     "pipelined(a, q0, fp0, fp1, dtype, op, result, j, budget) -> (status, j): the "
     "pipelined all_reduce/reduce from step j on."},
    {"small_all_reduce", (PyCFunction)(void (*)(void))G_small_all_reduce, METH_FASTCALL,
     "small_all_reduce(a, op, seq, budget) -> status as exchange, or 5: not taken."},
    {"bind_p2p", (PyCFunction)(void (*)(void))G_bind_p2p, METH_FASTCALL,
     "bind_p2p(R, magic, offsets): the rings of every peer, for send and recv."},
    {"send", (PyCFunction)(void (*)(void))G_send, METH_FASTCALL,
     "send(dst, head, tag, dtype, payload) -> new head, or -1 where it does not fit now."},
    {"recv", (PyCFunction)(void (*)(void))G_recv, METH_FASTCALL,
     "recv(src, tail, tag, out, budget) -> new tail; -1 not there within budget s; -2 the "
     "next message is another."},
    {"cma_reduce", (PyCFunction)(void (*)(void))G_cma_reduce, METH_FASTCALL,
     "cma_reduce(out, pids, addrs, dtype, op) -> 0 or -errno (-ECANCELED: a peer "
     "failed or closed): out = the rank-order reduction of the peers' pieces (read in "
     "place) and out, written into the peers' pieces too."},
    {"wait_change", (PyCFunction)(void (*)(void))G_wait_change, METH_FASTCALL,
     "wait_change(word_off, old, budget) -> 1 once the word changed, 0 after budget s."},
    {NULL, NULL, 0, NULL},
};

static PyObject *G_get_phase(Group *g, void *unused) {
    return PyLong_FromUnsignedLongLong(g->phase);
}
static int G_set_phase(Group *g, PyObject *v, void *unused) {
    unsigned long long q = v ? PyLong_AsUnsignedLongLong(v) : (unsigned long long)-1;
    if (q == (unsigned long long)-1 && (v == NULL || PyErr_Occurred())) {
        if (v == NULL) PyErr_SetString(PyExc_TypeError, "phase cannot be deleted");
        return -1;
    }
    g->phase = q;
    return 0;
}
static PyObject *G_get_small_limit(Group *g, void *unused) {
    return PyLong_FromSsize_t(g->small_limit);
}
static int G_set_small_limit(Group *g, PyObject *v, void *unused) {
    Py_ssize_t n = v ? PyLong_AsSsize_t(v) : -1;
    if (n < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "small_limit: bytes >= 0");
        return -1;
    }
    g->small_limit = n;
    return 0;
}

static PyGetSetDef Group_getset[] = {
    {"phase", (getter)G_get_phase, (setter)G_set_phase,
     "The last phase this rank entered (the shm group's phase counter).", NULL},
    {"small_limit", (getter)G_get_small_limit, (setter)G_set_small_limit,
     "Bytes of the largest all_reduce small_all_reduce takes (0: none).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GroupType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "backends.shm._native.Group",
    .tp_basicsize = sizeof(Group),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_getset = Group_getset,
    .tp_doc = "Group(mapping, ctrl_off, data_off, chunk, rank, size, spin_s, yield_s, "
              "slice_s, futex): one rank's view of a shm group's segment.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Group_init,
    .tp_dealloc = (destructor)Group_dealloc,
    .tp_methods = Group_methods,
};

/* ------------------------------------------------------------- module functions */
/* combine(out, sources, dtype, op, n[, copies]): out = sources[0] (op) sources[1] ... in
 * order, then AVG divides by n; GIL released. `out` may be one of the sources. Each
 * array of `copies` (writable, out's length) receives the result too (see Reduction). */
static PyObject *m_combine(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    int code, op, n;
    Reduction R;
    if (nargs != 5 && nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "shm native combine: 5 or 6 arguments expected");
        return NULL;
    }
    if (arg_int(args[2], &code) < 0 || arg_int(args[3], &op) < 0 || arg_int(args[4], &n) < 0)
        return NULL;
    if (check_kernel(code, op) < 0) return NULL;
    if (reduction_get(&R, args[0], args[1], nargs == 6 ? args[5] : Py_None, "combine") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    reduction_run(&R, code, op, n, NULL);
    Py_END_ALLOW_THREADS
    reduction_release(&R);
    Py_RETURN_NONE;
}

/* ------------------------------------------------------- cross-memory attach (CMA) */
/* Single-copy reads of a peer's memory and writes into it (process_vm_readv/writev: the
 * kernel copies between the peer's pages and ours), for the large all_reduce of cma.py.
 * Each call returns 0, or -errno of the first failed copy (EPERM where ptrace rules
 * forbid it, ENOSYS where the kernel or a seccomp filter lacks it, ESRCH/EFAULT for a
 * peer gone or an address not its). */
#define CMA_BLOCK (256 << 10)

/* len bytes between `local` here and `addr` in process pid: read into local (!write) or
 * written from it (write). */
static int cma_transfer(pid_t pid, char *local_buf, uint64_t addr, size_t len, int write) {
#ifdef __linux__
    while (len > 0) {
        struct iovec local = {local_buf, len}, remote = {(void *)(uintptr_t)addr, len};
        ssize_t got = write ? process_vm_writev(pid, &local, 1, &remote, 1, 0)
                            : process_vm_readv(pid, &local, 1, &remote, 1, 0);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -errno;
        }
        if (got == 0) return -EFAULT;
        local_buf += got;
        addr += (uint64_t)got;
        len -= (size_t)got;
    }
    return 0;
#else
    (void)pid; (void)local_buf; (void)addr; (void)len; (void)write;
    return -ENOSYS;
#endif
}


/* cma_read(out, pid, addr) / cma_write(src, pid, addr) -> 0 or -errno: len(buffer)
 * bytes at addr in process pid, into out or from src. */
static PyObject *cma_one(PyObject *const *args, Py_ssize_t nargs, int write, const char *name) {
    int pid;
    uint64_t addr;
    Py_buffer buf;
    if (nargs != 3)
        return PyErr_Format(PyExc_TypeError, "shm native %s: 3 arguments expected", name);
    if (arg_int(args[1], &pid) < 0 || arg_u64(args[2], &addr) < 0) return NULL;
    if (get_array(args[0], &buf, !write, name) < 0) return NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = cma_transfer((pid_t)pid, buf.buf, addr, (size_t)buf.len, write);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    return PyLong_FromLong(rc);
}

static PyObject *m_cma_read(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    return cma_one(args, nargs, 0, "cma_read");
}

static PyObject *m_cma_write(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    return cma_one(args, nargs, 1, "cma_write");
}

/* Group.cma_reduce(out, pids, addrs, dtype, op) -> 0 or -errno. out is this rank's piece
 * of its own array, and source `me` of the reduction; the same piece of rank r's array
 * (r != me) is at addrs[r] in process pids[r]. Block by block (a quarter MiB, so the
 * copies stay in cache): read every peer's block, out = s_0 (op) s_1 ... in rank order
 * (AVG divided by n once: bitwise what combine computes), then write the reduced block
 * into every peer's piece from the cache. No other rank touches piece `me` of any
 * array during the call (its owner reads a block there before writing that block).
 *
 * A peer may leave the call early with an error (a timeout, a failure of its own) and
 * hand its array back to its caller; nothing may be written there after that: each
 * block's write is fenced by push_begin/push_end. -ECANCELED where a peer had failed or
 * closed. GIL released. */
static PyObject *G_cma_reduce(Group *g, PyObject *const *args, Py_ssize_t nargs) {
    int code, op, me = g->rank;
    Py_buffer out;
    NARGS("cma_reduce", 5);
    if (arg_int(args[3], &code) < 0 || arg_int(args[4], &op) < 0) return NULL;
    if (check_kernel(code, op) < 0) return NULL;
    PyObject *pids = PySequence_Fast(args[1], "shm native cma_reduce: a sequence of pids");
    if (pids == NULL) return NULL;
    PyObject *addrs = PySequence_Fast(args[2], "shm native cma_reduce: a sequence of addresses");
    if (addrs == NULL) { Py_DECREF(pids); return NULL; }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(pids);
    PyObject *ret = NULL;
    int *pid = NULL;
    uint64_t *addr = NULL;
    char **tmp = NULL, **srcs = NULL;
    if (n != g->size || n != PySequence_Fast_GET_SIZE(addrs)) {
        PyErr_SetString(PyExc_ValueError, "shm native cma_reduce: a pid and an address per rank");
        goto end_seq;
    }
    pid = PyMem_Malloc(sizeof(int) * (size_t)n);
    addr = PyMem_Malloc(sizeof(uint64_t) * (size_t)n);
    tmp = PyMem_Calloc((size_t)n, sizeof(char *));
    srcs = PyMem_Malloc(sizeof(char *) * (size_t)n);
    if (!pid || !addr || !tmp || !srcs) { PyErr_NoMemory(); goto end_alloc; }
    for (Py_ssize_t r = 0; r < n; r++) {
        if (arg_int(PySequence_Fast_GET_ITEM(pids, r), &pid[r]) < 0 ||
            arg_u64(PySequence_Fast_GET_ITEM(addrs, r), &addr[r]) < 0)
            goto end_alloc;
        if (r != me && !(tmp[r] = PyMem_RawMalloc(CMA_BLOCK))) { PyErr_NoMemory(); goto end_alloc; }
    }
    if (get_array(args[0], &out, 1, "cma_reduce") < 0) goto end_alloc;
    int itemsize = KERNELS[code].itemsize, rc = 0;
    Py_ssize_t block = CMA_BLOCK / itemsize * itemsize;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t off = 0; off < out.len && rc == 0; off += block) {
        Py_ssize_t k = out.len - off < block ? out.len - off : block;
        char *mine = (char *)out.buf + off;
        for (Py_ssize_t r = 0; r < n && rc == 0; r++) {
            if (r == me) {
                srcs[r] = mine;
            } else {
                rc = cma_transfer((pid_t)pid[r], tmp[r], addr[r] + (uint64_t)off, (size_t)k, 0);
                srcs[r] = tmp[r];
            }
        }
        if (rc == 0) KERNELS[code].fn(mine, srcs, (int)n, k / itemsize, op, (int)n);
        for (int r = 0; r < n && rc == 0; r++) {
            if (r == me) continue;
            if (!push_begin(g, r)) {
                rc = -ECANCELED;
                break;
            }
            rc = cma_transfer((pid_t)pid[r], mine, addr[r] + (uint64_t)off, (size_t)k, 1);
            push_end(g);
        }
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&out);
    ret = PyLong_FromLong(rc);
end_alloc:
    if (tmp)
        for (Py_ssize_t r = 0; r < n; r++) PyMem_RawFree(tmp[r]);
    PyMem_Free(pid);
    PyMem_Free(addr);
    PyMem_Free(tmp);
    PyMem_Free(srcs);
end_seq:
    Py_DECREF(pids);
    Py_DECREF(addrs);
    return ret;
}

static PyMethodDef module_methods[] = {
    {"bind_codes", (PyCFunction)(void (*)(void))m_bind_codes, METH_FASTCALL,
     "bind_codes(ops, dtypes): the ReduceOp members by code and dtype -> code."},
    {"combine", (PyCFunction)(void (*)(void))m_combine, METH_FASTCALL,
     "combine(out, sources, dtype, op, n[, copies]): the rank-order reduction, also "
     "written into each copy; GIL released."},
    {"cma_read", (PyCFunction)(void (*)(void))m_cma_read, METH_FASTCALL,
     "cma_read(out, pid, addr) -> 0 or -errno: a peer's bytes, one kernel copy."},
    {"cma_write", (PyCFunction)(void (*)(void))m_cma_write, METH_FASTCALL,
     "cma_write(src, pid, addr) -> 0 or -errno: bytes into a peer, one kernel copy."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The compiled hot path of the shm backend (see backends/shm/native.py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&GroupType) < 0) return NULL;
    PyObject *m = PyModule_Create(&native_module);
    if (m == NULL) return NULL;
    Py_INCREF(&GroupType);
    if (PyModule_AddObject(m, "Group", (PyObject *)&GroupType) < 0) {
        Py_DECREF(&GroupType);
        Py_DECREF(m);
        return NULL;
    }
    /* What this file assumes of segment.py, codes.py and reduce.py; native.py checks it at
     * import. */
    PyModule_AddObject(m, "LAYOUT", Py_BuildValue("(iiiiiiiii)", CTRL_STRIDE, W_ARRIVED, W_FP,
                                                  W_STATE, W_SLEEPERS, W_PUSHING, BELL_BYTE,
                                                  PIECE_MAX_BYTES, CORE_REVISION));
    PyModule_AddObject(m, "DTYPE_CODES", Py_BuildValue(
        "{sisisisisisisisisisi}", "float16", T_F16, "bfloat16", T_BF16, "float32", T_F32,
        "float64", T_F64, "int8", T_I8, "uint8", T_U8, "int16", T_I16, "int32", T_I32,
        "int64", T_I64, "bool", T_BOOL));
    PyModule_AddObject(m, "REDOP_CODES", Py_BuildValue(
        "{sisisisisi}", "SUM", R_SUM, "AVG", R_AVG, "PRODUCT", R_PROD, "MIN", R_MIN,
        "MAX", R_MAX));
    PyModule_AddIntConstant(m, "DONE", DONE);
    PyModule_AddIntConstant(m, "BUDGET", BUDGET);
    PyModule_AddIntConstant(m, "PEER", PEER);
    PyModule_AddIntConstant(m, "MISMATCH", MISMATCH);
    PyModule_AddIntConstant(m, "DECLINED", DECLINED);
    PyModule_AddIntConstant(m, "NOT_TAKEN", NOT_TAKEN);
    PyModule_AddIntConstant(m, "CANCELED", CANCELED);
    PyModule_AddIntConstant(m, "MOVE_GATHER", M_GATHER);
    PyModule_AddIntConstant(m, "MOVE_BROADCAST", M_BROADCAST);
    PyModule_AddIntConstant(m, "MOVE_SCATTER", M_SCATTER);
    PyModule_AddIntConstant(m, "MOVE_REDUCE_SCATTER", M_REDUCE_SCATTER);
    PyModule_AddIntConstant(m, "OP_ALL_REDUCE", OP_ALL_REDUCE_CODE);
    return m;
}
