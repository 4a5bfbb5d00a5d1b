/* Paged decode attention for fp32 caches, in place: each decode row's query token attends to its keys where they lie
   in the paged cache (no gather into a workspace), with an online softmax page by page, in fp32. Built and loaded by
   decode_kernel.py, which says why it exists and what it is checked against. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>

#define LANES 16
#define MAX_PAGE 256
#define MAX_REP 64 /* query heads of one work item */

typedef struct {
    const float *q, *k, *v;
    const int64_t *table, *lens, *qpos;
    int64_t max_pages, hkv, rep, d, dv, page, q_stride_t, q_stride_h, out_stride_t, out_stride_h;
    float scale;
    float *out;
    int64_t groups, begin, end; /* work items: row * groups + group of KV heads */
} Job;

/* exp(x) for the scores after the max is subtracted (x <= 0): Cephes' expf polynomial, within 2 ulp of expf, in
   branch-free lanes the compiler vectorises. */
static void exp_lanes(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        float v = x[i] < -87.0f ? -87.0f : x[i];
        float fn = floorf(v * 1.44269504088896341f + 0.5f);
        float r = v - fn * 0.693359375f + fn * 2.12194440e-4f;
        float p = 1.9875691500E-4f;
        p = p * r + 1.3981999507E-3f;
        p = p * r + 8.3334519073E-3f;
        p = p * r + 4.1665795894E-2f;
        p = p * r + 1.6666665459E-1f;
        p = p * r + 5.0000001201E-1f;
        float y = p * r * r + r + 1.0f;
        int32_t bits = ((int32_t)fn + 127) << 23;
        float scale;
        memcpy(&scale, &bits, sizeof scale);
        x[i] = y * scale;
    }
}

static float dot(const float *a, const float *b, int64_t n) {
    float part[LANES] = {0};
    int64_t d = 0;
    for (; d + LANES <= n; d += LANES)
        for (int u = 0; u < LANES; u++) part[u] += a[d + u] * b[d + u];
    for (int u = 0; d < n; d++, u++) part[u] += a[d] * b[d];
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int u = 0; u < w; u++) part[u] += part[u + w];
    return part[0];
}

#define MAX_ACC 16384

/* One work item: decode row `row`, KV heads h0..h1-1 (their rep query heads each). A page's keys of every head of the
   item are read together (consecutive bytes of the cache), then its values. */
static void attend(const Job *j, int64_t row, int64_t h0, int64_t h1, float *acc, float (*s)[MAX_PAGE]) {
    const int64_t rep = j->rep, d = j->d, dv = j->dv, page = j->page, len = j->lens[row], heads = (h1 - h0) * rep;
    const int64_t token_stride = j->hkv * d, vtoken_stride = j->hkv * dv;
    float m[MAX_REP], l[MAX_REP];
    const float *qs[MAX_REP];
    for (int64_t i = 0; i < heads; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
        qs[i] = j->q + j->qpos[row] * j->q_stride_t + (h0 * rep + i) * j->q_stride_h;
    }
    memset(acc, 0, sizeof(float) * heads * dv);
    for (int64_t p = 0; p * page < len; p++) {
        const int64_t base = j->table[row * j->max_pages + p] * page;
        const int64_t n = len - p * page < page ? len - p * page : page;
        const float *kp = j->k + base * token_stride, *vp = j->v + base * vtoken_stride;
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < heads; i++)
                s[i][t] = dot(qs[i], kp + t * token_stride + (h0 + i / rep) * d, d) * j->scale;
        float alpha[MAX_REP];
        for (int64_t i = 0; i < heads; i++) {
            float top = m[i];
            for (int64_t t = 0; t < n; t++) top = s[i][t] > top ? s[i][t] : top;
            alpha[i] = expf(m[i] - top); /* 0 on the first page: m = -inf */
            for (int64_t t = 0; t < n; t++) s[i][t] -= top;
            exp_lanes(s[i], n);
            float sum = 0.0f;
            for (int64_t t = 0; t < n; t++) sum += s[i][t];
            l[i] = l[i] * alpha[i] + sum;
            m[i] = top;
            float *a = acc + i * dv;
            for (int64_t e = 0; e < dv; e++) a[e] *= alpha[i];
        }
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < heads; i++) {
                const float w = s[i][t], *vt = vp + t * vtoken_stride + (h0 + i / rep) * dv;
                float *a = acc + i * dv;
                for (int64_t e = 0; e < dv; e++) a[e] += w * vt[e];
            }
    }
    for (int64_t i = 0; i < heads; i++) {
        float *o = j->out + j->qpos[row] * j->out_stride_t + (h0 * rep + i) * j->out_stride_h;
        const float norm = l[i] > 0.0f ? 1.0f / l[i] : 0.0f; /* a row with no keys (none in the engine) gives 0 */
        for (int64_t e = 0; e < dv; e++) o[e] = acc[i * dv + e] * norm;
    }
}

/* A thread's scratch (128 KiB) is on the heap, not its stack: the caller's thread may have a small one. */
static void *run(void *arg) {
    const Job *j = (const Job *)arg;
    float *acc = malloc(sizeof(float) * MAX_ACC);
    float (*s)[MAX_PAGE] = malloc(sizeof(float) * MAX_REP * MAX_PAGE);
    if (acc == NULL || s == NULL) {
        free(acc);
        free(s);
        return (void *)1;
    }
    for (int64_t w = j->begin; w < j->end; w++) {
        const int64_t row = w / j->groups, g = w % j->groups;
        attend(j, row, j->hkv * g / j->groups, j->hkv * (g + 1) / j->groups, acc, s);
    }
    free(acc);
    free(s);
    return NULL;
}

/* Returns 0; -1 where a size is past this kernel's limits (nothing written); -2 where scratch memory could not be had
   (some rows not written). */
int paged_decode(const float *q, int64_t q_stride_t, int64_t q_stride_h, const float *k, const float *v,
                 const int64_t *table, int64_t max_pages, const int64_t *lens, const int64_t *qpos, int64_t rows,
                 int64_t hkv, int64_t rep, int64_t d, int64_t dv, int64_t page, float scale, float *out,
                 int64_t out_stride_t, int64_t out_stride_h, int64_t threads) {
    if (threads < 1) threads = 1;
    /* split a row's KV heads into groups only where rows alone would leave threads idle */
    int64_t groups = (4 * threads + rows - 1) / rows;
    if (groups > hkv) groups = hkv;
    while (groups < hkv && (hkv + groups - 1) / groups * rep > MAX_REP) groups++;
    const int64_t heads = (hkv + groups - 1) / groups * rep;
    if (page > MAX_PAGE || heads > MAX_REP || heads * dv > MAX_ACC) return -1;
    const int64_t work = rows * groups;
    if (threads > work) threads = work;
    if (threads > 64) threads = 64;
    Job jobs[64];
    pthread_t ids[64];
    for (int64_t t = 0; t < threads; t++) {
        jobs[t] = (Job){q, k, v, table, lens, qpos, max_pages, hkv, rep, d, dv, page, q_stride_t, q_stride_h,
                        out_stride_t, out_stride_h, scale, out, groups, work * t / threads, work * (t + 1) / threads};
    }
    int64_t started = 1, failed = 0;
    for (; started < threads; started++)
        if (pthread_create(&ids[started], NULL, run, &jobs[started]) != 0) break;
    for (int64_t t = started; t < threads; t++) failed |= run(&jobs[t]) != NULL; /* threads that could not start */
    failed |= run(&jobs[0]) != NULL;
    for (int64_t t = 1; t < started; t++) {
        void *result;
        pthread_join(ids[t], &result);
        failed |= result != NULL;
    }
    return failed ? -2 : 0;
}

/* The step's new keys and values ([tokens, Hkv, D], any token and head strides, last dim contiguous) copied into cache
   rows write[t] of keys / values ([cache rows, Hkv, D], contiguous), a head's D floats at a time. Returns 0; -1 where
   an index is outside the cache (nothing written). torch's index_copy_ goes element by element through the strided
   views: 32 us for a layer's keys and values at 128 rows of the 25M model, against 12 us here (bench_kernels.py). */
int paged_write(const float *k, int64_t k_stride_t, int64_t k_stride_h, const float *v, int64_t v_stride_t,
                int64_t v_stride_h, float *keys, float *values, const int64_t *write, int64_t tokens, int64_t hkv,
                int64_t d, int64_t dv, int64_t cache_rows) {
    for (int64_t t = 0; t < tokens; t++)
        if (write[t] < 0 || write[t] >= cache_rows) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        float *kr = keys + write[t] * hkv * d, *vr = values + write[t] * hkv * dv;
        for (int64_t h = 0; h < hkv; h++) {
            memcpy(kr + h * d, k + t * k_stride_t + h * k_stride_h, sizeof(float) * d);
            memcpy(vr + h * dv, v + t * v_stride_t + h * v_stride_h, sizeof(float) * dv);
        }
    }
    return 0;
}
