/* Fused elementwise pieces of a decoder layer (RMSNorm, rotary embedding) for fp32, bit for bit what torch's eager ops
   compute: the same roundings in the same order, so nothing downstream can tell them apart. Built with
   -ffp-contract=off (elementwise.py): a fused multiply-add would round once where torch rounds twice. Rows are split
   over the engine thread's OpenMP team (else POSIX threads) when there are enough of them; a row's result never
   depends on the split. Loaded by
   elementwise.py, which says why they exist and how they are checked. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#define MAX_THREADS 64
/* torch's sum kernel adds a row as 8-float vectors on x86 CPUs, AVX-512 ones included (measured: 8 give its bits on an
   AVX-512 core, 16 do not); elementwise.py's self-check guards every other CPU and torch build */
#define LANES 8
#define FLOATS_PER_THREAD (1 << 20) /* less work than this a thread runs on the caller's: starting and joining one costs
                                       ~45 us here, a thread norms ~7 floats a nanosecond */
#define FLOATS_PER_TEAM_THREAD 32768 /* on the engine thread's OpenMP team: torch's own grain size for its ops */

/* torch's sum of x[e]^2 over one contiguous row of n floats, as its CPU kernel computes it
   (aten/src/ATen/native/cpu/SumKernel.cpp, vectorized_inner_sum over pow(2)'s output): LANES-wide vectors summed by
   row_sum (4 interleaved accumulators, each a cascade of 4 levels of 2^power vectors: multi_row_sum), vectors past the
   last group of 4 into the first accumulator, the accumulators added in order, then the scalar tail and the lanes
   added to a scalar. Each square is rounded before it is added, as pow(2) stores it. */
static float row_sum_of_squares(const float *x, int64_t n) {
    const int64_t lanes = LANES, vectors = n / lanes, size = vectors / 4;
    int64_t ceil_log2 = 1; /* c10's CeilLog2: 1 up to 2, else ceil(log2(size)) */
    if (size > 2) {
        ceil_log2 = 0;
        for (uint64_t v = (uint64_t)size - 1; v; v >>= 1) ceil_log2++;
    }
    const int64_t power = ceil_log2 / 4 > 4 ? ceil_log2 / 4 : 4, step = (int64_t)1 << power, mask = step - 1;
    float acc[4][4][LANES];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
#define ADD_VECTOR(dst, v)                                                   \
    for (int64_t l = 0; l < lanes; l++) {                                   \
        const float sq = x[(v) * lanes + l] * x[(v) * lanes + l];            \
        (dst)[l] += sq;                                                      \
    }
    for (; i + step <= size;) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int64_t k = 0; k < 4; k++) ADD_VECTOR(acc[0][k], i * 4 + k)
        for (int64_t level = 1; level < 4; level++) {
            for (int64_t k = 0; k < 4; k++)
                for (int64_t l = 0; l < lanes; l++) {
                    acc[level][k][l] += acc[level - 1][k][l];
                    acc[level - 1][k][l] = 0.0f;
                }
            if ((i & (mask << (level * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int64_t k = 0; k < 4; k++) ADD_VECTOR(acc[0][k], i * 4 + k)
    for (int64_t level = 1; level < 4; level++)
        for (int64_t k = 0; k < 4; k++)
            for (int64_t l = 0; l < lanes; l++) acc[0][k][l] += acc[level][k][l];
    for (int64_t v = size * 4; v < vectors; v++) ADD_VECTOR(acc[0][0], v)
#undef ADD_VECTOR
    for (int64_t k = 1; k < 4; k++)
        for (int64_t l = 0; l < lanes; l++) acc[0][0][l] += acc[0][k][l];
    float total = 0.0f;
    for (int64_t e = vectors * lanes; e < n; e++) {
        const float sq = x[e] * x[e];
        total += sq;
    }
    for (int64_t l = 0; l < lanes; l++) total += acc[0][0][l];
    return total;
}

typedef struct {
    const float *x, *weight, *cos_, *sin_;
    float *out;
    int64_t x_stride_t, x_stride_h, out_stride_t, out_stride_h, heads, n, begin, end;
    float eps;
} Job;

/* transformers' LlamaRMSNorm in fp32, rows begin..end: pow(2), sum, / n (torch's mean on CPU is sum then div_),
   + eps, 1 / sqrt (torch's rsqrt), x * that, weight * that; each rounded as torch rounds it. */
static void *norm_rows(void *arg) {
    const Job *j = (const Job *)arg;
    for (int64_t r = j->begin; r < j->end; r++) {
        const float *x = j->x + r * j->x_stride_t;
        float *o = j->out + r * j->out_stride_t;
        const float variance = row_sum_of_squares(x, j->n) / (float)j->n;
        const float inv = 1.0f / sqrtf(variance + j->eps);
        for (int64_t e = 0; e < j->n; e++) {
            const float h = x[e] * inv;
            o[e] = j->weight[e] * h;
        }
    }
    return NULL;
}

/* transformers' apply_rotary_pos_emb for one of q or k, tokens begin..end: x * cos + rotate_half(x) * sin, where
   rotate_half(x) = (-x2, x1); both products rounded, then their sum. */
static void *rotate_rows(void *arg) {
    const Job *j = (const Job *)arg;
    const int64_t d = j->n, half = d / 2;
    for (int64_t t = j->begin; t < j->end; t++) {
        const float *c = j->cos_ + t * d, *s = j->sin_ + t * d;
        for (int64_t h = 0; h < j->heads; h++) {
            const float *x = j->x + t * j->x_stride_t + h * j->x_stride_h;
            float *o = j->out + t * j->out_stride_t + h * j->out_stride_h;
            for (int64_t e = 0; e < half; e++) {
                const float a = x[e] * c[e], b = (-x[e + half]) * s[e];
                o[e] = a + b;
            }
            for (int64_t e = half; e < d; e++) {
                const float a = x[e] * c[e], b = x[e - half] * s[e];
                o[e] = a + b;
            }
        }
    }
    return NULL;
}

/* torch's OpenMP runtime (libgomp), when elementwise.py found it: rows are then split over the engine thread's own
   OpenMP team, whose workers are already spinning between the forward's parallel ops (see decode_kernel.c). */
static void (*gomp_parallel)(void (*)(void *), void *, unsigned, unsigned) = NULL;

void use_openmp(void *parallel) { gomp_parallel = (void (*)(void (*)(void *), void *, unsigned, unsigned))parallel; }

typedef struct {
    void *(*fn)(void *);
    Job *jobs;
    int64_t count, next;
} Team;

/* Each member of the team takes jobs until none is left, so every job runs however many threads the runtime gives. */
static void team_member(void *arg) {
    Team *team = (Team *)arg;
    for (int64_t t; (t = __atomic_fetch_add(&team->next, 1, __ATOMIC_RELAXED)) < team->count;) team->fn(&team->jobs[t]);
}

/* runs fn over rows 0..rows of job, split over up to `threads` threads (the caller's included) */
static void split(void *(*fn)(void *), Job job, int64_t rows, int64_t row_floats, int64_t threads) {
    const int64_t enough = rows * row_floats / (gomp_parallel != NULL ? FLOATS_PER_TEAM_THREAD : FLOATS_PER_THREAD);
    if (threads > enough) threads = enough;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    Job jobs[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    for (int64_t t = 0; t < threads; t++) {
        jobs[t] = job;
        jobs[t].begin = rows * t / threads;
        jobs[t].end = rows * (t + 1) / threads;
    }
    if (gomp_parallel != NULL && threads > 1) {
        Team team = {fn, jobs, threads, 0};
        gomp_parallel(team_member, &team, (unsigned)threads, 0);
        return;
    }
    for (int64_t t = 1; t < threads; t++) started[t] = pthread_create(&ids[t], NULL, fn, &jobs[t]) == 0;
    for (int64_t t = 1; t < threads; t++)
        if (!started[t]) fn(&jobs[t]); /* a thread that could not start: its rows run here */
    fn(&jobs[0]);
    for (int64_t t = 1; t < threads; t++)
        if (started[t]) pthread_join(ids[t], NULL);
}

/* out[r] = RMSNorm(x[r]) for rows of n floats (last dim contiguous, rows `x_stride` apart). */
void rms_norm(const float *x, int64_t x_stride, const float *weight, float eps, float *out, int64_t out_stride,
              int64_t rows, int64_t n, int64_t threads) {
    Job job = {x, weight, NULL, NULL, out, x_stride, 0, out_stride, 0, 1, n, 0, rows, eps};
    split(norm_rows, job, rows, n, threads);
}

/* out = apply_rotary_pos_emb's result for x [tokens, heads, d] by strides (last dim contiguous, d even), with
   cos / sin [tokens, d] contiguous, into out by its strides. */
void rotary(const float *x, int64_t x_stride_t, int64_t x_stride_h, const float *cos_, const float *sin_, float *out,
            int64_t out_stride_t, int64_t out_stride_h, int64_t tokens, int64_t heads, int64_t d, int64_t threads) {
    Job job = {x, NULL, cos_, sin_, out, x_stride_t, x_stride_h, out_stride_t, out_stride_h, heads, d, 0, tokens, 0.0f};
    split(rotate_rows, job, tokens, heads * d, threads);
}
