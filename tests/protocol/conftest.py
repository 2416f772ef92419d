"""Every protocol test runs on both builds of the frame codec: the pure-Python reference
and the compiled fast paths (msgq_trio/protocol/_speedups.c), where it is built.

Module-scoped, so each test module runs once per build (hypothesis accepts no
function-scoped fixture). Under ``MSGQ_TRIO_PURE_PYTHON=1`` (a CI step) or without the
extension only the pure build runs. test_speedups.py compares the two itself.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from msgq_trio.protocol import framing

#: The builds to run, ``MSGQ_TRIO_TEST_BUILDS=compiled`` for the compiled one only (the
#: sanitizer run, tests/protocol/sanitize.sh, which has nothing to check in pure Python).
BUILDS = os.environ.get("MSGQ_TRIO_TEST_BUILDS", "pure,compiled").split(",")


@pytest.fixture(scope="module", params=BUILDS, autouse=True)
def codec_build(request: pytest.FixtureRequest) -> Iterator[str]:
    """Switch framing's fast-path hooks to one build for the module's tests."""
    if request.module.__name__.endswith("test_speedups"):
        if request.param == "pure":
            pytest.skip("test_speedups compares both builds itself")
        yield request.param
        return
    if request.param == "compiled":
        if not framing.SPEEDUPS:
            pytest.skip("the compiled fast path is not in use (MSGQ_TRIO_PURE_PYTHON or no build)")
        yield request.param
        return
    saved = (
        framing._scan_loop,
        framing.Frame.__dict__["body"],
        framing.encode_small_bytes,
        framing._new_body,
    )
    saved_reuse = framing._reuse_body
    framing._scan_loop = framing._scan_loop_py
    framing.Frame.body = framing._body_py  # type: ignore[method-assign]
    framing.encode_small_bytes = framing._encode_small_bytes_py
    framing._new_body = framing._new_body_py
    framing._reuse_body = framing._reuse_body_py
    try:
        yield request.param
    finally:
        framing._scan_loop, body, framing.encode_small_bytes, framing._new_body = saved
        framing._reuse_body = saved_reuse
        framing.Frame.body = body  # type: ignore[method-assign]
