/*
 * libmsgq: one connection to the msgq_trio broker (framing, handshake, calls, handlers,
 * the caller-driven event loop). The contract is in include/msgq/msgq.h.
 */
#define _GNU_SOURCE
#include "msgq/msgq.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#define PREFIX_SIZE 32
#define DEFAULT_MAX_FRAME_SIZE (64u * 1024u * 1024u) /* framing.py DEFAULT_MAX_FRAME_SIZE */
#define DEFAULT_MAX_OUT (1024u * 1024u)             /* the Python clients' OUT_HIGH_WATER */
#define DEFAULT_MAX_FDS 253u                        /* config.py max_fds_per_message */
#define DEFAULT_MAX_CBOR_DEPTH 1000 /* see the well-formedness check below */
#define LIBCBOR_MAX_DEPTH 2000      /* under libcbor's CBOR_MAX_STACK_SIZE (2048) */
#define LOCAL_GRACE_US 1000000u                     /* session.py LOCAL_GRACE (1 s) */
/* Bytes asked of the socket per read: a large frame then arrives in few reads, and the
 * input buffer never holds more than one incomplete frame plus one read. */
#define READ_CHUNK (256u * 1024u)
/* Reads per msgq_process call, so one busy connection cannot starve the caller's loop. */
#define READS_PER_PROCESS 16

enum { T_HELLO = 1, T_WELCOME, T_MESSAGE, T_REQUEST, T_REPLY, T_ERROR, T_NOTIFY, T_ROUTED,
       T_GOODBYE };
enum state { S_HELLO_SENT, S_READY, S_CLOSING, S_LOST };
#define FLAG_TRACED 2 /* protocol/codes.py Flag.TRACED */
/* Room for the prefix, target and stamp of the answer to msgq.introspect (lnames and
 * client names are short: the broker bounds them far below this). */
#define INTROSPECT_HEADROOM 4096u
#define TRACESTATE_MAX 512 /* docs/PROTOCOL.md: a longer tracestate is dropped */

static const char *const CODE_NAMES[MSGQ_CODE__WIRE_COUNT] = {
    NULL,
    "no-recipient", "recipient-gone", "timeout", "receiver-full", "multiple-recipients",
    "unknown-command", "bad-request", "internal-error",
    "protocol-error", "version-mismatch", "frame-too-large", "limit-exceeded", "forbidden",
    "broker-shutdown", "slow-consumer", "dropped",
    "queue-full", "out-of-order", "pipe-broken", "pipe-mismatch",
    "unauthenticated", "heartbeat-timeout",
};

const char *msgq_code_name(msgq_code code) {
    if (code > MSGQ_CODE_NONE && code < MSGQ_CODE__WIRE_COUNT) return CODE_NAMES[code];
    if (code == MSGQ_CODE_CONNECTION_LOST) return "connection-lost";
    return NULL;
}

msgq_code msgq_code_from_name(const char *name) {
    if (!name) return MSGQ_CODE_OTHER;
    for (int i = 1; i < MSGQ_CODE__WIRE_COUNT; i++)
        if (strcmp(CODE_NAMES[i], name) == 0) return (msgq_code)i;
    if (strcmp(name, "connection-lost") == 0) return MSGQ_CODE_CONNECTION_LOST;
    return MSGQ_CODE_OTHER;
}

void msgq_error_clear(msgq_error *err) {
    if (!err) return;
    free(err->message);
    if (err->data) cbor_decref(&err->data);
    memset(err, 0, sizeof *err);
}

static void err_setv(msgq_error *err, const char *code, cbor_item_t *data, const char *fmt,
                     va_list ap) {
    if (!err) {
        if (data) cbor_decref(&data);
        return;
    }
    msgq_error_clear(err);
    snprintf(err->code, sizeof err->code, "%s", code ? code : "");
    err->code_id = code && *code ? msgq_code_from_name(code) : MSGQ_CODE_NONE;
    if (vasprintf(&err->message, fmt, ap) < 0) err->message = NULL;
    err->data = data;
}

static void err_set(msgq_error *err, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void err_set(msgq_error *err, const char *code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    err_setv(err, code, NULL, fmt, ap);
    va_end(ap);
}

static void err_copy(msgq_error *dst, const msgq_error *src) {
    if (!dst) return;
    msgq_error_clear(dst);
    memcpy(dst->code, src->code, sizeof dst->code);
    dst->code_id = src->code_id;
    dst->message = src->message ? strdup(src->message) : NULL;
    dst->data = src->data ? cbor_incref(src->data) : NULL;
}

void msgq_options_init(msgq_options *o) {
    memset(o, 0, sizeof *o);
    o->max_frame_size = DEFAULT_MAX_FRAME_SIZE;
    o->max_out_bytes = DEFAULT_MAX_OUT;
    o->max_fds = DEFAULT_MAX_FDS;
    o->max_cbor_depth = DEFAULT_MAX_CBOR_DEPTH;
    o->handshake_timeout = 10.0;
    o->close_timeout = 2.0;
}

uint64_t msgq_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000u + (uint64_t)ts.tv_nsec / 1000u;
}

/* ---- byte helpers --------------------------------------------------------------- */
static uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] << 8 | p[1]); }
static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) << 32 | rd32(p + 4); }
static void wr16(uint8_t *p, uint16_t v) { p[0] = (uint8_t)(v >> 8); p[1] = (uint8_t)v; }
static void wr32(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)(v >> 24); p[1] = (uint8_t)(v >> 16); p[2] = (uint8_t)(v >> 8);
    p[3] = (uint8_t)v;
}
static void wr64(uint8_t *p, uint64_t v) { wr32(p, (uint32_t)(v >> 32)); wr32(p + 4, (uint32_t)v); }

static int utf8_valid(const uint8_t *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        uint8_t c = s[i];
        size_t k;
        uint32_t cp;
        if (c < 0x80) { i++; continue; }
        if ((c & 0xE0) == 0xC0) { k = 1; cp = c & 0x1F; }
        else if ((c & 0xF0) == 0xE0) { k = 2; cp = c & 0x0F; }
        else if ((c & 0xF8) == 0xF0) { k = 3; cp = c & 0x07; }
        else return 0;
        if (n - i <= k) return 0;
        for (size_t j = 1; j <= k; j++) {
            if ((s[i + j] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (s[i + j] & 0x3F);
        }
        if ((k == 1 && cp < 0x80) || (k == 2 && cp < 0x800) || (k == 3 && cp < 0x10000) ||
            cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return 0;
        i += k + 1;
    }
    return 1;
}

static char *strndup0(const uint8_t *s, size_t n) {
    char *r = malloc(n + 1);
    if (!r) return NULL;
    memcpy(r, s, n);
    r[n] = 0;
    return r;
}

static void close_fds(int *fds, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (fds[i] >= 0) { close(fds[i]); fds[i] = -1; }
}

/* ---- the frame codec ---------------------------------------------------------- */
struct layout {
    uint8_t type, flags;
    uint16_t target_len, source_len, n_blobs, n_fds;
    uint64_t request_id;
    uint32_t header_len, body_len;
    size_t target_off, source_off, header_off, body_off, table_off, blobs_off;
};

static int frame_layout(const uint8_t *f, size_t len, uint32_t max, struct layout *L,
                        msgq_error *err) {
    if (len < PREFIX_SIZE) {
        err_set(err, "protocol-error", "broker sent a frame of %zu bytes, less than the 32-byte prefix", len);
        return -EPROTO;
    }
    uint64_t total = (uint64_t)rd32(f) + 4;
    if (total > max) {
        err_set(err, "frame-too-large", "broker sent a frame of %llu bytes, over max_frame_size %u",
                (unsigned long long)total, max);
        return -EMSGSIZE;
    }
    if (total != len) {
        err_set(err, "protocol-error", "frame length field says %llu bytes, frame has %zu",
                (unsigned long long)total, len);
        return -EPROTO;
    }
    L->type = f[4];
    L->flags = f[5];
    L->target_len = rd16(f + 6);
    L->source_len = rd16(f + 8);
    L->n_blobs = rd16(f + 10);
    L->n_fds = rd16(f + 12);
    L->request_id = rd64(f + 16);
    L->header_len = rd32(f + 24);
    L->body_len = rd32(f + 28);
    if (L->type < T_HELLO || L->type > T_GOODBYE) {
        err_set(err, "protocol-error", "broker sent a frame of unknown type %u", L->type);
        return -EPROTO;
    }
    if (rd16(f + 14) != 0) {
        err_set(err, "protocol-error", "broker sent a frame with nonzero reserved bytes");
        return -EPROTO;
    }
    uint64_t need = (uint64_t)PREFIX_SIZE + L->target_len + L->source_len + L->header_len +
                    L->body_len + 4ull * L->n_blobs;
    if (need > len) {
        err_set(err, "protocol-error", "broker sent a frame whose sections exceed its length");
        return -EPROTO;
    }
    L->target_off = PREFIX_SIZE;
    L->source_off = L->target_off + L->target_len;
    L->header_off = L->source_off + L->source_len;
    L->body_off = L->header_off + L->header_len;
    L->table_off = L->body_off + L->body_len;
    L->blobs_off = L->table_off + 4u * L->n_blobs;
    for (size_t i = 0; i < L->n_blobs; i++) need += rd32(f + L->table_off + 4 * i);
    if (need != len) {
        err_set(err, "protocol-error", "broker sent a frame whose sections add up to %llu bytes, not %zu",
                (unsigned long long)need, len);
        return -EPROTO;
    }
    if (!utf8_valid(f + L->target_off, L->target_len)) {
        err_set(err, "protocol-error", "broker sent a frame whose target is not UTF-8");
        return -EPROTO;
    }
    return 0;
}

/*
 * Well-formedness of one CBOR item (RFC 8949 appendix C) before libcbor sees it.
 * Why: libcbor 0.8 allocates an array or map for the count its head claims before any
 * item arrives, so a 9-byte body claiming 2^32 items costs gigabytes (found by the
 * fuzz target). Here every claimed count must fit in the bytes that remain (an item is
 * at least one byte), so what libcbor then allocates is bounded by the input's size,
 * and nesting deeper than max_cbor_depth is refused (libcbor's own parse stack holds
 * 2048 levels; cbor2 in the Python clients is bounded by Python's recursion limit, about
 * 1000, so a body one side can build the other can read).
 */

static int wf_head(const uint8_t *p, size_t len, size_t *off, int *mt, int *ai, uint64_t *val) {
    if (*off >= len) return -1;
    uint8_t ib = p[(*off)++];
    *mt = ib >> 5;
    *ai = ib & 31;
    int n = *ai < 24 ? 0 : *ai == 24 ? 1 : *ai == 25 ? 2 : *ai == 26 ? 4 : *ai == 27 ? 8 : -1;
    if (n < 0) {
        *val = 0;
        return *ai == 31 ? 0 : -1; /* 28..30 are reserved */
    }
    if (len - *off < (size_t)n) return -1;
    uint64_t v = n ? 0 : (uint64_t)*ai;
    for (int i = 0; i < n; i++) v = v << 8 | p[(*off)++];
    *val = v;
    return 0;
}

static int wf_item(const uint8_t *p, size_t len, size_t *off, int depth, int max_depth,
                   int *is_break) {
    int mt, ai;
    uint64_t val;
    *is_break = 0;
    if (depth > max_depth || wf_head(p, len, off, &mt, &ai, &val) < 0) return -1;
    size_t left = len - *off;
    if (ai == 31) {
        switch (mt) {
        case 2:
        case 3: /* indefinite string: definite chunks of the same type, then break */
            for (;;) {
                int cmt, cai;
                uint64_t cval;
                if (*off < len && p[*off] == 0xFF) { (*off)++; return 0; }
                if (wf_head(p, len, off, &cmt, &cai, &cval) < 0 || cmt != mt || cai == 31 ||
                    cval > len - *off)
                    return -1;
                *off += (size_t)cval;
            }
        case 4:
        case 5: /* indefinite array or map: items until break */
            for (uint64_t k = 0;; k++) {
                int brk;
                if (wf_item(p, len, off, depth + 1, max_depth, &brk) < 0) return -1;
                if (brk) return (mt == 5 && k % 2) ? -1 : 0;
            }
        case 7:
            *is_break = 1;
            return depth > 0 ? 0 : -1;
        default:
            return -1;
        }
    }
    switch (mt) {
    case 0:
    case 1:
        return 0;
    case 2:
    case 3:
        if (val > left) return -1;
        *off += (size_t)val;
        return 0;
    case 4:
    case 5: {
        uint64_t items = val;
        if (mt == 5) {
            if (items > left / 2) return -1;
            items *= 2;
        } else if (items > left) {
            return -1;
        }
        for (uint64_t k = 0; k < items; k++) {
            int brk;
            if (wf_item(p, len, off, depth + 1, max_depth, &brk) < 0 || brk) return -1;
        }
        return 0;
    }
    case 6: {
        int brk;
        return wf_item(p, len, off, depth + 1, max_depth, &brk) < 0 || brk ? -1 : 0;
    }
    default: /* 7: simple values and floats; the head read their bytes */
        return ai == 24 && val < 32 ? -1 : 0;
    }
}

/* Decode exactly one CBOR item from buf (NULL if malformed or trailing bytes). */
static cbor_item_t *cbor_one(const uint8_t *buf, size_t len, int max_depth) {
    size_t off = 0;
    int brk;
    if (wf_item(buf, len, &off, 0, max_depth, &brk) < 0 || brk || off != len) return NULL;
    struct cbor_load_result r;
    cbor_item_t *it = cbor_load(buf, len, &r);
    if (!it) return NULL;
    if (r.error.code != CBOR_ERR_NONE || r.read != len) {
        cbor_decref(&it);
        return NULL;
    }
    return it;
}

/* A string value of a CBOR map with string keys, as a new C string, or NULL. */
static char *map_str(const cbor_item_t *map, const char *key) {
    if (!map || !cbor_isa_map(map)) return NULL;
    size_t n = cbor_map_size(map), kl = strlen(key);
    struct cbor_pair *p = cbor_map_handle(map);
    for (size_t i = 0; i < n; i++) {
        cbor_item_t *k = p[i].key, *v = p[i].value;
        if (cbor_isa_string(k) && cbor_string_is_definite(k) && cbor_string_length(k) == kl &&
            memcmp(cbor_string_handle(k), key, kl) == 0) {
            if (cbor_isa_string(v) && cbor_string_is_definite(v))
                return strndup0(cbor_string_handle(v), cbor_string_length(v));
            return NULL;
        }
    }
    return NULL;
}

static cbor_item_t *map_get(const cbor_item_t *map, const char *key) {
    if (!map || !cbor_isa_map(map)) return NULL;
    size_t n = cbor_map_size(map), kl = strlen(key);
    struct cbor_pair *p = cbor_map_handle(map);
    for (size_t i = 0; i < n; i++) {
        cbor_item_t *k = p[i].key;
        if (cbor_isa_string(k) && cbor_string_is_definite(k) && cbor_string_length(k) == kl &&
            memcmp(cbor_string_handle(k), key, kl) == 0)
            return p[i].value;
    }
    return NULL;
}

static int cbor_to_u64(const cbor_item_t *v, uint64_t *out) {
    if (!v || !cbor_isa_uint(v)) return 0;
    *out = cbor_get_int(v);
    return 1;
}

/* ---- messages ----------------------------------------------------------------- */
struct msgq_message {
    int refs;
    int max_depth; /* the connection's max_cbor_depth when it arrived */
    int answered;
    uint8_t *raw;
    size_t len;
    struct layout L;
    char *target, *sender, *sender_name, *reply_to, *name; /* name: event or command */
    cbor_item_t *header;
    int header_bad;
    cbor_item_t *body;
    int body_state; /* 0 not decoded, 1 decoded, -1 malformed */
    int *fds;
    size_t n_fds;
    char *traceparent, *tracestate; /* a valid trace context of a TRACED frame, or NULL */
};

msgq_message *msgq_message_ref(msgq_message *msg) {
    if (msg) msg->refs++;
    return msg;
}

void msgq_message_unref(msgq_message *msg) {
    if (!msg || --msg->refs > 0) return;
    free(msg->raw);
    free(msg->target);
    free(msg->sender);
    free(msg->sender_name);
    free(msg->reply_to);
    free(msg->name);
    free(msg->traceparent);
    free(msg->tracestate);
    if (msg->header) cbor_decref(&msg->header);
    if (msg->body) cbor_decref(&msg->body);
    close_fds(msg->fds, msg->n_fds);
    free(msg->fds);
    free(msg);
}

msgq_kind msgq_message_kind(const msgq_message *m) { return (msgq_kind)m->L.type; }
const char *msgq_message_target(const msgq_message *m) { return m->target; }
const char *msgq_message_sender(const msgq_message *m) { return m->sender; }
const char *msgq_message_sender_name(const msgq_message *m) { return m->sender_name; }
const char *msgq_message_event(const msgq_message *m) {
    return m->L.type == T_NOTIFY ? m->name : NULL;
}
const char *msgq_message_command(const msgq_message *m) {
    return m->L.type == T_REQUEST ? m->name : NULL;
}
uint64_t msgq_message_request_id(const msgq_message *m) { return m->L.request_id; }

int msgq_message_body(msgq_message *m, cbor_item_t **body, msgq_error *err) {
    if (m->body_state == 0) {
        if (m->L.body_len == 0) {
            m->body = cbor_new_null();
        } else {
            m->body = cbor_one(m->raw + m->L.body_off, m->L.body_len, m->max_depth);
        }
        m->body_state = m->body ? 1 : -1;
    }
    if (m->body_state < 0) {
        err_set(err, "malformed-message", "malformed body from %s (%s): not one well-formed CBOR item",
                m->sender, m->sender_name);
        *body = NULL;
        return -EBADMSG;
    }
    *body = m->body;
    return 0;
}

const uint8_t *msgq_message_body_raw(const msgq_message *m, size_t *len) {
    *len = m->L.body_len;
    return m->raw + m->L.body_off;
}

size_t msgq_message_attachment_count(const msgq_message *m) { return m->L.n_blobs; }

const uint8_t *msgq_message_attachment(const msgq_message *m, size_t i, size_t *len) {
    if (i >= m->L.n_blobs) { *len = 0; return NULL; }
    size_t off = m->L.blobs_off;
    for (size_t j = 0; j < i; j++) off += rd32(m->raw + m->L.table_off + 4 * j);
    *len = rd32(m->raw + m->L.table_off + 4 * i);
    return m->raw + off;
}

size_t msgq_message_fd_count(const msgq_message *m) { return m->n_fds; }

int msgq_message_take_fd(msgq_message *m, size_t i) {
    if (i >= m->n_fds) return -1;
    int fd = m->fds[i];
    m->fds[i] = -1;
    return fd;
}

/* Whether tp is a W3C traceparent this library continues (as tracing.parse_traceparent
 * of the Python clients: lowercase hex, ids not all zero, version not ff, version 00
 * with exactly four fields). */
static int hex_run(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f'))) return 0;
    return 1;
}
static int not_zero(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (s[i] != '0') return 1;
    return 0;
}
static int traceparent_valid(const char *tp) {
    size_t n = strlen(tp);
    if (n < 55 || tp[2] != '-' || tp[35] != '-' || tp[52] != '-') return 0;
    if (!hex_run(tp, 2) || !hex_run(tp + 3, 32) || !hex_run(tp + 36, 16) || !hex_run(tp + 53, 2))
        return 0;
    if (memcmp(tp, "ff", 2) == 0 || !not_zero(tp + 3, 32) || !not_zero(tp + 36, 16)) return 0;
    if (n > 55 && (memcmp(tp, "00", 2) == 0 || tp[55] != '-')) return 0;
    return 1;
}

const char *msgq_message_traceparent(const msgq_message *msg) {
    return msg ? msg->traceparent : NULL;
}

/* Parse a whole valid-layout frame (taking raw) into a message. */
static msgq_message *message_new(uint8_t *raw, size_t len, const struct layout *L,
                                 int max_depth) {
    msgq_message *m = calloc(1, sizeof *m);
    if (!m) return NULL;
    m->refs = 1;
    m->max_depth = max_depth;
    m->raw = raw;
    m->len = len;
    m->L = *L;
    m->target = strndup0(raw + L->target_off, L->target_len);
    /* Source: "lname NUL name", or relayed "binder NUL bname NUL origin NUL oname". */
    const uint8_t *s = raw + L->source_off;
    size_t sl = L->source_len, parts = 0, start[4] = {0}, plen[4] = {0}, p0 = 0;
    for (size_t i = 0; i <= sl && parts < 4; i++) {
        if (i == sl || s[i] == 0) {
            start[parts] = p0;
            plen[parts] = i - p0;
            parts++;
            p0 = i + 1;
        }
    }
    if (parts == 4) {
        m->reply_to = strndup0(s + start[0], plen[0]);
        m->sender = strndup0(s + start[2], plen[2]);
        m->sender_name = strndup0(s + start[3], plen[3]);
    } else {
        m->reply_to = strndup0(s + start[0], plen[0]);
        m->sender = strndup0(s + start[0], plen[0]);
        m->sender_name = parts > 1 ? strndup0(s + start[1], plen[1]) : strndup0(s, 0);
    }
    if (L->header_len) {
        m->header = cbor_one(raw + L->header_off, L->header_len, max_depth);
        if (!m->header || !cbor_isa_map(m->header)) {
            m->header_bad = 1;
            if (m->header) cbor_decref(&m->header);
        }
    }
    if (m->header) {
        if (L->type == T_NOTIFY) m->name = map_str(m->header, "event");
        else if (L->type == T_REQUEST) m->name = map_str(m->header, "cmd");
        if (L->flags & FLAG_TRACED) {
            m->traceparent = map_str(m->header, "traceparent");
            if (m->traceparent && !traceparent_valid(m->traceparent)) {
                free(m->traceparent); /* W3C: an invalid traceparent leaves it untraced */
                m->traceparent = NULL;
            }
            if (m->traceparent) m->tracestate = map_str(m->header, "tracestate");
            if (m->tracestate && strlen(m->tracestate) > TRACESTATE_MAX) {
                free(m->tracestate);
                m->tracestate = NULL;
            }
        }
    }
    if (!m->target || !m->reply_to || !m->sender || !m->sender_name) {
        m->raw = NULL; /* the caller still owns raw on failure */
        msgq_message_unref(m);
        return NULL;
    }
    return m;
}

int msgq_frame_check(const uint8_t *frame, size_t len, uint32_t max, msgq_error *err) {
    struct layout L;
    int r = frame_layout(frame, len, max, &L, err);
    if (r < 0) return r;
    if (L.header_len) {
        cbor_item_t *h = cbor_one(frame + L.header_off, L.header_len, DEFAULT_MAX_CBOR_DEPTH);
        int ok = h && cbor_isa_map(h);
        if (h) cbor_decref(&h);
        if (!ok) {
            err_set(err, "protocol-error", "frame header is not one well-formed CBOR map");
            return -EPROTO;
        }
    }
    if (L.body_len) {
        cbor_item_t *b = cbor_one(frame + L.body_off, L.body_len, DEFAULT_MAX_CBOR_DEPTH);
        if (!b) {
            err_set(err, "protocol-error", "frame body is not one well-formed CBOR item");
            return -EPROTO;
        }
        cbor_decref(&b);
    }
    /* The rest of what a receiver does with a frame: split the source, read the
     * header's fields, walk the attachments. */
    uint8_t *copy = malloc(len);
    if (!copy) return -ENOMEM;
    memcpy(copy, frame, len);
    msgq_message *msg = message_new(copy, len, &L, DEFAULT_MAX_CBOR_DEPTH);
    if (!msg) {
        free(copy);
        return -ENOMEM;
    }
    for (size_t i = 0; i < msgq_message_attachment_count(msg); i++) {
        size_t bl;
        (void)msgq_message_attachment(msg, i, &bl);
    }
    msgq_message_unref(msg);
    return 0;
}

/* ---- the connection ----------------------------------------------------------- */
struct outframe {
    struct outframe *next;
    uint8_t *buf;
    size_t len, off;
    int *fds;
    size_t n_fds;
};

struct fdbatch {
    struct fdbatch *next;
    uint64_t start, end; /* stream offsets of the bytes they arrived with */
    int *fds;
    size_t n;
    int claimed;
};

struct pending {
    struct pending *next;
    uint64_t rid;
    uint64_t deadline; /* 0: none (the broker's deadline covers it) */
    msgq_call_cb cb;
    void *ud;
};

struct decl_param {
    char *name, *type, *doc;
    int required;
    cbor_item_t *def; /* NULL: none */
};

/* A declared command or event (docs/PROTOCOL.md, "Interfaces and introspection"). */
struct decl {
    struct decl_param *params;
    size_t n_params;
    int has_params; /* 0: not declared (null on the wire, nothing checked) */
    char *result, *doc, *group;
    char **raises;
    size_t n_raises;
};

struct command {
    struct command *next;
    char *name;
    msgq_command_cb cb; /* NULL: declared, no handler yet */
    void *ud;
    struct decl *decl;
};

struct event {
    struct event *next;
    char *name;
    struct decl *decl;
};

/* The current trace while a handler of a traced request runs (on: 0 outside). */
struct trace {
    int on;
    char trace_id[33], span_id[17], cause[17], flags[3];
    char *state;
    char traceparent[56];
};

struct msgq {
    int fd;
    enum state state;
    msgq_options o;
    uint32_t send_max_frame; /* min(ours, the broker's) */
    char lname[64];
    char *name, *broker;
    /* Our stamp ("lname NUL name") from WELCOME on, written into every frame we send:
     * the broker forwards a frame whose source is already the sender's stamp without
     * copying it, and queues runs of them as one buffer. */
    uint8_t *stamp;
    size_t stamp_len;
    /* input: one buffer, in[0] is stream offset in_base; in[0..in_pos) is parsed, so
     * frames are taken by moving a cursor, and the rest moved down once per parse */
    uint8_t *in;
    size_t in_pos, in_len, in_cap;
    uint64_t in_base;
    struct fdbatch *fdb;
    struct outframe *out_head, *out_tail;
    size_t out_bytes;
    struct pending *pending;
    uint64_t next_rid;
    struct command *commands;
    struct event *events;
    size_t n_decls;
    char **groups; /* joined, in join order (for msgq.introspect) */
    size_t n_groups;
    struct trace trace;
    msgq_message_cb msg_cb;
    void *msg_ud;
    msgq_error lost; /* why the connection ended (state S_LOST) */
    int goodbye_in;
};

const char *msgq_lname(const msgq *m) { return m->lname; }
const char *msgq_broker_version(const msgq *m) { return m->broker ? m->broker : ""; }
int msgq_get_fd(const msgq *m) { return m->fd; }
size_t msgq_get_queued_bytes(const msgq *m) { return m->out_bytes; }

int msgq_status(const msgq *m, msgq_error *err) {
    if (m->state != S_LOST) return 0;
    err_copy(err, &m->lost);
    return -ENOTCONN;
}

int msgq_get_events(const msgq *m) {
    if (m->state == S_LOST) return 0;
    return POLLIN | (m->out_head ? POLLOUT : 0);
}

uint64_t msgq_get_timeout(const msgq *m) {
    uint64_t t = UINT64_MAX;
    for (struct pending *p = m->pending; p; p = p->next)
        if (p->deadline && p->deadline < t) t = p->deadline;
    return t;
}

static void fail_all_calls(msgq *m);

/* The connection ended: remember why, close what it holds, fail every pending call. */
static void lose(msgq *m, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void lose(msgq *m, const char *code, const char *fmt, ...) {
    if (m->state == S_LOST) return;
    m->state = S_LOST;
    va_list ap;
    va_start(ap, fmt);
    err_setv(&m->lost, code, NULL, fmt, ap);
    va_end(ap);
    /* Keep the descriptor number until msgq_close, so a caller's epoll set never sees
     * it reused; shut it down so the broker sees us gone. */
    if (m->fd >= 0) shutdown(m->fd, SHUT_RDWR);
    for (struct outframe *f = m->out_head, *n; f; f = n) {
        n = f->next;
        close_fds(f->fds, f->n_fds);
        free(f->fds);
        free(f->buf);
        free(f);
    }
    m->out_head = m->out_tail = NULL;
    m->out_bytes = 0;
    for (struct fdbatch *b = m->fdb, *n; b; b = n) {
        n = b->next;
        close_fds(b->fds, b->n);
        free(b->fds);
        free(b);
    }
    m->fdb = NULL;
    fail_all_calls(m);
}

static void deliver_result(msgq *m, struct pending *p, msgq_result *res) {
    /* A call's callback is not part of a handler that happens to be waiting meanwhile:
     * what it sends is untraced (the current trace is the running handler's only). */
    struct trace outer = m->trace;
    m->trace.on = 0;
    if (p->cb) p->cb(m, res, p->ud);
    m->trace = outer;
    msgq_result_clear(res);
    free(p);
}

static void fail_all_calls(msgq *m) {
    while (m->pending) {
        struct pending *p = m->pending;
        m->pending = p->next;
        msgq_result res;
        memset(&res, 0, sizeof res);
        res.status = -ENOTCONN;
        err_copy(&res.error, &m->lost);
        if (!res.error.code[0]) snprintf(res.error.code, sizeof res.error.code, "connection-lost");
        deliver_result(m, p, &res);
    }
}

void msgq_result_clear(msgq_result *res) {
    if (!res) return;
    msgq_message_unref(res->answer);
    msgq_error_clear(&res->error);
    memset(res, 0, sizeof *res);
}

static int read_some(msgq *m);
static void parse_frames(msgq *m);

/* Parse what the broker sent before it closed, without waiting, while the handshake
 * lasts (a peek first: at EOF read_some would record a crash, not our failed write). */
static void read_refusal(msgq *m) {
    char c;
    while (m->state == S_HELLO_SENT && recv(m->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0 &&
           read_some(m) > 0)
        parse_frames(m);
}

/* ---- writing ----------------------------------------------------------------- */
/* Write what the socket takes now. 1 if anything was written, 0 if not, <0 lost. */
static int try_write(msgq *m) {
    int progress = 0;
    while (m->out_head && m->state != S_LOST) {
        struct outframe *f = m->out_head;
        ssize_t n;
        if (f->off == 0 && f->n_fds) {
            /* Descriptors travel with the frame's first byte (docs/PROTOCOL.md). */
            struct iovec iov = {f->buf, f->len};
            size_t clen = CMSG_SPACE(sizeof(int) * f->n_fds);
            char *cbuf = calloc(1, clen);
            if (!cbuf) return -ENOMEM;
            struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                                .msg_controllen = clen};
            struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
            c->cmsg_level = SOL_SOCKET;
            c->cmsg_type = SCM_RIGHTS;
            c->cmsg_len = CMSG_LEN(sizeof(int) * f->n_fds);
            memcpy(CMSG_DATA(c), f->fds, sizeof(int) * f->n_fds);
            n = sendmsg(m->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
            free(cbuf);
            if (n > 0) {
                close_fds(f->fds, f->n_fds);
                f->n_fds = 0;
            }
        } else {
            n = send(m->fd, f->buf + f->off, f->len - f->off, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        if (n < 0) {
            if (errno == EAGAIN || errno == EWOULDBLOCK) break;
            if (errno == EINTR) continue;
            int e = errno;
            /* A broker that refused us may have closed before our HELLO was all written
             * (its lingering close is bounded): its ERROR still waits in our receive
             * buffer and says why better than EPIPE does (take_welcome keeps it). */
            if (m->state == S_HELLO_SENT) read_refusal(m);
            lose(m, "connection-lost", "write to the broker failed: %s", strerror(e));
            return -ENOTCONN;
        }
        progress = 1;
        f->off += (size_t)n;
        m->out_bytes -= (size_t)n;
        if (f->off == f->len) {
            m->out_head = f->next;
            if (!m->out_head) m->out_tail = NULL;
            free(f->fds);
            free(f->buf);
            free(f);
        }
    }
    return progress;
}

/* Build a frame. blobs may be NULL. Returns the buffer or NULL (-errno in *rc). */
static uint8_t *build_frame(msgq *m, int type, int flags, const char *target, uint64_t rid,
                            const uint8_t *hdr, size_t hl, const uint8_t *body, size_t bl,
                            const msgq_extras *x, size_t *out_len, int *rc) {
    size_t tl = target ? strlen(target) : 0;
    size_t nb = x ? x->n_attachments : 0, nf = x ? x->n_fds : 0;
    if (tl > 0xFFFF || nb > 0xFFFF || nf > m->o.max_fds || hl > UINT32_MAX || bl > UINT32_MAX) {
        *rc = tl > 0xFFFF || nb > 0xFFFF ? -EINVAL : (nf > m->o.max_fds ? -EINVAL : -EMSGSIZE);
        return NULL;
    }
    uint64_t total = PREFIX_SIZE + (uint64_t)tl + hl + bl + 4ull * nb;
    for (size_t i = 0; i < nb; i++) {
        if (x->attachments[i].len > UINT32_MAX) { *rc = -EMSGSIZE; return NULL; }
        total += x->attachments[i].len;
    }
    if (total > m->send_max_frame) { *rc = -EMSGSIZE; return NULL; }
    /* Our stamp, unless it alone would push the frame over the limit: the size limit
     * stays the one for an unstamped frame (the broker stamps that one itself). */
    size_t sl = m->stamp_len;
    if (total + sl > m->send_max_frame) sl = 0;
    total += sl;
    uint8_t *f = malloc(total);
    if (!f) { *rc = -ENOMEM; return NULL; }
    wr32(f, (uint32_t)(total - 4));
    f[4] = (uint8_t)type;
    f[5] = (uint8_t)flags;
    wr16(f + 6, (uint16_t)tl);
    wr16(f + 8, (uint16_t)sl); /* the broker replaces any source but our true stamp */
    wr16(f + 10, (uint16_t)nb);
    wr16(f + 12, (uint16_t)nf);
    wr16(f + 14, 0);
    wr64(f + 16, rid);
    wr32(f + 24, (uint32_t)hl);
    wr32(f + 28, (uint32_t)bl);
    uint8_t *p = f + PREFIX_SIZE;
    if (tl) memcpy(p, target, tl), p += tl;
    if (sl) memcpy(p, m->stamp, sl), p += sl;
    if (hl) memcpy(p, hdr, hl), p += hl;
    if (bl) memcpy(p, body, bl), p += bl;
    for (size_t i = 0; i < nb; i++, p += 4) wr32(p, (uint32_t)x->attachments[i].len);
    for (size_t i = 0; i < nb; i++) {
        if (x->attachments[i].len) memcpy(p, x->attachments[i].data, x->attachments[i].len);
        p += x->attachments[i].len;
    }
    *out_len = total;
    return f;
}

static int wait_io(msgq *m, int events, uint64_t deadline);

/* Queue a frame (taking buf); dup the caller's fds. Applies the out bound. */
static int enqueue(msgq *m, uint8_t *buf, size_t len, const msgq_extras *x) {
    if (m->state == S_LOST) { free(buf); return -ENOTCONN; }
    while (m->out_bytes >= m->o.max_out_bytes) {
        int r = try_write(m);
        if (r < 0) { free(buf); return r; }
        if (m->out_bytes < m->o.max_out_bytes) break;
        if (m->o.nonblocking) { free(buf); return -EAGAIN; }
        /* Wait for the socket; read meanwhile (callbacks run), so a broker that is
         * itself waiting for us to read cannot deadlock with us. */
        wait_io(m, POLLIN | POLLOUT, msgq_get_timeout(m));
        r = msgq_process(m);
        if (r < 0) { free(buf); return r; }
    }
    struct outframe *f = calloc(1, sizeof *f);
    if (!f) { free(buf); return -ENOMEM; }
    f->buf = buf;
    f->len = len;
    size_t nf = x ? x->n_fds : 0;
    if (nf) {
        f->fds = malloc(sizeof(int) * nf);
        if (!f->fds) { free(f); free(buf); return -ENOMEM; }
        for (size_t i = 0; i < nf; i++) {
            f->fds[i] = fcntl(x->fds[i], F_DUPFD_CLOEXEC, 0);
            if (f->fds[i] < 0) {
                int e = errno;
                close_fds(f->fds, i);
                free(f->fds);
                free(f);
                free(buf);
                return -e;
            }
        }
        f->n_fds = nf;
    }
    if (m->out_tail) m->out_tail->next = f;
    else m->out_head = f;
    m->out_tail = f;
    m->out_bytes += len;
    int r = try_write(m);
    return r < 0 ? r : 0;
}

static cbor_item_t *trace_header(msgq *m, const cbor_item_t *header);

static int send_frame(msgq *m, int type, const char *target, uint64_t rid,
                      const cbor_item_t *header, const uint8_t *body, size_t bl,
                      const msgq_extras *x) {
    unsigned char *hb = NULL;
    size_t hsz = 0, hl = 0;
    int flags = 0;
    cbor_item_t *traced = NULL;
    if (m->trace.on && (type == T_REQUEST || type == T_MESSAGE || type == T_NOTIFY)) {
        traced = trace_header(m, header);
        if (!traced) return -ENOMEM;
        header = traced;
        flags = FLAG_TRACED;
    }
    if (header) {
        hl = cbor_serialize_alloc(header, &hb, &hsz);
        if (traced) cbor_decref(&traced);
        if (!hl) return -ENOMEM;
    }
    size_t len;
    int rc = 0;
    uint8_t *f = build_frame(m, type, flags, target, rid, hb, hl, body, bl, x, &len, &rc);
    free(hb);
    if (!f) return rc;
    return enqueue(m, f, len, x);
}

static int serialize(const cbor_item_t *v, unsigned char **buf, size_t *len) {
    *buf = NULL;
    *len = 0;
    if (!v) return 0;
    size_t sz;
    *len = cbor_serialize_alloc(v, buf, &sz);
    return *len ? 0 : -ENOMEM;
}

int msgq_send_raw(msgq *m, const char *target, const void *cbor, size_t len,
                  const msgq_extras *x) {
    if (!target || !*target) return -EINVAL;
    return send_frame(m, T_MESSAGE, target, 0, NULL, cbor, len, x);
}

int msgq_send(msgq *m, const char *target, const cbor_item_t *body, const msgq_extras *x) {
    unsigned char *b;
    size_t bl;
    if (serialize(body, &b, &bl) < 0) return -ENOMEM;
    int r = msgq_send_raw(m, target, b, bl, x);
    free(b);
    return r;
}

static cbor_item_t *str_item(const char *s) { return cbor_build_string(s); }

static int map_add(cbor_item_t *map, const char *k, cbor_item_t *v) {
    cbor_item_t *key = str_item(k);
    if (!key || !v) {
        if (key) cbor_decref(&key);
        if (v) cbor_decref(&v);
        return -ENOMEM;
    }
    bool ok = cbor_map_add(map, (struct cbor_pair){.key = key, .value = v});
    cbor_decref(&key);
    cbor_decref(&v);
    return ok ? 0 : -ENOMEM;
}

int msgq_notify(msgq *m, const char *group, const char *event, const cbor_item_t *params) {
    if (!group || !*group || !event) return -EINVAL;
    cbor_item_t *h = cbor_new_definite_map(1);
    if (!h || map_add(h, "event", str_item(event)) < 0) {
        if (h) cbor_decref(&h);
        return -ENOMEM;
    }
    unsigned char *b;
    size_t bl;
    int r = serialize(params, &b, &bl);
    if (r == 0) r = send_frame(m, T_NOTIFY, group, 0, h, b, bl, NULL);
    free(b);
    cbor_decref(&h);
    return r;
}

/* ---- calls -------------------------------------------------------------------- */
int msgq_call_async_raw(msgq *m, const char *target, const char *command, const void *cbor,
                        size_t len, const msgq_extras *x, double timeout_s, msgq_call_cb cb,
                        void *ud, uint64_t *request_id) {
    if (!target || !*target || !command) return -EINVAL;
    if (m->state == S_LOST) return -ENOTCONN;
    cbor_item_t *h = cbor_new_definite_map(timeout_s > 0 ? 2 : 1);
    if (!h) return -ENOMEM;
    int r = map_add(h, "cmd", str_item(command));
    if (r == 0 && timeout_s > 0) r = map_add(h, "timeout", cbor_build_float8(timeout_s));
    if (r < 0) { cbor_decref(&h); return r; }
    struct pending *p = calloc(1, sizeof *p);
    if (!p) { cbor_decref(&h); return -ENOMEM; }
    p->rid = ++m->next_rid;
    p->cb = cb;
    p->ud = ud;
    if (timeout_s > 0) p->deadline = msgq_now() + (uint64_t)(timeout_s * 1e6) + LOCAL_GRACE_US;
    r = send_frame(m, T_REQUEST, target, p->rid, h, cbor, len, x);
    cbor_decref(&h);
    if (r < 0) { free(p); return r; }
    p->next = m->pending;
    m->pending = p;
    if (request_id) *request_id = p->rid;
    return 0;
}

int msgq_call_async(msgq *m, const char *target, const char *command,
                    const cbor_item_t *params, const msgq_extras *x, double timeout_s,
                    msgq_call_cb cb, void *ud, uint64_t *request_id) {
    unsigned char *b;
    size_t bl;
    if (serialize(params, &b, &bl) < 0) return -ENOMEM;
    int r = msgq_call_async_raw(m, target, command, b, bl, x, timeout_s, cb, ud, request_id);
    free(b);
    return r;
}

struct sync_call {
    int done;
    msgq_result *res;
};

static void sync_cb(msgq *m, msgq_result *res, void *ud) {
    (void)m;
    struct sync_call *s = ud;
    *s->res = *res; /* take everything: the library then frees nothing */
    memset(res, 0, sizeof *res);
    s->done = 1;
}

int msgq_call(msgq *m, const char *target, const char *command, const cbor_item_t *params,
              const msgq_extras *x, double timeout_s, msgq_result *res) {
    memset(res, 0, sizeof *res);
    struct sync_call s = {0, res};
    int r = msgq_call_async(m, target, command, params, x, timeout_s, sync_cb, &s, NULL);
    if (r < 0) {
        res->status = r;
        if (r == -ENOTCONN) err_copy(&res->error, &m->lost);
        else err_set(&res->error, "", "cannot send the request: %s", strerror(-r));
        return r;
    }
    while (!s.done) {
        wait_io(m, msgq_get_events(m), msgq_get_timeout(m));
        msgq_process(m);
    }
    return res->status;
}

/* Keep the joined groups in join order, for msgq.introspect (best effort: out of
 * memory only leaves the list short). */
static void track_group(msgq *m, int joined, const char *group) {
    size_t i = 0;
    while (i < m->n_groups && strcmp(m->groups[i], group) != 0) i++;
    if (!joined) {
        if (i == m->n_groups) return;
        free(m->groups[i]);
        memmove(m->groups + i, m->groups + i + 1, (m->n_groups - i - 1) * sizeof *m->groups);
        m->n_groups--;
        return;
    }
    if (i < m->n_groups) return;
    char **g = realloc(m->groups, (m->n_groups + 1) * sizeof *g);
    if (!g) return;
    m->groups = g;
    if ((g[m->n_groups] = strdup(group))) m->n_groups++;
}

static int broker_bool(msgq *m, const char *cmd, const char *group, int *changed,
                       msgq_error *err) {
    cbor_item_t *p = cbor_new_definite_map(1);
    if (!p || map_add(p, "group", str_item(group)) < 0) {
        if (p) cbor_decref(&p);
        return -ENOMEM;
    }
    msgq_result res;
    int r = msgq_call(m, "msgq", cmd, p, NULL, 0, &res);
    cbor_decref(&p);
    int ch = r == 0 && res.value && cbor_isa_float_ctrl(res.value) && cbor_is_bool(res.value) &&
             cbor_get_bool(res.value);
    if (changed) *changed = ch;
    if (ch) track_group(m, strcmp(cmd, "subscribe") == 0, group);
    if (r < 0) err_copy(err, &res.error);
    msgq_result_clear(&res);
    return r;
}

int msgq_subscribe(msgq *m, const char *group, int *changed, msgq_error *err) {
    return broker_bool(m, "subscribe", group, changed, err);
}
int msgq_unsubscribe(msgq *m, const char *group, int *changed, msgq_error *err) {
    return broker_bool(m, "unsubscribe", group, changed, err);
}

/* ---- handlers and answers ---------------------------------------------------- */
void msgq_set_message_handler(msgq *m, msgq_message_cb cb, void *ud) {
    m->msg_cb = cb;
    m->msg_ud = ud;
}

static void decl_free(struct decl *d);

int msgq_add_command(msgq *m, const char *command, msgq_command_cb cb, void *ud) {
    if (!m || !command) return -EINVAL;
    struct command **pp = &m->commands;
    for (; *pp; pp = &(*pp)->next) {
        if (strcmp((*pp)->name, command) == 0) {
            if (!cb) {
                struct command *c = *pp;
                *pp = c->next;
                if (c->decl) m->n_decls--;
                decl_free(c->decl);
                free(c->name);
                free(c);
            } else {
                (*pp)->cb = cb;
                (*pp)->ud = ud;
            }
            return 0;
        }
    }
    if (!cb) return 0;
    struct command *c = calloc(1, sizeof *c);
    if (!c || !(c->name = strdup(command))) { free(c); return -ENOMEM; }
    c->cb = cb;
    c->ud = ud;
    c->next = m->commands;
    m->commands = c;
    return 0;
}

int msgq_reply_raw(msgq *m, msgq_message *req, const void *cbor, size_t len,
                   const msgq_extras *x) {
    if (!req || req->L.type != T_REQUEST || req->answered) return -EINVAL;
    req->answered = 1;
    return send_frame(m, T_REPLY, req->reply_to, req->L.request_id, NULL, cbor, len, x);
}

int msgq_reply(msgq *m, msgq_message *req, const cbor_item_t *result, const msgq_extras *x) {
    unsigned char *b;
    size_t bl;
    if (serialize(result, &b, &bl) < 0) return -ENOMEM;
    int r = msgq_reply_raw(m, req, b, bl, x);
    free(b);
    return r;
}

int msgq_reply_error(msgq *m, msgq_message *req, const char *code, const char *message,
                     const cbor_item_t *data) {
    if (!req || req->L.type != T_REQUEST || req->answered || !code) return -EINVAL;
    cbor_item_t *h = cbor_new_definite_map(2);
    if (!h) return -ENOMEM;
    int r = map_add(h, "code", str_item(code));
    if (r == 0) r = map_add(h, "message", str_item(message ? message : ""));
    unsigned char *b = NULL;
    size_t bl = 0;
    if (r == 0) r = serialize(data, &b, &bl);
    if (r == 0) {
        req->answered = 1;
        r = send_frame(m, T_ERROR, req->reply_to, req->L.request_id, h, b, bl, NULL);
    }
    free(b);
    cbor_decref(&h);
    return r;
}

/* ---- declared interfaces ------------------------------------------------------- */
/* The type grammar of docs/PROTOCOL.md (as interface.parse_type): a union of names
 * separated by "|", where list and dict may take [T] and [str, T]. Parsing and checking
 * are one walk: v NULL only parses; else *fits says whether v is of the type. */
#define TYPE_MAX_DEPTH 32 /* nesting of list[...] and dict[...]: a name is short anyway */

static const char *skip_ws(const char *s) {
    while (*s && isspace((unsigned char)*s)) s++;
    return s;
}

static int is_number(const cbor_item_t *v) {
    if (cbor_isa_uint(v) || cbor_isa_negint(v)) return 1;
    return cbor_isa_float_ctrl(v) && cbor_float_get_width(v) != CBOR_FLOAT_0;
}

static int ty_union(const char **ps, const cbor_item_t *v, int *fits, int depth);

static int ty_one(const char **ps, const cbor_item_t *v, int *fits, int depth) {
    const char *s = *ps;
    size_t n = 0;
    while (isalpha((unsigned char)s[n]) || s[n] == '_') n++;
#define IS(w) (n == sizeof(w) - 1 && memcmp(s, w, n) == 0)
    int list = IS("list"), dict = IS("dict");
    int f = 1;
    if (IS("any")) f = 1;
    else if (IS("str")) f = v && cbor_isa_string(v);
    else if (IS("bytes")) f = v && cbor_isa_bytestring(v);
    else if (IS("int")) f = v && (cbor_isa_uint(v) || cbor_isa_negint(v));
    else if (IS("float")) f = v && is_number(v);
    else if (IS("bool")) f = v && cbor_isa_float_ctrl(v) && cbor_is_bool(v);
    else if (IS("null")) f = v && cbor_isa_float_ctrl(v) && cbor_is_null(v);
    else if (list) f = v && cbor_isa_array(v);
    else if (dict) f = v && cbor_isa_map(v);
    else return -1;
#undef IS
    s += n;
    if ((list || dict) && *s == '[') {
        s = skip_ws(s + 1);
        if (dict) {
            if (strncmp(s, "str", 3) != 0) return -1;
            s = skip_ws(s + 3);
            if (*s != ',') return -1;
            s++;
        }
        const char *inner = s;
        int dummy;
        if (ty_union(&s, NULL, &dummy, depth + 1) < 0) return -1;
        s = skip_ws(s);
        if (*s != ']') return -1;
        s++;
        if (v && f && list) {
            size_t k = cbor_array_size(v);
            cbor_item_t **items = cbor_array_handle(v);
            for (size_t i = 0; i < k && f; i++) {
                const char *p = inner;
                ty_union(&p, items[i], &f, depth + 1);
            }
        }
        if (v && f && dict) {
            size_t k = cbor_map_size(v);
            struct cbor_pair *pairs = cbor_map_handle(v);
            for (size_t i = 0; i < k && f; i++) {
                const char *p = inner;
                f = cbor_isa_string(pairs[i].key);
                if (f) ty_union(&p, pairs[i].value, &f, depth + 1);
            }
        }
    } else if (v && f && dict) { /* a bare dict is dict[str, any] */
        size_t k = cbor_map_size(v);
        struct cbor_pair *pairs = cbor_map_handle(v);
        for (size_t i = 0; i < k && f; i++) f = cbor_isa_string(pairs[i].key);
    }
    *fits = f;
    *ps = s;
    return 0;
}

static int ty_union(const char **ps, const cbor_item_t *v, int *fits, int depth) {
    if (depth > TYPE_MAX_DEPTH) return -1;
    const char *s = *ps;
    int any = 0;
    for (;;) {
        int f = 0;
        s = skip_ws(s);
        if (ty_one(&s, v, &f, depth) < 0) return -1;
        any |= f;
        s = skip_ws(s);
        if (*s != '|') break;
        s++;
    }
    *fits = any;
    *ps = s;
    return 0;
}

int msgq_check_type(const char *type) {
    if (!type || strlen(type) > MSGQ_DECL_MAX_NAME) return -EINVAL;
    const char *s = type;
    int f;
    if (ty_union(&s, NULL, &f, 0) < 0 || *skip_ws(s)) return -EINVAL;
    return 0;
}

/* Whether v is of the (already checked) type. */
static int type_fits(const char *type, const cbor_item_t *v) {
    const char *s = type;
    int f = 1;
    if (ty_union(&s, v, &f, 0) < 0) return 1; /* cannot happen: checked when declared */
    return f;
}

static const char *kind_of(const cbor_item_t *v) {
    switch (cbor_typeof(v)) {
    case CBOR_TYPE_UINT:
    case CBOR_TYPE_NEGINT: return "int";
    case CBOR_TYPE_BYTESTRING: return "bytes";
    case CBOR_TYPE_STRING: return "str";
    case CBOR_TYPE_ARRAY: return "list";
    case CBOR_TYPE_MAP: return "dict";
    case CBOR_TYPE_TAG: return "tag";
    case CBOR_TYPE_FLOAT_CTRL:
        if (cbor_is_null(v)) return "null";
        if (cbor_is_bool(v)) return "bool";
        return cbor_float_get_width(v) == CBOR_FLOAT_0 ? "simple" : "float";
    }
    return "value";
}

/* A JSON scalar (null, true, false, a number, a string) as a new CBOR item, or NULL if
 * text is not one. The library has no JSON dependency; a default is a plain value. */
static cbor_item_t *json_scalar(const char *text) {
    const char *s = skip_ws(text), *end = NULL;
    cbor_item_t *it = NULL;
    if (strncmp(s, "null", 4) == 0) {
        it = cbor_new_null();
        end = s + 4;
    } else if (strncmp(s, "true", 4) == 0 || strncmp(s, "false", 5) == 0) {
        it = cbor_build_bool(*s == 't');
        end = s + (*s == 't' ? 4 : 5);
    } else if (*s == '"') {
        size_t n = strlen(s);
        char *buf = malloc(n + 1);
        if (!buf) return NULL;
        size_t j = 0;
        const char *p = s + 1;
        for (; *p && *p != '"'; p++) {
            if ((unsigned char)*p < 0x20) { free(buf); return NULL; }
            if (*p != '\\') { buf[j++] = *p; continue; }
            p++;
            const char *esc = strchr("\"\\/bfnrt", *p);
            if (*p && esc) {
                buf[j++] = "\"\\/\b\f\n\r\t"[esc - "\"\\/bfnrt"];
            } else if (*p == 'u' && hex_run(p + 1, 4) ) {
                unsigned c = (unsigned)strtoul((char[5]){p[1], p[2], p[3], p[4], 0}, NULL, 16);
                if (c >= 0xD800 && c <= 0xDFFF) { free(buf); return NULL; } /* no pairs */
                if (c < 0x80) buf[j++] = (char)c;
                else if (c < 0x800) {
                    buf[j++] = (char)(0xC0 | c >> 6);
                    buf[j++] = (char)(0x80 | (c & 0x3F));
                } else {
                    buf[j++] = (char)(0xE0 | c >> 12);
                    buf[j++] = (char)(0x80 | (c >> 6 & 0x3F));
                    buf[j++] = (char)(0x80 | (c & 0x3F));
                }
                p += 4;
            } else {
                free(buf);
                return NULL;
            }
        }
        if (*p != '"' || !utf8_valid((const uint8_t *)buf, j)) { free(buf); return NULL; }
        it = cbor_build_stringn(buf, j);
        free(buf);
        end = p + 1;
    } else if (*s == '-' || isdigit((unsigned char)*s)) {
        size_t n = strspn(s, "0123456789+-.eE");
        int integral = strcspn(s, ".eE") >= n;
        char *e;
        errno = 0;
        if (integral && *s == '-') {
            long long v = strtoll(s, &e, 10);
            if (errno) return NULL;
            it = v < 0 ? cbor_build_negint64((uint64_t)(-(v + 1))) : cbor_build_uint64((uint64_t)v);
        } else if (integral) {
            unsigned long long v = strtoull(s, &e, 10);
            if (errno) return NULL;
            it = cbor_build_uint64(v);
        } else {
            double v = strtod(s, &e);
            if (errno) return NULL;
            it = cbor_build_float8(v);
        }
        if (e != s + n) {
            if (it) cbor_decref(&it);
            return NULL;
        }
        end = e;
    }
    if (it && *skip_ws(end)) cbor_decref(&it);
    return it;
}

static int text_ok(const char *s, size_t max, int nonempty) {
    if (!s) return 0;
    size_t n = strlen(s);
    return n <= max && (n > 0 || !nonempty) && utf8_valid((const uint8_t *)s, n);
}

static void decl_free(struct decl *d) {
    if (!d) return;
    for (size_t i = 0; i < d->n_params; i++) {
        free(d->params[i].name);
        free(d->params[i].type);
        free(d->params[i].doc);
        if (d->params[i].def) cbor_decref(&d->params[i].def);
    }
    free(d->params);
    for (size_t i = 0; i < d->n_raises; i++) free(d->raises[i]);
    free(d->raises);
    free(d->result);
    free(d->doc);
    free(d->group);
    free(d);
}

static char *dup_or(const char *s, const char *dflt) { return strdup(s ? s : dflt); }

/* Check and copy a declaration; -EINVAL / -ENOMEM. */
static int decl_new(const msgq_param *params, size_t n, const char *result, const char *doc,
                    const char *const *raises, const char *group, struct decl **out) {
    *out = NULL;
    if (!params && n) return -EINVAL;
    if (n > MSGQ_DECL_MAX_PARAMS) return -EINVAL;
    if (result && (!text_ok(result, MSGQ_DECL_MAX_NAME, 1) || msgq_check_type(result) < 0))
        return -EINVAL;
    if (doc && !text_ok(doc, MSGQ_DECL_MAX_DOC, 0)) return -EINVAL;
    if (group && !text_ok(group, MSGQ_DECL_MAX_NAME, 1)) return -EINVAL;
    size_t nr = 0;
    for (; raises && raises[nr]; nr++)
        if (nr >= MSGQ_DECL_MAX_RAISES || !text_ok(raises[nr], MSGQ_DECL_MAX_NAME, 1))
            return -EINVAL;
    for (size_t i = 0; i < n; i++) {
        const msgq_param *p = &params[i];
        if (!text_ok(p->name, MSGQ_DECL_MAX_NAME, 1) || !text_ok(p->type, MSGQ_DECL_MAX_NAME, 1) ||
            msgq_check_type(p->type) < 0 || (p->doc && !text_ok(p->doc, MSGQ_DECL_MAX_DOC, 0)) ||
            (p->default_json && (p->required || !text_ok(p->default_json, MSGQ_DECL_MAX_DOC, 1))))
            return -EINVAL;
        for (size_t k = 0; k < i; k++)
            if (strcmp(params[k].name, p->name) == 0) return -EINVAL;
    }
    struct decl *d = calloc(1, sizeof *d);
    if (!d) return -ENOMEM;
    int rc = -ENOMEM;
    d->has_params = params != NULL;
    if (n && !(d->params = calloc(n, sizeof *d->params))) goto fail;
    for (size_t i = 0; i < n; i++, d->n_params++) {
        struct decl_param *q = &d->params[i];
        q->required = params[i].required != 0;
        if (!(q->name = strdup(params[i].name)) || !(q->type = strdup(params[i].type)) ||
            !(q->doc = dup_or(params[i].doc, "")))
            goto fail_param;
        if (params[i].default_json && !(q->def = json_scalar(params[i].default_json))) {
            rc = -EINVAL; /* not a JSON scalar (or no memory: the caller's input is likelier) */
            goto fail_param;
        }
        continue;
    fail_param:
        d->n_params++; /* free this one's parts too */
        goto fail;
    }
    if (nr && !(d->raises = calloc(nr, sizeof *d->raises))) goto fail;
    for (size_t i = 0; i < nr; i++, d->n_raises++)
        if (!(d->raises[i] = strdup(raises[i]))) goto fail;
    if (!(d->result = dup_or(result, "any")) || !(d->doc = dup_or(doc, ""))) goto fail;
    if (group && !(d->group = strdup(group))) goto fail;
    *out = d;
    return 0;
fail:
    decl_free(d);
    return rc;
}

static int reserved(const char *name) { return strncmp(name, "msgq.", 5) == 0; }

int msgq_declare_command(msgq *m, const char *command, const msgq_param *params,
                         size_t n_params, const char *result_type, const char *doc,
                         const char *const *raises) {
    if (!m || !text_ok(command, MSGQ_DECL_MAX_NAME, 1) || reserved(command)) return -EINVAL;
    struct command *c = m->commands;
    while (c && strcmp(c->name, command) != 0) c = c->next;
    if ((!c || !c->decl) && m->n_decls >= MSGQ_DECL_MAX_DECLS) return -ENOSPC;
    struct decl *d;
    int r = decl_new(params, n_params, result_type, doc, raises, NULL, &d);
    if (r < 0) return r;
    if (!c) {
        c = calloc(1, sizeof *c);
        if (!c || !(c->name = strdup(command))) {
            free(c);
            decl_free(d);
            return -ENOMEM;
        }
        c->next = m->commands;
        m->commands = c;
    }
    if (c->decl) decl_free(c->decl);
    else m->n_decls++;
    c->decl = d;
    return 0;
}

int msgq_declare_event(msgq *m, const char *event, const char *group,
                       const msgq_param *params, size_t n_params, const char *doc) {
    if (!m || !text_ok(event, MSGQ_DECL_MAX_NAME, 1)) return -EINVAL;
    struct event *e = m->events;
    while (e && strcmp(e->name, event) != 0) e = e->next;
    if (!e && m->n_decls >= MSGQ_DECL_MAX_DECLS) return -ENOSPC;
    struct decl *d;
    int r = decl_new(params, n_params, NULL, doc, NULL, group, &d);
    if (r < 0) return r;
    if (!e) {
        e = calloc(1, sizeof *e);
        if (!e || !(e->name = strdup(event))) {
            free(e);
            decl_free(d);
            return -ENOMEM;
        }
        e->next = m->events;
        m->events = e;
        m->n_decls++;
    } else {
        decl_free(e->decl);
    }
    e->decl = d;
    return 0;
}

/* The wire form of a declaration's params: null, or a list of param maps. */
static cbor_item_t *params_item(const struct decl *d) {
    if (!d || !d->has_params) return cbor_new_null();
    cbor_item_t *list = cbor_new_definite_array(d->n_params);
    for (size_t i = 0; list && i < d->n_params; i++) {
        const struct decl_param *q = &d->params[i];
        cbor_item_t *p = cbor_new_definite_map(5);
        int r = p ? 0 : -ENOMEM;
        if (!r) r = map_add(p, "name", str_item(q->name));
        if (!r) r = map_add(p, "type", str_item(q->type));
        if (!r) r = map_add(p, "required", cbor_build_bool(q->required));
        if (!r && !q->required && q->def) r = map_add(p, "default", cbor_incref(q->def));
        if (!r && *q->doc) r = map_add(p, "doc", str_item(q->doc));
        if (!r && !cbor_array_push(list, p)) r = -ENOMEM;
        if (p) cbor_decref(&p);
        if (r) cbor_decref(&list);
    }
    return list;
}

static int by_name(const void *a, const void *b) {
    return strcmp(**(char *const *const *)a, **(char *const *const *)b);
}

/* The v1 description answered to msgq.introspect, or NULL (out of memory). The name
 * is the first member of struct command and struct event: both sort by it. */
static cbor_item_t *describe(msgq *m) {
    size_t nc = 0, ne = 0;
    for (struct command *c = m->commands; c; c = c->next) nc += c->cb != NULL;
    for (struct event *e = m->events; e; e = e->next) ne++;
    char ***cs = calloc(nc + 1, sizeof *cs), ***es = calloc(ne + 1, sizeof *es);
    cbor_item_t *out = cbor_new_definite_map(6);
    cbor_item_t *groups = cbor_new_definite_array(m->n_groups);
    cbor_item_t *cmds = cbor_new_definite_array(nc), *evs = cbor_new_definite_array(ne);
    int r = cs && es && out && groups && cmds && evs ? 0 : -ENOMEM;
    if (!r) {
        size_t i = 0;
        for (struct command *c = m->commands; c; c = c->next)
            if (c->cb) cs[i++] = &c->name;
        i = 0;
        for (struct event *e = m->events; e; e = e->next) es[i++] = &e->name;
        qsort(cs, nc, sizeof *cs, by_name);
        qsort(es, ne, sizeof *es, by_name);
    }
    for (size_t i = 0; !r && i < m->n_groups; i++) {
        cbor_item_t *g = str_item(m->groups[i]);
        if (!g || !cbor_array_push(groups, g)) r = -ENOMEM;
        if (g) cbor_decref(&g);
    }
    for (size_t i = 0; !r && i < nc; i++) {
        const struct command *c = (const struct command *)((char *)cs[i] - offsetof(struct command, name));
        const struct decl *d = c->decl;
        cbor_item_t *raises = cbor_new_definite_array(d ? d->n_raises : 0);
        for (size_t k = 0; raises && d && k < d->n_raises; k++) {
            cbor_item_t *s = str_item(d->raises[k]);
            if (!s || !cbor_array_push(raises, s)) r = -ENOMEM;
            if (s) cbor_decref(&s);
        }
        cbor_item_t *one = cbor_new_definite_map(5);
        if (!one || !raises) r = -ENOMEM;
        if (!r) r = map_add(one, "name", str_item(c->name));
        if (!r) r = map_add(one, "doc", str_item(d ? d->doc : ""));
        if (!r) r = map_add(one, "params", params_item(d));
        if (!r) r = map_add(one, "result", str_item(d ? d->result : "any"));
        if (!r) r = map_add(one, "raises", raises ? cbor_incref(raises) : NULL);
        if (!r && !cbor_array_push(cmds, one)) r = -ENOMEM;
        if (raises) cbor_decref(&raises);
        if (one) cbor_decref(&one);
    }
    for (size_t i = 0; !r && i < ne; i++) {
        const struct event *e = (const struct event *)((char *)es[i] - offsetof(struct event, name));
        cbor_item_t *one = cbor_new_definite_map(4);
        if (!one) r = -ENOMEM;
        if (!r) r = map_add(one, "name", str_item(e->name));
        if (!r) r = map_add(one, "group", e->decl->group ? str_item(e->decl->group) : cbor_new_null());
        if (!r) r = map_add(one, "doc", str_item(e->decl->doc));
        if (!r) r = map_add(one, "params", params_item(e->decl));
        if (!r && !cbor_array_push(evs, one)) r = -ENOMEM;
        if (one) cbor_decref(&one);
    }
    if (!r) r = map_add(out, "version", cbor_build_uint8(1));
    if (!r) r = map_add(out, "name", str_item(m->name));
    if (!r) r = map_add(out, "lname", str_item(m->lname));
    if (!r) r = map_add(out, "groups", cbor_incref(groups));
    if (!r) r = map_add(out, "commands", cbor_incref(cmds));
    if (!r) r = map_add(out, "events", cbor_incref(evs));
    free(cs);
    free(es);
    if (groups) cbor_decref(&groups);
    if (cmds) cbor_decref(&cmds);
    if (evs) cbor_decref(&evs);
    if (r && out) cbor_decref(&out);
    return out;
}

/* The callee-side check of a declared command's params (docs/PROTOCOL.md): 0 if the
 * handler may run, else the request has been answered bad-request. */
static int check_params(msgq *m, msgq_message *req, const struct command *c) {
    const struct decl *d = c->decl;
    if (!d || !d->has_params) return 0;
    cbor_item_t *params;
    msgq_error e = MSGQ_ERROR_INIT;
    char text[512];
    const char *param = "";
    if (msgq_message_body(req, &params, &e) < 0) {
        snprintf(text, sizeof text, "%s: params are not well-formed CBOR", c->name);
        msgq_error_clear(&e);
        goto refuse;
    }
    int null = cbor_isa_float_ctrl(params) && cbor_is_null(params);
    if (!null && !cbor_isa_map(params)) {
        snprintf(text, sizeof text, "%s: params must be a map of named parameters, not %s",
                 c->name, kind_of(params));
        goto refuse;
    }
    size_t n = null ? 0 : cbor_map_size(params);
    struct cbor_pair *pairs = null ? NULL : cbor_map_handle(params);
    for (size_t i = 0; i < d->n_params; i++) {
        if (!d->params[i].required || map_get(null ? NULL : params, d->params[i].name)) continue;
        param = d->params[i].name;
        snprintf(text, sizeof text, "%s: missing required parameter '%s' (%s)", c->name, param,
                 d->params[i].type);
        goto refuse;
    }
    for (size_t i = 0; i < n; i++) {
        const cbor_item_t *k = pairs[i].key;
        const struct decl_param *q = NULL;
        if (cbor_isa_string(k) && cbor_string_is_definite(k))
            for (size_t j = 0; j < d->n_params && !q; j++)
                if (strlen(d->params[j].name) == cbor_string_length(k) &&
                    memcmp(d->params[j].name, cbor_string_handle(k), cbor_string_length(k)) == 0)
                    q = &d->params[j];
        if (!q) {
            snprintf(text, sizeof text, "%s: unknown parameter", c->name);
            if (cbor_isa_string(k) && cbor_string_is_definite(k)) {
                /* name it as the Python clients do (the bytes are the caller's UTF-8) */
                snprintf(text, sizeof text, "%s: unknown parameter '%.*s'", c->name,
                         (int)(cbor_string_length(k) > 200 ? 200 : cbor_string_length(k)),
                         (const char *)cbor_string_handle(k));
                char *name = strndup0(cbor_string_handle(k), cbor_string_length(k));
                cbor_item_t *data = cbor_new_definite_map(1);
                if (data && map_add(data, "param", str_item(name ? name : "")) == 0)
                    msgq_reply_error(m, req, "bad-request", text, data);
                else
                    msgq_reply_error(m, req, "bad-request", text, NULL);
                if (data) cbor_decref(&data);
                free(name);
                return -1;
            }
            goto refuse;
        }
        if (!type_fits(q->type, pairs[i].value)) {
            param = q->name;
            snprintf(text, sizeof text, "%s: parameter '%s' must be %s, got %s", c->name, param,
                     q->type, kind_of(pairs[i].value));
            goto refuse;
        }
    }
    return 0;
refuse:;
    cbor_item_t *data = cbor_new_definite_map(1);
    if (data && map_add(data, "param", str_item(param)) == 0)
        msgq_reply_error(m, req, "bad-request", text, data);
    else
        msgq_reply_error(m, req, "bad-request", text, NULL);
    if (data) cbor_decref(&data);
    return -1;
}

/* ---- trace context -------------------------------------------------------------- */
static void rand_hex(char *out, size_t nbytes) {
    uint8_t b[16];
    for (;;) {
        ssize_t got = getrandom(b, nbytes, 0);
        if (got != (ssize_t)nbytes) { /* no entropy source: time and address still differ */
            uint64_t t = msgq_now() ^ (uint64_t)(uintptr_t)out;
            for (size_t i = 0; i < nbytes; i++) b[i] = (uint8_t)(t >> (8 * (i % 8)) ^ i * 37u);
        }
        for (size_t i = 0; i < nbytes; i++) sprintf(out + 2 * i, "%02x", b[i]);
        if (not_zero(out, 2 * nbytes)) return;
    }
}

const char *msgq_current_traceparent(const msgq *m) {
    return m && m->trace.on ? m->trace.traceparent : NULL;
}

/* header (may be NULL) plus a new span's traceparent, tracestate and tracecause. */
static cbor_item_t *trace_header(msgq *m, const cbor_item_t *header) {
    size_t n = header && cbor_isa_map(header) ? cbor_map_size(header) : 0;
    cbor_item_t *h = cbor_new_definite_map(n + 3);
    if (!h) return NULL;
    struct cbor_pair *pairs = n ? cbor_map_handle(header) : NULL;
    for (size_t i = 0; i < n; i++)
        if (!cbor_map_add(h, pairs[i])) { cbor_decref(&h); return NULL; }
    char span[17], tp[56];
    rand_hex(span, 8);
    snprintf(tp, sizeof tp, "00-%s-%s-%s", m->trace.trace_id, span, m->trace.flags);
    int r = map_add(h, "traceparent", str_item(tp));
    if (!r && m->trace.state) r = map_add(h, "tracestate", str_item(m->trace.state));
    if (!r) r = map_add(h, "tracecause", str_item(m->trace.cause));
    if (r) cbor_decref(&h);
    return h;
}

/* Enter the span of a handler of req (untraced if req carries no trace context). */
static void trace_enter(msgq *m, const msgq_message *req) {
    memset(&m->trace, 0, sizeof m->trace);
    const char *tp = req->traceparent;
    if (!tp) return;
    memcpy(m->trace.trace_id, tp + 3, 32);
    memcpy(m->trace.cause, tp + 36, 16);
    memcpy(m->trace.flags, tp + 53, 2);
    rand_hex(m->trace.span_id, 8);
    snprintf(m->trace.traceparent, sizeof m->trace.traceparent, "00-%s-%s-%s",
             m->trace.trace_id, m->trace.span_id, m->trace.flags);
    m->trace.state = req->tracestate ? strdup(req->tracestate) : NULL;
    m->trace.on = 1;
}

/* ---- reading and dispatch ------------------------------------------------------ */
static void dispatch_answer(msgq *m, msgq_message *msg) {
    struct pending **pp = &m->pending;
    while (*pp && (*pp)->rid != msg->L.request_id) pp = &(*pp)->next;
    if (!*pp) { /* late answer to a call that gave up locally: drop it */
        msgq_message_unref(msg);
        return;
    }
    struct pending *p = *pp;
    *pp = p->next;
    msgq_result res;
    memset(&res, 0, sizeof res);
    res.answer = msg;
    if (msg->L.type == T_REPLY) {
        msgq_error e = MSGQ_ERROR_INIT;
        if (msgq_message_body(msg, &res.value, &e) == 0) {
            res.ok = 1;
        } else {
            res.status = -EBADMSG;
            res.error = e;
        }
    } else {
        res.status = -EREMOTEIO;
        char *code = map_str(msg->header, "code");
        char *text = map_str(msg->header, "message");
        cbor_item_t *data = NULL;
        if (msgq_message_body(msg, &data, NULL) == 0 && data) cbor_incref(data);
        if (msg->header_bad || !code) {
            if (data) cbor_decref(&data);
            data = NULL;
            err_set(&res.error, "", "malformed ERROR answer from %s (%s)", msg->sender,
                    msg->sender_name);
            res.status = -EBADMSG;
        } else {
            snprintf(res.error.code, sizeof res.error.code, "%s", code);
            res.error.code_id = msgq_code_from_name(code);
            res.error.message = text ? text : strdup("");
            text = NULL;
            if (data && cbor_isa_float_ctrl(data) && cbor_is_null(data)) {
                cbor_decref(&data); /* libcbor clears the pointer only when it frees */
                data = NULL;
            }
            res.error.data = data;
        }
        free(code);
        free(text);
    }
    deliver_result(m, p, &res);
}

static void dispatch_request(msgq *m, msgq_message *msg) {
    if (msg->header_bad || !msg->name) {
        msgq_reply_error(m, msg, "bad-request", "malformed request header (no cmd)", NULL);
        msgq_message_unref(msg);
        return;
    }
    if (strcmp(msg->name, "msgq.introspect") == 0) {
        cbor_item_t *d = describe(m);
        unsigned char *b = NULL;
        size_t bl = 0;
        if (!d || serialize(d, &b, &bl) < 0) {
            msgq_reply_error(m, msg, "internal-error", "out of memory describing", NULL);
        } else if ((uint64_t)bl + INTROSPECT_HEADROOM > m->send_max_frame) {
            /* the declarations' bounds allow more than a frame carries: say so, rather
             * than leave the caller waiting for an answer that cannot be sent */
            char text[256];
            snprintf(text, sizeof text, "description of %zu bytes exceeds the frame limit of %u",
                     bl, m->send_max_frame);
            msgq_reply_error(m, msg, "limit-exceeded", text, NULL);
        } else {
            msgq_reply_raw(m, msg, b, bl, NULL);
        }
        free(b);
        if (d) cbor_decref(&d);
        msgq_message_unref(msg);
        return;
    }
    struct command *c = m->commands;
    while (c && (strcmp(c->name, msg->name) != 0 || !c->cb)) c = c->next;
    if (!c) {
        char text[512];
        snprintf(text, sizeof text, "no handler for command '%s' at %s", msg->name, m->lname);
        cbor_item_t *cmds = cbor_new_indefinite_array();
        for (struct command *k = m->commands; k && cmds; k = k->next) {
            if (!k->cb) continue;
            cbor_item_t *s = str_item(k->name);
            if (s) { cbor_array_push(cmds, s); cbor_decref(&s); }
        }
        msgq_reply_error(m, msg, "unknown-command", text, cmds);
        if (cmds) cbor_decref(&cmds);
        msgq_message_unref(msg);
        return;
    }
    if (check_params(m, msg, c) < 0) {
        msgq_message_unref(msg);
        return;
    }
    /* The handler runs in a span of the request's trace; nested handlers (run while it
     * waits in a blocking call) have their own, and it is restored after them. */
    struct trace outer = m->trace;
    trace_enter(m, msg);
    c->cb(m, msg, c->ud);
    free(m->trace.state);
    m->trace = outer;
    if (!msg->answered && msg->refs == 1 && m->state != S_LOST)
        msgq_reply_error(m, msg, "internal-error", "handler did not answer", NULL);
    msgq_message_unref(msg);
}

static int take_welcome(msgq *m, msgq_message *msg) {
    if (msg->L.type == T_ERROR) {
        char *code = map_str(msg->header, "code"), *text = map_str(msg->header, "message");
        lose(m, code ? code : "protocol-error", "broker refused the connection: %s",
             text ? text : "(no message)");
        free(code);
        free(text);
        return -ENOTCONN;
    }
    char *lname = map_str(msg->header, "lname");
    if (msg->L.type != T_WELCOME || !lname || strlen(lname) >= sizeof m->lname) {
        free(lname);
        lose(m, "protocol-error", "broker violated the protocol in the handshake "
             "(frame type %u, no lname)", msg->L.type);
        return -EPROTO;
    }
    strcpy(m->lname, lname);
    free(lname);
    /* The stamp the broker gives our frames; it names an empty HELLO name "anonymous".
     * Without memory for it, frames go unstamped and the broker stamps them. */
    const char *nm = m->name[0] ? m->name : "anonymous";
    size_t ll = strlen(m->lname), nl = strlen(nm);
    m->stamp = malloc(ll + 1 + nl);
    if (m->stamp) {
        memcpy(m->stamp, m->lname, ll + 1);
        memcpy(m->stamp + ll + 1, nm, nl);
        m->stamp_len = ll + 1 + nl;
    }
    m->broker = map_str(msg->header, "broker");
    cbor_item_t *limits = map_get(msg->header, "limits");
    uint64_t v;
    if (cbor_to_u64(map_get(limits, "max_fds_per_message"), &v) && v < m->o.max_fds)
        m->o.max_fds = (unsigned)v;
    if (cbor_to_u64(map_get(limits, "max_frame_size"), &v) && v < m->send_max_frame && v >= 64)
        m->send_max_frame = (uint32_t)v;
    m->state = S_READY;
    return 0;
}

/* Descriptors for a frame starting at stream offset `start` that declares n. */
static int claim_fds(msgq *m, uint64_t start, size_t n, int **fds) {
    *fds = NULL;
    /* Batches wholly before this frame that no frame claimed: descriptors nobody declared. */
    while (m->fdb && m->fdb->end <= start) {
        struct fdbatch *b = m->fdb;
        int claimed = b->claimed;
        m->fdb = b->next;
        close_fds(b->fds, b->n);
        free(b->fds);
        free(b);
        if (!claimed) return -1;
    }
    if (!n) return 0;
    struct fdbatch *b = m->fdb;
    if (!b || b->claimed || b->start > start || b->n != n) return -1;
    b->claimed = 1;
    *fds = b->fds;
    b->fds = NULL;
    b->n = 0;
    return 0;
}

static void handle_frame(msgq *m, uint8_t *raw, size_t len, uint64_t start) {
    struct layout L;
    msgq_error e = MSGQ_ERROR_INIT;
    int r = frame_layout(raw, len, m->o.max_frame_size, &L, &e);
    if (r < 0) {
        free(raw);
        lose(m, e.code, "%s", e.message ? e.message : "bad frame");
        msgq_error_clear(&e);
        return;
    }
    int *fds = NULL;
    if (claim_fds(m, start, L.n_fds, &fds) < 0) {
        free(raw);
        lose(m, "protocol-error", "broker sent file descriptors that do not match the frames "
             "declaring them");
        return;
    }
    msgq_message *msg = message_new(raw, len, &L, (int)m->o.max_cbor_depth);
    if (!msg) {
        if (fds) { close_fds(fds, L.n_fds); free(fds); }
        free(raw);
        lose(m, "connection-lost", "out of memory reading a frame");
        return;
    }
    msg->fds = fds;
    msg->n_fds = fds ? L.n_fds : 0;
    if (m->state == S_HELLO_SENT) {
        take_welcome(m, msg);
        msgq_message_unref(msg);
        return;
    }
    switch (L.type) {
    case T_MESSAGE:
    case T_NOTIFY: {
        struct trace outer = m->trace; /* as in deliver_result */
        m->trace.on = 0;
        if (m->msg_cb) m->msg_cb(m, msg, m->msg_ud);
        m->trace = outer;
        msgq_message_unref(msg);
        break;
    }
    case T_REQUEST:
        dispatch_request(m, msg);
        break;
    case T_REPLY:
    case T_ERROR:
        if (L.type == T_ERROR && L.request_id == 0) {
            char *code = map_str(msg->header, "code"), *text = map_str(msg->header, "message");
            lose(m, code ? code : "protocol-error", "broker closed the connection: %s",
                 text ? text : "(no message)");
            free(code);
            free(text);
            msgq_message_unref(msg);
            break;
        }
        dispatch_answer(m, msg);
        break;
    case T_GOODBYE: {
        char *reason = map_str(msg->header, "reason");
        m->goodbye_in = 1;
        if (m->state == S_CLOSING)
            lose(m, "connection-lost", "connection closed");
        else
            lose(m, reason ? reason : "connection-lost", "broker said goodbye (%s)",
                 reason ? reason : "no reason");
        free(reason);
        msgq_message_unref(msg);
        break;
    }
    case T_ROUTED: /* only for ALL requests, which this library does not send */
    default:
        msgq_message_unref(msg);
        lose(m, "protocol-error", "broker sent an unexpected frame of type %u", L.type);
        break;
    }
}

/* Read once. 1: got bytes, 0: nothing now, <0: lost. */
static int read_some(msgq *m) {
    if (m->in_cap - m->in_len < READ_CHUNK) {
        size_t want = m->in_len + READ_CHUNK;
        uint8_t *n = realloc(m->in, want);
        if (!n) { lose(m, "connection-lost", "out of memory for the input buffer"); return -ENOTCONN; }
        m->in = n;
        m->in_cap = want;
    }
    struct iovec iov = {m->in + m->in_len, m->in_cap - m->in_len};
    size_t clen = CMSG_SPACE(sizeof(int) * m->o.max_fds);
    char *cbuf = calloc(1, clen);
    if (!cbuf) { lose(m, "connection-lost", "out of memory"); return -ENOTCONN; }
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cbuf,
                        .msg_controllen = clen};
    ssize_t n = recvmsg(m->fd, &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    if (n < 0) {
        free(cbuf);
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
        lose(m, "connection-lost", "read from the broker failed: %s", strerror(errno));
        return -ENOTCONN;
    }
    int trunc = (mh.msg_flags & MSG_CTRUNC) != 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t k = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        struct fdbatch *b = calloc(1, sizeof *b);
        int *fds = malloc(sizeof(int) * (k ? k : 1));
        if (!b || !fds) {
            int tmp[256];
            size_t kk = k < 256 ? k : 256;
            memcpy(tmp, CMSG_DATA(c), sizeof(int) * kk);
            close_fds(tmp, kk);
            free(b);
            free(fds);
            continue;
        }
        memcpy(fds, CMSG_DATA(c), sizeof(int) * k);
        b->fds = fds;
        b->n = k;
        b->start = m->in_base + m->in_len;
        b->end = b->start + (uint64_t)(n > 0 ? n : 1);
        struct fdbatch **pp = &m->fdb;
        while (*pp) pp = &(*pp)->next;
        *pp = b;
    }
    free(cbuf);
    if (trunc) {
        lose(m, "limit-exceeded", "broker sent more than max_fds=%u descriptors in one message",
             m->o.max_fds);
        return -ENOTCONN;
    }
    if (n == 0) {
        if (m->state == S_CLOSING)
            lose(m, "connection-lost", "connection closed");
        else
            lose(m, "connection-lost", "the broker closed the connection without GOODBYE "
                 "(it crashed or was killed)");
        return -ENOTCONN;
    }
    m->in_len += (size_t)n;
    return 1;
}

/* Hand every complete frame in the input buffer to handle_frame.
 *
 * Callbacks may re-enter (msgq_process from a handler reads and parses further), so the
 * position lives in m->in_pos and nothing local survives handle_frame: each turn starts
 * from m's fields, whatever a nested call has taken or moved. */
static void parse_frames(msgq *m) {
    while (m->state != S_LOST && m->in_len - m->in_pos >= 4) {
        size_t off = m->in_pos;
        uint64_t total = (uint64_t)rd32(m->in + off) + 4;
        if (total > m->o.max_frame_size) {
            lose(m, "frame-too-large", "broker sent a frame of %llu bytes, over max_frame_size %u",
                 (unsigned long long)total, m->o.max_frame_size);
            return;
        }
        if (total < PREFIX_SIZE) {
            lose(m, "protocol-error", "broker sent a frame of %llu bytes, less than the 32-byte "
                 "prefix", (unsigned long long)total);
            return;
        }
        if (m->in_len - off < total) break;
        uint8_t *raw = malloc(total);
        if (!raw) { lose(m, "connection-lost", "out of memory for a frame"); return; }
        memcpy(raw, m->in + off, total);
        uint64_t start = m->in_base + off;
        /* Take the frame before dispatch: callbacks may re-enter. */
        m->in_pos = off + (size_t)total;
        handle_frame(m, raw, total, start);
    }
    /* Move the unparsed rest (a partial frame at most) to the front, once per parse. */
    if (m->in_pos) {
        size_t rest = m->in_len - m->in_pos;
        if (rest) memmove(m->in, m->in + m->in_pos, rest);
        m->in_base += m->in_pos;
        m->in_len = rest;
        m->in_pos = 0;
    }
    /* Keep the buffer from staying large after a big frame. */
    if (m->state != S_LOST && m->in_cap > 4 * READ_CHUNK && m->in_len < READ_CHUNK) {
        uint8_t *n = realloc(m->in, READ_CHUNK * 2);
        if (n) { m->in = n; m->in_cap = READ_CHUNK * 2; }
    }
}

static void expire_calls(msgq *m) {
    uint64_t now = msgq_now();
    for (;;) {
        struct pending **pp = &m->pending;
        while (*pp && !((*pp)->deadline && (*pp)->deadline <= now)) pp = &(*pp)->next;
        if (!*pp) return;
        struct pending *p = *pp;
        *pp = p->next;
        msgq_result res;
        memset(&res, 0, sizeof res);
        res.status = -ETIMEDOUT;
        err_set(&res.error, "timeout", "no answer, not even the broker's timeout, within the "
                "call's timeout + 1 s (local deadline)");
        deliver_result(m, p, &res);
    }
}

int msgq_process(msgq *m) {
    if (m->state == S_LOST) return -ENOTCONN;
    int progress = 0;
    int r = try_write(m);
    if (r > 0) progress = 1;
    for (int i = 0; i < READS_PER_PROCESS && m->state != S_LOST; i++) {
        r = read_some(m);
        if (r <= 0) break;
        progress = 1;
        parse_frames(m);
    }
    if (m->state != S_LOST) {
        if (try_write(m) > 0) progress = 1;
        if (m->pending) expire_calls(m);
    }
    if (m->state == S_LOST) return -ENOTCONN;
    return progress;
}

static int wait_io(msgq *m, int events, uint64_t deadline) {
    if (m->state == S_LOST) return -ENOTCONN;
    struct pollfd p = {m->fd, (short)events, 0};
    int ms = -1;
    if (deadline != UINT64_MAX) {
        uint64_t now = msgq_now();
        ms = deadline <= now ? 0 : (int)((deadline - now + 999) / 1000);
    }
    int r = poll(&p, 1, ms);
    if (r < 0) return -errno;
    return r;
}

int msgq_wait(msgq *m, int64_t timeout_us) {
    uint64_t d = msgq_get_timeout(m);
    if (timeout_us >= 0) {
        uint64_t t = msgq_now() + (uint64_t)timeout_us;
        if (t < d) d = t;
    }
    return wait_io(m, msgq_get_events(m), d);
}

int msgq_flush(msgq *m) {
    while (m->out_head && m->state != S_LOST) {
        wait_io(m, POLLIN | POLLOUT, UINT64_MAX);
        msgq_process(m);
    }
    return m->state == S_LOST ? -ENOTCONN : 0;
}

/* ---- connect and close ------------------------------------------------------- */
static char *default_socket(void) {
    const char *env = getenv("MSGQ_TRIO_SOCKET");
    char *p = NULL;
    if (env && *env) return strdup(env);
    const char *rt = getenv("XDG_RUNTIME_DIR");
    struct stat st;
    if (rt && *rt && stat(rt, &st) == 0 && S_ISDIR(st.st_mode)) {
        if (asprintf(&p, "%s/msgq-trio/bus.sock", rt) < 0) return NULL;
        return p;
    }
    if (asprintf(&p, "/tmp/msgq-trio-%u/bus.sock", (unsigned)getuid()) < 0) return NULL;
    return p;
}

int msgq_connect(msgq **out, const msgq_options *opts, msgq_error *err) {
    *out = NULL;
    msgq_options o;
    if (opts) o = *opts;
    else msgq_options_init(&o);
    if (o.max_frame_size < 64) o.max_frame_size = 64;
    if (!o.max_fds) o.max_fds = DEFAULT_MAX_FDS;
    if (!o.max_out_bytes) o.max_out_bytes = DEFAULT_MAX_OUT;
    if (!o.max_cbor_depth) o.max_cbor_depth = DEFAULT_MAX_CBOR_DEPTH;
    if (o.max_cbor_depth > LIBCBOR_MAX_DEPTH) o.max_cbor_depth = LIBCBOR_MAX_DEPTH;
    char *path = o.socket ? strdup(o.socket) : default_socket();
    if (!path) return -ENOMEM;
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof sa.sun_path) {
        err_set(err, "", "socket path too long (%zu bytes, at most %zu): %s", strlen(path),
                sizeof sa.sun_path - 1, path);
        free(path);
        return -ENAMETOOLONG;
    }
    strcpy(sa.sun_path, path);
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        int e = errno;
        err_set(err, "", "socket: %s", strerror(e));
        free(path);
        return -e;
    }
    if (connect(fd, (struct sockaddr *)&sa, sizeof sa) < 0) {
        int e = errno;
        err_set(err, "", "cannot connect to the broker at %s: %s", path, strerror(e));
        close(fd);
        free(path);
        return -e;
    }
    free(path);
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
    msgq *m = calloc(1, sizeof *m);
    if (!m) { close(fd); return -ENOMEM; }
    m->fd = fd;
    m->o = o;
    m->send_max_frame = o.max_frame_size;
    m->name = strdup(o.name ? o.name : "msgq-c");
    m->o.name = m->name;
    m->o.socket = NULL;
    m->state = S_HELLO_SENT;
    cbor_item_t *h = cbor_new_definite_map(3);
    int r = h ? 0 : -ENOMEM;
    if (!r) r = map_add(h, "version", cbor_build_uint8(MSGQ_PROTOCOL_VERSION));
    if (!r) r = map_add(h, "name", str_item(m->name));
    if (!r) r = map_add(h, "pid", cbor_build_uint32((uint32_t)getpid()));
    if (!r) r = send_frame(m, T_HELLO, "", 0, h, NULL, 0, NULL);
    if (h) cbor_decref(&h);
    uint64_t deadline = msgq_now() + (uint64_t)(o.handshake_timeout * 1e6);
    while (r == 0 && m->state == S_HELLO_SENT) {
        if (msgq_now() >= deadline) {
            lose(m, "timeout", "no WELCOME from the broker within %.1f s", o.handshake_timeout);
            break;
        }
        wait_io(m, msgq_get_events(m), deadline);
        msgq_process(m);
    }
    if (r < 0 || m->state != S_READY) {
        if (m->state == S_LOST) err_copy(err, &m->lost);
        else err_set(err, "", "cannot send HELLO: %s", strerror(-r));
        /* A refusal read after our HELLO's write failed is a refusal too. */
        int refused = m->state == S_LOST && strcmp(m->lost.code, "connection-lost") != 0;
        if (r == 0 || refused)
            r = m->lost.code_id == MSGQ_CODE_PROTOCOL_ERROR ? -EPROTO : -ECONNREFUSED;
        msgq_close(m);
        return r;
    }
    *out = m;
    return 0;
}

void msgq_close(msgq *m) {
    if (!m) return;
    if (m->state == S_READY) {
        /* GOODBYE goes after everything queued, whatever the bound: it is the last frame. */
        m->o.max_out_bytes = SIZE_MAX;
        send_frame(m, T_GOODBYE, "", 0, NULL, NULL, 0, NULL);
        m->state = S_CLOSING;
        /* Wait for the broker's GOODBYE for close_timeout, and longer while it is still
         * taking our queued bytes: it reads a sender only as fast as the receivers take
         * them (backpressure), and what it has not read when we close is lost. */
        uint64_t patience = (uint64_t)(m->o.close_timeout * 1e6);
        uint64_t deadline = msgq_now() + patience;
        size_t left = m->out_bytes;
        while (m->state != S_LOST && msgq_now() < deadline) {
            wait_io(m, msgq_get_events(m), deadline);
            msgq_process(m);
            if (m->out_bytes < left) {
                left = m->out_bytes;
                deadline = msgq_now() + patience;
            }
        }
    }
    lose(m, "connection-lost", "connection closed");
    if (m->fd >= 0) close(m->fd);
    for (struct command *c = m->commands, *n; c; c = n) {
        n = c->next;
        decl_free(c->decl);
        free(c->name);
        free(c);
    }
    for (struct event *e = m->events, *n; e; e = n) {
        n = e->next;
        decl_free(e->decl);
        free(e->name);
        free(e);
    }
    for (size_t i = 0; i < m->n_groups; i++) free(m->groups[i]);
    free(m->groups);
    msgq_error_clear(&m->lost);
    free(m->in);
    free(m->stamp);
    free(m->name);
    free(m->broker);
    free(m);
}
