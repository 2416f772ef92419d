"""A Python program that shares its libmsgq connection with a C component loaded into it
(tests/c/test_shared_handle.py runs it; the pattern is in docs/C-CLIENT.md).

usage: shared_handle_app.py LIBMSGQ COMPONENT_SO SOCKET

It connects once through the ctypes binding, joins group App, hands the connection's
``handle`` to the component (which calls PyPeer.greet on it and registers the command
"double" on it), calls PyPeer.greet itself on the same connection, then serves its loop
(the component's "double" included) until it receives the message "bye". Every step is
one JSON line on stdout; the test drives and checks it. All of it runs on the main
thread: the library's rule is one thread at a time per connection.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

from libmsgq_py import MSGQ_KIND_MESSAGE, Connection, load


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def main(lib_path: str, component_path: str, socket: str) -> int:
    lib = load(lib_path)
    component = ctypes.CDLL(component_path)
    component.component_greet.restype = ctypes.c_int
    component.component_greet.argtypes = [
        ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p,
        ctypes.c_char_p, ctypes.c_size_t,
    ]  # fmt: skip
    component.component_register.restype = ctypes.c_int
    component.component_register.argtypes = [ctypes.c_void_p]

    conn = Connection(lib, socket, name="shared-app")
    say(step="connected", lname=conn.lname)
    conn.subscribe("App")

    out = ctypes.create_string_buffer(256)
    rc = component.component_greet(conn.handle, b"PyPeer", b"greet", b"C", out, len(out))
    say(step="component", rc=rc, text=out.value.decode(errors="replace"))
    say(step="register", rc=component.component_register(conn.handle))

    # Python keeps using the very connection the component just called on.
    say(step="python", result=conn.call("PyPeer", "greet", {"name": "Python"}))
    say(step="ready")

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        conn.process(0.2)
        while conn.messages:
            msg = conn.messages.pop(0)
            if msg.kind == MSGQ_KIND_MESSAGE:
                say(step="message", sender=msg.sender, body=msg.body)
                if msg.body == "bye":
                    conn.close()
                    say(step="closed")
                    return 0
    say(step="gave up")
    conn.close()
    return 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
