"""The differential fuzz of differential.py, bounded and seeded so that CI is
deterministic: the compiled fast paths and the pure-Python reference agree on random and
mutated frame streams in random chunkings. ``MSGQ_TRIO_FUZZ_COUNT`` and
``MSGQ_TRIO_FUZZ_SEED`` change the run (tests/protocol/sanitize.sh runs it under ASan).
"""

from __future__ import annotations

import os
import random

import differential
import pytest

from msgq_trio.protocol import framing

COUNT = int(os.environ.get("MSGQ_TRIO_FUZZ_COUNT", "2000"))
SEED = int(os.environ.get("MSGQ_TRIO_FUZZ_SEED", "1"))


@pytest.fixture(autouse=True)
def compiled_only(codec_build: str) -> None:
    if codec_build != "compiled":
        pytest.skip("compares both builds itself")


def test_builds_agree_on_random_and_mutated_streams() -> None:
    differential.fuzz(SEED, COUNT)


def test_a_disagreement_is_reported_with_its_case() -> None:
    """The harness sees a difference: with the compiled Frame.body made to answer
    differently for one kind of body, the fuzz fails and names the seed and case."""
    builds = differential.Builds()
    real = builds.hooks["c"]

    def wrong_body(self: framing.Frame) -> object:
        value = real[1](self)
        return b"!" + value if isinstance(value, bytes) and len(value) == 5 else value

    builds.hooks["c"] = (real[0], wrong_body, *real[2:])
    with pytest.raises(differential.Disagreement, match="compiled"):
        for k in range(200):
            differential.run_case(builds, random.Random(f"1:{k}"))
