"""The example system's deliberately broken components (they show that the checks catch
what they claim to catch): each one's scenario fails, and the failure names the
operations that break the promise.

Real broker, real example programs (``msgq_trio.scenario.examples``), real faults: these
run whole scenarios through :func:`run_scenario`, a few seconds each.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from msgq_trio.scenario.runner import run_scenario

SCENARIO_DIR = Path(__file__).resolve().parent.parent / "scenarios"


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "sc.toml"
    p.write_text(text)
    return p


def test_a_swallowing_transfer_worker_is_caught_naming_the_unanswered_calls(
    tmp_path: Path,
) -> None:
    """The zone transfer scenario with workers that start every transfer and never
    answer (``xfrin --swallow``): the zone manager's calls wait for their 30 s deadline,
    so the run ends at its own (shorter) timeout, and the history check names the calls
    that never completed and the transfers the workers never finished."""
    text = (SCENARIO_DIR / "example-dns-xfrin-crash.toml").read_text()
    text = text.replace(
        '"msgq_trio.scenario.examples.xfrin", "--work", "1"]',
        '"msgq_trio.scenario.examples.xfrin", "--work", "1", "--swallow"]',
    )
    # Far below the calls' 30 s deadline: the run ends while they still wait.
    text = text.replace("timeout = 90", "timeout = 15")
    assert '"--swallow"]' in text and "timeout = 15" in text
    result = run_scenario(_write(tmp_path, text))
    why = result.explain()
    assert not result.passed, why
    assert re.search(
        r"history check answered-once: call never completed: "
        r"#\d+ zonemgr-0 invoke call zone\d+\.example",
        why,
    ), why
    # xfrin-0 was never killed: its open transfers are its own failure, not unknown.
    assert re.search(
        r"history check answered-once: transfer never completed: "
        r"#\d+ xfrin-0 invoke transfer zone\d+\.example/1",
        why,
    ), why


# A smaller durable-queue-kill-loop: one broker restart, struck by an event (the
# producer's 40th history line) so it comes while the consumer still sleeps on its
# first connection (--delay 10: seconds of margin for the restart on a busy machine): the
# consumer takes every message in its second session,
# where a message stored twice is delivered twice.
QUEUE_RESEND = """
summary = "s"
fault = "f"
broker_does = "b"
timeout = 90

[broker]
plugins = ["queue"]

[broker.plugin.queue.queues.dq]

[[clients]]
name = "producer"
role = "exec"
[clients.params]
command = ["{{python}}", "-m", "msgq_trio.scenario.examples.queue_producer", "dq", "400",
           "--rate", "200"{flag}]
ready = "line:ready"

[[clients]]
name = "consumer"
role = "exec"
[clients.params]
command = ["{{python}}", "-m", "msgq_trio.scenario.examples.queue_consumer", "dq", "400",
           "--delay", "10"]
ready = "line:ready"

[[faults]]
name = "broker"
at = 0
when = "ops:40"
action = "restart-broker"

[expect]
fds_baseline = false
tasks_baseline = false

[expect.counts]
"broker.restarts" = "== 1"

[expect.history]
lost = true
duplicates = true
duplicates_per = "session"
answered_once = true
silence = 30
"""


@pytest.mark.parametrize("broken", [False, True], ids=["dedup", "resend-new-identity"])
def test_a_producer_resending_without_dedup_is_caught_naming_the_duplicates(
    tmp_path: Path, broken: bool
) -> None:
    """A durable queue's producer resends after a broker restart. Under its own name and
    seqs the queue deduplicates and the run passes; under a new name
    (``queue_producer --resend-new-identity``) the queue stores its last messages again,
    and the duplicates check names each message delivered twice in one session."""
    flag = ', "--resend-new-identity"' if broken else ""
    result = run_scenario(_write(tmp_path, QUEUE_RESEND.format(flag=flag)))
    why = result.explain()
    if not broken:
        assert result.passed, why
        return
    assert not result.passed, why
    assert re.search(
        r"history check duplicates: message p1:\d+ delivered 2 times: "
        r"#\d+ consumer-0 ok deliver p1:\d+ at [\d.]+; #\d+ consumer-0 ok deliver p1:\d+",
        why,
    ), why
