/* kvxfer's native layer: the per-piece loops that cost too much in Python.
 *
 * - sendv / recvv: scatter/gather socket I/O straight from a plan's extent arrays (region, offset, nbytes) into
 *   registered host regions, IOV_MAX pieces per sendmsg / recvmsg, with the GIL released and no Python object per
 *   piece (building one memoryview per 8 KiB page cost as much as moving it), on a private duplicate of the
 *   socket's descriptor.
 * - gather / scatter: the same extents to and from one contiguous buffer (a bounce or staging buffer), one memcpy
 *   per piece on several threads (numpy's indexed copy went through a temporary: two copies).
 * - gather_blocks / scatter_blocks: a small request's pieces straight from its block ids and one layout side's
 *   piece table, into new bytes or out of a message (building its extents cost more than copying it).
 * - spin_readable: a short busy-wait for a socket to turn readable, GIL released, yielding the core to any other
 *   runnable thread: a thread that blocks in recv is woken by the kernel, and on a virtual machine waking an idle
 *   core costs several loopback round trips (docs/performance.md); a reader that spins for the answer it expects
 *   takes it at once.
 * - check_ids: range and duplicate check of a block-id vector in one pass over a bitmap; affine: a plan's
 *   offsets (ids * stride + offset) in one pass; run_starts: where runs of consecutive ids begin, in one pass.
 *
 * Every extent is checked against its region's bounds before a byte moves: a bad plan is a ValueError, never a
 * write outside registered memory.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define BATCH 1024 /* iovecs per system call: Linux's IOV_MAX */

/* A 1-D vector of 8-byte integers seen through the buffer protocol; stride 0 (a broadcast column) allowed. */
typedef struct {
    Py_buffer view;
    const char *base;
    Py_ssize_t stride, len;
} Vec;

static int vec_get(PyObject *obj, Vec *v, const char *what) {
    if (PyObject_GetBuffer(obj, &v->view, PyBUF_STRIDED_RO | PyBUF_FORMAT) < 0)
        return -1;
    const char *f = v->view.format ? v->view.format : "B";
    if (*f == '<' || *f == '=' || *f == '@')
        f++;
    if (v->view.ndim != 1 || v->view.itemsize != 8 || strchr("qQlLnN", *f) == NULL || f[1] != '\0') {
        PyErr_Format(PyExc_TypeError, "%s: a 1-D vector of 8-byte integers is needed (format %s, %d dims)", what,
                     v->view.format ? v->view.format : "B", v->view.ndim);
        PyBuffer_Release(&v->view);
        return -1;
    }
    v->base = (const char *)v->view.buf;
    v->stride = v->view.strides ? v->view.strides[0] : 8;
    v->len = v->view.shape[0];
    return 0;
}

static inline int64_t vec_at(const Vec *v, Py_ssize_t i) { return *(const int64_t *)(v->base + i * v->stride); }

/* ---- scatter/gather I/O --------------------------------------------------------------------------------------- */

typedef struct {
    Vec bases, sizes, region, offset, nbytes;
    int nvec;
} Extents;

static void ext_release(Extents *e) {
    Vec *all[] = {&e->bases, &e->sizes, &e->region, &e->offset, &e->nbytes};
    for (int i = 0; i < e->nvec; i++)
        PyBuffer_Release(&all[i]->view);
}

/* Bounds-check the vectors (bases, sizes, region, offset, nbytes) in o; the total in *total. */
static int ext_check(PyObject *o[5], Extents *e, uint64_t *total) {
    const char *names[] = {"bases", "sizes", "region", "offset", "nbytes"};
    Vec *all[] = {&e->bases, &e->sizes, &e->region, &e->offset, &e->nbytes};
    e->nvec = 0;
    for (int i = 0; i < 5; i++) {
        if (vec_get(o[i], all[i], names[i]) < 0) {
            ext_release(e);
            return -1;
        }
        e->nvec++;
    }
    if (e->sizes.len != e->bases.len || e->offset.len != e->region.len || e->nbytes.len != e->region.len) {
        PyErr_SetString(PyExc_ValueError, "extent vectors differ in length");
        ext_release(e);
        return -1;
    }
    uint64_t sum = 0;
    for (Py_ssize_t i = 0; i < e->region.len; i++) {
        int64_t r = vec_at(&e->region, i), off = vec_at(&e->offset, i), n = vec_at(&e->nbytes, i);
        if (r < 0 || r >= e->bases.len || off < 0 || n < 0 || (uint64_t)off + (uint64_t)n > (uint64_t)vec_at(&e->sizes, r)) {
            PyErr_Format(PyExc_ValueError, "extent %zd (region %lld, offset %lld, %lld bytes) is outside its region",
                         i, (long long)r, (long long)off, (long long)n);
            ext_release(e);
            return -1;
        }
        sum += (uint64_t)n;
    }
    *total = sum;
    return 0;
}

/* Parse fd, the five extent vectors and a timeout, bounds-checked; the total in *total. */
static int ext_get(PyObject *args, int *fd, Extents *e, int *timeout_ms, uint64_t *total) {
    PyObject *o[5];
    e->nvec = 0;
    if (!PyArg_ParseTuple(args, "iOOOOOi", fd, &o[0], &o[1], &o[2], &o[3], &o[4], timeout_ms))
        return -1;
    return ext_check(o, e, total);
}

/* Move every byte of the extents (send when sending, else receive). Returns 0, or an errno; -1: peer closed. */
static int move(int fd, const Extents *e, int sending, int timeout_ms) {
    struct iovec iov[BATCH];
    Py_ssize_t i = 0, n = e->region.len;
    uint64_t skip = 0; /* bytes of extent i already moved */
    while (i < n) {
        int k = 0;
        for (Py_ssize_t j = i; j < n && k < BATCH; j++) {
            int64_t len = vec_at(&e->nbytes, j) - (j == i ? (int64_t)skip : 0);
            if (len == 0)
                continue;
            char *base = (char *)(uintptr_t)vec_at(&e->bases, vec_at(&e->region, j));
            iov[k].iov_base = base + vec_at(&e->offset, j) + (j == i ? skip : 0);
            iov[k].iov_len = (size_t)len;
            k++;
        }
        if (k == 0)
            return 0;
        struct msghdr msg;
        memset(&msg, 0, sizeof msg);
        msg.msg_iov = iov;
        msg.msg_iovlen = (size_t)k;
        ssize_t got = sending ? sendmsg(fd, &msg, MSG_NOSIGNAL) : recvmsg(fd, &msg, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                struct pollfd p = {fd, sending ? POLLOUT : POLLIN, 0};
                int r = poll(&p, 1, timeout_ms);
                if (r == 0)
                    return EAGAIN;
                if (r < 0 && errno != EINTR)
                    return errno;
                continue;
            }
            return errno;
        }
        if (got == 0 && !sending)
            return -1;
        uint64_t left = (uint64_t)got;
        while (left > 0 && i < n) {
            uint64_t rest = (uint64_t)vec_at(&e->nbytes, i) - skip;
            if (left >= rest) {
                left -= rest;
                skip = 0;
                i++;
            } else {
                skip += left;
                left = 0;
            }
        }
        while (i < n && vec_at(&e->nbytes, i) == 0)
            i++;
    }
    return 0;
}

static PyObject *io(PyObject *args, int sending) {
    int fd, timeout_ms, rc;
    Extents e;
    uint64_t total;
    if (ext_get(args, &fd, &e, &timeout_ms, &total) < 0)
        return NULL;
    /* A private descriptor for the whole move: the caller's number, closed meanwhile by another thread, would be
     * reused by the next socket, pipe or file the process opens, and written into. A shutdown of the socket still
     * stops the move (it acts on the socket, not on a number). */
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) {
        ext_release(&e);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_BEGIN_ALLOW_THREADS rc = move(own, &e, sending, timeout_ms);
    close(own);
    Py_END_ALLOW_THREADS ext_release(&e);
    if (rc == -1) {
        PyErr_SetString(PyExc_EOFError, "connection closed by peer mid-transfer");
        return NULL;
    }
    if (rc == EAGAIN) {
        PyErr_SetString(PyExc_TimeoutError, "timed out");
        return NULL;
    }
    if (rc) {
        errno = rc;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *sendv(PyObject *self, PyObject *args) { return io(args, 1); }
static PyObject *recvv(PyObject *self, PyObject *args) { return io(args, 0); }

/* ---- gather / scatter between extents and one contiguous buffer ----------------------------------------------- */

#define COPY_THREADS 8
#define COPY_MIN (4 << 20) /* bytes each copying thread takes at least */

typedef struct {
    const Extents *e;
    const uint64_t *pre; /* pre[i]: the stream position of extent i; pre[n]: the total */
    char *buf;
    int gathering;
    uint64_t lo, hi; /* this thread's bytes of the stream */
} Part;

static void *copy_part(void *arg) {
    const Part *p = arg;
    Py_ssize_t a = 0, b = p->e->region.len;
    while (a < b) { /* the first extent ending after lo */
        Py_ssize_t mid = a + (b - a) / 2;
        if (p->pre[mid + 1] <= p->lo)
            a = mid + 1;
        else
            b = mid;
    }
    for (Py_ssize_t i = a; i < p->e->region.len && p->pre[i] < p->hi; i++) {
        uint64_t s = p->pre[i] > p->lo ? p->pre[i] : p->lo, t = p->pre[i + 1] < p->hi ? p->pre[i + 1] : p->hi;
        if (t <= s)
            continue;
        char *mem = (char *)(uintptr_t)vec_at(&p->e->bases, vec_at(&p->e->region, i)) + vec_at(&p->e->offset, i) +
                    (s - p->pre[i]);
        if (p->gathering)
            memcpy(p->buf + s, mem, t - s);
        else
            memcpy(mem, p->buf + s, t - s);
    }
    return NULL;
}

/* Copy every byte of the extents, in stream order, into buf (gathering) or out of it, on up to `threads` threads
 * cutting the stream into equal byte ranges. 0, or -1 out of memory. */
static int copy_all(const Extents *e, char *buf, int gathering, uint64_t total, int threads) {
    Py_ssize_t n = e->region.len;
    uint64_t *pre = malloc(((size_t)n + 1) * 8);
    if (pre == NULL)
        return -1;
    pre[0] = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        pre[i + 1] = pre[i] + (uint64_t)vec_at(&e->nbytes, i);
    uint64_t most = total / COPY_MIN;
    int k = threads < 1 ? 1 : threads > COPY_THREADS ? COPY_THREADS : threads;
    if ((uint64_t)k > most)
        k = most < 1 ? 1 : (int)most;
    Part parts[COPY_THREADS];
    pthread_t tids[COPY_THREADS];
    int started[COPY_THREADS] = {0};
    for (int t = 0; t < k; t++)
        parts[t] = (Part){e, pre, buf, gathering, total * (uint64_t)t / (uint64_t)k, total * (uint64_t)(t + 1) / (uint64_t)k};
    for (int t = 1; t < k; t++)
        started[t] = pthread_create(&tids[t], NULL, copy_part, &parts[t]) == 0;
    copy_part(&parts[0]);
    for (int t = 1; t < k; t++) {
        if (started[t])
            pthread_join(tids[t], NULL);
        else
            copy_part(&parts[t]); /* no thread to be had: this one copies that part too */
    }
    free(pre);
    return 0;
}

static PyObject *copy(PyObject *args, int gathering) {
    PyObject *o[5], *bufobj;
    int threads;
    Extents e;
    uint64_t total;
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "OOOOOOi", &o[0], &o[1], &o[2], &o[3], &o[4], &bufobj, &threads))
        return NULL;
    if (ext_check(o, &e, &total) < 0)
        return NULL;
    if (PyObject_GetBuffer(bufobj, &buf, (gathering ? PyBUF_WRITABLE : 0) | PyBUF_C_CONTIGUOUS) < 0) {
        ext_release(&e);
        return NULL;
    }
    if ((uint64_t)buf.len < total) {
        PyErr_Format(PyExc_ValueError, "the buffer holds %zd bytes, the extents %llu", buf.len,
                     (unsigned long long)total);
        PyBuffer_Release(&buf);
        ext_release(&e);
        return NULL;
    }
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = copy_all(&e, buf.buf, gathering, total, threads);
    Py_END_ALLOW_THREADS PyBuffer_Release(&buf);
    ext_release(&e);
    if (rc < 0)
        return PyErr_NoMemory();
    return PyLong_FromUnsignedLongLong(total);
}

static PyObject *gather(PyObject *self, PyObject *args) { return copy(args, 1); }
static PyObject *scatter(PyObject *self, PyObject *args) { return copy(args, 0); }

/* ---- gather / scatter straight from block ids (a small request's inline bytes) -------------------------------- */

/* Every (piece k, block ids[j]) of one layout side, piece-major (the stream order of that side's extents):
 * bases[region[k]] + offset[k] + ids[j] * stride[k], nbytes[k] bytes. blocks_total checks each against its
 * region and returns their total (-1 with a ValueError set when one is outside); blocks_copy then copies them
 * into buf (gathering) or out of it. The extents of a small request cost more to build than to copy. */
static int64_t blocks_total(const Vec *bases, const Vec *sizes, const Vec *region, const Vec *offset,
                            const Vec *stride, const Vec *nbytes, const Vec *ids) {
    Py_ssize_t p = region->len, n = ids->len;
    if (offset->len != p || stride->len != p || nbytes->len != p || sizes->len != bases->len) {
        PyErr_SetString(PyExc_ValueError, "piece vectors differ in length");
        return -1;
    }
    int64_t total = 0;
    for (Py_ssize_t k = 0; k < p; k++) {
        int64_t r = vec_at(region, k), off = vec_at(offset, k), st = vec_at(stride, k), nb = vec_at(nbytes, k);
        if (r < 0 || r >= bases->len || off < 0 || st < 0 || nb < 0) {
            PyErr_Format(PyExc_ValueError, "piece %zd (region %lld) is not a piece of these regions", k, (long long)r);
            return -1;
        }
        int64_t size = vec_at(sizes, r);
        for (Py_ssize_t j = 0; j < n; j++) {
            int64_t id = vec_at(ids, j), at, end;
            if (id < 0 || __builtin_mul_overflow(id, st, &at) || __builtin_add_overflow(at, off, &at) ||
                __builtin_add_overflow(at, nb, &end) || end > size) {
                PyErr_Format(PyExc_ValueError, "block %lld, piece %zd is outside region %lld", (long long)id, k,
                             (long long)r);
                return -1;
            }
        }
        int64_t piece;
        if (__builtin_mul_overflow(nb, (int64_t)n, &piece) || __builtin_add_overflow(total, piece, &total)) {
            PyErr_SetString(PyExc_ValueError, "the blocks hold more bytes than a buffer can");
            return -1;
        }
    }
    return total;
}

static void blocks_copy(const Vec *bases, const Vec *region, const Vec *offset, const Vec *stride, const Vec *nbytes,
                        const Vec *ids, char *buf, int gathering) {
    char *at = buf;
    for (Py_ssize_t k = 0; k < region->len; k++) {
        char *base = (char *)(uintptr_t)vec_at(bases, vec_at(region, k)) + vec_at(offset, k);
        int64_t st = vec_at(stride, k), nb = vec_at(nbytes, k);
        for (Py_ssize_t j = 0; j < ids->len; j++, at += nb) {
            char *mem = base + vec_at(ids, j) * st;
            if (gathering)
                memcpy(at, mem, nb);
            else
                memcpy(mem, at, nb);
        }
    }
}

/* gather_blocks(bases, sizes, region, offset, stride, nbytes, ids) -> bytes;
 * scatter_blocks(bases, sizes, region, offset, stride, nbytes, ids, src) -> None. */
static PyObject *blocks(PyObject *args, int gathering) {
    PyObject *o[7], *srcobj = NULL, *out = NULL;
    const char *names[] = {"bases", "sizes", "region", "offset", "stride", "nbytes", "ids"};
    Vec v[7];
    int got = 0;
    Py_buffer src;
    if (gathering ? !PyArg_ParseTuple(args, "OOOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6])
                  : !PyArg_ParseTuple(args, "OOOOOOOO", &o[0], &o[1], &o[2], &o[3], &o[4], &o[5], &o[6], &srcobj))
        return NULL;
    for (; got < 7; got++)
        if (vec_get(o[got], &v[got], names[got]) < 0)
            goto done;
    int64_t total = blocks_total(&v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6]);
    if (total < 0)
        goto done;
    if (gathering) {
        out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)total);
        if (out != NULL)
            blocks_copy(&v[0], &v[2], &v[3], &v[4], &v[5], &v[6], PyBytes_AS_STRING(out), 1);
    } else if (PyObject_GetBuffer(srcobj, &src, PyBUF_C_CONTIGUOUS) == 0) {
        if (src.len != total)
            PyErr_Format(PyExc_ValueError, "the buffer holds %zd bytes, the blocks %lld", src.len, (long long)total);
        else {
            blocks_copy(&v[0], &v[2], &v[3], &v[4], &v[5], &v[6], src.buf, 0);
            out = Py_NewRef(Py_None);
        }
        PyBuffer_Release(&src);
    }
done:
    for (int i = 0; i < got; i++)
        PyBuffer_Release(&v[i].view);
    return out;
}

static PyObject *gather_blocks(PyObject *self, PyObject *args) { return blocks(args, 1); }
static PyObject *scatter_blocks(PyObject *self, PyObject *args) { return blocks(args, 0); }

/* ---- block ids ------------------------------------------------------------------------------------------------ */

static int cmp64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* 0: every id in [0, num_blocks) and none repeated; 1: one out of range; 2: one repeated; -1: out of memory. */
static int check(const Vec *v, uint64_t num_blocks) {
    Py_ssize_t n = v->len;
    uint64_t dense = (uint64_t)(n > (1 << 18) ? n : (1 << 18)) * 64; /* a bitmap up to 8 bytes per id */
    if (num_blocks <= dense) {
        /* one pass: the range check and a branch-free test-and-set in a bitmap of num_blocks bits */
        uint64_t *seen = calloc((num_blocks >> 6) + 1, 8), dup = 0;
        if (seen == NULL)
            return -1;
        int status = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t x = (uint64_t)vec_at(v, i);
            if (x >= num_blocks) {
                status = 1;
                break;
            }
            uint64_t w = seen[x >> 6], bit = 1ULL << (x & 63);
            dup |= w & bit;
            seen[x >> 6] = w | bit;
        }
        free(seen);
        return status ? status : dup ? 2 : 0;
    }
    /* few ids in a huge range: sort a copy */
    int64_t *c = malloc((size_t)n * 8 + 8);
    if (c == NULL)
        return -1;
    int status = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        c[i] = vec_at(v, i);
        if ((uint64_t)c[i] >= num_blocks)
            status = 1;
    }
    if (!status) {
        qsort(c, (size_t)n, 8, cmp64);
        for (Py_ssize_t i = 1; i < n && !status; i++)
            status = c[i] == c[i - 1] ? 2 : 0;
    }
    free(c);
    return status;
}

/* check_ids(ids, num_blocks) -> 0 fine, 1 an id outside [0, num_blocks), 2 a repeated id. */
static PyObject *check_ids(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long long num_blocks;
    Vec v;
    int status;
    if (!PyArg_ParseTuple(args, "OK", &obj, &num_blocks) || vec_get(obj, &v, "ids") < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS status = check(&v, num_blocks);
    Py_END_ALLOW_THREADS PyBuffer_Release(&v.view);
    if (status < 0)
        return PyErr_NoMemory();
    return PyLong_FromLong(status);
}

/* affine(ids, stride, offset, out): out[i] = ids[i] * stride + offset, one pass (numpy needs two and a temporary). */
static PyObject *affine(PyObject *self, PyObject *args) {
    PyObject *src, *dst;
    long long stride, offset;
    Vec v;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "OLLO", &src, &stride, &offset, &dst) || vec_get(src, &v, "ids") < 0)
        return NULL;
    if (PyObject_GetBuffer(dst, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&v.view);
        return NULL;
    }
    if (out.itemsize != 8 || out.len != v.len * 8) {
        PyErr_SetString(PyExc_ValueError, "out must hold one 8-byte integer per id");
        PyBuffer_Release(&out);
        PyBuffer_Release(&v.view);
        return NULL;
    }
    int64_t *o = (int64_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < v.len; i++) o[i] = vec_at(&v, i) * stride + offset;
    Py_END_ALLOW_THREADS PyBuffer_Release(&out);
    PyBuffer_Release(&v.view);
    Py_RETURN_NONE;
}

/* run_starts(a, b, out) -> k: out[:k] = the positions i where a run of consecutive ids begins on either side
 * (i == 0, or a[i] != a[i-1] + 1, or b[i] != b[i-1] + 1), one pass and no temporaries (numpy needs six). */
static PyObject *run_starts(PyObject *self, PyObject *args) {
    PyObject *pa, *pb, *dst;
    Vec a, b;
    Py_buffer out;
    if (!PyArg_ParseTuple(args, "OOO", &pa, &pb, &dst) || vec_get(pa, &a, "a") < 0)
        return NULL;
    if (vec_get(pb, &b, "b") < 0) {
        PyBuffer_Release(&a.view);
        return NULL;
    }
    if (PyObject_GetBuffer(dst, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&b.view);
        PyBuffer_Release(&a.view);
        return NULL;
    }
    Py_ssize_t n = a.len, k = 0;
    if (b.len != n || out.itemsize != 8 || out.len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "a, b and out must have one 8-byte integer per id each");
        PyBuffer_Release(&out);
        PyBuffer_Release(&b.view);
        PyBuffer_Release(&a.view);
        return NULL;
    }
    int64_t *o = (int64_t *)out.buf;
    Py_BEGIN_ALLOW_THREADS for (Py_ssize_t i = 0; i < n; i++) {
        if (i == 0 || vec_at(&a, i) != vec_at(&a, i - 1) + 1 || vec_at(&b, i) != vec_at(&b, i - 1) + 1)
            o[k++] = i;
    }
    Py_END_ALLOW_THREADS PyBuffer_Release(&out);
    PyBuffer_Release(&b.view);
    PyBuffer_Release(&a.view);
    return PyLong_FromSsize_t(k);
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static PyObject *spin_readable(PyObject *self, PyObject *args) {
    int fd;
    Py_buffer until;
    if (!PyArg_ParseTuple(args, "iw*", &fd, &until))
        return NULL;
    if (fd < 0 || until.len != sizeof(int64_t) || ((uintptr_t)until.buf % sizeof(int64_t))) {
        PyBuffer_Release(&until);
        PyErr_SetString(PyExc_ValueError, "spin_readable: an open socket and one aligned 8-byte deadline");
        return NULL;
    }
    const int64_t *end = until.buf; /* others may move it later while we spin: read it every time */
    int ready = 0;
    Py_BEGIN_ALLOW_THREADS;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    do {
        if (poll(&p, 1, 0) > 0) { /* readable, closed or failed: the read that follows says which */
            ready = 1;
            break;
        }
        sched_yield();
    } while (now_ns() < __atomic_load_n(end, __ATOMIC_RELAXED));
    Py_END_ALLOW_THREADS;
    PyBuffer_Release(&until);
    return PyBool_FromLong(ready);
}

static PyMethodDef methods[] = {
    {"sendv", sendv, METH_VARARGS,
     "sendv(fd, bases, sizes, region, offset, nbytes, timeout_ms) -> bytes sent: gather-send every extent"},
    {"recvv", recvv, METH_VARARGS,
     "recvv(fd, bases, sizes, region, offset, nbytes, timeout_ms) -> bytes received: scatter-receive every extent"},
    {"gather", gather, METH_VARARGS,
     "gather(bases, sizes, region, offset, nbytes, out, threads) -> bytes: every extent, in order, into out"},
    {"scatter", scatter, METH_VARARGS,
     "scatter(bases, sizes, region, offset, nbytes, src, threads) -> bytes: src, in order, into every extent"},
    {"gather_blocks", gather_blocks, METH_VARARGS,
     "gather_blocks(bases, sizes, region, offset, stride, nbytes, ids) -> bytes: every piece of every block"},
    {"scatter_blocks", scatter_blocks, METH_VARARGS,
     "scatter_blocks(bases, sizes, region, offset, stride, nbytes, ids, src): src into every piece of every block"},
    {"spin_readable", spin_readable, METH_VARARGS,
     "spin_readable(fd, until) -> bool: whether fd turned readable before the monotonic ns in until (an int64 "
     "buffer others may move on; busy-wait, GIL released)"},
    {"affine", affine, METH_VARARGS, "affine(ids, stride, offset, out): out = ids * stride + offset"},
    {"check_ids", check_ids, METH_VARARGS, "check_ids(ids, num_blocks) -> 0 fine, 1 out of range, 2 repeated"},
    {"run_starts", run_starts, METH_VARARGS, "run_starts(a, b, out) -> k: out[:k] = where runs of consecutive ids begin"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_kvx", "kvxfer's native loops", -1, methods};

PyMODINIT_FUNC PyInit__kvx(void) { return PyModule_Create(&module); }
