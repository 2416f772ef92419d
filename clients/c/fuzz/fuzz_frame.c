/*
 * libFuzzer target over the frame decoder: every input is one frame as the broker
 * might send it (msgq_frame_check: layout, UTF-8 target, header and body CBOR, all
 * through libcbor). A crash, leak or sanitizer report is a bug; a rejected frame is not.
 */
#include <stdint.h>
#include <stddef.h>

#include "msgq/msgq.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    msgq_error err = MSGQ_ERROR_INIT;
    (void)msgq_frame_check(data, size, 1u << 20, &err);
    msgq_error_clear(&err);
    return 0;
}
