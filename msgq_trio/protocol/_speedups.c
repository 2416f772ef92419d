/*
 * Compiled fast paths of msgq_trio/protocol/framing.py (optional; see ARCHITECTURE.md).
 *
 * framing.py is the reference: every function here does exactly what a named piece of
 * it does, for the common case only, and hands anything else to that Python code (or
 * stops where the Python caller's careful path takes over). It never raises a protocol
 * error of its own, so the errors, their messages and their codes stay those of the
 * Python code. tests/protocol/test_speedups.py feeds both the same random streams.
 *
 *   scan(buf, pos, limit, source, out, seen) -> (pos, seen, bad_target)
 *       the fast loop of FrameParser._scan (framing._scan_loop_py).
 *   frame_body_method(Frame) -> a method descriptor for Frame.body: the frame's
 *       large_body when it has one, a definite-length CBOR byte string filling the body
 *       section, else framing._body_py.
 *   encode_small_bytes(type, target, payload, source) -> bytes
 *       framing._encode_small_bytes_py for exact bytes arguments; anything else (and
 *       every error) goes to that function.
 *   slot_maker(cls, arg_slots, fixed_slots) -> a constructor of cls setting its slots
 *       without its Python __init__.
 *   ready(value) -> an awaitable already done with value.
 *   body_getter(cls, frame_slot, decoded_slot, body_slot, fallback) -> a getter for
 *       property(): the cached body, or Frame.body of the frame slot, cached; anything
 *       else goes to fallback (the Python getter).
 *   new_bytes(n) -> (bytes, memoryview): a new bytes of n bytes and a writable view of
 *       its content that keeps it alive (framing._new_body_py, without its copy).
 *   reuse_bytes(spares, n) -> (bytes, memoryview) or None: the same from a bytes of the
 *       list spares that only the list holds (framing._reuse_body_py: always None).
 *
 * Memory safety: nothing here trusts a value it did not make. Frame fields are checked
 * against raw before a byte is read, lengths are compared before they are added, slot
 * offsets come from the class's own member descriptors, and init() checks the Frame
 * layout the indices rely on. CI runs the protocol and client tests and a differential
 * fuzz against the Python code with this file built under ASan and UBSan
 * (tests/protocol/sanitize.sh).
 * init(Frame, Run, valid_mask, message_type, body_py, encode_small_bytes_py) is called
 * once by framing.py before any of these is used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h> /* T_OBJECT_EX */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* The interface of this file as framing.py expects it; framing.py ignores a build of
 * another version (a stale in-place build left beside newer sources). */
#define SPEEDUPS_API 8 /* 8: reuse_bytes */

#define PREFIX_SIZE 32
#define FIXED_AFTER_LENGTH 28
#define SEEN_FDS (1ULL << 32)
#define FLAG_TRACED 2 /* Flag.TRACED (protocol/codes.py) */
#define FRAME_FIELDS 14

static PyTypeObject *frame_type = NULL; /* framing.Frame (a tuple subclass) */
static PyObject *run_type = NULL;       /* framing.Run */
static uint64_t valid_mask = 0;         /* bit t set for each valid FrameType t (< 64) */
static unsigned message_type = 0;       /* FrameType.MESSAGE */
static PyObject *body_py = NULL;        /* the Python Frame.body */
static PyObject *encode_small_py = NULL; /* the Python encode_small_bytes */
static PyObject *empty_tuple = NULL;
static PyObject *empty_bytes = NULL;

static inline uint32_t be16(const unsigned char *p) { return ((uint32_t)p[0] << 8) | p[1]; }

static inline uint32_t be32(const unsigned char *p)
{
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline uint64_t be64(const unsigned char *p)
{
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}

static inline void put16(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 8);
    p[1] = (unsigned char)v;
}

static inline void put32(unsigned char *p, uint32_t v)
{
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static int ready(void)
{
    if (frame_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "msgq_trio.protocol._speedups.init() not called");
        return 0;
    }
    return 1;
}

/* The fields of Frame in the order this file reads and writes them by index. */
static const char *const frame_fields[FRAME_FIELDS] = {
    "type", "flags", "request_id", "target", "source", "n_blobs", "n_fds",
    "header_len", "body_len", "raw", "tail", "fds", "large_body", "spliced",
};

/* 0 if frame._fields is exactly frame_fields; -1 with a TypeError otherwise: make_frame
 * builds FRAME_FIELDS items and frame_body reads items by index, so another layout
 * would be wrong values or reads past the tuple. */
static int check_fields(PyObject *frame)
{
    PyObject *fields = PyObject_GetAttrString(frame, "_fields");
    if (fields == NULL)
        return -1;
    int ok = PyTuple_CheckExact(fields) && PyTuple_GET_SIZE(fields) == FRAME_FIELDS;
    for (Py_ssize_t i = 0; ok && i < FRAME_FIELDS; i++) {
        PyObject *name = PyTuple_GET_ITEM(fields, i);
        ok = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, frame_fields[i]) == 0;
    }
    Py_DECREF(fields);
    if (!ok) {
        PyErr_Format(PyExc_TypeError, "init(): Frame._fields must be %d fields: type, ..., spliced",
                     FRAME_FIELDS);
        return -1;
    }
    return 0;
}

static PyObject *init(PyObject *mod, PyObject *args)
{
    PyObject *frame, *run, *mask, *body, *encode;
    unsigned int message;
    if (!PyArg_ParseTuple(args, "O!OOIOO:init", &PyType_Type, &frame, &run, &mask, &message,
                          &body, &encode))
        return NULL;
    if (!PyType_IsSubtype((PyTypeObject *)frame, &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "init(): Frame must be a tuple subclass");
        return NULL;
    }
    if (check_fields(frame) < 0)
        return NULL;
    if (!PyCallable_Check(run) || !PyCallable_Check(body) || !PyCallable_Check(encode)) {
        PyErr_SetString(PyExc_TypeError, "init(): Run and the fallbacks must be callable");
        return NULL;
    }
    uint64_t m = PyLong_AsUnsignedLongLong(mask);
    if (m == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    Py_XSETREF(frame_type, (PyTypeObject *)Py_NewRef(frame));
    Py_XSETREF(run_type, Py_NewRef(run));
    Py_XSETREF(body_py, Py_NewRef(body));
    Py_XSETREF(encode_small_py, Py_NewRef(encode));
    valid_mask = m;
    message_type = message;
    Py_RETURN_NONE;
}

/* Run(target, bytes(buf[start:end]), count); steals no reference. */
static int emit_run(PyObject *out, PyObject *target, const unsigned char *b, Py_ssize_t start,
                    Py_ssize_t end, Py_ssize_t count)
{
    PyObject *raw = PyBytes_FromStringAndSize((const char *)b + start, end - start);
    if (raw == NULL)
        return -1;
    PyObject *n = PyLong_FromSsize_t(count);
    if (n == NULL) {
        Py_DECREF(raw);
        return -1;
    }
    PyObject *argv[3] = {target, raw, n};
    PyObject *run = PyObject_Vectorcall(run_type, argv, 3, NULL);
    Py_DECREF(raw);
    Py_DECREF(n);
    if (run == NULL)
        return -1;
    int rc = PyList_Append(out, run);
    Py_DECREF(run);
    return rc;
}

/* The target and source of the frame made last in this scan, where their bytes are in
 * the scanned buffer: a burst of messages has one target and one sender, and equal
 * values may share one object (str and bytes are immutable). */
typedef struct {
    PyObject *target, *source;
    const unsigned char *tbytes, *sbytes;
    Py_ssize_t tlen, slen;
    /* The arguments of tuple.__new__(Frame, values) for make_frame, reused from frame to
     * frame of one scan while no one else holds them: (values,), values a tuple of
     * FRAME_FIELDS items (the last frame's, or NULL). */
    PyObject *args;
} Last;

static void last_clear(Last *last)
{
    Py_CLEAR(last->target);
    Py_CLEAR(last->source);
    Py_CLEAR(last->args);
}

/* How make_frame builds a Frame (a tuple subclass). Where tuple's own constructor for a
 * subclass (tuple_subtype_new) is exactly the subclass's tp_alloc followed by a new
 * reference stored into each item, as in CPython 3.11 to 3.13, make_frame does those
 * two steps itself (FILL_FRAMES): the constructor first takes the items as a tuple of
 * arguments, checks them, then copies them with a reference each, which made about a
 * seventh of the instructions scan executes per small frame. 3.14 also resets a hash
 * cache there, so for it, later versions and the free-threaded build the constructor
 * itself builds the frame. */
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
#define FILL_FRAMES 1
#endif

#ifndef FILL_FRAMES
/* last->args ready to be filled: reused when only this scan holds it and its tuple (as
 * tuple.__new__ leaves them: it keeps neither), else new. NULL with an error. */
static PyObject *frame_args(Last *last)
{
    PyObject *args = last->args;
    if (args != NULL && Py_REFCNT(args) == 1 && Py_REFCNT(PyTuple_GET_ITEM(args, 0)) == 1)
        return PyTuple_GET_ITEM(args, 0);
    Py_CLEAR(last->args);
    PyObject *values = PyTuple_New(FRAME_FIELDS);
    if (values == NULL)
        return NULL;
    args = PyTuple_New(1);
    if (args == NULL) {
        Py_DECREF(values);
        return NULL;
    }
    PyTuple_SET_ITEM(args, 0, values);
    last->args = args;
    return values;
}
#endif

/* The target of a frame whose target bytes are t[0:tlen] (a new reference); NULL with
 * *bad set if they are not UTF-8 (no Python error set then), NULL with an error
 * otherwise. */
static PyObject *frame_target(Last *last, const unsigned char *t, Py_ssize_t tlen, int *bad)
{
    if (last->target != NULL && tlen == last->tlen && memcmp(t, last->tbytes, (size_t)tlen) == 0)
        return Py_NewRef(last->target);
    PyObject *target = PyUnicode_DecodeUTF8((const char *)t, tlen, NULL);
    if (target == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeDecodeError)) {
            PyErr_Clear();
            *bad = 1;
        }
        return NULL;
    }
    Py_XSETREF(last->target, Py_NewRef(target));
    last->tbytes = t;
    last->tlen = tlen;
    return target;
}

static PyObject *frame_source(Last *last, const unsigned char *s, Py_ssize_t slen)
{
    if (last->source != NULL && slen == last->slen && memcmp(s, last->sbytes, (size_t)slen) == 0)
        return Py_NewRef(last->source);
    PyObject *source = PyBytes_FromStringAndSize((const char *)s, slen);
    if (source == NULL)
        return NULL;
    Py_XSETREF(last->source, Py_NewRef(source));
    last->sbytes = s;
    last->slen = slen;
    return source;
}

/* The Frame tuple of one complete frame at b[pos:pos+total]; NULL with *bad set if its
 * target is not UTF-8 (no Python error set then), NULL with an error otherwise. */
static PyObject *make_frame(Last *last, const unsigned char *p, Py_ssize_t total,
                            unsigned ftype, unsigned flags, uint64_t rid, Py_ssize_t tlen,
                            Py_ssize_t slen, unsigned nfds, uint32_t hlen, uint32_t blen,
                            int *bad)
{
    PyObject *target = frame_target(last, p + PREFIX_SIZE, tlen, bad);
    if (target == NULL)
        return NULL;
    PyObject *raw = PyBytes_FromStringAndSize((const char *)p, total);
    if (raw == NULL) {
        Py_DECREF(target);
        return NULL;
    }
    PyObject *items[FRAME_FIELDS];
    items[0] = PyLong_FromUnsignedLong(ftype);
    items[1] = PyLong_FromUnsignedLong(flags);
    items[2] = PyLong_FromUnsignedLongLong(rid);
    items[3] = target;
    items[4] = frame_source(last, p + PREFIX_SIZE + tlen, slen);
    items[5] = PyLong_FromLong(0);
    items[6] = PyLong_FromUnsignedLong(nfds);
    items[7] = PyLong_FromUnsignedLong(hlen);
    items[8] = PyLong_FromUnsignedLong(blen);
    items[9] = raw;
    items[10] = PyLong_FromSsize_t(PREFIX_SIZE + tlen + slen);
    items[11] = Py_NewRef(empty_tuple);
    items[12] = Py_NewRef(empty_bytes); /* large_body: only a client's large frames */
    items[13] = Py_NewRef(Py_None);     /* spliced: only the broker's large frames */
    for (int i = 0; i < FRAME_FIELDS; i++)
        if (items[i] == NULL)
            goto fail;
#ifdef FILL_FRAMES
    /* tuple_subtype_new's own steps (see FILL_FRAMES): tp_alloc gives FRAME_FIELDS
     * items, all NULL (a NULL item is fine for its dealloc), and each is set once. */
    PyObject *frame = frame_type->tp_alloc(frame_type, FRAME_FIELDS);
    if (frame == NULL)
        goto fail;
    for (int i = 0; i < FRAME_FIELDS; i++)
        PyTuple_SET_ITEM(frame, i, items[i]); /* steals */
#else
    PyObject *values = frame_args(last);
    if (values == NULL)
        goto fail;
    for (int i = 0; i < FRAME_FIELDS; i++) {
        /* (a tuple only this code holds: its items may be replaced) */
        PyObject *old = PyTuple_GET_ITEM(values, i);
        PyTuple_SET_ITEM(values, i, items[i]); /* steals: values owns it now */
        Py_XDECREF(old);
    }
    /* tuple.__new__(Frame, values), as the Python loop: the NamedTuple's own __new__ is a
     * Python function. Through the tuple constructor, not tp_alloc and stores: it sets
     * up whatever a tuple needs besides its items (the hash cache of newer CPythons). */
    PyObject *frame = PyTuple_Type.tp_new(frame_type, last->args, NULL);
    if (frame == NULL)
        return NULL;
#endif
    /* Every field is an int, str or bytes and fds is the empty tuple: this frame can be
     * in no reference cycle, so the cyclic collector need not track it. Thousands of
     * frames of one receive are alive at once, waiting for the application; tracked,
     * each collection of the youngest generation walks them and promotes them, and
     * their promotion brings on full collections, which then walk every frame waiting
     * (BENCHMARKS.md "The collector"). A frame that gets descriptors is a new tuple (tracked). */
    PyObject_GC_UnTrack(frame);
    return frame;
fail:
    for (int i = 0; i < FRAME_FIELDS; i++)
        Py_XDECREF(items[i]);
    return NULL;
}

/* The fast loop of FrameParser._scan: see framing._scan_loop_py, which this mirrors
 * statement by statement (same breaks, same runs, same position on a bad target). */
static PyObject *scan(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (!ready())
        return NULL;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "scan() takes 6 arguments");
        return NULL;
    }
    PyObject *source = args[3], *out = args[4];
    if (source != Py_None && !PyBytes_CheckExact(source)) {
        PyErr_SetString(PyExc_TypeError, "scan(): source must be bytes or None");
        return NULL;
    }
    if (!PyList_CheckExact(out)) {
        PyErr_SetString(PyExc_TypeError, "scan(): out must be a list");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred())
        return NULL;
    long long limit = PyLong_AsLongLong(args[2]);
    if (limit == -1 && PyErr_Occurred())
        return NULL;
    uint64_t seen = PyLong_AsUnsignedLongLong(args[5]);
    if (seen == (uint64_t)-1 && PyErr_Occurred())
        return NULL;
    /* A buffer export: the bytearray cannot be resized under us (it raises BufferError). */
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    const unsigned char *b = (const unsigned char *)view.buf;
    const Py_ssize_t end = view.len;
    if (pos < 0) { /* (past the end is fine: no frame there, as for the Python loop) */
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "scan(): negative pos");
        return NULL;
    }
    const Py_ssize_t slen_run = source == Py_None ? -1 : PyBytes_GET_SIZE(source);
    const char *src = source == Py_None ? NULL : PyBytes_AS_STRING(source);
    /* The open run: its first byte, frame count, target (decoded) and where its target's
     * bytes are in the buffer (run_n == 0: none open). */
    Py_ssize_t run_start = 0, run_n = 0, run_tstart = 0, run_tlen = 0;
    PyObject *run_target = NULL;
    int bad = 0;
    Last last = {NULL, NULL, NULL, NULL, 0, 0, NULL};

    while (end - pos >= PREFIX_SIZE) {
        const unsigned char *p = b + pos;
        uint32_t length = be32(p);
        unsigned ftype = p[4], flags = p[5];
        Py_ssize_t tlen = be16(p + 6), slen = be16(p + 8);
        uint32_t nblobs = be16(p + 10), nfds = be16(p + 12), reserved = be16(p + 14);
        uint64_t rid = be64(p + 16);
        uint32_t hlen = be32(p + 24), blen = be32(p + 28);
        if ((long long)length > limit || nblobs || ftype >= 64 ||
            !((valid_mask >> ftype) & 1) || reserved ||
            (uint64_t)FIXED_AFTER_LENGTH + tlen + slen + hlen + blen != length)
            break; /* anything unusual (or an error) takes the careful path */
        /* Compared before 4 + length is formed: a Py_ssize_t of 32 bits cannot hold it. */
        if ((uint64_t)(end - pos) - 4 < (uint64_t)length)
            break;
        const Py_ssize_t total = 4 + (Py_ssize_t)length; /* <= end - pos: no overflow */
        seen |= (1ULL << ftype) | (nfds ? SEEN_FDS : 0);
        Py_ssize_t tstart = pos + PREFIX_SIZE;
        /* (TRACED: a traced message is a hop of its own, as in the Python loop) */
        if (slen == slen_run && ftype == message_type && !nfds && !(flags & FLAG_TRACED) && tlen &&
            memcmp(b + tstart + tlen, src, (size_t)slen) == 0) {
            if (run_n && tlen == run_tlen && memcmp(b + tstart, b + run_tstart, (size_t)tlen) == 0) {
                run_n++;
                pos += total;
                continue;
            }
            if (run_n) {
                if (emit_run(out, run_target, b, run_start, pos, run_n) < 0)
                    goto error;
                run_n = 0;
                Py_CLEAR(run_target);
            }
            run_target = PyUnicode_DecodeUTF8((const char *)b + tstart, tlen, NULL);
            if (run_target == NULL) {
                if (!PyErr_ExceptionMatches(PyExc_UnicodeDecodeError))
                    goto error;
                PyErr_Clear();
                bad = 1; /* at this frame's start, as the Python loop */
                break;
            }
            run_tstart = tstart;
            run_tlen = tlen;
            run_start = pos;
            run_n = 1;
            pos += total;
            continue;
        }
        if (run_n) {
            if (emit_run(out, run_target, b, run_start, pos, run_n) < 0)
                goto error;
            run_n = 0;
            Py_CLEAR(run_target);
        }
        PyObject *frame =
            make_frame(&last, p, total, ftype, flags, rid, tlen, slen, nfds, hlen, blen, &bad);
        pos += total; /* past the frame even if its target is bad, as the Python loop */
        if (frame == NULL) {
            if (bad)
                break;
            goto error;
        }
        int rc = PyList_Append(out, frame);
        Py_DECREF(frame);
        if (rc < 0)
            goto error;
    }
    if (run_n && emit_run(out, run_target, b, run_start, pos, run_n) < 0)
        goto error;
    Py_XDECREF(run_target);
    last_clear(&last);
    PyBuffer_Release(&view);
    return Py_BuildValue("(nKO)", pos, (unsigned long long)seen, bad ? Py_True : Py_False);
error:
    Py_XDECREF(run_target);
    last_clear(&last);
    PyBuffer_Release(&view);
    return NULL;
}

/* Frame.body: large_body when the parser received the body into one; a definite-length
 * CBOR byte string that fills the section exactly is its head and a slice; anything else
 * is the Python method's (cbor2, errors, bytearray). */
static PyObject *frame_body(PyObject *self, PyObject *unused)
{
    if (!ready())
        return NULL;
    if (PyTuple_Check(self) && PyTuple_GET_SIZE(self) == FRAME_FIELDS) {
        PyObject *large = PyTuple_GET_ITEM(self, 12);
        if (PyBytes_CheckExact(large) && PyBytes_GET_SIZE(large) > 0)
            return Py_NewRef(large); /* the body was received into its own bytes */
        PyObject *raw = PyTuple_GET_ITEM(self, 9);
        PyObject *o_blen = PyTuple_GET_ITEM(self, 8), *o_hlen = PyTuple_GET_ITEM(self, 7),
                 *o_tail = PyTuple_GET_ITEM(self, 10);
        if (PyLong_CheckExact(o_blen) && PyLong_CheckExact(o_hlen) && PyLong_CheckExact(o_tail) &&
            PyBytes_CheckExact(raw)) {
            /* (one at a time: no C API call with an exception set) */
            int overflow = 0;
            long long blen = PyLong_AsLongLongAndOverflow(o_blen, &overflow);
            long long hlen = overflow ? 0 : PyLong_AsLongLongAndOverflow(o_hlen, &overflow);
            long long tail = overflow ? 0 : PyLong_AsLongLongAndOverflow(o_tail, &overflow);
            if (overflow) /* absurd lengths: only a hand-made Frame has them */
                return PyObject_CallOneArg(body_py, self);
            if (blen == 0)
                Py_RETURN_NONE;
            const long long size = PyBytes_GET_SIZE(raw);
            const unsigned char *r = (const unsigned char *)PyBytes_AS_STRING(raw);
            /* Only a frame whose body lies inside raw (as every parsed frame's does); any
             * other is the Python method's, which raises. Each bound is checked apart, by
             * subtraction: a sum of hand-made lengths can overflow. */
            if (blen > 0 && tail >= 0 && hlen >= 0 && tail <= size && hlen <= size - tail &&
                blen <= size - tail - hlen) {
                const long long start = tail + hlen;
                unsigned ib = r[start];
                if (ib >= 0x40 && ib <= 0x5A) {
                    long long h = 0, n = -1;
                    if (ib < 0x58) {
                        h = 1;
                        n = ib - 0x40;
                    } else {
                        int k = 1 << (ib - 0x58);
                        if (blen >= 1 + k) {
                            h = 1 + k;
                            n = 0;
                            for (int i = 0; i < k; i++)
                                n = (n << 8) | r[start + 1 + i];
                        }
                    }
                    if (h + n == blen)
                        return PyBytes_FromStringAndSize((const char *)r + start + h, blen - h);
                }
            }
        }
    }
    return PyObject_CallOneArg(body_py, self);
}

static PyMethodDef frame_body_def = {
    "body", (PyCFunction)frame_body, METH_NOARGS,
    "body($self, /)\n--\n\n"
    "Decode the CBOR body (an empty section means ``None``).\n\n"
    "Raises:\n"
    "    RemoteProtocolError: the body is not well-formed CBOR or has trailing bytes.",
};

static PyObject *frame_body_method(PyObject *mod, PyObject *type)
{
    if (!PyType_Check(type)) {
        PyErr_SetString(PyExc_TypeError, "frame_body_method(): a type is required");
        return NULL;
    }
    return PyDescr_NewMethod((PyTypeObject *)type, &frame_body_def);
}

/* encode_small_bytes for exact bytes arguments whose frame fits; the Python function
 * gets every other call (and raises its errors). */
static PyObject *encode_small_bytes(PyObject *mod, PyObject *const *args, size_t nargsf,
                                    PyObject *kwnames)
{
    if (!ready())
        return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 4 || kwnames != NULL)
        goto slow;
    PyObject *o_type = args[0], *target = args[1], *payload = args[2], *source = args[3];
    if (!PyLong_Check(o_type) || !PyBytes_CheckExact(target) || !PyBytes_CheckExact(payload) ||
        !PyBytes_CheckExact(source))
        goto slow;
    int overflow = 0;
    long type = PyLong_AsLongAndOverflow(o_type, &overflow);
    if (overflow || type < 0 || type > 0xFF) {
        if (type == -1 && PyErr_Occurred())
            PyErr_Clear();
        goto slow;
    }
    Py_ssize_t tl = PyBytes_GET_SIZE(target), sl = PyBytes_GET_SIZE(source);
    Py_ssize_t n = PyBytes_GET_SIZE(payload);
    if (tl > 0xFFFF || sl > 0xFFFF)
        goto slow;
    unsigned char head[5];
    Py_ssize_t hl;
    if (n < 24) {
        head[0] = (unsigned char)(0x40 + n);
        hl = 1;
    } else if (n < 0x100) {
        head[0] = 0x58;
        head[1] = (unsigned char)n;
        hl = 2;
    } else if (n < 0x10000) {
        head[0] = 0x59;
        put16(head + 1, (uint32_t)n);
        hl = 3;
    } else if ((unsigned long long)n < 0x100000000ULL) {
        head[0] = 0x5A;
        put32(head + 1, (uint32_t)n);
        hl = 5;
    } else {
        goto slow;
    }
    unsigned long long blen = (unsigned long long)hl + (unsigned long long)n;
    unsigned long long length = FIXED_AFTER_LENGTH + (unsigned long long)tl + sl + blen;
    if (blen > 0xFFFFFFFFULL || length > 0xFFFFFFFFULL ||
        length > (unsigned long long)PY_SSIZE_T_MAX - 4)
        goto slow;
    PyObject *out = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(4 + length));
    if (out == NULL)
        return NULL;
    unsigned char *w = (unsigned char *)PyBytes_AS_STRING(out);
    put32(w, (uint32_t)length);
    w[4] = (unsigned char)type;
    w[5] = 0;                    /* flags */
    put16(w + 6, (uint32_t)tl);
    put16(w + 8, (uint32_t)sl);
    memset(w + 10, 0, 6 + 8 + 4); /* n_blobs, n_fds, reserved, request_id, header_len */
    put32(w + 28, (uint32_t)blen);
    w += PREFIX_SIZE;
    memcpy(w, PyBytes_AS_STRING(target), (size_t)tl);
    w += tl;
    memcpy(w, PyBytes_AS_STRING(source), (size_t)sl);
    w += sl;
    memcpy(w, head, (size_t)hl);
    w += hl;
    memcpy(w, PyBytes_AS_STRING(payload), (size_t)n);
    return out;
slow:
    return PyObject_Vectorcall(encode_small_py, args, nargsf, kwnames);
}

/* -- slot_maker ------------------------------------------------------------------------
 * A constructor for a class with __slots__ that sets its slots from C: the arguments in
 * order, then fixed values, with no Python frame (a Python __init__ costs most of the
 * time of making a small object). The class's own __init__ is the reference; its module
 * builds one of these only when the extension is in use, and a test compares the
 * two. */
#define MAKER_MAX 8

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyTypeObject *cls;
    Py_ssize_t nargs, nfixed;
    Py_ssize_t arg_offset[MAKER_MAX], fixed_offset[MAKER_MAX];
    PyObject *fixed[MAKER_MAX];
} Maker;

static PyObject *maker_call(PyObject *self, PyObject *const *args, size_t nargsf,
                            PyObject *kwnames)
{
    Maker *mk = (Maker *)self;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != mk->nargs || (kwnames != NULL && PyTuple_GET_SIZE(kwnames))) {
        PyErr_Format(PyExc_TypeError, "%s maker takes %zd positional arguments",
                     mk->cls->tp_name, mk->nargs);
        return NULL;
    }
    PyObject *obj = mk->cls->tp_alloc(mk->cls, 0);
    if (obj == NULL)
        return NULL;
    char *base = (char *)obj;
    for (Py_ssize_t i = 0; i < nargs; i++)
        *(PyObject **)(base + mk->arg_offset[i]) = Py_NewRef(args[i]);
    for (Py_ssize_t i = 0; i < mk->nfixed; i++)
        *(PyObject **)(base + mk->fixed_offset[i]) = Py_NewRef(mk->fixed[i]);
    return obj;
}

static int maker_traverse(PyObject *self, visitproc visit, void *arg)
{
    Maker *mk = (Maker *)self;
    Py_VISIT(mk->cls);
    for (Py_ssize_t i = 0; i < mk->nfixed; i++)
        Py_VISIT(mk->fixed[i]);
    return 0;
}

static int maker_clear(PyObject *self)
{
    Maker *mk = (Maker *)self;
    Py_CLEAR(mk->cls);
    for (Py_ssize_t i = 0; i < mk->nfixed; i++)
        Py_CLEAR(mk->fixed[i]);
    return 0;
}

/* tp_dealloc of this file's GC types: untracked, their references dropped (tp_clear),
 * freed. */
static void gc_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_TYPE(self)->tp_clear(self);
    Py_TYPE(self)->tp_free(self);
}

static PyTypeObject MakerType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msgq_trio.protocol._speedups.SlotMaker",
    .tp_basicsize = sizeof(Maker),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(Maker, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = maker_traverse,
    .tp_clear = maker_clear,
    .tp_dealloc = gc_dealloc,
    .tp_doc = "A constructor made by slot_maker().",
};

/* The offset of the object slot `name` of `cls`: a member descriptor made for cls
 * itself. One of another class (assigned to an attribute of cls after its creation) has
 * an offset into that class's instances, maybe past the end of cls's. */
static Py_ssize_t slot_offset(PyTypeObject *cls, PyObject *name)
{
    PyObject *descr = PyDict_GetItemWithError(cls->tp_dict, name);
    if (descr == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_TypeError, "slot_maker(): %R is not a slot of %s", name,
                         cls->tp_name);
        return -1;
    }
    if (!Py_IS_TYPE(descr, &PyMemberDescr_Type) ||
        ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX ||
        PyDescr_TYPE(descr) != cls) {
        PyErr_Format(PyExc_TypeError, "slot_maker(): %R is not an object slot of %s", name,
                     cls->tp_name);
        return -1;
    }
    return ((PyMemberDescrObject *)descr)->d_member->offset;
}

/* 1 if offset is among the n of offsets (a slot named twice would be set twice, and
 * its first reference lost). */
static int offset_taken(const Py_ssize_t *offsets, Py_ssize_t n, Py_ssize_t offset)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (offsets[i] == offset)
            return 1;
    return 0;
}

static PyObject *slot_maker(PyObject *mod, PyObject *args)
{
    PyObject *cls, *names, *fixed;
    if (!PyArg_ParseTuple(args, "O!O!O!:slot_maker", &PyType_Type, &cls, &PyTuple_Type, &names,
                          &PyDict_Type, &fixed))
        return NULL;
    PyTypeObject *t = (PyTypeObject *)cls;
    /* Only a class whose instances are exactly its slots: no __dict__, no C base with a
     * state of its own that tp_alloc would leave unset. */
    if (!(t->tp_flags & Py_TPFLAGS_HEAPTYPE) || t->tp_base != &PyBaseObject_Type ||
        t->tp_dictoffset != 0 || t->tp_weaklistoffset != 0) {
        PyErr_Format(PyExc_TypeError, "slot_maker(): %s is not a plain class with __slots__",
                     t->tp_name);
        return NULL;
    }
    if (PyTuple_GET_SIZE(names) > MAKER_MAX || PyDict_GET_SIZE(fixed) > MAKER_MAX) {
        PyErr_SetString(PyExc_ValueError, "slot_maker(): too many slots");
        return NULL;
    }
    Maker *mk = PyObject_GC_New(Maker, &MakerType);
    if (mk == NULL)
        return NULL;
    mk->vectorcall = maker_call;
    mk->cls = (PyTypeObject *)Py_NewRef(cls);
    mk->nargs = mk->nfixed = 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(names); i++) {
        Py_ssize_t off = slot_offset(t, PyTuple_GET_ITEM(names, i));
        if (off < 0)
            goto fail;
        if (offset_taken(mk->arg_offset, mk->nargs, off))
            goto twice;
        mk->arg_offset[mk->nargs++] = off;
    }
    Py_ssize_t it = 0;
    PyObject *key, *value;
    while (PyDict_Next(fixed, &it, &key, &value)) {
        Py_ssize_t off = slot_offset(t, key);
        if (off < 0)
            goto fail;
        if (offset_taken(mk->arg_offset, mk->nargs, off) ||
            offset_taken(mk->fixed_offset, mk->nfixed, off))
            goto twice;
        mk->fixed_offset[mk->nfixed] = off;
        mk->fixed[mk->nfixed++] = Py_NewRef(value);
    }
    PyObject_GC_Track(mk);
    return (PyObject *)mk;
twice:
    PyErr_Format(PyExc_ValueError, "slot_maker(): a slot of %s is named twice", t->tp_name);
fail:
    PyObject_GC_Track(mk);
    Py_DECREF(mk);
    return NULL;
}

/*
 * A getter for a lazily decoded body cached in slots, for property(fget=...): with the
 * value cached (flag slot True) it returns the value slot; otherwise, for a frame in the
 * source slot, Frame.body (above) stored in the value slot with the flag set. Anything
 * else, every failure included, is the Python getter's (the reference, which then
 * decodes again and raises its own errors). What it saves is the Python frame of a
 * property read once per received message.
 */
typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyTypeObject *cls;
    PyObject *fallback;
    Py_ssize_t source_offset, flag_offset, value_offset;
} BodyGetter;

static PyObject *body_getter_call(PyObject *self, PyObject *const *args, size_t nargsf,
                                  PyObject *kwnames)
{
    BodyGetter *g = (BodyGetter *)self;
    if (PyVectorcall_NARGS(nargsf) != 1 || (kwnames != NULL && PyTuple_GET_SIZE(kwnames)))
        return PyObject_Vectorcall(g->fallback, args, nargsf, kwnames);
    PyObject *obj = args[0];
    /* (before init(), the Python getter: ready() would set an error to call it with) */
    if (Py_TYPE(obj) != g->cls || frame_type == NULL)
        return PyObject_CallOneArg(g->fallback, obj);
    char *base = (char *)obj;
    PyObject **flag = (PyObject **)(base + g->flag_offset);
    PyObject **value = (PyObject **)(base + g->value_offset);
    if (*flag == Py_True && *value != NULL)
        return Py_NewRef(*value);
    PyObject *frame = *(PyObject **)(base + g->source_offset);
    if (frame == NULL || Py_TYPE(frame) != frame_type || *flag != Py_False)
        return PyObject_CallOneArg(g->fallback, obj);
    PyObject *res = frame_body(frame, NULL);
    if (res == NULL) {
        PyErr_Clear(); /* the reference raises it, with its own message */
        return PyObject_CallOneArg(g->fallback, obj);
    }
    Py_XSETREF(*value, Py_NewRef(res));
    Py_XSETREF(*flag, Py_NewRef(Py_True));
    return res;
}

static int body_getter_traverse(PyObject *self, visitproc visit, void *arg)
{
    BodyGetter *g = (BodyGetter *)self;
    Py_VISIT(g->cls);
    Py_VISIT(g->fallback);
    return 0;
}

static int body_getter_clear(PyObject *self)
{
    BodyGetter *g = (BodyGetter *)self;
    Py_CLEAR(g->cls);
    Py_CLEAR(g->fallback);
    return 0;
}

static PyTypeObject BodyGetterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msgq_trio.protocol._speedups.BodyGetter",
    .tp_basicsize = sizeof(BodyGetter),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(BodyGetter, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_traverse = body_getter_traverse,
    .tp_clear = body_getter_clear,
    .tp_dealloc = gc_dealloc,
    .tp_doc = "A getter made by body_getter().",
};

static PyObject *body_getter(PyObject *mod, PyObject *args)
{
    PyObject *cls, *source, *flag, *value, *fallback;
    if (!PyArg_ParseTuple(args, "O!UUUO:body_getter", &PyType_Type, &cls, &source, &flag,
                          &value, &fallback))
        return NULL;
    PyTypeObject *t = (PyTypeObject *)cls;
    if (!(t->tp_flags & Py_TPFLAGS_HEAPTYPE) || t->tp_base != &PyBaseObject_Type ||
        t->tp_dictoffset != 0) {
        PyErr_Format(PyExc_TypeError, "body_getter(): %s is not a plain class with __slots__",
                     t->tp_name);
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "body_getter(): the fallback must be callable");
        return NULL;
    }
    Py_ssize_t so = slot_offset(t, source), fo = so < 0 ? -1 : slot_offset(t, flag),
               vo = fo < 0 ? -1 : slot_offset(t, value);
    if (vo < 0)
        return NULL;
    BodyGetter *g = PyObject_GC_New(BodyGetter, &BodyGetterType);
    if (g == NULL)
        return NULL;
    g->vectorcall = body_getter_call;
    g->cls = (PyTypeObject *)Py_NewRef(cls);
    g->fallback = Py_NewRef(fallback);
    g->source_offset = so;
    g->flag_offset = fo;
    g->value_offset = vo;
    PyObject_GC_Track(g);
    return (PyObject *)g;
}

/*
 * ready(value): an awaitable that is already done, ``await ready(v)`` being ``v``; for an
 * ``__anext__`` written as a plain function that has its value at once (a message
 * waiting), where a coroutine object per call would cost more than the rest of the call.
 * A GC type: the value is anything, and may refer back to the awaitable (a value that
 * keeps it in an attribute), a cycle only the collector can free.
 */
typedef struct {
    PyObject_HEAD
    PyObject *value;
} Ready;

static PyTypeObject ReadyType;

/* One freed Ready kept for the next ready(), untracked and holding nothing (NULL: none):
 * a receiving loop makes one per message and drops it before the next, so that one
 * object serves them all, without an allocation, its release and the collector's count
 * of allocations that each would move (which schedules collections). Not with the
 * free-threaded build, whose threads would share it. */
#ifndef Py_GIL_DISABLED
static Ready *ready_spare = NULL;
#endif

static PyObject *ready_new(PyObject *mod, PyObject *value)
{
    Ready *r;
#ifndef Py_GIL_DISABLED
    r = ready_spare;
    if (r != NULL) {
        ready_spare = NULL;
        PyObject_Init((PyObject *)r, &ReadyType); /* a new reference, as at allocation */
    }
    else
#endif
    {
        r = PyObject_GC_New(Ready, &ReadyType);
        if (r == NULL)
            return NULL;
    }
    r->value = Py_NewRef(value);
    PyObject_GC_Track(r);
    return (PyObject *)r;
}

/* gc_dealloc, keeping the object as ready_spare if that is free. */
static void ready_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    Py_CLEAR(((Ready *)self)->value);
#ifndef Py_GIL_DISABLED
    if (ready_spare == NULL) {
        ready_spare = (Ready *)self;
        return;
    }
#endif
    Py_TYPE(self)->tp_free(self);
}

static int ready_traverse(PyObject *self, visitproc visit, void *arg)
{
    Py_VISIT(((Ready *)self)->value);
    return 0;
}

static int ready_clear(PyObject *self)
{
    Py_CLEAR(((Ready *)self)->value);
    return 0;
}

static PyObject *ready_await(PyObject *self) { return Py_NewRef(self); }

/* The value; NULL with an error once the collector cleared it (a cycle being freed). */
static PyObject *ready_value(PyObject *self)
{
    PyObject *value = ((Ready *)self)->value;
    if (value == NULL)
        PyErr_SetString(PyExc_RuntimeError, "ready(): the awaitable was cleared");
    return value;
}

static PySendResult ready_am_send(PyObject *self, PyObject *arg, PyObject **result)
{
    PyObject *value = ready_value(self);
    if (value == NULL) {
        *result = NULL;
        return PYGEN_ERROR;
    }
    *result = Py_NewRef(value);
    return PYGEN_RETURN;
}

static PyObject *ready_stop(PyObject *self)
{
    PyObject *value = ready_value(self);
    if (value == NULL)
        return NULL;
    PyObject *exc = PyObject_CallOneArg(PyExc_StopIteration, value);
    if (exc == NULL)
        return NULL;
    PyErr_SetObject(PyExc_StopIteration, exc);
    Py_DECREF(exc);
    return NULL;
}

static PyObject *ready_send(PyObject *self, PyObject *arg) { return ready_stop(self); }

static PyObject *ready_throw(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "throw() takes 1 to 3 arguments");
        return NULL;
    }
    PyObject *typ = args[0], *val = nargs > 1 ? args[1] : NULL;
    if (PyExceptionInstance_Check(typ))
        PyErr_SetObject((PyObject *)Py_TYPE(typ), typ);
    else if (PyExceptionClass_Check(typ))
        PyErr_SetObject(typ, val);
    else
        PyErr_SetString(PyExc_TypeError, "throw() needs an exception");
    return NULL;
}

static PyObject *ready_close(PyObject *self, PyObject *unused) { Py_RETURN_NONE; }

static PyMethodDef ready_methods[] = {
    {"send", (PyCFunction)ready_send, METH_O, "Finish: raises StopIteration(value)."},
    {"throw", (PyCFunction)(void (*)(void))ready_throw, METH_FASTCALL, "Raise the exception."},
    {"close", (PyCFunction)ready_close, METH_NOARGS, "Nothing to close."},
    {NULL, NULL, 0, NULL},
};

static PyAsyncMethods ready_async = {
    .am_await = ready_await,
    .am_send = ready_am_send,
};

static PyTypeObject ReadyType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msgq_trio.protocol._speedups.Ready",
    .tp_basicsize = sizeof(Ready),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_as_async = &ready_async,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = ready_stop,
    .tp_methods = ready_methods,
    .tp_traverse = ready_traverse,
    .tp_clear = ready_clear,
    .tp_dealloc = ready_dealloc,
    .tp_doc = "An awaitable already done (see ready()).",
};

/*
 * new_bytes(n): a bytes object of n bytes not yet written, with a writable memoryview of
 * its content for the parser to receive a large body into. CPython itself fills a new
 * bytes in place before anyone sees it (socket.recv: PyBytes_FromStringAndSize(NULL, n),
 * then a read into it); here the filling takes several receives, so the view's exporter
 * (a Writer) holds a reference to the bytes: the view never outlives what it writes
 * into. The parser hands the bytes out only once every byte has been written, and
 * releases its view first; no one hashes it before (the hash is computed on first use).
 */
typedef struct {
    PyObject_HEAD
    PyObject *bytes;
} Writer;

static int writer_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    PyObject *b = ((Writer *)self)->bytes;
    return PyBuffer_FillInfo(view, self, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b), 0, flags);
}

static void writer_dealloc(PyObject *self)
{
    Py_XDECREF(((Writer *)self)->bytes);
    PyObject_Free(self);
}

static PyBufferProcs writer_as_buffer = {.bf_getbuffer = writer_getbuffer};

/* No GC support: its one reference is to a bytes, which refers to nothing. */
static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "msgq_trio.protocol._speedups.BytesWriter",
    .tp_basicsize = sizeof(Writer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_as_buffer = &writer_as_buffer,
    .tp_dealloc = writer_dealloc,
    .tp_doc = "The exporter of new_bytes()'s writable view.",
};

/* (b, a writable view of b's content owned by a Writer); steals the reference to b. */
static PyObject *writable(PyObject *b)
{
    Writer *w = PyObject_New(Writer, &WriterType);
    if (w == NULL) {
        Py_DECREF(b);
        return NULL;
    }
    w->bytes = Py_NewRef(b);
    PyObject *view = PyMemoryView_FromObject((PyObject *)w);
    Py_DECREF(w);
    if (view == NULL) {
        Py_DECREF(b);
        return NULL;
    }
    PyObject *res = PyTuple_Pack(2, b, view);
    Py_DECREF(b);
    Py_DECREF(view);
    return res;
}

static PyObject *new_bytes(PyObject *mod, PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred())
        return NULL;
    if (n <= 0) {
        PyErr_SetString(PyExc_ValueError, "new_bytes(): the size must be positive");
        return NULL;
    }
    PyObject *b = PyBytes_FromStringAndSize(NULL, n);
    if (b == NULL)
        return NULL;
    return writable(b);
}

/*
 * reuse_bytes(spares, n) -> (bytes, memoryview) or None: new_bytes(n), made of an item
 * of the list spares (the large bodies a parser handed out) that is a bytes of exactly
 * n bytes held by that list alone; None if there is none. A bytes no one else holds a
 * reference to (a memoryview or buffer export of it would hold one) can be seen by no
 * one: writing into it is writing into a new bytes, as new_bytes does, once its cached
 * hash is reset. Why: a new multi-megabyte bytes is a fresh mapping of the C library's
 * allocator (zeroed pages faulted in one by one while the body is received) until its
 * thresholds adapt, and again whenever it trims its heap; a body reused is in pages the
 * process has already.
 * Only where the hash is the bytes object's one cached state (CPython 3.11 to 3.13, with
 * the GIL: the count of references is exact); elsewhere always None.
 */
static PyObject *reuse_bytes(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyList_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "reuse_bytes(spares: list, n: int)");
        return NULL;
    }
    Py_ssize_t n = PyLong_AsSsize_t(args[1]);
    if (n == -1 && PyErr_Occurred())
        return NULL;
#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
    PyObject *spares = args[0];
    for (Py_ssize_t i = 0; n > 0 && i < PyList_GET_SIZE(spares); i++) {
        PyObject *b = PyList_GET_ITEM(spares, i); /* borrowed: the list's reference */
        if (PyBytes_CheckExact(b) && Py_REFCNT(b) == 1 && PyBytes_GET_SIZE(b) == n) {
            _Py_COMP_DIAG_PUSH
            _Py_COMP_DIAG_IGNORE_DEPR_DECLS
            ((PyBytesObject *)b)->ob_shash = -1;
            _Py_COMP_DIAG_POP
            return writable(Py_NewRef(b));
        }
    }
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"init", (PyCFunction)init, METH_VARARGS,
     "init(Frame, Run, valid_mask, message_type, body_py, encode_small_bytes_py)"},
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(buf, pos, limit, source, out, seen) -> (pos, seen, bad_target)"},
    {"frame_body_method", (PyCFunction)frame_body_method, METH_O,
     "frame_body_method(Frame) -> a method descriptor for Frame.body"},
    {"encode_small_bytes", (PyCFunction)(void (*)(void))encode_small_bytes,
     METH_FASTCALL | METH_KEYWORDS, "encode_small_bytes(type, target, payload, source) -> bytes"},
    {"slot_maker", (PyCFunction)slot_maker, METH_VARARGS,
     "slot_maker(cls, arg_slots, fixed_slots) -> a constructor of cls setting its slots"},
    {"ready", (PyCFunction)ready_new, METH_O, "ready(value) -> an awaitable done with value"},
    {"body_getter", (PyCFunction)body_getter, METH_VARARGS,
     "body_getter(cls, frame_slot, decoded_slot, body_slot, fallback) -> a property getter"},
    {"new_bytes", (PyCFunction)new_bytes, METH_O,
     "new_bytes(n) -> (bytes, memoryview): a new bytes and a writable view of it"},
    {"reuse_bytes", (PyCFunction)(void (*)(void))reuse_bytes, METH_FASTCALL,
     "reuse_bytes(spares, n) -> (bytes, memoryview) or None: new_bytes(n) from a spare"},
    {NULL, NULL, 0, NULL},
};

/* Multi-phase initialization (PEP 489). The state set by init() is the process's, not
 * the module object's: frame_body is a method of Frame, which reaches no module. One
 * interpreter imports this once; framing.py calls init() with the same values again
 * for a second module object. */
static int module_exec(PyObject *m)
{
    if (empty_tuple == NULL && (empty_tuple = PyTuple_New(0)) == NULL)
        return -1;
    if (empty_bytes == NULL && (empty_bytes = PyBytes_FromStringAndSize(NULL, 0)) == NULL)
        return -1;
    if (PyType_Ready(&MakerType) < 0 || PyType_Ready(&BodyGetterType) < 0 ||
        PyType_Ready(&ReadyType) < 0 || PyType_Ready(&WriterType) < 0)
        return -1;
    return PyModule_AddIntConstant(m, "API", SPEEDUPS_API);
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_speedups",
    .m_doc = "Optional compiled fast paths of msgq_trio.protocol.framing (the Python code is "
             "the reference).",
    .m_size = 0,
    .m_methods = methods,
    .m_slots = module_slots,
};

PyMODINIT_FUNC PyInit__speedups(void) { return PyModuleDef_Init(&module); }
