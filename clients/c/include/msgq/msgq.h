/*
 * libmsgq: a native C client of the msgq_trio message bus.
 *
 * The whole contract is in this file. Wire protocol: docs/PROTOCOL.md; guide and
 * examples: docs/C-CLIENT.md.
 *
 * Model (as sd-bus and nats.c): one `msgq` object is one connection to the broker. The
 * caller owns the event loop: `msgq_get_fd()`, `msgq_get_events()`,
 * `msgq_get_timeout()` and `msgq_process()` are all a loop needs; `msgq_wait()` and
 * the blocking calls (`msgq_connect`, `msgq_call`, `msgq_flush`, `msgq_close`) are
 * built on those and nothing else. The library starts no thread and has no global
 * state (no static mutable data; libcbor's allocator hooks are left alone).
 *
 * Blocking functions dispatch callbacks while they wait (so handlers keep answering).
 * A callback may send, answer and make blocking calls itself; a frame it sends while
 * an outer send waits for room goes out before that outer frame. A callback must not
 * call msgq_close on its own connection.
 *
 * Threads: a `msgq` object may be used by one thread at a time. Use one connection
 * per thread, or guard every call on a shared connection with one lock of your own
 * (callbacks run inside `msgq_process`, on the calling thread, with that lock held).
 *
 * Errors are values: functions return 0 (or a count) on success and a negative errno
 * on failure; where the broker or a handler said why, a `msgq_error` holds its wire
 * code (`code`, also as the enum `code_id`), message and CBOR data:
 *   -ENOTCONN     the connection is lost or closed (msgq_error: connection-lost, or the
 *                 broker's connection-level code such as broker-shutdown)
 *   -EREMOTEIO    the call was answered with an ERROR (code, message, data)
 *   -ETIMEDOUT    a local deadline passed (msgq_error code "timeout")
 *   -EAGAIN       non-blocking mode: the send would exceed max_out_bytes; retry after
 *                 msgq_process() wrote some
 *   -EPROTO       the broker violated the protocol (its fault; the connection closes)
 *   -EMSGSIZE     a frame is larger than max_frame_size (refused before sending)
 *   -EINVAL       a bad argument (the caller's fault)
 *   -EBADMSG      a received body is not well-formed CBOR (the sender's fault; local
 *                 code "malformed-message")
 *   other         an errno from the system (socket(2), connect(2), ...)
 *
 * Ownership: every object the library hands out says who frees it. CBOR items passed
 * in are borrowed (the library serializes them before returning); CBOR items handed
 * out by an accessor are owned by the message or result they come from unless the
 * function says "new reference" (then `cbor_decref` it). File descriptors passed in
 * are duplicated (the caller keeps and closes its own); received descriptors belong
 * to the message until taken with `msgq_message_take_fd`, after which the caller owns
 * them; ones not taken are closed when the message is released.
 */
#ifndef MSGQ_MSGQ_H
#define MSGQ_MSGQ_H

#include <stddef.h>
#include <stdint.h>

#include <cbor.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MSGQ_PROTOCOL_VERSION 1

/*
 * The broker's stable error codes (msgq_trio/protocol/codes.py, ErrorCode), in the
 * same order. tests/c checks this list against codes.py with `msgq-c codes`, so the
 * two cannot drift. MSGQ_CODE_OTHER: a code string not in the registry (a handler may
 * answer any code; the string is in msgq_error.code). MSGQ_CODE_CONNECTION_LOST is
 * local (never on the wire).
 */
typedef enum msgq_code {
    MSGQ_CODE_NONE = 0,
    MSGQ_CODE_NO_RECIPIENT,        /* "no-recipient" */
    MSGQ_CODE_RECIPIENT_GONE,      /* "recipient-gone" */
    MSGQ_CODE_TIMEOUT,             /* "timeout" */
    MSGQ_CODE_RECEIVER_FULL,       /* "receiver-full" */
    MSGQ_CODE_MULTIPLE_RECIPIENTS, /* "multiple-recipients" */
    MSGQ_CODE_UNKNOWN_COMMAND,     /* "unknown-command" */
    MSGQ_CODE_BAD_REQUEST,         /* "bad-request" */
    MSGQ_CODE_INTERNAL_ERROR,      /* "internal-error" */
    MSGQ_CODE_PROTOCOL_ERROR,      /* "protocol-error" */
    MSGQ_CODE_VERSION_MISMATCH,    /* "version-mismatch" */
    MSGQ_CODE_FRAME_TOO_LARGE,     /* "frame-too-large" */
    MSGQ_CODE_LIMIT_EXCEEDED,      /* "limit-exceeded" */
    MSGQ_CODE_FORBIDDEN,           /* "forbidden" */
    MSGQ_CODE_BROKER_SHUTDOWN,     /* "broker-shutdown" */
    MSGQ_CODE_SLOW_CONSUMER,       /* "slow-consumer" */
    MSGQ_CODE_DROPPED,             /* "dropped" */
    MSGQ_CODE_QUEUE_FULL,          /* "queue-full" */
    MSGQ_CODE_OUT_OF_ORDER,        /* "out-of-order" */
    MSGQ_CODE_PIPE_BROKEN,         /* "pipe-broken" */
    MSGQ_CODE_PIPE_MISMATCH,       /* "pipe-mismatch" */
    MSGQ_CODE_UNAUTHENTICATED,     /* "unauthenticated" */
    MSGQ_CODE_HEARTBEAT_TIMEOUT,   /* "heartbeat-timeout" */
    MSGQ_CODE__WIRE_COUNT,         /* number of wire codes + 1; not a code */
    MSGQ_CODE_OTHER = 1000,
    MSGQ_CODE_CONNECTION_LOST = 1001 /* "connection-lost" (local) */
} msgq_code;

/* The wire string of `code` ("no-recipient"), or NULL for NONE/OTHER/unknown. */
const char *msgq_code_name(msgq_code code);
/* The enum of a wire string; MSGQ_CODE_OTHER if it is not in the registry. */
msgq_code msgq_code_from_name(const char *name);

/* Why something failed. Zero-initialize (MSGQ_ERROR_INIT), pass to a function, read,
 * then msgq_error_clear() (also before reusing it). */
typedef struct msgq_error {
    msgq_code code_id;
    char code[64];       /* the wire code string ("" when none) */
    char *message;       /* malloc'd text, or NULL */
    cbor_item_t *data;   /* the ERROR's body, or NULL; owned by this struct */
} msgq_error;
#define MSGQ_ERROR_INIT {MSGQ_CODE_NONE, {0}, NULL, NULL}
void msgq_error_clear(msgq_error *err);

/*
 * Connection options. msgq_options_init() fills the defaults; each says where it comes
 * from.
 */
typedef struct msgq_options {
    /* Socket path; NULL: $MSGQ_TRIO_SOCKET, else $XDG_RUNTIME_DIR/msgq-trio/bus.sock
     * if that directory exists, else /tmp/msgq-trio-<uid>/bus.sock (as the Python
     * clients, msgq_trio.config.default_socket_path). */
    const char *socket;
    /* Client name in HELLO; NULL: "msgq-c" (the broker shows it in membership
     * events and stamps it on our frames). */
    const char *name;
    /* Largest frame accepted from the broker and sent to it. Default 64 MiB:
     * the broker's and the Python client's DEFAULT_MAX_FRAME_SIZE (framing.py). */
    uint32_t max_frame_size;
    /* Bytes queued for the socket before a send waits (blocking) or fails -EAGAIN
     * (nonblocking). Default 1 MiB: the Python clients' OUT_HIGH_WATER. */
    size_t max_out_bytes;
    /* Most descriptors in one received or sent frame. Default 253: the broker's
     * max_fds_per_message default (SCM_MAX_FD on Linux); WELCOME's limit lowers it. */
    unsigned max_fds;
    /* Deepest nesting of a received CBOR header or body; deeper is malformed. Default
     * 1000: about Python's recursion limit, which bounds cbor2 in the Python clients;
     * at most 2000 (libcbor's parse stack holds 2048 levels). */
    unsigned max_cbor_depth;
    /* Handshake and close patience, seconds. Defaults 10 s (the broker's
     * handshake_timeout) and 2 s (the Python clients' CLOSE_WAIT). */
    double handshake_timeout;
    double close_timeout;
    /* Nonzero: sends never wait for the socket; they fail -EAGAIN over max_out_bytes.
     * For callers that drive the connection from their own loop. */
    int nonblocking;
} msgq_options;
void msgq_options_init(msgq_options *opts);

typedef struct msgq msgq;

/* Connect, send HELLO and wait for WELCOME (blocking, handshake_timeout). On success
 * *out is the connection (free with msgq_close). opts may be NULL (defaults). */
int msgq_connect(msgq **out, const msgq_options *opts, msgq_error *err);
/* Send what is queued and GOODBYE, wait for the broker's GOODBYE (close_timeout, and
 * longer while the broker is still taking our queued bytes), fail pending calls with
 * connection-lost (their callbacks run), free everything. Never call it from a callback
 * of the same connection; release kept messages (msgq_message_ref) before or after it,
 * but answer them before. NULL is ignored. */
void msgq_close(msgq *m);

const char *msgq_lname(const msgq *m);           /* "l.N" from WELCOME */
const char *msgq_broker_version(const msgq *m);  /* WELCOME's "broker" */
/* 0 while the connection is up; else -ENOTCONN and, if err, why it ended. */
int msgq_status(const msgq *m, msgq_error *err);

/* ---- event loop integration ------------------------------------------------------ */
/* The socket to poll. Never read or write it yourself. */
int msgq_get_fd(const msgq *m);
/* The poll events wanted now: POLLIN, plus POLLOUT while bytes are queued. */
int msgq_get_events(const msgq *m);
/* The earliest deadline (CLOCK_MONOTONIC, microseconds) at which msgq_process must run
 * even without socket activity, or UINT64_MAX if none. */
uint64_t msgq_get_timeout(const msgq *m);
/* Make progress without blocking: write what the socket takes, read what is there,
 * dispatch callbacks, expire deadlines. Returns 1 if something happened, 0 if not,
 * -ENOTCONN once the connection is gone (the callbacks of pending calls have run). */
int msgq_process(msgq *m);
/* Block until the socket is ready or the deadline (or timeout_us, -1 = none) passes;
 * returns >0 ready, 0 timeout, -EINTR on a signal. Does not process. */
int msgq_wait(msgq *m, int64_t timeout_us);
/* Bytes queued for the socket, not yet written (at most max_out_bytes plus the last
 * frame queued: a frame is queued whole while the queue is under the bound). */
size_t msgq_get_queued_bytes(const msgq *m);
/* Block until everything queued is written (or the connection fails). */
int msgq_flush(msgq *m);
/* Monotonic clock in microseconds, the clock of msgq_get_timeout. */
uint64_t msgq_now(void);

/* ---- received messages ----------------------------------------------------------- */
typedef enum msgq_kind {
    MSGQ_KIND_MESSAGE = 3, /* one-way MESSAGE */
    MSGQ_KIND_REQUEST = 4, /* a call to one of our commands */
    MSGQ_KIND_REPLY = 5,   /* an answer (in call results) */
    MSGQ_KIND_ERROR = 6,
    MSGQ_KIND_NOTIFY = 7   /* a notification (membership events too) */
} msgq_kind;

/* A received frame. Valid for the callback it is given to; msgq_message_ref() keeps it
 * (a request kept so can be answered later), msgq_message_unref() releases it. */
typedef struct msgq_message msgq_message;
msgq_message *msgq_message_ref(msgq_message *msg);
void msgq_message_unref(msgq_message *msg);
msgq_kind msgq_message_kind(const msgq_message *msg);
const char *msgq_message_target(const msgq_message *msg);
/* The true sender as stamped by the broker (for a relayed frame: the origin). */
const char *msgq_message_sender(const msgq_message *msg);
const char *msgq_message_sender_name(const msgq_message *msg);
/* NOTIFY: the event name; REQUEST: the command; else NULL. */
const char *msgq_message_event(const msgq_message *msg);
const char *msgq_message_command(const msgq_message *msg);
uint64_t msgq_message_request_id(const msgq_message *msg);
/* The body as CBOR, decoded once (owned by the message; NULL body = CBOR null item).
 * -EBADMSG if it is not one well-formed CBOR item: err has the local code
 * "malformed-message" and names the sender (its bug, not the connection's). */
int msgq_message_body(msgq_message *msg, cbor_item_t **body, msgq_error *err);
/* The body's encoded bytes (len 0: no body, which means null). */
const uint8_t *msgq_message_body_raw(const msgq_message *msg, size_t *len);
size_t msgq_message_attachment_count(const msgq_message *msg);
const uint8_t *msgq_message_attachment(const msgq_message *msg, size_t i, size_t *len);
size_t msgq_message_fd_count(const msgq_message *msg);
/* Take descriptor i: the caller owns it from now on; -1 if out of range or taken. */
int msgq_message_take_fd(msgq_message *msg, size_t i);

/* ---- sending ------------------------------------------------------------------- */
typedef struct msgq_blob {
    const void *data;
    size_t len;
} msgq_blob;

/* Attachments and descriptors to send with a frame (all borrowed; NULL = none). */
typedef struct msgq_extras {
    const msgq_blob *attachments;
    size_t n_attachments;
    const int *fds; /* duplicated at the call; the caller keeps its own */
    size_t n_fds;
} msgq_extras;

/* One-way MESSAGE to target (lname, Group, Group[N], Group[?]). body NULL = null. */
int msgq_send(msgq *m, const char *target, const cbor_item_t *body, const msgq_extras *x);
int msgq_send_raw(msgq *m, const char *target, const void *cbor, size_t len,
                  const msgq_extras *x);
/* NOTIFY event to group. */
int msgq_notify(msgq *m, const char *group, const char *event, const cbor_item_t *params);

/* ---- calls ---------------------------------------------------------------------- */
/* The outcome of a call. ok: value is the result (owned by the result; the whole
 * answer, with attachments and descriptors, is `answer`). Not ok: error says why. */
typedef struct msgq_result {
    int ok;
    int status; /* 0, or the negative errno (-EREMOTEIO, -ENOTCONN, -ETIMEDOUT, -EBADMSG) */
    cbor_item_t *value;
    msgq_message *answer; /* the REPLY/ERROR frame; NULL for local failures */
    msgq_error error;
} msgq_result;
void msgq_result_clear(msgq_result *res);

/* Called once per call, from msgq_process (or msgq_close). `res` is valid during the
 * callback only; take what you need (msgq_message_ref(res->answer), cbor_incref). */
typedef void (*msgq_call_cb)(msgq *m, msgq_result *res, void *userdata);

/* Start a call: REQUEST `command` to target with params (NULL = null). timeout_s > 0
 * asks the broker to answer `timeout` after that many seconds; the library gives up
 * locally 1 s later (LOCAL_GRACE of the Python clients) if even the broker is silent.
 * timeout_s <= 0: the broker's own deadline (request_timeout, 300 s by default).
 * *request_id (may be NULL) gets the call's id. */
int msgq_call_async(msgq *m, const char *target, const char *command,
                    const cbor_item_t *params, const msgq_extras *x, double timeout_s,
                    msgq_call_cb cb, void *userdata, uint64_t *request_id);
int msgq_call_async_raw(msgq *m, const char *target, const char *command, const void *cbor,
                        size_t len, const msgq_extras *x, double timeout_s, msgq_call_cb cb,
                        void *userdata, uint64_t *request_id);
/* Blocking call: starts msgq_call_async and runs msgq_process until it is answered
 * (other callbacks are dispatched meanwhile). Returns res->status; res is filled
 * either way (msgq_result_clear it). */
int msgq_call(msgq *m, const char *target, const char *command, const cbor_item_t *params,
              const msgq_extras *x, double timeout_s, msgq_result *res);

/* Broker commands: join or leave a group (blocking; *changed = result, may be NULL). */
int msgq_subscribe(msgq *m, const char *group, int *changed, msgq_error *err);
int msgq_unsubscribe(msgq *m, const char *group, int *changed, msgq_error *err);

/* ---- receiving and handlers ---------------------------------------------------- */
/* MESSAGE and NOTIFY frames (membership events: subscribe to "msgq.membership"). */
typedef void (*msgq_message_cb)(msgq *m, msgq_message *msg, void *userdata);
void msgq_set_message_handler(msgq *m, msgq_message_cb cb, void *userdata);

/* A REQUEST for a registered command. The handler answers with msgq_reply* or
 * msgq_reply_error, now or later (keep the request with msgq_message_ref). If it
 * returns without answering and did not keep the request, the caller is answered
 * internal-error "handler did not answer". A request for a command with no handler
 * is answered unknown-command. */
typedef void (*msgq_command_cb)(msgq *m, msgq_message *request, void *userdata);
/* Register (or replace; cb NULL removes) the handler of `command`. */
int msgq_add_command(msgq *m, const char *command, msgq_command_cb cb, void *userdata);

int msgq_reply(msgq *m, msgq_message *request, const cbor_item_t *result,
               const msgq_extras *x);
int msgq_reply_raw(msgq *m, msgq_message *request, const void *cbor, size_t len,
                   const msgq_extras *x);
/* Answer with an ERROR: any code string (the registry's: msgq_code_name), message,
 * data (NULL = none). */
int msgq_reply_error(msgq *m, msgq_message *request, const char *code, const char *message,
                     const cbor_item_t *data);

/* ---- declared interface (docs/PROTOCOL.md, "Interfaces and introspection") ------ */
/*
 * The library answers the standard command `msgq.introspect` itself with the v1
 * description: name, lname, groups joined (msgq_subscribe, in join order), every command
 * that has a handler (sorted; `params` null unless declared) and the declared events.
 * Names starting with "msgq." are reserved for such standard commands.
 *
 * Limits (each argument over one fails -EINVAL, nothing kept): at most
 * MSGQ_DECL_MAX_PARAMS parameters and MSGQ_DECL_MAX_RAISES error codes per declaration;
 * names, types and codes at most MSGQ_DECL_MAX_NAME bytes, docs and defaults at most
 * MSGQ_DECL_MAX_DOC; at most MSGQ_DECL_MAX_DECLS declared commands plus events per
 * connection (-ENOSPC past it). They bound the memory a connection keeps for its
 * description; a description too large for one frame (only near the bounds) is
 * answered limit-exceeded.
 */
#define MSGQ_DECL_MAX_PARAMS 64
#define MSGQ_DECL_MAX_RAISES 32
#define MSGQ_DECL_MAX_NAME 255
#define MSGQ_DECL_MAX_DOC 1024
#define MSGQ_DECL_MAX_DECLS 1024

/* One declared parameter. `type` is a type string of the grammar in docs/PROTOCOL.md
 * ("str", "int | null", "list[str]", "dict[str, any]"); `required` nonzero: it must be
 * given; `default_json`: an optional parameter's default as JSON text of a scalar
 * (null, true, false, a number, a string), or NULL for none; `doc` one line or NULL. */
typedef struct msgq_param {
    const char *name;
    const char *type;
    int required;
    const char *default_json;
    const char *doc;
} msgq_param;

/* Declare command `command`'s interface (before or after msgq_add_command; declaring
 * again replaces; msgq_add_command(.., NULL, ..) removes the handler and the
 * declaration). params: n_params entries; params NULL (with n_params 0): parameters not
 * declared (listed as null, not checked); a non-NULL params with n_params 0 declares
 * that there are none. result_type: a type string, NULL = "any". doc: one line, NULL =
 * "". raises: a NULL-terminated list of error codes the handler may answer, or NULL.
 * Everything is copied. A REQUEST for a declared command is then checked before its
 * handler runs: params not a map (null is an empty map), a missing required parameter,
 * an unknown one or one of the wrong type is answered bad-request with data
 * {"param": NAME} ("" for the whole params) and the handler does not run.
 * Returns 0, -EINVAL (a NULL or empty name, a name starting "msgq.", a bad type string,
 * a duplicate parameter name, an over-limit length or count, a default that is not a
 * JSON scalar or given for a required parameter), -ENOSPC, -ENOMEM. */
int msgq_declare_command(msgq *m, const char *command, const msgq_param *params,
                         size_t n_params, const char *result_type, const char *doc,
                         const char *const *raises);
/* Declare a notification this client emits: event `event` to `group` (NULL: any group),
 * with params as above (params NULL and n_params 0: not declared, listed as null). Same
 * errors as msgq_declare_command. */
int msgq_declare_event(msgq *m, const char *event, const char *group,
                       const msgq_param *params, size_t n_params, const char *doc);
/* 0 if `type` is in the type grammar of docs/PROTOCOL.md, else -EINVAL. */
int msgq_check_type(const char *type);

/* ---- trace context (docs/PROTOCOL.md, "Trace context") --------------------------- */
/* While a handler of a traced REQUEST runs (a valid `traceparent` in its header), the
 * connection's current trace is a new span of that trace caused by the request: every
 * call, MESSAGE and NOTIFY the handler sends from inside its callback carries a
 * `traceparent` (same trace id, a new span id, same flags), the request's `tracestate`
 * and `tracecause` (the request's span id), as the Python clients do. A request kept
 * and answered later does not extend the trace to what is sent after the callback;
 * message and call callbacks run while the handler waits are not part of its trace. */
/* The `traceparent` of a received frame, or NULL if it has none or an invalid one.
 * Owned by the message. */
const char *msgq_message_traceparent(const msgq_message *msg);
/* The current trace's `traceparent` (the running handler's span), or NULL outside a
 * handler of a traced request. Valid until the handler returns. */
const char *msgq_current_traceparent(const msgq *m);

/* ---- wire codec (no I/O; exposed for tests and fuzzing) ------------------------- */
/* Check one whole frame (prefix included) as the library checks every received frame:
 * 0 if valid, -EPROTO / -EMSGSIZE with the reason in err. */
int msgq_frame_check(const uint8_t *frame, size_t len, uint32_t max_frame_size,
                     msgq_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MSGQ_MSGQ_H */
