// libmsgq C++ wrapper: a thin header-only RAII layer over msgq.h (as sdbus-c++ over
// sd-bus). A Bus owns one connection; errors are msgqpp::Error exceptions carrying the
// wire code; CBOR values are msgqpp::Cbor (a reference-counted cbor_item_t handle).
// Threads: as the C library, one thread at a time per Bus.
#ifndef MSGQ_MSGQ_HPP
#define MSGQ_MSGQ_HPP

#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "msgq/msgq.h"

namespace msgqpp {

// A failed operation: code() is the wire code ("no-recipient", "connection-lost", ...)
// or "" for a local failure; status() the negative errno the C call returned.
class Error : public std::runtime_error {
public:
    Error(int status, const msgq_error &e)
        : std::runtime_error(std::string(e.code[0] ? e.code : "error") + ": " +
                             (e.message ? e.message : std::strerror(-status))),
          status_(status), code_(e.code) {}
    int status() const noexcept { return status_; }
    const std::string &code() const noexcept { return code_; }

private:
    int status_;
    std::string code_;
};

// An owning handle of a libcbor item (cbor_decref on destruction).
class Cbor {
public:
    Cbor() = default;
    // Takes the reference (an item fresh from cbor_build_*).
    explicit Cbor(cbor_item_t *owned) : item_(owned) {}
    static Cbor borrow(cbor_item_t *item) { return Cbor(item ? cbor_incref(item) : nullptr); }
    Cbor(const Cbor &o) : item_(o.item_ ? cbor_incref(o.item_) : nullptr) {}
    Cbor(Cbor &&o) noexcept : item_(std::exchange(o.item_, nullptr)) {}
    Cbor &operator=(Cbor o) noexcept { std::swap(item_, o.item_); return *this; }
    ~Cbor() { if (item_) cbor_decref(&item_); }
    cbor_item_t *get() const noexcept { return item_; }
    explicit operator bool() const noexcept { return item_ != nullptr; }

private:
    cbor_item_t *item_ = nullptr;
};

class Bus;

// A request given to a command handler; answer it once with reply() or fail().
class Request {
public:
    Request(Bus &bus, msgq_message *msg) : bus_(bus), msg_(msg) {}
    const char *command() const { return msgq_message_command(msg_); }
    const char *sender() const { return msgq_message_sender(msg_); }
    Cbor params() const;
    void reply(const Cbor &result);
    void fail(const std::string &code, const std::string &message);
    msgq_message *raw() const noexcept { return msg_; }

private:
    Bus &bus_;
    msgq_message *msg_;
};

class Bus {
public:
    // Connects (socket "" = $MSGQ_TRIO_SOCKET or the per-user default).
    explicit Bus(const std::string &name, const std::string &socket = "") {
        msgq_options o;
        msgq_options_init(&o);
        o.name = name.c_str();
        o.socket = socket.empty() ? nullptr : socket.c_str();
        msgq_error e = MSGQ_ERROR_INIT;
        int r = msgq_connect(&m_, &o, &e);
        if (r < 0) throw_error(r, e);
    }
    Bus(const Bus &) = delete;
    Bus &operator=(const Bus &) = delete;
    ~Bus() { msgq_close(m_); }

    msgq *handle() const noexcept { return m_; }
    std::string lname() const { return msgq_lname(m_); }

    bool subscribe(const std::string &group) {
        int changed = 0;
        msgq_error e = MSGQ_ERROR_INIT;
        int r = msgq_subscribe(m_, group.c_str(), &changed, &e);
        if (r < 0) throw_error(r, e);
        return changed != 0;
    }

    // Blocking call; returns the result, throws Error on any failure.
    Cbor call(const std::string &target, const std::string &command, const Cbor &params = Cbor(),
              double timeout_s = 0) {
        msgq_result res;
        int r = msgq_call(m_, target.c_str(), command.c_str(), params.get(), nullptr, timeout_s,
                          &res);
        if (r < 0) {
            Error err(r, res.error);
            msgq_result_clear(&res);
            throw err;
        }
        Cbor value = Cbor::borrow(res.value);
        msgq_result_clear(&res);
        return value;
    }

    void send(const std::string &target, const Cbor &body) {
        int r = msgq_send(m_, target.c_str(), body.get(), nullptr);
        if (r < 0) fail_status(r);
    }

    // Register a handler; it runs inside process(). An exception it throws answers
    // internal-error with its what() (msgqpp::Error: its code).
    void on(const std::string &command, std::function<void(Request &)> fn) {
        handlers_[command] = std::move(fn);
        int r = msgq_add_command(m_, command.c_str(), &Bus::trampoline, this);
        if (r < 0) fail_status(r);
    }

    // Declare a command's interface (msgq_declare_command: params copied; raises a
    // NULL-terminated list or nullptr); throws Error(-EINVAL) on a bad declaration.
    void declare(const std::string &command, const std::vector<msgq_param> &params,
                 const char *result_type = "any", const char *doc = "",
                 const char *const *raises = nullptr) {
        static const msgq_param none{}; // an empty list declares none (not "undeclared")
        int r = msgq_declare_command(m_, command.c_str(), params.empty() ? &none : params.data(),
                                     params.size(), result_type, doc, raises);
        if (r < 0) fail_status(r);
    }

    // Event-loop integration, as the C API.
    int fd() const { return msgq_get_fd(m_); }
    int events() const { return msgq_get_events(m_); }
    uint64_t deadline() const { return msgq_get_timeout(m_); }
    // Make progress; throws Error once the connection is lost.
    bool process() {
        int r = msgq_process(m_);
        if (r < 0) fail_status(r);
        return r > 0;
    }
    // Block up to timeout_us (-1: until something happens), then process.
    bool run_once(int64_t timeout_us = -1) {
        msgq_wait(m_, timeout_us);
        return process();
    }

private:
    [[noreturn]] static void throw_error(int r, msgq_error &e) {
        Error err(r, e);
        msgq_error_clear(&e);
        throw err;
    }
    [[noreturn]] void fail_status(int r) {
        msgq_error e = MSGQ_ERROR_INIT;
        if (msgq_status(m_, &e) == 0) snprintf(e.code, sizeof e.code, "%s", "");
        throw_error(r, e);
    }
    static void trampoline(msgq *, msgq_message *msg, void *ud) {
        Bus *self = static_cast<Bus *>(ud);
        auto it = self->handlers_.find(msgq_message_command(msg));
        if (it == self->handlers_.end()) return;
        Request req(*self, msg);
        try {
            it->second(req);
        } catch (const Error &e) {
            msgq_reply_error(self->m_, msg, e.code().empty() ? "internal-error" : e.code().c_str(),
                             e.what(), nullptr);
        } catch (const std::exception &e) {
            msgq_reply_error(self->m_, msg, "internal-error", e.what(), nullptr);
        }
    }

    msgq *m_ = nullptr;
    std::map<std::string, std::function<void(Request &)>> handlers_;
};

inline Cbor Request::params() const {
    cbor_item_t *body = nullptr;
    msgq_error e = MSGQ_ERROR_INIT;
    int r = msgq_message_body(msg_, &body, &e);
    if (r < 0) {
        Error err(r, e);
        msgq_error_clear(&e);
        throw err;
    }
    return Cbor::borrow(body);
}

inline void Request::reply(const Cbor &result) {
    msgq_reply(bus_.handle(), msg_, result.get(), nullptr);
}

inline void Request::fail(const std::string &code, const std::string &message) {
    msgq_reply_error(bus_.handle(), msg_, code.c_str(), message.c_str(), nullptr);
}

}  // namespace msgqpp

#endif  // MSGQ_MSGQ_HPP
