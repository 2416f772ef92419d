/*
 * api-check: a component on libmsgq for tests/c that uses what msgq-c does not:
 * subscribe/unsubscribe results, a request kept and answered later, a handler that
 * does not answer, and blocking calls made from inside a handler (re-entrancy).
 * usage: api-check SOCKET   (group ApiC; runs until SIGTERM)
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "msgq/msgq.h"

struct state {
    msgq_message *kept; /* a "later" request, answered on the next loop turn */
};

static volatile sig_atomic_t stop;
static void on_term(int sig) { (void)sig; stop = 1; }

static void later(msgq *m, msgq_message *req, void *ud) {
    (void)m;
    struct state *s = ud;
    if (s->kept) msgq_message_unref(s->kept); /* only one kept at a time here */
    s->kept = msgq_message_ref(req);
}

static void silent(msgq *m, msgq_message *req, void *ud) {
    (void)m;
    (void)req;
    (void)ud;
}

/* Calls Python's Py.ping with our params (a blocking call inside a handler) and
 * answers with its result, or with its error's code, message and data. */
static void callback(msgq *m, msgq_message *req, void *ud) {
    (void)ud;
    cbor_item_t *params;
    if (msgq_message_body(req, &params, NULL) < 0) return;
    msgq_result res;
    if (msgq_call(m, "Py", "ping", params, NULL, 0, &res) == 0)
        msgq_reply(m, req, res.value, NULL);
    else
        msgq_reply_error(m, req, res.error.code, res.error.message, res.error.data);
    msgq_result_clear(&res);
}

/* Calls Python's Py.file, which answers with a descriptor and an attachment; answers
 * [the file's first bytes (read through the descriptor taken from the answer), the
 * attachment]. */
static void fetch(msgq *m, msgq_message *req, void *ud) {
    (void)ud;
    msgq_result res;
    if (msgq_call(m, "Py", "file", NULL, NULL, 0, &res) < 0 || !res.answer ||
        msgq_message_fd_count(res.answer) != 1 || msgq_message_attachment_count(res.answer) != 1) {
        msgq_reply_error(m, req, "internal-error", "no descriptor in the answer", NULL);
        msgq_result_clear(&res);
        return;
    }
    int fd = msgq_message_take_fd(res.answer, 0);
    char buf[256];
    ssize_t n = pread(fd, buf, sizeof buf, 0);
    close(fd);
    size_t alen;
    const uint8_t *att = msgq_message_attachment(res.answer, 0, &alen);
    cbor_item_t *r = cbor_new_definite_array(2);
    cbor_array_push(r, cbor_move(cbor_build_bytestring((const unsigned char *)buf,
                                                       n > 0 ? (size_t)n : 0)));
    cbor_array_push(r, cbor_move(cbor_build_bytestring(att, alen)));
    msgq_reply(m, req, r, NULL);
    cbor_decref(&r);
    msgq_result_clear(&res);
}

/* Leaves ApiC twice: answers [first unsubscribe's result, second's]. */
static void leave(msgq *m, msgq_message *req, void *ud) {
    (void)ud;
    int a = -1, b = -1;
    msgq_unsubscribe(m, "ApiC", &a, NULL);
    msgq_unsubscribe(m, "ApiC", &b, NULL);
    cbor_item_t *r = cbor_new_definite_array(2);
    cbor_array_push(r, cbor_move(cbor_build_bool(a == 1)));
    cbor_array_push(r, cbor_move(cbor_build_bool(b == 1)));
    msgq_reply(m, req, r, NULL);
    cbor_decref(&r);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: api-check SOCKET\n");
        return 2;
    }
    struct sigaction sa = {0};
    sa.sa_handler = on_term;
    sigaction(SIGTERM, &sa, NULL);
    msgq_options o;
    msgq_options_init(&o);
    o.socket = argv[1];
    o.name = "api-check";
    msgq *m;
    msgq_error err = MSGQ_ERROR_INIT;
    if (msgq_connect(&m, &o, &err) < 0) {
        fprintf(stderr, "error: %s: %s\n", err.code, err.message);
        msgq_error_clear(&err);
        return 1;
    }
    int first = -1, second = -1;
    msgq_subscribe(m, "ApiC", &first, NULL);
    msgq_subscribe(m, "ApiC", &second, NULL);
    struct state s = {NULL};
    msgq_add_command(m, "later", later, &s);
    msgq_add_command(m, "silent", silent, NULL);
    msgq_add_command(m, "callback", callback, NULL);
    msgq_add_command(m, "leave", leave, NULL);
    msgq_add_command(m, "fetch", fetch, NULL);
    printf("subscribe %d %d\n", first, second);
    fflush(stdout);
    fprintf(stderr, "msgq-c: ready %s\n", msgq_lname(m));
    int rc = 0;
    while (!stop) {
        if (s.kept) {
            cbor_item_t *v = cbor_build_string("later-done");
            msgq_reply(m, s.kept, v, NULL);
            cbor_decref(&v);
            msgq_message_unref(s.kept);
            s.kept = NULL;
        }
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
    if (s.kept) msgq_message_unref(s.kept);
    msgq_close(m);
    return rc;
}
