/*
 * A C component loaded into a Python program as a shared object (tests/c,
 * test_shared_handle.py; the pattern is in docs/C-CLIENT.md): it is handed the
 * program's open connection (a `msgq *`, passed from Python as an integer) instead of
 * opening its own, calls on it, and registers a command on it that Python's loop then
 * serves. It never closes the connection: the program that opened it owns it.
 *
 * Built by the test: cc -shared -fPIC component.c -lmsgq (against the libmsgq under
 * test).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "msgq/msgq.h"

/* Calls `command` of `target` with {"name": name} on the borrowed connection m and
 * copies the text result into out (NUL-terminated, truncated to outlen). Returns 0, or
 * the call's negative errno with "CODE: MESSAGE" in out, or -EPROTO if the result is
 * not text. */
int component_greet(msgq *m, const char *target, const char *command, const char *name,
                     char *out, size_t outlen) {
    if (m == NULL || out == NULL || outlen == 0) return -EINVAL;
    cbor_item_t *params = cbor_new_definite_map(1);
    if (params == NULL) return -ENOMEM;
    if (!cbor_map_add(params, (struct cbor_pair){cbor_move(cbor_build_string("name")),
                                                 cbor_move(cbor_build_string(name))})) {
        cbor_decref(&params);
        return -ENOMEM;
    }
    msgq_result res;
    int rc = msgq_call(m, target, command, params, NULL, 10.0, &res);
    cbor_decref(&params);
    if (rc < 0) {
        snprintf(out, outlen, "%s: %s", res.error.code,
                 res.error.message ? res.error.message : "");
    } else if (!cbor_isa_string(res.value) || !cbor_string_is_definite(res.value)) {
        snprintf(out, outlen, "result is not text");
        rc = -EPROTO;
    } else {
        snprintf(out, outlen, "%.*s", (int)cbor_string_length(res.value),
                 (const char *)cbor_string_handle(res.value));
    }
    msgq_result_clear(&res);
    return rc;
}

/* "double": answers twice its unsigned integer params (bad-request otherwise). */
static void on_double(msgq *m, msgq_message *req, void *ud) {
    (void)ud;
    cbor_item_t *params;
    msgq_error err = MSGQ_ERROR_INIT;
    if (msgq_message_body(req, &params, &err) < 0 || !cbor_isa_uint(params) ||
        cbor_get_int(params) > UINT64_MAX / 2) {
        msgq_reply_error(m, req, "bad-request", "params must be an unsigned integer", NULL);
        msgq_error_clear(&err);
        return;
    }
    cbor_item_t *result = cbor_build_uint64(cbor_get_int(params) * 2);
    if (result == NULL) {
        msgq_reply_error(m, req, "internal-error", "out of memory", NULL);
        return;
    }
    msgq_reply(m, req, result, NULL);
    cbor_decref(&result);
}

/* Registers the command "double" on the borrowed connection m; it is answered whenever
 * the connection's owner runs msgq_process (its own loop, on its own thread). */
int component_register(msgq *m) {
    if (m == NULL) return -EINVAL;
    return msgq_add_command(m, "double", on_double, NULL);
}
