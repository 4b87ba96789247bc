"""A slow S3 never makes a request slower than recomputing, from its first request on.

A real ``vllm serve`` (route 1, cpu + s3, ``promotion:`` with S3 unseeded) over a moto
server behind a loopback proxy that holds every S3 answer 4 s (tests/e2e/slow_tier.py).
Without the wait bound the first stored prompt waited a whole S3 read (over 4 s) for its
first token; with it, a request gives its promotions up once recomputing its prefix would
have finished (here 0.128 s, below its 0.25 s deadline), and the slow job in flight keeps
the next requests from promoting at all.

The bound checked: no stored prompt's time to first token exceeds the slowest fresh
prompt's (recomputing, measured in the same run between the stored ones) by more than the
deadline plus :data:`SLACK_S`, a margin for a loaded 2-core machine, far below one S3
answer; and the texts are the first server's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.slow_tier import DEADLINE_S, run

#: Seconds every S3 answer is held.
DELAY_S = 4.0
#: Stored prompts (each sent after a fresh one).
PROMPTS = 6
#: Margin for scheduling noise on a loaded machine, seconds.
SLACK_S = 1.5

pytestmark = pytest.mark.timeout(600)


def test_a_slow_s3_costs_no_request_more_than_recomputing(
    model_dir: Path, tmp_path: Path, s3_bucket: tuple[str, str]
) -> None:
    endpoint, bucket = s3_bucket
    measured = run(model_dir, tmp_path, endpoint, bucket, delay_s=DELAY_S, prompts=PROMPTS,
                   prefix="slow-tier")
    print(measured.summary())
    assert measured.second_texts == measured.first_texts
    assert len(set(measured.first_texts)) == PROMPTS, "prompts should give distinct outputs"
    bound = max(measured.ttft_fresh_s) + DEADLINE_S + SLACK_S
    assert max(measured.ttft_stored_s) <= bound, (
        f"times to first token {measured.ttft_stored_s} (recomputing: "
        f"{measured.ttft_fresh_s}) exceed {bound:.2f} s")
    # The slow path was taken: the first stored prompt promoted from the unseeded tier,
    # waited its bound and gave up.
    stats = measured.kvtiers
    assert stats.get("kvtiers_stack_promotion_waits_abandoned_total", 0) >= 1, stats
