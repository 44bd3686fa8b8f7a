/* kvtier._mla: MLA's absorbed attention read straight from the paged KV pool, on a CPU.
 *
 * attend(out, q, pool, rows, lens, offset, heads, width, rank, scale) -> None
 *
 *   out    float32 [N, heads, rank], written: sum_s softmax_s(scale * q_h . row_s) row_s[:rank]
 *   q      float32 [N, heads, width]: each query's absorbed heads [W_UK^T q_nope, q_pe]
 *   pool   float32 [R, width]: every KV row of the pool (kv_pool viewed as rows)
 *   rows   int64 [N, K]: the pool row of each key position of each query, before `offset`
 *          is added (the engine passes layer 0's rows and layer * block_tokens)
 *   lens   int64 [N]: query n sees keys rows[n, :lens[n]] (its causal length; 1 <= lens[n] <= K)
 *
 * Why: with torch ops a decode step gathers every sequence's rows into a padded tensor
 * (one copy of all of them), then two batched matmuls read that copy twice (scores, then
 * probabilities x latents). Here each row is read from the pool where it lies, once per
 * block of keys, for every head at once: scores of a block of 32 keys, an online softmax
 * (flash style: the running max and sum are rescaled per block), then the weighted sum
 * of the same rows while they are still in cache.
 *
 * Every row index and length is checked before anything is read (ValueError). One thread,
 * the GIL released. AVX2 + FMA where the CPU has them (gcc's target_clones picks at load),
 * plain C elsewhere; the sums are in a different order than a BLAS matmul's (fp32 rounding).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 32      /* keys per block: 32 rows of 576 floats (74 KB) stay in L2 between the two passes */
#define GROUP 4       /* heads computed together: each row chunk is loaded once for 4 heads */

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

typedef float v8 __attribute__((vector_size(32)));   /* 8 floats: one AVX register, two SSE ones */

#pragma GCC diagnostic ignored "-Wpsabi"        /* v8 helpers are always inlined: no ABI crosses */

static inline v8
load8(const float *p)
{
    v8 v;
    memcpy(&v, p, sizeof v);                  /* unaligned load */
    return v;
}

static inline float
hsum8(v8 v)
{
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* One query's GROUP heads qg [GROUP, width] (zero rows past the real ones) over its keys;
 * writes out [g, rank]. acc: GROUP * rank floats, p: GROUP * BLOCK floats of scratch. */
CLONES static void
attend_group(const float *qg, int g, const float *pool, const int64_t *rows, int64_t offset, int64_t len,
             int width, int rank, float scale, float *out, float *acc, float *p)
{
    float m[GROUP], l[GROUP];
    for (int h = 0; h < GROUP; h++) {
        m[h] = -INFINITY;
        l[h] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * GROUP * (size_t)rank);
    const float *q0 = qg, *q1 = qg + width, *q2 = qg + 2 * width, *q3 = qg + 3 * width;
    int w8 = width & ~7;
    for (int64_t kb = 0; kb < len; kb += BLOCK) {
        int nb = (int)(len - kb < BLOCK ? len - kb : BLOCK);
        const float *r[BLOCK];
        for (int j = 0; j < nb; j++)
            r[j] = pool + (rows[kb + j] + offset) * (int64_t)width;
        /* scores: each row chunk is loaded once for the 4 heads */
        for (int j = 0; j < nb; j++) {
            /* two chunks per iteration: 8 independent FMA chains hide the FMA latency */
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            const float *rj = r[j];
            int d = 0;
            for (; d + 16 <= w8; d += 16) {
                v8 x = load8(rj + d), y = load8(rj + d + 8);
                a0 += load8(q0 + d) * x;
                a1 += load8(q1 + d) * x;
                a2 += load8(q2 + d) * x;
                a3 += load8(q3 + d) * x;
                b0 += load8(q0 + d + 8) * y;
                b1 += load8(q1 + d + 8) * y;
                b2 += load8(q2 + d + 8) * y;
                b3 += load8(q3 + d + 8) * y;
            }
            for (; d < w8; d += 8) {
                v8 x = load8(rj + d);
                a0 += load8(q0 + d) * x;
                a1 += load8(q1 + d) * x;
                a2 += load8(q2 + d) * x;
                a3 += load8(q3 + d) * x;
            }
            a0 += b0;
            a1 += b1;
            a2 += b2;
            a3 += b3;
            float s0 = hsum8(a0), s1 = hsum8(a1), s2 = hsum8(a2), s3 = hsum8(a3);
            for (int d = w8; d < width; d++) {
                s0 += q0[d] * rj[d];
                s1 += q1[d] * rj[d];
                s2 += q2[d] * rj[d];
                s3 += q3[d] * rj[d];
            }
            p[j] = s0 * scale;
            p[BLOCK + j] = s1 * scale;
            p[2 * BLOCK + j] = s2 * scale;
            p[3 * BLOCK + j] = s3 * scale;
        }
        /* online softmax: the new running max; what was summed so far is rescaled */
        float c[GROUP];
        for (int h = 0; h < GROUP; h++) {
            float *ph = p + h * BLOCK;
            float mx = m[h];
            for (int j = 0; j < nb; j++)
                mx = ph[j] > mx ? ph[j] : mx;
            c[h] = m[h] == -INFINITY ? 0.0f : expf(m[h] - mx);
            float sum = 0.0f;
            for (int j = 0; j < nb; j++) {
                ph[j] = expf(ph[j] - mx);
                sum += ph[j];
            }
            l[h] = l[h] * c[h] + sum;
            m[h] = mx;
        }
        /* weighted sum of the block's latents: each accumulator chunk stays in registers over
         * the block's rows (still in cache from the scores) */
        int r16 = rank & ~15;
        for (int d = 0; d < r16; d += 16) {      /* two chunks: 8 independent FMA chains */
            v8 a0 = load8(acc + d) * c[0], a1 = load8(acc + rank + d) * c[1];
            v8 a2 = load8(acc + 2 * rank + d) * c[2], a3 = load8(acc + 3 * rank + d) * c[3];
            v8 b0 = load8(acc + d + 8) * c[0], b1 = load8(acc + rank + d + 8) * c[1];
            v8 b2 = load8(acc + 2 * rank + d + 8) * c[2], b3 = load8(acc + 3 * rank + d + 8) * c[3];
            for (int j = 0; j < nb; j++) {
                v8 x = load8(r[j] + d), y = load8(r[j] + d + 8);
                float w0 = p[j], w1 = p[BLOCK + j], w2 = p[2 * BLOCK + j], w3 = p[3 * BLOCK + j];
                a0 += w0 * x;
                a1 += w1 * x;
                a2 += w2 * x;
                a3 += w3 * x;
                b0 += w0 * y;
                b1 += w1 * y;
                b2 += w2 * y;
                b3 += w3 * y;
            }
            memcpy(acc + d, &a0, sizeof a0);
            memcpy(acc + rank + d, &a1, sizeof a1);
            memcpy(acc + 2 * rank + d, &a2, sizeof a2);
            memcpy(acc + 3 * rank + d, &a3, sizeof a3);
            memcpy(acc + d + 8, &b0, sizeof b0);
            memcpy(acc + rank + d + 8, &b1, sizeof b1);
            memcpy(acc + 2 * rank + d + 8, &b2, sizeof b2);
            memcpy(acc + 3 * rank + d + 8, &b3, sizeof b3);
        }
        for (int d = r16; d < rank; d++) {
            for (int h = 0; h < GROUP; h++) {
                float a = acc[h * rank + d] * c[h];
                for (int j = 0; j < nb; j++)
                    a += p[h * BLOCK + j] * r[j][d];
                acc[h * rank + d] = a;
            }
        }
    }
    for (int h = 0; h < g; h++) {
        float inv = 1.0f / l[h];
        for (int d = 0; d < rank; d++)
            out[(size_t)h * rank + d] = acc[(size_t)h * rank + d] * inv;
    }
}

static PyObject *
attend(PyObject *self, PyObject *args)
{
    Py_buffer out, q, pool, rows, lens;
    Py_ssize_t offset, heads, width, rank;
    double scale;
    PyObject *result = NULL;
    (void)self;

    if (!PyArg_ParseTuple(args, "w*y*y*y*y*nnnnd:attend", &out, &q, &pool, &rows, &lens, &offset, &heads, &width,
                          &rank, &scale))
        return NULL;
    Py_ssize_t n = lens.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t fs = (Py_ssize_t)sizeof(float);
    if (heads <= 0 || width <= 0 || rank <= 0 || rank > width || n <= 0 || lens.len % (Py_ssize_t)sizeof(int64_t)
        || rows.len % (n * (Py_ssize_t)sizeof(int64_t)) || q.len != n * heads * width * fs
        || out.len != n * heads * rank * fs || pool.len % (width * fs)) {
        PyErr_SetString(PyExc_ValueError, "attend: buffer sizes do not match [N, heads, width] queries, "
                                          "[N, K] rows, [N] lens, [N, heads, rank] out and [R, width] pool");
        goto done;
    }
    Py_ssize_t k = rows.len / (n * (Py_ssize_t)sizeof(int64_t));
    int64_t nrows = pool.len / (width * fs);
    const int64_t *rw = (const int64_t *)rows.buf, *ln = (const int64_t *)lens.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (ln[i] < 1 || ln[i] > k) {
            PyErr_Format(PyExc_ValueError, "attend: lens[%zd] = %lld is not in [1, %zd]", i, (long long)ln[i], k);
            goto done;
        }
        for (int64_t j = 0; j < ln[i]; j++) {
            int64_t row = rw[i * k + j] + offset;
            if (row < 0 || row >= nrows) {
                PyErr_Format(PyExc_ValueError, "attend: row %lld is outside the pool's %lld rows",
                             (long long)row, (long long)nrows);
                goto done;
            }
        }
    }
    float *acc = malloc(sizeof(float) * (size_t)(GROUP * rank + GROUP * BLOCK + GROUP * width));
    if (acc == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        for (Py_ssize_t h = 0; h < heads; h += GROUP) {
            int g = (int)(heads - h < GROUP ? heads - h : GROUP);
            float *qg = acc + GROUP * rank + GROUP * BLOCK;          /* the group's queries, zero-padded */
            memcpy(qg, (const float *)q.buf + (i * heads + h) * width, sizeof(float) * (size_t)(g * width));
            memset(qg + g * width, 0, sizeof(float) * (size_t)((GROUP - g) * width));
            attend_group(qg, g, (const float *)pool.buf, rw + i * k, offset, ln[i], (int)width, (int)rank, (float)scale,
                         (float *)out.buf + (i * heads + h) * rank, acc, acc + GROUP * rank);
        }
    }
    Py_END_ALLOW_THREADS
    free(acc);
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&out);
    PyBuffer_Release(&q);
    PyBuffer_Release(&pool);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&lens);
    return result;
}

static PyMethodDef methods[] = {
    {"attend", attend, METH_VARARGS,
     "attend(out, q, pool, rows, lens, offset, heads, width, rank, scale): MLA absorbed attention of each "
     "query over pool[rows[n, :lens[n]] + offset], written to out [N, heads, rank]; indices checked first, "
     "GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "kvtier._mla", NULL, -1, methods};

PyMODINIT_FUNC
PyInit__mla(void)
{
    return PyModule_Create(&module);
}
