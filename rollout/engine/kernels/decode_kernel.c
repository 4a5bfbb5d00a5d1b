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

/* One page's online-softmax update for `heads` query heads whose scores s[i][0..n) are in: the running max m, sum l,
   and each head's rescale factor alpha (0 on the first page: m = -inf); s becomes the page's unnormalised weights. */
static void softmax_page(int64_t heads, int64_t n, float (*s)[MAX_PAGE], float *m, float *l, float *alpha) {
    for (int64_t i = 0; i < heads; i++) {
        float top = m[i];
        for (int64_t t = 0; t < n; t++) top = s[i][t] > top ? s[i][t] : top;
        alpha[i] = expf(m[i] - top);
        for (int64_t t = 0; t < n; t++) s[i][t] -= top;
        exp_lanes(s[i], n);
        float sum = 0.0f;
        for (int64_t t = 0; t < n; t++) sum += s[i][t];
        l[i] = l[i] * alpha[i] + sum;
        m[i] = top;
    }
}

#define MAX_ACC 16384

/* A work item's query heads (decode row `row`, KV heads from h0): where each one's query is, and its running softmax
   max and sum, started empty with its accumulator (heads x dv floats). */
typedef struct {
    float m[MAX_REP], l[MAX_REP];
    const float *qs[MAX_REP];
} Heads;

static void begin_item(const Job *j, int64_t row, int64_t h0, int64_t heads, Heads *st, float *acc) {
    for (int64_t i = 0; i < heads; i++) {
        st->m[i] = -INFINITY;
        st->l[i] = 0.0f;
        st->qs[i] = j->q + j->qpos[row] * j->q_stride_t + (h0 * j->rep + i) * j->q_stride_h;
    }
    memset(acc, 0, sizeof(float) * heads * j->dv);
}

/* Each head's output: its accumulator over its softmax sum. */
static void end_item(const Job *j, int64_t row, int64_t h0, int64_t heads, const Heads *st, const float *acc) {
    for (int64_t i = 0; i < heads; i++) {
        float *o = j->out + j->qpos[row] * j->out_stride_t + (h0 * j->rep + i) * j->out_stride_h;
        const float norm = st->l[i] > 0.0f ? 1.0f / st->l[i] : 0.0f; /* a row with no keys (none in the engine): 0 */
        for (int64_t e = 0; e < j->dv; e++) o[e] = acc[i * j->dv + e] * norm;
    }
}

/* The first cache row of decode row `row`'s page p, and how many of its tokens the row holds (len in all). */
static inline int64_t page_base(const Job *j, int64_t row, int64_t p) {
    return j->table[row * j->max_pages + p] * j->page;
}
static inline int64_t page_tokens(const Job *j, int64_t len, int64_t p) {
    return len - p * j->page < j->page ? len - p * j->page : j->page;
}

/* One work item: decode row `row`, KV heads h0..h1-1 (their rep query heads each). A page's keys of every head of the
   item are read together (consecutive bytes of the cache), then its values. */
static void attend(const Job *j, int64_t row, int64_t h0, int64_t h1, float *acc, float (*s)[MAX_PAGE]) {
    const int64_t rep = j->rep, d = j->d, dv = j->dv, page = j->page, len = j->lens[row], heads = (h1 - h0) * rep;
    const int64_t token_stride = j->hkv * d, vtoken_stride = j->hkv * dv;
    Heads st;
    begin_item(j, row, h0, heads, &st, acc);
    for (int64_t p = 0; p * page < len; p++) {
        const int64_t base = page_base(j, row, p), n = page_tokens(j, len, p);
        const float *kp = j->k + base * token_stride, *vp = j->v + base * vtoken_stride;
        for (int64_t t = 0; t < n; t++)
            for (int64_t i = 0; i < heads; i++)
                s[i][t] = dot(st.qs[i], kp + t * token_stride + (h0 + i / rep) * d, d) * j->scale;
        float alpha[MAX_REP];
        softmax_page(heads, n, s, st.m, st.l, alpha);
        for (int64_t i = 0; i < heads; i++) {
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
    end_item(j, row, h0, heads, &st, acc);
}

#if defined(__AVX512F__)
#include <immintrin.h>

/* exp_lanes' polynomial on 16 lanes (x <= 0; 2^n by scalef). */
static inline __m512 exp16(__m512 x) {
    const __m512 v = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 half_up = _mm512_fmadd_ps(v, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    const __m512 fn = _mm512_roundscale_ps(half_up, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(fn, _mm512_set1_ps(0.693359375f), v);
    r = _mm512_fmadd_ps(fn, _mm512_set1_ps(2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500E-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
    const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(y, fn);
}

/* Lane j: the sum of the 16 lanes of v[slot of token j], where token j's vector is in slot 4 * (j % 4) + j / 4 (the
   order this transpose-and-add network leaves them in): 15 adds for 16 sums in place of a reduction each. */
static inline __m512 sum16(__m512 *v) {
    __m512 a[8], b[4], c[2];
    for (int k = 0; k < 8; k++)
        a[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
    for (int k = 0; k < 4; k++)
        b[k] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * k], a[2 * k + 1], 0xDD));
    for (int k = 0; k < 2; k++)
        c[k] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * k], b[2 * k + 1], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
}

/* One page of attend() in AVX-512 registers for C (1-4) query heads of KV head h, where d is a multiple of 16 and dv
   of 16 * B (B = 4 or 1): kp / vp are the page's rows at head h, n its tokens, m / l / acc the heads' running state.
   Scores come 16 tokens at a time (sum16), the softmax runs on 16 lanes, and each head's output block (B vectors)
   stays in registers across the page's tokens, so a value row is loaded once for the C heads and the accumulator
   once a page. */
static inline __attribute__((always_inline)) void page_heads(const Job *j, const float *const *qs, const float *kp,
                                                             const float *vp, int64_t n, const int C, const int B,
                                                             float *m, float *l, float *acc, float (*s)[MAX_PAGE]) {
    const int64_t d = j->d, dv = j->dv, token_stride = j->hkv * d, vtoken_stride = j->hkv * dv;
    float alpha[4];
    for (int i = 0; i < C; i++) {
        __m512 top = _mm512_set1_ps(m[i]);
        for (int64_t b0 = 0; b0 < n; b0 += 16) {
            const int64_t count = n - b0 < 16 ? n - b0 : 16;
            __m512 part[16];
            for (int slot = 0; slot < 16; slot++) {
                const int64_t t = 4 * (slot % 4) + slot / 4;
                part[slot] = _mm512_setzero_ps();
                if (t < count) {
                    const float *kt = kp + (b0 + t) * token_stride;
                    for (int64_t c = 0; c < d; c += 16)
                        part[slot] = _mm512_fmadd_ps(_mm512_loadu_ps(qs[i] + c), _mm512_loadu_ps(kt + c), part[slot]);
                }
            }
            const __mmask16 live = (__mmask16)((1u << count) - 1u);
            const __m512 sc = _mm512_mask_blend_ps(live, _mm512_set1_ps(-INFINITY),
                                                   _mm512_mul_ps(sum16(part), _mm512_set1_ps(j->scale)));
            _mm512_storeu_ps(s[i] + b0, sc);
            top = _mm512_max_ps(top, sc);
        }
        const float most = _mm512_reduce_max_ps(top);
        alpha[i] = expf(m[i] - most); /* 0 on the first page: m = -inf */
        for (int64_t b0 = 0; b0 < n; b0 += 16) {
            const int64_t count = n - b0 < 16 ? n - b0 : 16;
            const __mmask16 live = (__mmask16)((1u << count) - 1u);
            _mm512_storeu_ps(s[i] + b0, _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(_mm512_loadu_ps(s[i] + b0),
                                                                                     _mm512_set1_ps(most)))));
        }
        float sum = 0.0f; /* in token order, as softmax_page adds them: both paths give the same bits */
        for (int64_t t = 0; t < n; t++) sum += s[i][t];
        l[i] = l[i] * alpha[i] + sum;
        m[i] = most;
    }
    for (int64_t e = 0; e < dv; e += 16 * B) {
        __m512 a[4][4];
        for (int i = 0; i < C; i++)
            for (int b = 0; b < B; b++)
                a[i][b] = _mm512_mul_ps(_mm512_loadu_ps(acc + i * dv + e + 16 * b), _mm512_set1_ps(alpha[i]));
        for (int64_t t = 0; t < n; t++) {
            const float *vt = vp + t * vtoken_stride + e;
            __m512 vv[4];
            for (int b = 0; b < B; b++) vv[b] = _mm512_loadu_ps(vt + 16 * b);
            for (int i = 0; i < C; i++) {
                const __m512 w = _mm512_set1_ps(s[i][t]);
                for (int b = 0; b < B; b++) a[i][b] = _mm512_fmadd_ps(w, vv[b], a[i][b]);
            }
        }
        for (int i = 0; i < C; i++)
            for (int b = 0; b < B; b++) _mm512_storeu_ps(acc + i * dv + e + 16 * b, a[i][b]);
    }
}

/* attend() with each page's heads through page_heads, the next page's keys and values of the item's heads prefetched
   while this one is computed (a page spans several 4 KiB memory pages, where hardware prefetchers stop); 0 where the
   head sizes do not allow it (nothing written). The portable loop is auto-vectorised at the width the compiler's
   tuning prefers (128 bits for gcc 12 on this project's AMD cores); this gives its bits, faster (decode_kernel.py). */
static int attend_vector(const Job *j, int64_t row, int64_t h0, int64_t h1, float *acc, float (*s)[MAX_PAGE]) {
    const int64_t rep = j->rep, d = j->d, dv = j->dv, page = j->page, len = j->lens[row], heads = (h1 - h0) * rep;
    if (d % 16 || dv % 16) return 0;
    const int wide = dv % 64 == 0;
    const int64_t token_stride = j->hkv * d, vtoken_stride = j->hkv * dv;
    Heads st;
    begin_item(j, row, h0, heads, &st, acc);
    for (int64_t p = 0; p * page < len; p++) {
        const int64_t base = page_base(j, row, p), n = page_tokens(j, len, p);
        if ((p + 1) * page < len) {
            const int64_t next = page_base(j, row, p + 1), coming = page_tokens(j, len, p + 1);
            for (int64_t t = 0; t < coming; t++) {
                const char *kn = (const char *)(j->k + (next + t) * token_stride + h0 * d);
                const char *vn = (const char *)(j->v + (next + t) * vtoken_stride + h0 * dv);
                for (int64_t off = 0; off < (int64_t)sizeof(float) * (h1 - h0) * d; off += 64)
                    _mm_prefetch(kn + off, _MM_HINT_T0);
                for (int64_t off = 0; off < (int64_t)sizeof(float) * (h1 - h0) * dv; off += 64)
                    _mm_prefetch(vn + off, _MM_HINT_T0);
            }
        }
        for (int64_t h = h0; h < h1; h++) {
            const float *kp = j->k + base * token_stride + h * d, *vp = j->v + base * vtoken_stride + h * dv;
            for (int64_t i0 = 0; i0 < rep; i0 += 4) {
                const int64_t i = (h - h0) * rep + i0, c = rep - i0 < 4 ? rep - i0 : 4;
#define HEADS(C)                                                                                          \
    case C:                                                                                               \
        if (wide)                                                                                         \
            page_heads(j, st.qs + i, kp, vp, n, C, 4, st.m + i, st.l + i, acc + i * dv, s + i);        \
        else                                                                                              \
            page_heads(j, st.qs + i, kp, vp, n, C, 1, st.m + i, st.l + i, acc + i * dv, s + i);        \
        break;
                switch (c) { HEADS(1) HEADS(2) HEADS(3) HEADS(4) }
#undef HEADS
            }
        }
    }
    end_item(j, row, h0, heads, &st, acc);
    return 1;
}
#else
static int attend_vector(const Job *j, int64_t row, int64_t h0, int64_t h1, float *acc, float (*s)[MAX_PAGE]) {
    (void)j, (void)row, (void)h0, (void)h1, (void)acc, (void)s;
    return 0;
}
#endif

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
        const int64_t h0 = j->hkv * g / j->groups, h1 = j->hkv * (g + 1) / j->groups;
        if (!attend_vector(j, row, h0, h1, acc, s)) attend(j, row, h0, h1, acc, s);
    }
    free(acc);
    free(s);
    return NULL;
}

/* torch's OpenMP runtime (libgomp), when decode_kernel.py found it: the kernel's threads are then the engine thread's
   own OpenMP team, whose workers are already spinning between the forward's parallel ops. POSIX threads of our own
   would have to share the CPUs with those spinning workers. */
static void (*gomp_parallel)(void (*)(void *), void *, unsigned, unsigned) = NULL;

void use_openmp(void *parallel) { gomp_parallel = (void (*)(void (*)(void *), void *, unsigned, unsigned))parallel; }

typedef struct {
    const Job *jobs;
    int64_t count, next, failed;
} Team;

/* Each member of the team takes jobs until none is left, so every job runs however many threads the runtime gives. */
static void team_member(void *arg) {
    Team *team = (Team *)arg;
    for (int64_t t; (t = __atomic_fetch_add(&team->next, 1, __ATOMIC_RELAXED)) < team->count;)
        if (run((void *)&team->jobs[t]) != NULL) __atomic_store_n(&team->failed, 1, __ATOMIC_RELAXED);
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
    if (gomp_parallel != NULL && threads > 1) {
        Team team = {jobs, threads, 0, 0};
        gomp_parallel(team_member, &team, (unsigned)threads, 0);
        return team.failed ? -2 : 0;
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
