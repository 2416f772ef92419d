/*
 * msgq-c: a command-line client of the msgq_trio bus on libmsgq (call, send, echo,
 * listen). JSON in and out through jansson; the mapping of CBOR values JSON cannot
 * hold is documented in docs/C-CLIENT.md ("JSON form").
 */
#define _GNU_SOURCE
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <jansson.h>

#include "msgq/msgq.h"

static const char USAGE[] =
    "usage: msgq-c call [-s SOCKET] [-t SECONDS] [-b TEXT]... [-f FD]... TARGET COMMAND [JSON]\n"
    "       msgq-c send [-s SOCKET] [-b TEXT]... [-f FD]... [-z SIZE] [-n COUNT] [-N] TARGET JSON\n"
    "       msgq-c notify [-s SOCKET] GROUP EVENT [JSON]\n"
    "       msgq-c echo [-s SOCKET] GROUP\n"
    "       msgq-c listen [-s SOCKET] GROUP\n"
    "       msgq-c pcall [-s SOCKET] N TARGET COMMAND [JSON]\n"
    "       msgq-c codes\n";

/* ---- CBOR -> JSON ------------------------------------------------------------ */
static const char B64[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

static json_t *b64_json(const uint8_t *p, size_t n) {
    size_t ol = 4 * ((n + 2) / 3);
    char *o = malloc(ol + 1);
    if (!o) return NULL;
    size_t j = 0;
    for (size_t i = 0; i < n; i += 3) {
        uint32_t v = (uint32_t)p[i] << 16 | (i + 1 < n ? p[i + 1] : 0) << 8 | (i + 2 < n ? p[i + 2] : 0);
        o[j++] = B64[v >> 18 & 63];
        o[j++] = B64[v >> 12 & 63];
        o[j++] = i + 1 < n ? B64[v >> 6 & 63] : '=';
        o[j++] = i + 2 < n ? B64[v & 63] : '=';
    }
    o[j] = 0;
    json_t *r = json_pack("{s:s}", "$bytes", o);
    free(o);
    return r;
}

static int b64_val(int c) {
    const char *p = c ? strchr(B64, c) : NULL;
    return p ? (int)(p - B64) : -1;
}

static uint8_t *b64_decode(const char *s, size_t *outlen) {
    size_t n = strlen(s);
    uint8_t *o = malloc(n / 4 * 3 + 3);
    if (!o) return NULL;
    size_t j = 0;
    uint32_t acc = 0;
    int bits = 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] == '=') break;
        int v = b64_val((unsigned char)s[i]);
        if (v < 0) { free(o); return NULL; }
        acc = acc << 6 | (uint32_t)v;
        bits += 6;
        if (bits >= 8) { bits -= 8; o[j++] = (uint8_t)(acc >> bits); }
    }
    *outlen = j;
    return o;
}

/* Bytes of a (possibly indefinite) byte or text string, malloc'd. */
static uint8_t *string_bytes(const cbor_item_t *it, size_t *len) {
    if (cbor_isa_bytestring(it) ? cbor_bytestring_is_definite(it) : cbor_string_is_definite(it)) {
        size_t n = cbor_isa_bytestring(it) ? cbor_bytestring_length(it) : cbor_string_length(it);
        const uint8_t *h = cbor_isa_bytestring(it) ? cbor_bytestring_handle(it) : cbor_string_handle(it);
        uint8_t *o = malloc(n + 1);
        if (o && n) memcpy(o, h, n);
        *len = n;
        return o;
    }
    size_t nc = cbor_isa_bytestring(it) ? cbor_bytestring_chunk_count(it) : cbor_string_chunk_count(it);
    cbor_item_t **ch = cbor_isa_bytestring(it) ? cbor_bytestring_chunks_handle(it) : cbor_string_chunks_handle(it);
    size_t total = 0;
    for (size_t i = 0; i < nc; i++) {
        size_t dummy;
        uint8_t *part = string_bytes(ch[i], &dummy);
        free(part);
        total += dummy;
    }
    uint8_t *o = malloc(total + 1);
    size_t off = 0;
    for (size_t i = 0; o && i < nc; i++) {
        size_t l;
        uint8_t *part = string_bytes(ch[i], &l);
        if (part && l) memcpy(o + off, part, l);
        off += l;
        free(part);
    }
    *len = total;
    return o;
}

/* Decimal text of a big-endian unsigned magnitude, optionally "-(1 + n)". */
static char *big_decimal(const uint8_t *be, size_t n, int negative) {
    uint8_t *v = malloc(n + 1);
    if (!v) return NULL;
    memcpy(v, be, n);
    if (negative) { /* -1 - n: add one to the magnitude */
        size_t i = n;
        int carry = 1;
        while (carry && i > 0) { i--; v[i]++; carry = v[i] == 0; }
        if (carry) { memmove(v + 1, v, n); v[0] = 1; n++; }
    }
    char *digits = malloc(n * 3 + 3);
    size_t nd = 0;
    for (;;) {
        int zero = 1;
        unsigned rem = 0;
        for (size_t i = 0; i < n; i++) {
            unsigned cur = rem << 8 | v[i];
            v[i] = (uint8_t)(cur / 10);
            rem = cur % 10;
            if (v[i]) zero = 0;
        }
        digits[nd++] = (char)('0' + rem);
        if (zero) break;
    }
    char *o = malloc(nd + 2);
    size_t j = 0;
    if (negative) o[j++] = '-';
    while (nd) o[j++] = digits[--nd];
    o[j] = 0;
    free(digits);
    free(v);
    return o;
}

static json_t *to_json(const cbor_item_t *it) {
    switch (cbor_typeof(it)) {
    case CBOR_TYPE_UINT: {
        uint64_t v = cbor_get_int(it);
        if (v <= INT64_MAX) return json_integer((json_int_t)v);
        char buf[32];
        snprintf(buf, sizeof buf, "%llu", (unsigned long long)v);
        return json_pack("{s:s}", "$bigint", buf);
    }
    case CBOR_TYPE_NEGINT: {
        uint64_t v = cbor_get_int(it);
        if (v <= INT64_MAX) return json_integer(-1 - (json_int_t)v);
        uint8_t be[8];
        for (int i = 0; i < 8; i++) be[i] = (uint8_t)(v >> (56 - 8 * i));
        char *d = big_decimal(be, 8, 1);
        json_t *r = json_pack("{s:s}", "$bigint", d);
        free(d);
        return r;
    }
    case CBOR_TYPE_BYTESTRING: {
        size_t n;
        uint8_t *b = string_bytes(it, &n);
        json_t *r = b64_json(b, n);
        free(b);
        return r;
    }
    case CBOR_TYPE_STRING: {
        size_t n;
        uint8_t *b = string_bytes(it, &n);
        json_t *r = json_stringn((const char *)b, n);
        free(b);
        return r;
    }
    case CBOR_TYPE_ARRAY: {
        json_t *a = json_array();
        cbor_item_t **h = cbor_array_handle(it);
        for (size_t i = 0; i < cbor_array_size(it); i++) json_array_append_new(a, to_json(h[i]));
        return a;
    }
    case CBOR_TYPE_MAP: {
        struct cbor_pair *p = cbor_map_handle(it);
        size_t n = cbor_map_size(it);
        int all_str = 1;
        for (size_t i = 0; i < n; i++) all_str &= cbor_isa_string(p[i].key);
        if (all_str) {
            json_t *o = json_object();
            for (size_t i = 0; i < n; i++) {
                size_t kl;
                uint8_t *k = string_bytes(p[i].key, &kl);
                json_object_setn_new(o, (const char *)k, kl, to_json(p[i].value));
                free(k);
            }
            return o;
        }
        json_t *pairs = json_array();
        for (size_t i = 0; i < n; i++)
            json_array_append_new(pairs, json_pack("[o,o]", to_json(p[i].key), to_json(p[i].value)));
        return json_pack("{s:o}", "$map", pairs);
    }
    case CBOR_TYPE_TAG: {
        uint64_t tag = cbor_tag_value(it);
        cbor_item_t *inner = cbor_tag_item(it);
        json_t *r;
        if ((tag == 2 || tag == 3) && cbor_isa_bytestring(inner)) {
            size_t n;
            uint8_t *b = string_bytes(inner, &n);
            char *d = big_decimal(b, n, tag == 3);
            r = json_pack("{s:s}", "$bigint", d);
            free(d);
            free(b);
        } else {
            r = json_pack("{s:I,s:o}", "$tag", (json_int_t)tag, "value", to_json(inner));
        }
        cbor_decref(&inner);
        return r;
    }
    case CBOR_TYPE_FLOAT_CTRL:
        if (cbor_float_ctrl_is_ctrl(it)) {
            if (cbor_is_bool(it)) return json_boolean(cbor_get_bool(it));
            if (cbor_is_null(it)) return json_null();
            if (cbor_is_undef(it)) return json_pack("{s:b}", "$undefined", 1);
            return json_pack("{s:i}", "$simple", cbor_ctrl_value(it));
        } else {
            double d = cbor_float_get_float(it);
            if (isnan(d)) return json_pack("{s:s}", "$float", "nan");
            if (isinf(d)) return json_pack("{s:s}", "$float", d > 0 ? "inf" : "-inf");
            return json_real(d);
        }
    }
    return json_null();
}

/* ---- JSON -> CBOR ------------------------------------------------------------ */
static cbor_item_t *uint_item(uint64_t v) {
    if (v <= 0xFF) return cbor_build_uint8((uint8_t)v);
    if (v <= 0xFFFF) return cbor_build_uint16((uint16_t)v);
    if (v <= 0xFFFFFFFF) return cbor_build_uint32((uint32_t)v);
    return cbor_build_uint64(v);
}

static cbor_item_t *from_json(json_t *j) {
    switch (json_typeof(j)) {
    case JSON_OBJECT: {
        json_t *b = json_object_get(j, "$bytes");
        if (b && json_is_string(b) && json_object_size(j) == 1) {
            size_t n;
            uint8_t *d = b64_decode(json_string_value(b), &n);
            if (!d) return NULL;
            cbor_item_t *r = cbor_build_bytestring(d, n);
            free(d);
            return r;
        }
        cbor_item_t *m = cbor_new_definite_map(json_object_size(j));
        const char *k;
        json_t *v;
        json_object_foreach(j, k, v) {
            cbor_item_t *ck = cbor_build_string(k), *cv = from_json(v);
            if (!ck || !cv) return NULL;
            cbor_map_add(m, (struct cbor_pair){ck, cv});
            cbor_decref(&ck);
            cbor_decref(&cv);
        }
        return m;
    }
    case JSON_ARRAY: {
        cbor_item_t *a = cbor_new_definite_array(json_array_size(j));
        size_t i;
        json_t *v;
        json_array_foreach(j, i, v) {
            cbor_item_t *cv = from_json(v);
            if (!cv) return NULL;
            cbor_array_push(a, cv);
            cbor_decref(&cv);
        }
        return a;
    }
    case JSON_STRING:
        return cbor_build_stringn(json_string_value(j), json_string_length(j));
    case JSON_INTEGER: {
        json_int_t v = json_integer_value(j);
        if (v >= 0) return uint_item((uint64_t)v);
        cbor_item_t *n = uint_item((uint64_t)(-(v + 1)));
        cbor_mark_negint(n);
        return n;
    }
    case JSON_REAL:
        return cbor_build_float8(json_real_value(j));
    case JSON_TRUE:
        return cbor_build_bool(true);
    case JSON_FALSE:
        return cbor_build_bool(false);
    case JSON_NULL:
        return cbor_new_null();
    }
    return NULL;
}

static cbor_item_t *parse_json_arg(const char *text) {
    json_error_t je;
    json_t *j = json_loads(text, JSON_DECODE_ANY, &je);
    if (!j) {
        fprintf(stderr, "error: usage: bad JSON argument: %s (at %d:%d)\n", je.text, je.line, je.column);
        return NULL;
    }
    cbor_item_t *c = from_json(j);
    json_decref(j);
    if (!c) fprintf(stderr, "error: usage: JSON argument cannot be converted to CBOR\n");
    return c;
}

static void print_json(json_t *j) {
    char *s = json_dumps(j, JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(17));
    if (s) {
        puts(s);
        fflush(stdout);
        free(s);
    }
}

static void print_error(const msgq_error *e, const char *fallback) {
    fprintf(stderr, "error: %s: %s\n", e->code[0] ? e->code : fallback,
            e->message ? e->message : "(no message)");
}

/* ---- options ------------------------------------------------------------------ */
struct opts {
    const char *socket;
    double timeout;
    msgq_blob blobs[64];
    size_t n_blobs;
    int fds[64];
    size_t n_fds;
    long count;       /* send: how many times */
    int nonblocking;  /* send: report EAGAIN instead of waiting */
    uint8_t *zeros;   /* send -z: an attachment of SIZE zero bytes */
};

static int parse_opts(int argc, char **argv, struct opts *o) {
    int c;
    optind = 1;
    o->count = 1;
    while ((c = getopt(argc, argv, "+s:t:b:f:z:n:N")) != -1) {
        switch (c) {
        case 'n': o->count = atol(optarg); break;
        case 'N': o->nonblocking = 1; break;
        case 'z': {
            size_t size = (size_t)atol(optarg);
            if (o->n_blobs == 64 || o->zeros || !(o->zeros = calloc(1, size ? size : 1))) return -1;
            o->blobs[o->n_blobs].data = o->zeros;
            o->blobs[o->n_blobs++].len = size;
            break;
        }
        case 's': o->socket = optarg; break;
        case 't': o->timeout = atof(optarg); break;
        case 'b':
            if (o->n_blobs == 64) return -1;
            o->blobs[o->n_blobs].data = optarg;
            o->blobs[o->n_blobs++].len = strlen(optarg);
            break;
        case 'f':
            if (o->n_fds == 64) return -1;
            o->fds[o->n_fds++] = atoi(optarg);
            break;
        default: return -1;
        }
    }
    return optind;
}

static int finish(struct opts *o, int rc) {
    free(o->zeros);
    return rc;
}

static msgq *open_bus(const struct opts *o) {
    msgq_options mo;
    msgq_options_init(&mo);
    mo.socket = o->socket;
    mo.name = "msgq-c";
    mo.nonblocking = o->nonblocking;
    msgq *m;
    msgq_error e = MSGQ_ERROR_INIT;
    if (msgq_connect(&m, &mo, &e) < 0) {
        print_error(&e, "connection-lost");
        msgq_error_clear(&e);
        return NULL;
    }
    return m;
}

static json_t *message_json(msgq_message *msg) {
    json_t *o = json_object();
    msgq_kind k = msgq_message_kind(msg);
    json_object_set_new(o, "kind", json_string(k == MSGQ_KIND_NOTIFY ? "notify" : k == MSGQ_KIND_REQUEST ? "request" : k == MSGQ_KIND_MESSAGE ? "message" : "answer"));
    json_object_set_new(o, "sender", json_string(msgq_message_sender(msg)));
    json_object_set_new(o, "sender_name", json_string(msgq_message_sender_name(msg)));
    json_object_set_new(o, "target", json_string(msgq_message_target(msg)));
    if (msgq_message_event(msg)) json_object_set_new(o, "event", json_string(msgq_message_event(msg)));
    cbor_item_t *body;
    msgq_error e = MSGQ_ERROR_INIT;
    if (msgq_message_body(msg, &body, &e) == 0) {
        json_object_set_new(o, "body", to_json(body));
    } else {
        json_object_set_new(o, "malformed", json_string(e.message ? e.message : ""));
        msgq_error_clear(&e);
    }
    json_t *att = json_array();
    for (size_t i = 0; i < msgq_message_attachment_count(msg); i++) {
        size_t l;
        const uint8_t *p = msgq_message_attachment(msg, i, &l);
        json_array_append_new(att, b64_json(p, l));
    }
    json_object_set_new(o, "attachments", att);
    /* Descriptors: a regular file's first 4 KiB (so tests can see what came), else null. */
    json_t *fds = json_array();
    for (size_t i = 0; i < msgq_message_fd_count(msg); i++) {
        int fd = msgq_message_take_fd(msg, i);
        struct stat st;
        uint8_t buf[4096];
        ssize_t n;
        if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode) &&
            (n = pread(fd, buf, sizeof buf, 0)) >= 0)
            json_array_append_new(fds, b64_json(buf, (size_t)n));
        else
            json_array_append_new(fds, json_null());
        if (fd >= 0) close(fd);
    }
    json_object_set_new(o, "fds", fds);
    return o;
}

/* ---- commands ----------------------------------------------------------------- */
static int cmd_call(int argc, char **argv) {
    struct opts o = {0};
    int i = parse_opts(argc, argv, &o);
    if (i < 0 || argc - i < 2 || argc - i > 3) { fputs(USAGE, stderr); return finish(&o, 2); }
    cbor_item_t *params = NULL;
    if (argc - i == 3 && !(params = parse_json_arg(argv[i + 2]))) return finish(&o, 2);
    msgq *m = open_bus(&o);
    if (!m) { if (params) cbor_decref(&params); return finish(&o, 1); }
    msgq_extras x = {o.blobs, o.n_blobs, o.fds, o.n_fds};
    msgq_result res;
    int r = msgq_call(m, argv[i], argv[i + 1], params, &x, o.timeout, &res);
    if (params) cbor_decref(&params);
    int rc = 0;
    if (r == 0) {
        json_t *j = to_json(res.value);
        print_json(j);
        json_decref(j);
    } else {
        print_error(&res.error, r == -ENOTCONN ? "connection-lost" : "error");
        rc = 1;
    }
    msgq_result_clear(&res);
    msgq_close(m);
    return finish(&o, rc);
}

static int cmd_send(int argc, char **argv, int notify) {
    struct opts o = {0};
    int i = parse_opts(argc, argv, &o);
    int need = notify ? 2 : 2;
    if (i < 0 || argc - i < need || argc - i > need + notify) { fputs(USAGE, stderr); return finish(&o, 2); }
    const char *jarg = notify ? (argc - i == 3 ? argv[i + 2] : "null") : argv[i + 1];
    cbor_item_t *body = parse_json_arg(jarg);
    if (!body) return finish(&o, 2);
    msgq *m = open_bus(&o);
    if (!m) { cbor_decref(&body); return finish(&o, 1); }
    msgq_extras x = {o.blobs, o.n_blobs, o.fds, o.n_fds};
    int r = 0;
    for (long k = 0; r == 0 && k < o.count; k++) {
        r = notify ? msgq_notify(m, argv[i], argv[i + 1], body) : msgq_send(m, argv[i], body, &x);
        if (r == -EAGAIN) {
            /* Nonblocking mode: the library refused to queue more than max_out_bytes. */
            fprintf(stderr, "msgq-c: EAGAIN after %ld messages, %zu bytes queued\n", k,
                    msgq_get_queued_bytes(m));
            cbor_decref(&body);
            msgq_close(m);
            return finish(&o, 3);
        }
    }
    cbor_decref(&body);
    if (r == 0) r = msgq_flush(m);
    int rc = 0;
    if (r < 0) {
        msgq_error e = MSGQ_ERROR_INIT;
        if (msgq_status(m, &e) < 0) print_error(&e, "connection-lost");
        else fprintf(stderr, "error: usage: cannot send: %s\n", strerror(-r));
        msgq_error_clear(&e);
        rc = 1;
    }
    msgq_close(m);
    return finish(&o, rc);
}

static volatile sig_atomic_t stop_requested;
static void on_signal(int sig) { (void)sig; stop_requested = 1; }

/* Run m from our own poll loop until SIGTERM/SIGINT: the event-loop API in use
 * (get_fd/get_events/get_timeout/process), with signals delivered only inside ppoll so
 * none is missed between the check and the wait. */
static int run_until_signal(msgq *m) {
    sigset_t block, orig;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    sigprocmask(SIG_BLOCK, &block, &orig);
    struct sigaction sa = {0};
    sa.sa_handler = on_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    while (!stop_requested) {
        struct pollfd p = {msgq_get_fd(m), (short)msgq_get_events(m), 0};
        uint64_t d = msgq_get_timeout(m), now = msgq_now();
        struct timespec ts, *tsp = NULL;
        if (d != UINT64_MAX) {
            uint64_t left = d > now ? d - now : 0;
            ts.tv_sec = (time_t)(left / 1000000u);
            ts.tv_nsec = (long)(left % 1000000u) * 1000;
            tsp = &ts;
        }
        int r = ppoll(&p, 1, tsp, &orig);
        if (r < 0 && errno != EINTR) return 1;
        if (msgq_process(m) < 0) {
            msgq_error e = MSGQ_ERROR_INIT;
            msgq_status(m, &e);
            print_error(&e, "connection-lost");
            msgq_error_clear(&e);
            return 1;
        }
    }
    return 0;
}

static void echo_handler(msgq *m, msgq_message *req, void *ud) {
    (void)ud;
    cbor_item_t *params;
    msgq_error e = MSGQ_ERROR_INIT;
    if (msgq_message_body(req, &params, &e) < 0) {
        msgq_reply_error(m, req, "bad-request", e.message, NULL);
        msgq_error_clear(&e);
        return;
    }
    /* Answer with what came: the params (decoded and encoded again by libcbor), the
     * attachments and the descriptors. */
    size_t nb = msgq_message_attachment_count(req), nf = msgq_message_fd_count(req);
    msgq_blob *blobs = calloc(nb ? nb : 1, sizeof *blobs);
    int *fds = calloc(nf ? nf : 1, sizeof *fds);
    for (size_t i = 0; i < nb; i++) blobs[i].data = msgq_message_attachment(req, i, &blobs[i].len);
    for (size_t i = 0; i < nf; i++) fds[i] = msgq_message_take_fd(req, i);
    msgq_extras x = {blobs, nb, fds, nf};
    int r = msgq_reply(m, req, params, &x);
    if (r < 0) {
        char text[128];
        snprintf(text, sizeof text, "cannot answer: %s", strerror(-r));
        msgq_reply_error(m, req, "internal-error", text, NULL);
    }
    for (size_t i = 0; i < nf; i++) if (fds[i] >= 0) close(fds[i]);
    free(fds);
    free(blobs);
}

static void listen_handler(msgq *m, msgq_message *msg, void *ud) {
    (void)m;
    (void)ud;
    json_t *j = message_json(msg);
    print_json(j);
    json_decref(j);
}

static int cmd_serve(int argc, char **argv, int echo) {
    struct opts o = {0};
    int i = parse_opts(argc, argv, &o);
    if (i < 0 || argc - i != 1) { fputs(USAGE, stderr); return 2; }
    msgq *m = open_bus(&o);
    if (!m) return 1;
    if (echo) msgq_add_command(m, "echo", echo_handler, NULL);
    else msgq_set_message_handler(m, listen_handler, NULL);
    msgq_error e = MSGQ_ERROR_INIT;
    if (msgq_subscribe(m, argv[i], NULL, &e) < 0) {
        print_error(&e, "connection-lost");
        msgq_error_clear(&e);
        msgq_close(m);
        return 1;
    }
    /* Readiness on stderr, so stdout stays one JSON line per message. */
    fprintf(stderr, "msgq-c: ready %s\n", msgq_lname(m));
    fflush(stderr);
    int rc = run_until_signal(m);
    msgq_close(m);
    return rc;
}

struct pcall_state {
    int left;
};

static void pcall_cb(msgq *m, msgq_result *res, void *ud) {
    (void)m;
    struct pcall_state *s = ud;
    s->left--;
    if (res->ok) {
        json_t *j = to_json(res->value);
        print_json(j);
        json_decref(j);
    } else {
        json_t *j = json_pack("{s:s,s:s,s:o}", "error", res->error.code, "message",
                              res->error.message ? res->error.message : "", "data",
                              res->error.data ? to_json(res->error.data) : json_null());
        print_json(j);
        json_decref(j);
    }
}

/* N calls at once from one thread, driven by our own poll loop. */
static int cmd_pcall(int argc, char **argv) {
    struct opts o = {0};
    int i = parse_opts(argc, argv, &o);
    if (i < 0 || argc - i < 3 || argc - i > 4) { fputs(USAGE, stderr); return 2; }
    int n = atoi(argv[i]);
    cbor_item_t *params = NULL;
    if (argc - i == 4 && !(params = parse_json_arg(argv[i + 3]))) return 2;
    msgq *m = open_bus(&o);
    if (!m) return 1;
    struct pcall_state s = {0};
    for (int k = 0; k < n; k++) {
        int r = msgq_call_async(m, argv[i + 1], argv[i + 2], params, NULL, o.timeout, pcall_cb, &s, NULL);
        if (r < 0) { fprintf(stderr, "error: usage: %s\n", strerror(-r)); break; }
        s.left++;
    }
    if (params) cbor_decref(&params);
    while (s.left > 0) {
        struct pollfd p = {msgq_get_fd(m), (short)msgq_get_events(m), 0};
        uint64_t d = msgq_get_timeout(m), now = msgq_now();
        int ms = d == UINT64_MAX ? -1 : (int)(d > now ? (d - now + 999) / 1000 : 0);
        poll(&p, 1, ms);
        if (msgq_process(m) < 0) break; /* pending callbacks have run */
    }
    msgq_close(m);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 2) { fputs(USAGE, stderr); return 2; }
    const char *c = argv[1];
    if (strcmp(c, "call") == 0) return cmd_call(argc - 1, argv + 1);
    if (strcmp(c, "send") == 0) return cmd_send(argc - 1, argv + 1, 0);
    if (strcmp(c, "notify") == 0) return cmd_send(argc - 1, argv + 1, 1);
    if (strcmp(c, "echo") == 0) return cmd_serve(argc - 1, argv + 1, 1);
    if (strcmp(c, "listen") == 0) return cmd_serve(argc - 1, argv + 1, 0);
    if (strcmp(c, "pcall") == 0) return cmd_pcall(argc - 1, argv + 1);
    if (strcmp(c, "codes") == 0) {
        for (int k = 1; k < MSGQ_CODE__WIRE_COUNT; k++) printf("%s\n", msgq_code_name((msgq_code)k));
        return 0;
    }
    fputs(USAGE, stderr);
    return 2;
}
