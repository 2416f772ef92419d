/*
 * introspect-check: a component on libmsgq for tests/c that declares its interface
 * (msgq_declare_command, msgq_declare_event) and passes a request's trace on.
 * usage: introspect-check serve SOCKET GROUP   (runs until SIGTERM; "msgq-c: ready
 *                                               LNAME" on stderr when it answers)
 *        introspect-check args SOCKET          (bad declarations: one "CASE RC" line
 *                                               each on stdout, RC the return value)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "msgq/msgq.h"

static volatile sig_atomic_t stop;
static void on_term(int sig) { (void)sig; stop = 1; }

static void reply_text(msgq *m, msgq_message *req, const char *text) {
    cbor_item_t *v = cbor_build_string(text);
    msgq_reply(m, req, v, NULL);
    cbor_decref(&v);
}

/* Answers 42 (the parameters were checked by the library before it runs). */
static void zone_count(msgq *m, msgq_message *req, void *ud) {
    (void)ud;
    cbor_item_t *v = cbor_build_uint8(42);
    msgq_reply(m, req, v, NULL);
    cbor_decref(&v);
}

/* Notifies PyEvents "relayed" with our params, calls Python's Py.ping with them from
 * inside the handler and answers
 * {"pong": its result, "incoming": the request's traceparent, "current": the handler's}
 * (null for each that is absent). */
static void relay(msgq *m, msgq_message *req, void *ud) {
    (void)ud;
    cbor_item_t *params;
    if (msgq_message_body(req, &params, NULL) < 0) return;
    int r = msgq_notify(m, "PyEvents", "relayed", params);
    if (r < 0) {
        msgq_reply_error(m, req, "internal-error", strerror(-r), NULL);
        return;
    }
    msgq_result res;
    if (msgq_call(m, "Py", "ping", params, NULL, 10.0, &res) < 0) {
        msgq_reply_error(m, req, res.error.code, res.error.message, res.error.data);
        msgq_result_clear(&res);
        return;
    }
    const char *in = msgq_message_traceparent(req), *cur = msgq_current_traceparent(m);
    cbor_item_t *out = cbor_new_definite_map(3);
    cbor_map_add(out, (struct cbor_pair){cbor_move(cbor_build_string("pong")), res.value});
    cbor_map_add(out, (struct cbor_pair){cbor_move(cbor_build_string("incoming")),
                                         cbor_move(in ? cbor_build_string(in) : cbor_new_null())});
    cbor_map_add(out, (struct cbor_pair){cbor_move(cbor_build_string("current")),
                                         cbor_move(cur ? cbor_build_string(cur) : cbor_new_null())});
    msgq_reply(m, req, out, NULL);
    cbor_decref(&out);
    msgq_result_clear(&res);
}

static void plain(msgq *m, msgq_message *req, void *ud) {
    (void)ud;
    reply_text(m, req, "plain");
}

static msgq *open_bus(const char *socket) {
    msgq_options o;
    msgq_options_init(&o);
    o.socket = socket;
    o.name = "introspect-check";
    msgq *m;
    msgq_error err = MSGQ_ERROR_INIT;
    if (msgq_connect(&m, &o, &err) < 0) {
        fprintf(stderr, "error: %s: %s\n", err.code, err.message);
        msgq_error_clear(&err);
        return NULL;
    }
    return m;
}

static int serve(const char *socket, const char *group) {
    msgq *m = open_bus(socket);
    if (!m) return 1;
    static const msgq_param zone_params[] = {
        {"zone_class", "str", 0, "\"IN\"", "the class to count"},
        {"verbose", "bool", 0, "false", NULL},
        {"serials", "list[int] | null", 0, NULL, NULL},
    };
    static const char *const zone_raises[] = {"no-zone", NULL};
    static const msgq_param relay_params[] = {{"text", "str", 1, NULL, NULL}};
    static const msgq_param event_params[] = {{"zone", "str", 1, NULL, NULL},
                                              {"serial", "int", 0, "1", NULL}};
    int r = msgq_declare_command(m, "get_zone_count", zone_params, 3, "int",
                                 "Count the zones of a class.", zone_raises);
    if (!r) r = msgq_add_command(m, "get_zone_count", zone_count, NULL);
    if (!r) r = msgq_add_command(m, "relay", relay, NULL);
    if (!r) r = msgq_declare_command(m, "relay", relay_params, 1, "dict[str, any]",
                                     "Ping Python from inside the handler.", NULL);
    if (!r) r = msgq_add_command(m, "plain", plain, NULL);
    /* declared, then removed: not listed */
    if (!r) r = msgq_declare_command(m, "gone", relay_params, 1, NULL, NULL, NULL);
    if (!r) r = msgq_add_command(m, "gone", plain, NULL);
    if (!r) r = msgq_add_command(m, "gone", NULL, NULL);
    if (!r) r = msgq_declare_event(m, "zone_added", "Zones", event_params, 2, "A zone was added.");
    if (!r) r = msgq_declare_event(m, "tick", NULL, NULL, 0, NULL);
    if (r < 0) {
        fprintf(stderr, "error: declaring: %s\n", strerror(-r));
        msgq_close(m);
        return 1;
    }
    msgq_error err = MSGQ_ERROR_INIT;
    if (msgq_subscribe(m, group, NULL, &err) < 0 || msgq_subscribe(m, "Second", NULL, &err) < 0) {
        fprintf(stderr, "error: %s: %s\n", err.code, err.message);
        msgq_error_clear(&err);
        msgq_close(m);
        return 1;
    }
    fprintf(stderr, "msgq-c: ready %s\n", msgq_lname(m));
    int rc = 0;
    while (!stop) {
        int w = msgq_wait(m, 200000);
        if (w < 0 && w != -EINTR) break;
        if (msgq_process(m) < 0) {
            msgq_status(m, &err);
            fprintf(stderr, "error: %s: %s\n", err.code, err.message);
            msgq_error_clear(&err);
            rc = 1;
            break;
        }
    }
    msgq_close(m);
    return rc;
}

#define CASE(name, call) printf("%s %d\n", name, (call))

static int args(const char *socket) {
    msgq *m = open_bus(socket);
    if (!m) return 1;
    char longname[MSGQ_DECL_MAX_NAME + 2];
    memset(longname, 'a', sizeof longname - 1);
    longname[sizeof longname - 1] = 0;
    msgq_param many[MSGQ_DECL_MAX_PARAMS + 1];
    char names[MSGQ_DECL_MAX_PARAMS + 1][8];
    for (int i = 0; i <= MSGQ_DECL_MAX_PARAMS; i++) {
        snprintf(names[i], sizeof names[i], "p%d", i);
        many[i] = (msgq_param){names[i], "int", 0, NULL, NULL};
    }
    const msgq_param ok[] = {{"a", "int", 1, NULL, NULL}};
    const msgq_param twice[] = {{"a", "int", 1, NULL, NULL}, {"a", "str", 1, NULL, NULL}};
    const msgq_param no_name[] = {{NULL, "int", 1, NULL, NULL}};
    const msgq_param empty_name[] = {{"", "int", 1, NULL, NULL}};
    const msgq_param no_type[] = {{"a", NULL, 1, NULL, NULL}};
    const msgq_param bad_types[][1] = {
        {{"a", "integer", 1, NULL, NULL}}, {{"a", "list[", 1, NULL, NULL}},
        {{"a", "dict[int, str]", 1, NULL, NULL}}, {{"a", "str |", 1, NULL, NULL}},
        {{"a", "", 1, NULL, NULL}}, {{"a", "str]", 1, NULL, NULL}},
        {{"a", longname, 1, NULL, NULL}},
    };
    const msgq_param bad_defaults[][1] = {
        {{"a", "int", 1, "1", NULL}},      /* a default for a required parameter */
        {{"a", "int", 0, "[1]", NULL}},    /* not a scalar */
        {{"a", "str", 0, "\"open", NULL}}, /* not JSON */
        {{"a", "int", 0, "1 2", NULL}},
        {{"a", "int", 0, "", NULL}},
        {{"a", "str", 0, "\"\\ud800\"", NULL}},
    };
    const char *const bad_raises[] = {"", NULL};
    const char *const long_raises[] = {longname, NULL};
    const char *const good_raises[] = {"no-zone", "busy", NULL};
    const char bad_utf8[] = {'c', (char)0xff, 0};
    CASE("null-connection", msgq_declare_command(NULL, "c", ok, 1, NULL, NULL, NULL));
    CASE("null-name", msgq_declare_command(m, NULL, ok, 1, NULL, NULL, NULL));
    CASE("empty-name", msgq_declare_command(m, "", ok, 1, NULL, NULL, NULL));
    CASE("long-name", msgq_declare_command(m, longname, ok, 1, NULL, NULL, NULL));
    CASE("not-utf8-name", msgq_declare_command(m, bad_utf8, ok, 1, NULL, NULL, NULL));
    CASE("reserved-name", msgq_declare_command(m, "msgq.introspect", ok, 1, NULL, NULL, NULL));
    CASE("null-params-with-count", msgq_declare_command(m, "c", NULL, 2, NULL, NULL, NULL));
    CASE("too-many-params",
         msgq_declare_command(m, "c", many, MSGQ_DECL_MAX_PARAMS + 1, NULL, NULL, NULL));
    CASE("most-params", msgq_declare_command(m, "c", many, MSGQ_DECL_MAX_PARAMS, NULL, NULL, NULL));
    CASE("duplicate-param", msgq_declare_command(m, "c", twice, 2, NULL, NULL, NULL));
    CASE("null-param-name", msgq_declare_command(m, "c", no_name, 1, NULL, NULL, NULL));
    CASE("empty-param-name", msgq_declare_command(m, "c", empty_name, 1, NULL, NULL, NULL));
    CASE("null-type", msgq_declare_command(m, "c", no_type, 1, NULL, NULL, NULL));
    for (size_t i = 0; i < sizeof bad_types / sizeof *bad_types; i++) {
        char label[32];
        snprintf(label, sizeof label, "bad-type-%zu", i);
        CASE(label, msgq_declare_command(m, "c", bad_types[i], 1, NULL, NULL, NULL));
    }
    for (size_t i = 0; i < sizeof bad_defaults / sizeof *bad_defaults; i++) {
        char label[32];
        snprintf(label, sizeof label, "bad-default-%zu", i);
        CASE(label, msgq_declare_command(m, "c", bad_defaults[i], 1, NULL, NULL, NULL));
    }
    CASE("bad-result", msgq_declare_command(m, "c", ok, 1, "number", NULL, NULL));
    CASE("empty-raise", msgq_declare_command(m, "c", ok, 1, NULL, NULL, bad_raises));
    CASE("long-raise", msgq_declare_command(m, "c", ok, 1, NULL, NULL, long_raises));
    CASE("good", msgq_declare_command(m, "c", ok, 1, "list[dict[str, int | null]]", "doc",
                                      good_raises));
    CASE("event-null-name", msgq_declare_event(m, NULL, NULL, NULL, 0, NULL));
    CASE("event-bad-type", msgq_declare_event(m, "e", NULL, bad_types[0], 1, NULL));
    CASE("event-empty-group", msgq_declare_event(m, "e", "", NULL, 0, NULL));
    CASE("event-good", msgq_declare_event(m, "e", "G", ok, 1, NULL));
    CASE("check-type-null", msgq_check_type(NULL));
    CASE("check-type-good", msgq_check_type(" dict[str, list[bytes | float]] | null "));
    /* the bound on declarations per connection */
    int full = 0;
    for (int i = 0; i < MSGQ_DECL_MAX_DECLS + 1 && !full; i++) {
        char name[32];
        snprintf(name, sizeof name, "x%d", i);
        int r = msgq_declare_command(m, name, NULL, 0, NULL, NULL, NULL);
        if (r < 0) {
            printf("declarations-bound %d at %d\n", r, i);
            full = 1;
        }
    }
    fflush(stdout);
    msgq_close(m);
    return 0;
}

int main(int argc, char **argv) {
    struct sigaction sa = {0};
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    if (argc == 4 && strcmp(argv[1], "serve") == 0) return serve(argv[2], argv[3]);
    if (argc == 3 && strcmp(argv[1], "args") == 0) return args(argv[2]);
    fprintf(stderr, "usage: introspect-check serve SOCKET GROUP | args SOCKET\n");
    return 2;
}
