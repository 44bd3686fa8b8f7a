/* kvtier._chain: chained xxh3-128 block keys in one C call.
 *
 * chain_xxh3(data, block_tokens, parent) -> list[bytes]
 *
 *   data          bytes-like, the tokens as little-endian uint32 (len % 4 == 0)
 *   block_tokens  tokens per block (> 0); a partial trailing block is not keyed
 *   parent        the 16-byte key before the first block (key_{-1})
 *
 * key_i = XXH3_128bits(key_{i-1} || block_i), as the 16-byte canonical (big-endian)
 * digest, exactly what python's xxhash.xxh3_128_digest returns, so the keys match
 * kvtier.keys' Python path bit for bit. The hash is the real xxHash implementation
 * (kvtier/_vendor/xxhash/xxhash.h, inlined), not a rewrite.
 *
 * The chain is computed with the GIL released (for more than a few blocks) into a
 * scratch array, then turned into a list of 16-byte bytes objects: building the list
 * here costs less than returning one n*16 bytes object and slicing it in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#define XXH_INLINE_ALL
#include "xxhash.h"

/* On x86, the checksum goes through xxHash's own runtime dispatch (xxh_x86dispatch.c,
 * compiled alongside by setup.py): AVX2 where the CPU has it, ~2x the SSE2 baseline that
 * a portable build otherwise gets (22 -> 45 GB/s on a 1 MiB block in cache here). The
 * keys stay on the inlined baseline: they hash 64-byte blocks, where vectors do not pay. */
#ifdef KVTIER_XXH_DISPATCH
#define XXH_DISPATCH_DISABLE_REPLACE
#include "xxh_x86dispatch.h"
#define BLOCK_XXH3_64 XXH3_64bits_dispatch
#else
#define BLOCK_XXH3_64 XXH3_64bits
#endif

#define KEY_BYTES 16
/* Below this many blocks the chain takes under a microsecond (~10 ns a block):
 * releasing and re-taking the GIL would cost more than it lets other threads gain. */
#define NOGIL_MIN_BLOCKS 64

/* out[i*16 .. i*16+16) = key_i for i in [0, n). buf has room for 16 + step bytes. */
static void
chain(const unsigned char *data, Py_ssize_t step, Py_ssize_t n,
      const unsigned char *parent, unsigned char *buf, unsigned char *out)
{
    const unsigned char *prev = parent;
    for (Py_ssize_t i = 0; i < n; i++) {
        memcpy(buf, prev, KEY_BYTES);
        memcpy(buf + KEY_BYTES, data + i * step, (size_t)step);
        XXH128_hash_t h = XXH3_128bits(buf, (size_t)(KEY_BYTES + step));
        XXH128_canonicalFromHash((XXH128_canonical_t *)(out + i * KEY_BYTES), h);
        prev = out + i * KEY_BYTES;
    }
}

static PyObject *
chain_xxh3(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *kwlist[] = {"data", "block_tokens", "parent", NULL};
    Py_buffer data, parent;
    Py_ssize_t block_tokens;
    PyObject *result = NULL;
    unsigned char *scratch = NULL;
    (void)self;

    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*ny*:chain_xxh3", kwlist,
                                     &data, &block_tokens, &parent))
        return NULL;

    if (data.len % 4 != 0) {
        PyErr_Format(PyExc_ValueError,
                     "chain_xxh3: data must be little-endian uint32 tokens, "
                     "its length (%zd bytes) is not a multiple of 4", data.len);
        goto done;
    }
    if (block_tokens <= 0) {
        PyErr_Format(PyExc_ValueError,
                     "chain_xxh3: block_tokens must be positive, got %zd", block_tokens);
        goto done;
    }
    if (parent.len != KEY_BYTES) {
        PyErr_Format(PyExc_ValueError,
                     "chain_xxh3: parent key must be exactly %d bytes, got %zd",
                     KEY_BYTES, parent.len);
        goto done;
    }

    /* Blocks of 4 * block_tokens bytes; a block larger than data means no full block
     * (and also rules out overflow of 4 * block_tokens below). */
    Py_ssize_t ntok = data.len / 4;
    Py_ssize_t n = block_tokens > ntok ? 0 : ntok / block_tokens;
    Py_ssize_t step = 4 * (n ? block_tokens : 0);

    result = PyList_New(n);
    if (result == NULL || n == 0)
        goto done;

    /* One allocation: n keys, then the (16 + step)-byte hash input buffer. */
    scratch = PyMem_RawMalloc((size_t)(n * KEY_BYTES + KEY_BYTES + step));
    if (scratch == NULL) {
        Py_CLEAR(result);
        PyErr_NoMemory();
        goto done;
    }
    unsigned char *out = scratch;
    unsigned char *buf = scratch + n * KEY_BYTES;
    const unsigned char *src = (const unsigned char *)data.buf;
    const unsigned char *par = (const unsigned char *)parent.buf;

    if (n >= NOGIL_MIN_BLOCKS) {
        /* The Py_buffer exports keep data and parent alive and unresizable meanwhile. */
        Py_BEGIN_ALLOW_THREADS
        chain(src, step, n, par, buf, out);
        Py_END_ALLOW_THREADS
    }
    else {
        chain(src, step, n, par, buf, out);
    }

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *key = PyBytes_FromStringAndSize((const char *)(out + i * KEY_BYTES),
                                                  KEY_BYTES);
        if (key == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, key);
    }

done:
    PyMem_RawFree(scratch);
    PyBuffer_Release(&data);
    PyBuffer_Release(&parent);
    return result;
}

PyDoc_STRVAR(chain_xxh3_doc,
"chain_xxh3(data, block_tokens, parent) -> list[bytes]\n\n"
"Chained xxh3-128 keys of the full blocks of `data` (tokens as little-endian\n"
"uint32, len(data) % 4 == 0), `block_tokens` tokens a block, starting from the\n"
"16-byte `parent`: key_i = xxh3_128_digest(key_{i-1} + block_i). A partial\n"
"trailing block is not keyed. Raises ValueError on a bad length, block size or\n"
"parent.");

/* xxh3_64(data) -> int: the block checksum the disk tier records, with the GIL released
 * for large buffers so the I/O threads writing those blocks keep running meanwhile
 * (python-xxhash holds the GIL while it hashes). Same value as xxhash.xxh3_64_intdigest. */
static PyObject *
xxh3_64(PyObject *self, PyObject *arg)
{
    Py_buffer data;
    XXH64_hash_t h;
    (void)self;
    if (PyObject_GetBuffer(arg, &data, PyBUF_SIMPLE) < 0)
        return NULL;
    if (data.len >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        h = BLOCK_XXH3_64(data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    }
    else {
        h = BLOCK_XXH3_64(data.buf, (size_t)data.len);
    }
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong((unsigned long long)h);
}

/* xxh3_64_many(blocks) -> list[int]: xxh3_64 of each buffer in a sequence, all hashed
 * under one release of the GIL. Speed: the disk tier checksums a put's blocks while its I/O
 * threads write them; one GIL hand-off per 1 MiB block (512 for a 512 MiB put) delayed the
 * I/O threads' next syscalls (0.90 -> 0.97 of raw O_DIRECT, measured with 1 MiB blocks). */
static PyObject *
xxh3_64_many(PyObject *self, PyObject *arg)
{
    (void)self;
    PyObject *seq = PySequence_Fast(arg, "xxh3_64_many expects a sequence of buffers");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_buffer *views = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(Py_buffer));
    unsigned long long *sums = PyMem_Calloc(n > 0 ? (size_t)n : 1, sizeof(unsigned long long));
    PyObject *out = NULL;
    Py_ssize_t got = 0;
    size_t total = 0;
    if (views == NULL || sums == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; got < n; got++) {
        if (PyObject_GetBuffer(items[got], &views[got], PyBUF_SIMPLE) < 0)
            goto done;
        total += (size_t)views[got].len;
    }
    if (total >= (1 << 16)) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n; i++)
            sums[i] = (unsigned long long)BLOCK_XXH3_64(views[i].buf, (size_t)views[i].len);
        Py_END_ALLOW_THREADS
    }
    else {
        for (Py_ssize_t i = 0; i < n; i++)
            sums[i] = (unsigned long long)BLOCK_XXH3_64(views[i].buf, (size_t)views[i].len);
    }
    out = PyList_New(n);
    if (out == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(sums[i]);
        if (v == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, v);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(sums);
    Py_DECREF(seq);
    return out;
}

static PyMethodDef chain_methods[] = {
    {"chain_xxh3", (PyCFunction)(void (*)(void))chain_xxh3, METH_VARARGS | METH_KEYWORDS,
     chain_xxh3_doc},
    {"xxh3_64", xxh3_64, METH_O,
     "xxh3_64(data) -> int: XXH3-64 of a contiguous buffer (seed 0), GIL released for large ones."},
    {"xxh3_64_many", xxh3_64_many, METH_O,
     "xxh3_64_many(blocks) -> list[int]: xxh3_64 of each contiguous buffer, under one release of the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef chain_module = {
    PyModuleDef_HEAD_INIT,
    "kvtier._chain",
    "Native chained xxh3-128 block keys (optional accelerator for kvtier.keys).",
    -1,
    chain_methods,
};

PyMODINIT_FUNC
PyInit__chain(void)
{
    PyObject *m = PyModule_Create(&chain_module);
    if (m == NULL)
        return NULL;
#ifdef KVTIER_XXH_DISPATCH
    const int dispatch = 1;
#else
    const int dispatch = 0;
#endif
    if (PyModule_AddIntConstant(m, "XXH_VERSION_NUMBER", XXH_VERSION_NUMBER) < 0
        || PyModule_AddIntConstant(m, "XXH_DISPATCH", dispatch) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
