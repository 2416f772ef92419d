"""The named-pipe scenarios (scenarios/pipe-*.toml) catch what they claim to catch.

scenarios/pipe-stream-faults.toml runs the example programs
:mod:`msgq_trio.scenario.examples.pipe_writer` and ``pipe_reader`` through a stall of the
reader and a SIGKILL of the writer; tests/test_scenario_matrix_*.py run it as shipped (it must
pass). Here the same scenario runs with a deliberately broken reader, a pipe bound larger
than the writer checks for, and a writer that stalls instead of dying: each must fail,
naming the operations that break the promise. Every run starts a real broker with the
pipe plugin and real processes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from msgq_trio.scenario.examples.pipe_writer import RECORD, make_record, parse_record
from msgq_trio.scenario.runner import run_scenario

SCENARIO = Path(__file__).resolve().parent.parent / "scenarios" / "pipe-stream-faults.toml"
READER = '"msgq_trio.scenario.examples.pipe_reader", "stream"'


def _variant(tmp_path: Path, *replacements: tuple[str, str]) -> Path:
    text = SCENARIO.read_text()
    for old, new in replacements:
        assert old in text, old
        text = text.replace(old, new)
    p = tmp_path / "pipe-variant.toml"
    p.write_text(text)
    return p


def test_records_carry_their_number_and_detect_damage() -> None:
    """A record is RECORD bytes naming its writer and number; a corrupted, cut or shifted
    one is not taken for a record."""
    rec = make_record("w1", 42)
    assert len(rec) == RECORD and rec.endswith(b"\n")
    assert parse_record(rec) == ("w1", 42)
    assert parse_record(rec[:-1]) is None
    assert parse_record(rec[:20] + b"x" + rec[21:]) is None  # one digest byte changed
    assert parse_record(rec.replace(b"42", b"43")) is None  # the number changed
    shifted = (make_record("w1", 1) + make_record("w1", 2))[3 : 3 + RECORD]
    assert parse_record(shifted) is None


@pytest.mark.parametrize(
    ("flag", "why"),
    [
        (
            "--drop",
            r"history check lost: 1 acked messages were never delivered: "
            r"#\d+ writer-0 ok send w1:100 at",
        ),
        ("--swap", r"history check order: reader-0 got w1's seq 100 after seq 101: #\d+ reader-0"),
    ],
)
def test_a_reader_that_loses_or_reorders_a_record_is_caught(
    tmp_path: Path, flag: str, why: str
) -> None:
    """The scenario with a reader that drops record 100, or records 101 before 100,
    fails naming the record and the operations."""
    result = run_scenario(_variant(tmp_path, (READER, f'{READER}, "{flag}", "100"')))
    assert not result.passed
    assert re.search(why, result.explain()), result.explain()


def test_a_pipe_holding_more_than_its_bound_is_caught(tmp_path: Path) -> None:
    """With the pipe's max_buffer at 1 MiB while the writer checks for 64 KiB, the
    writer's backlog check fails when the stopped reader makes it block, naming it."""
    result = run_scenario(_variant(tmp_path, ("max_buffer = 65536", "max_buffer = 1048576")))
    assert not result.passed
    assert re.search(
        r"history check answered-once: backlog failed with an undocumented error "
        r"'backlog-over-bound' \(documented: \['write-timeout'\]\): #\d+ writer-0 invoke backlog",
        result.explain(),
    ), result.explain()


def test_a_reader_left_waiting_by_a_silent_writer_is_caught(tmp_path: Path) -> None:
    """A writer that stops (SIGSTOP) instead of dying stays attached: no end of pipe. The
    reader's read times out (10 s) and it records that, which the scenario does not
    allow: a hang is named, not waited out."""
    result = run_scenario(
        _variant(
            tmp_path,
            ('action = "sigkill"\ntarget = "writer"', 'action = "sigstop"\ntarget = "writer"'),
            ("timeout = 120", "timeout = 25"),
            ('"writer.killed" = "== 1"', '"writer.killed" = "== 0"'),
        )
    )
    explained = result.explain()
    assert not result.passed
    assert re.search(
        r"history check answered-once: read failed with an undocumented error "
        r"'read-timeout' \(documented: \['write-timeout'\]\): #\d+ reader-0 invoke read",
        explained,
    ), explained
    assert "program reader#0 (pid" in explained and "ended with 3" in explained, explained
