// A C++ component on the bus (docs/C-CLIENT.md): it answers "sum" in group CxxDemo
// and calls the Python component PyDemo's "greet" once, printing the answer.
// usage: msgq-cxx-example [SOCKET]    (runs until SIGTERM/SIGINT)
#include <csignal>
#include <cstdio>

#include "msgq/msgq.hpp"

static volatile std::sig_atomic_t stop;

int main(int argc, char **argv) {
    std::signal(SIGTERM, [](int) { stop = 1; });
    std::signal(SIGINT, [](int) { stop = 1; });
    try {
        msgqpp::Bus bus("cxx-demo", argc > 1 ? argv[1] : "");
        bus.subscribe("CxxDemo");
        // sum([a, b, ...]) of unsigned integers
        bus.on("sum", [](msgqpp::Request &req) {
            msgqpp::Cbor params = req.params();
            if (!cbor_isa_array(params.get())) {
                req.fail("bad-request", "params must be an array of unsigned integers");
                return;
            }
            uint64_t total = 0;
            for (size_t i = 0; i < cbor_array_size(params.get()); i++) {
                cbor_item_t *v = cbor_array_handle(params.get())[i];
                if (!cbor_isa_uint(v)) {
                    req.fail("bad-request", "params must be an array of unsigned integers");
                    return;
                }
                total += cbor_get_int(v);
            }
            req.reply(msgqpp::Cbor(cbor_build_uint64(total)));
        });
        cbor_item_t *who = cbor_new_definite_map(1);
        cbor_map_add(who, {cbor_move(cbor_build_string("name")), cbor_move(cbor_build_string("C++"))});
        msgqpp::Cbor greeting = bus.call("PyDemo", "greet", msgqpp::Cbor(who));
        if (cbor_isa_string(greeting.get()))
            std::printf("PyDemo says: %.*s\n", (int)cbor_string_length(greeting.get()),
                        (const char *)cbor_string_handle(greeting.get()));
        std::fflush(stdout);
        while (!stop) bus.run_once(200000);
    } catch (const msgqpp::Error &e) {
        std::fprintf(stderr, "error: %s\n", e.what());
        return 1;
    }
    return 0;
}
