/*
 * msgq-bench: the benchmark worker of the C client (benchmarks/worker_msgq_c.py execs it).
 *
 * It speaks the worker protocol of benchmarks/common.py: the spec is one JSON argument
 * (role, addr.socket, deadline, n/size or calls/conc/warmup/latencies); it prints
 * "READY" once connected (and subscribed), a sender waits for "GO" on stdin, and the
 * last line is "RESULT {json}" with the fields the Python workers report, plus "cpu":
 * this process's CPU seconds since READY (since GO for a sender).
 *
 * Roles, as the Python workers':
 *   sub        subscribe to bench.data, count n messages of size bytes
 *   pub        n x msgq_send_raw to bench.data, then msgq_flush
 *   responder  member of bench.echo, "echo" answers with the request's own body bytes
 *   requester  conc calls in flight on one connection (msgq_call_async), calls each,
 *              every reply compared with its request
 *
 * Bodies are CBOR byte strings encoded once up front (the Python workers send bytes
 * too), so the figures measure the library and the broker, not a CBOR encoder.
 * Every loop is bounded by its count and by the deadline; SIGALRM a few seconds past
 * the deadline ends a worker that is stuck anyway.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>
#include <msgq/msgq.h>

#define GROUP "bench.data"
#define ECHO "bench.echo"
/* benchmarks/common.py ALARM_GRACE. */
#define ALARM_GRACE 5
/* How long one wait may last before the deadline is checked again. */
#define WAIT_SLICE_US 100000

static double cpu_mark;

static double mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* time.monotonic() of the Python workers */
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static void line(const char *s) {
    fputs(s, stdout);
    fputc('\n', stdout);
    fflush(stdout);
}

static void ready(void) {
    cpu_mark = cpu_now();
    line("READY");
}

static void emit(json_t *result) {
    char *text = json_dumps(result, JSON_COMPACT);
    printf("RESULT %s\n", text ? text : "{\"error\":\"cannot encode the result\"}");
    fflush(stdout);
    free(text);
    json_decref(result);
}

/* Report a failure as the Python workers do (an "error" RESULT) and exit 1. */
__attribute__((format(printf, 1, 2), noreturn)) static void fail(const char *fmt, ...) {
    char text[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    fprintf(stderr, "msgq-bench: %s\n", text);
    emit(json_pack("{s:s}", "error", text));
    exit(1);
}

/* Wait for GO on stdin (the parent starts every sender at once). */
static void wait_go(double deadline) {
    char buf[64];
    size_t have = 0;
    for (;;) {
        double left = deadline - mono();
        if (left <= 0) fail("TimeoutError: no GO from the parent");
        struct pollfd p = {0, POLLIN, 0};
        int r = poll(&p, 1, (int)(left * 1000) + 1);
        if (r < 0 && errno != EINTR) fail("poll(stdin): %s", strerror(errno));
        if (r <= 0) continue;
        ssize_t n = read(0, buf + have, sizeof buf - 1 - have);
        if (n == 0) fail("EOFError: the parent closed stdin before GO");
        if (n < 0) {
            if (errno == EINTR) continue;
            fail("read(stdin): %s", strerror(errno));
        }
        have += (size_t)n;
        buf[have] = 0;
        if (strstr(buf, "GO\n")) {
            cpu_mark = cpu_now();
            return;
        }
        if (have >= sizeof buf - 1) have = 0; /* a line that is not GO: forget it */
    }
}

/* ---- the spec ------------------------------------------------------------------ */
struct spec {
    const char *role, *socket;
    double deadline; /* absolute, mono() */
    long n, size, conc, calls, warmup, index, seed;
    int latencies;
};

static long spec_long(json_t *o, const char *key, long dflt) {
    json_t *v = json_object_get(o, key);
    if (!v) return dflt;
    if (json_is_integer(v)) return (long)json_integer_value(v);
    if (json_is_true(v)) return 1;
    if (json_is_false(v)) return 0;
    fail("spec: %s is not an integer", key);
}

static msgq *open_bus(const struct spec *s, const char *name) {
    msgq_options o;
    msgq_options_init(&o);
    o.socket = s->socket;
    o.name = name;
    msgq *m = NULL;
    msgq_error e = MSGQ_ERROR_INIT;
    int r = msgq_connect(&m, &o, &e);
    if (r < 0) fail("cannot connect to %s: %s (%s)", s->socket, e.message ? e.message : "",
                    strerror(-r));
    msgq_error_clear(&e);
    return m;
}

static void join(msgq *m, const char *group) {
    msgq_error e = MSGQ_ERROR_INIT;
    int r = msgq_subscribe(m, group, NULL, &e);
    if (r < 0) fail("cannot subscribe to %s: %s (%s)", group, e.message ? e.message : "",
                    strerror(-r));
    msgq_error_clear(&e);
}

/* Wait for the socket (at most one slice, never past the deadline), then process.
 * Returns <0 once the connection is gone. */
static int step(msgq *m, double deadline) {
    double left = deadline - mono();
    int64_t us = left <= 0 ? 0 : (int64_t)(left * 1e6);
    if (us > WAIT_SLICE_US) us = WAIT_SLICE_US;
    msgq_wait(m, us);
    return msgq_process(m);
}

/* ---- bodies --------------------------------------------------------------------- */
/* 16 distinct bodies (2 when large), as benchmarks/common.py payloads(), each encoded
 * once as a CBOR byte string. */
struct bodies {
    size_t count, len; /* len: encoded length, the same for all */
    uint8_t **enc;
};

static void make_bodies(struct bodies *b, long size, long seed) {
    b->count = size <= 64 * 1024 ? 16 : 2;
    size_t hl = size < 24 ? 1 : size < 256 ? 2 : size < 65536 ? 3 : 5;
    b->len = hl + (size_t)size;
    b->enc = calloc(b->count, sizeof *b->enc);
    if (!b->enc) fail("out of memory");
    unsigned state = (unsigned)seed * 2654435761u + 1u;
    for (size_t i = 0; i < b->count; i++) {
        uint8_t *p = malloc(b->len);
        if (!p) fail("out of memory");
        uint64_t v = (uint64_t)size;
        if (hl == 1) p[0] = (uint8_t)(0x40 | v);
        else if (hl == 2) p[0] = 0x58, p[1] = (uint8_t)v;
        else if (hl == 3) p[0] = 0x59, p[1] = (uint8_t)(v >> 8), p[2] = (uint8_t)v;
        else p[0] = 0x5a, p[1] = (uint8_t)(v >> 24), p[2] = (uint8_t)(v >> 16),
             p[3] = (uint8_t)(v >> 8), p[4] = (uint8_t)v;
        for (size_t k = hl; k < b->len; k++) {
            state = state * 1103515245u + 12345u;
            p[k] = (uint8_t)(state >> 16);
        }
        b->enc[i] = p;
    }
}

static void free_bodies(struct bodies *b) {
    for (size_t i = 0; i < b->count; i++) free(b->enc[i]);
    free(b->enc);
}

/* ---- sub ------------------------------------------------------------------------ */
struct tally {
    long n, count, bad;
    size_t len;
    double first, last;
};

static void on_message(msgq *m, msgq_message *msg, void *ud) {
    (void)m;
    struct tally *t = ud;
    if (msgq_message_kind(msg) != MSGQ_KIND_MESSAGE) return;
    size_t len;
    msgq_message_body_raw(msg, &len);
    if (len != t->len) t->bad++;
    t->count++;
    if (t->count == 1) t->first = mono();
    if (t->count == t->n) t->last = mono();
}

static json_t *role_sub(const struct spec *s) {
    char name[64];
    snprintf(name, sizeof name, "bench-sub-%ld", s->index);
    struct bodies b;
    make_bodies(&b, s->size, s->seed); /* only for the encoded length */
    struct tally t = {s->n, 0, 0, b.len, 0, 0};
    free_bodies(&b);
    msgq *m = open_bus(s, name);
    msgq_set_message_handler(m, on_message, &t);
    join(m, GROUP);
    ready();
    while (t.count < t.n && mono() < s->deadline)
        if (step(m, s->deadline) < 0) break;
    if (t.count < t.n) t.last = mono();
    msgq_close(m);
    return json_pack("{s:I,s:I,s:f,s:f,s:b}", "count", (json_int_t)t.count, "bad",
                     (json_int_t)t.bad, "first", t.first, "last", t.last, "timeout",
                     t.count < t.n);
}

/* ---- pub ------------------------------------------------------------------------ */
static json_t *role_pub(const struct spec *s) {
    struct bodies b;
    make_bodies(&b, s->size, s->seed);
    size_t mask = b.count - 1;
    msgq *m = open_bus(s, "bench-pub");
    ready();
    wait_go(s->deadline);
    double start = mono();
    long sent = 0;
    for (long i = 0; i < s->n; i++) {
        if ((i & 1023) == 0 && mono() >= s->deadline) break;
        int r = msgq_send_raw(m, GROUP, b.enc[(size_t)i & mask], b.len, NULL);
        if (r < 0) fail("send: %s", strerror(-r));
        sent++;
    }
    int r = msgq_flush(m);
    if (r < 0) fail("flush: %s", strerror(-r));
    double end = mono();
    msgq_close(m);
    free_bodies(&b);
    return json_pack("{s:I,s:f,s:f,s:b}", "sent", (json_int_t)sent, "start", start, "end",
                     end, "timeout", sent < s->n);
}

/* ---- responder ------------------------------------------------------------------ */
static void on_echo(msgq *m, msgq_message *req, void *ud) {
    long *served = ud;
    size_t len;
    const uint8_t *body = msgq_message_body_raw(req, &len);
    /* The params' own bytes go back: the answer is the request's body, re-encoded by
     * nobody (a C responder has no reason to decode what it returns unchanged). */
    msgq_reply_raw(m, req, body, len, NULL);
    (*served)++;
}

static json_t *role_responder(const struct spec *s) {
    long served = 0;
    msgq *m = open_bus(s, "bench-echo");
    int r = msgq_add_command(m, "echo", on_echo, &served);
    if (r < 0) fail("add_command: %s", strerror(-r));
    join(m, ECHO);
    ready();
    /* Serves until the parent ends this process (or the deadline). */
    while (mono() < s->deadline)
        if (step(m, s->deadline) < 0) break;
    msgq_close(m);
    return json_pack("{s:I}", "served", (json_int_t)served);
}

/* ---- requester ------------------------------------------------------------------ */
struct caller {
    msgq *m;
    const struct bodies *b;
    long calls, done, bad, issued_total, failed;
    int measuring;
    uint64_t *lat;
    size_t n_lat;
};

struct slot {
    struct caller *c;
    long slot, i; /* the slot's next call number */
    size_t body;
    uint64_t t0;
};

static void on_reply(msgq *m, msgq_result *res, void *ud);

static void issue(struct slot *sl) {
    struct caller *c = sl->c;
    sl->body = (size_t)(sl->i + sl->slot) & (c->b->count - 1);
    sl->t0 = mono_ns();
    int r = msgq_call_async_raw(c->m, ECHO, "echo", c->b->enc[sl->body], c->b->len, NULL, 0,
                                on_reply, sl, NULL);
    if (r < 0) fail("call: %s", strerror(-r));
}

static void on_reply(msgq *m, msgq_result *res, void *ud) {
    (void)m;
    uint64_t t1 = mono_ns();
    struct slot *sl = ud;
    struct caller *c = sl->c;
    if (!res->ok) {
        c->failed++;
        fprintf(stderr, "msgq-bench: call failed: %s %s\n", res->error.code,
                res->error.message ? res->error.message : "");
        return;
    }
    size_t len;
    const uint8_t *body = msgq_message_body_raw(res->answer, &len);
    if (len != c->b->len || memcmp(body, c->b->enc[sl->body], len) != 0) c->bad++;
    if (c->measuring && c->lat) c->lat[c->n_lat++] = t1 - sl->t0;
    c->done++;
    if (++sl->i < c->calls) issue(sl);
}

/* Run `calls` calls on each of `conc` slots; true if all were answered in time. */
static int run_calls(struct caller *c, struct slot *slots, long conc, long calls,
                     double deadline) {
    c->calls = calls;
    c->done = 0;
    for (long k = 0; k < conc; k++) {
        slots[k] = (struct slot){c, k, 0, 0, 0};
        if (calls > 0) issue(&slots[k]);
    }
    while (c->done + c->failed < conc * calls && mono() < deadline)
        if (step(c->m, deadline) < 0) break;
    return c->done == conc * calls;
}

static json_t *role_requester(const struct spec *s) {
    char name[64];
    snprintf(name, sizeof name, "bench-req-%ld", s->index);
    struct bodies b;
    make_bodies(&b, s->size, s->seed);
    struct caller c = {0};
    c.m = open_bus(s, name);
    c.b = &b;
    struct slot *slots = calloc((size_t)(s->conc > 0 ? s->conc : 1), sizeof *slots);
    if (!slots) fail("out of memory");
    if (s->warmup > 0 && !run_calls(&c, slots, 1, s->warmup, s->deadline))
        fail("warm-up calls not answered (%ld failed)", c.failed);
    if (s->latencies) {
        c.lat = malloc(sizeof *c.lat * (size_t)(s->conc * s->calls + 1));
        if (!c.lat) fail("out of memory");
    }
    c.bad = 0;
    c.measuring = 1;
    ready();
    wait_go(s->deadline);
    double start = mono();
    int all = run_calls(&c, slots, s->conc, s->calls, s->deadline);
    double end = mono();
    msgq_close(c.m);
    json_t *out = json_pack("{s:I,s:I,s:f,s:f,s:b}", "calls", (json_int_t)c.done, "bad",
                            (json_int_t)c.bad, "start", start, "end", end, "timeout", !all);
    if (s->latencies) {
        json_t *lat = json_array();
        for (size_t i = 0; i < c.n_lat; i++)
            json_array_append_new(lat, json_integer((json_int_t)c.lat[i]));
        json_object_set_new(out, "lat_ns", lat);
    }
    free(c.lat);
    free(slots);
    free_bodies(&b);
    return out;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: msgq-bench SPEC_JSON (started by benchmarks/worker_msgq_c.py)\n");
        return 2;
    }
    json_error_t jerr;
    json_t *spec = json_loads(argv[1], 0, &jerr);
    if (!json_is_object(spec)) fail("spec is not a JSON object: %s", jerr.text);
    struct spec s = {0};
    s.role = json_string_value(json_object_get(spec, "role"));
    s.socket = json_string_value(json_object_get(json_object_get(spec, "addr"), "socket"));
    json_t *dl = json_object_get(spec, "deadline");
    if (!s.role || !s.socket || !json_is_number(dl))
        fail("spec needs role, addr.socket and deadline");
    s.deadline = mono() + json_number_value(dl);
    alarm((unsigned)json_number_value(dl) + ALARM_GRACE);
    s.n = spec_long(spec, "n", 0);
    s.size = spec_long(spec, "size", 0);
    s.conc = spec_long(spec, "conc", 1);
    s.calls = spec_long(spec, "calls", 0);
    s.warmup = spec_long(spec, "warmup", 0);
    s.index = spec_long(spec, "index", 0);
    s.seed = spec_long(spec, "seed", 0);
    s.latencies = (int)spec_long(spec, "latencies", 0);
    if (s.size < 0 || s.size > 0x7fffffffL || s.n < 0 || s.calls < 0 || s.conc < 1 ||
        s.warmup < 0)
        fail("spec: a count or size out of range");
    json_t *result;
    if (strcmp(s.role, "sub") == 0) result = role_sub(&s);
    else if (strcmp(s.role, "pub") == 0) result = role_pub(&s);
    else if (strcmp(s.role, "responder") == 0) result = role_responder(&s);
    else if (strcmp(s.role, "requester") == 0) result = role_requester(&s);
    else fail("unknown role '%s'", s.role);
    json_object_set_new(result, "cpu", json_real(cpu_now() - cpu_mark));
    emit(result);
    json_decref(spec);
    return 0;
}
