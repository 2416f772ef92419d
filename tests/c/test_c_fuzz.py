"""The libFuzzer target over libmsgq's frame decoder (clients/c/fuzz/fuzz_frame.c), run
for a fixed short time from a seed corpus of frames the Python codec encodes.

Built with clang (libFuzzer + ASan + UBSan); a crash, a leak, a sanitizer report, or a
frame that makes the decoder use more than the memory limit (a claimed-but-absent
size it believed) fails the test, with the reproducer's bytes in the output.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from libmsgq_build import meson_build

from msgq_trio.protocol.codes import FrameType
from msgq_trio.protocol.framing import encode_cbor, encode_frame

#: Seconds of fuzzing per run: long enough for millions of inputs, short for CI.
FUZZ_SECONDS = 15
#: Far above what a frame of at most 4 KiB (libFuzzer's default max_len) needs, far
#: below what an unchecked claimed size would allocate.
RSS_LIMIT_MB = 512


def seed_frames() -> list[bytes]:
    """Well-formed frames of every kind a broker sends, to start the fuzzer from."""
    body = encode_cbor({"a": [1, -2, 2.5, b"\x00", "ü", None, True, 2**70], "m": {1: []}})
    frames = [
        encode_frame(FrameType.WELCOME, header=encode_cbor({"lname": "l.1", "limits": {}})),
        encode_frame(FrameType.REPLY, target="l.1", source=b"l.2\x00x", request_id=7, body=body),
        encode_frame(
            FrameType.ERROR,
            target="l.1",
            source=b"l.0\x00msgq",
            request_id=7,
            header=encode_cbor({"code": "no-recipient", "message": "m"}),
        ),
        encode_frame(
            FrameType.MESSAGE,
            target="G[0]",
            source=b"l.3\x00b\x00l.4\x00origin",
            body=body,
            blobs=[b"abc", b""],
        ),
        encode_frame(FrameType.NOTIFY, target="G", header=encode_cbor({"event": "e"})),
        encode_frame(
            FrameType.REQUEST,
            target="G",
            request_id=1,
            header=encode_cbor({"cmd": "c", "timeout": 1.5}),
            body=body,
        ),
        encode_frame(FrameType.GOODBYE, header=encode_cbor({"reason": "broker-shutdown"})),
    ]
    return [b"".join(bytes(p) for p in f) for f in frames]


@pytest.fixture(scope="session")
def fuzz_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    missing = [t for t in ("clang-14", "clang++-14") if not shutil.which(t)]
    if missing:
        pytest.fail(
            f"cannot build the fuzz target: missing {', '.join(missing)} "
            "(Debian: apt-get install clang-14 libclang-rt-14-dev)"
        )
    d = tmp_path_factory.mktemp("libmsgq") / "fuzz"
    meson_build(d, "-Dfuzz=true", env={"CC": "clang-14", "CXX": "clang++-14"})
    return d


def test_fuzz_frame_decoder(fuzz_build: Path, tmp_path: Path) -> None:
    """The decoder survives FUZZ_SECONDS of libFuzzer without a finding."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, f in enumerate(seed_frames()):
        (corpus / f"seed{i}").write_bytes(f)
    r = subprocess.run(
        [
            str(fuzz_build / "fuzz-frame"),
            f"-max_total_time={FUZZ_SECONDS}",
            f"-rss_limit_mb={RSS_LIMIT_MB}",
            "-timeout=10",
            f"-artifact_prefix={tmp_path}/",
            str(corpus),
        ],
        capture_output=True,
        text=True,
        timeout=FUZZ_SECONDS + 120,
        check=False,
    )
    assert r.returncode == 0, r.stderr[-5000:]
    assert "Done" in r.stderr, r.stderr[-5000:]
