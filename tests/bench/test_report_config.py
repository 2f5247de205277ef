"""The bench JSON is shared and committed: its ``config`` never carries a Redis password
(issue 25), while the rest of the config is kept as given."""

from __future__ import annotations

import json

from pagedq.bench.options import BenchConfig
from pagedq.bench.report import config_record


def test_the_redis_password_is_masked_in_the_bench_json_config():
    config = BenchConfig(redis_url="rediss://bench:s3cr3t-pw@redis.example:6380/2",
                         queue="q-bench")
    record = config_record(config)
    assert record["redis_url"] == "rediss://bench:***@redis.example:6380/2"
    assert "s3cr3t-pw" not in json.dumps(record)
    assert record["queue"] == "q-bench"
    assert {k: v for k, v in record.items() if k != "redis_url"} == {
        k: v for k, v in json.loads(json.dumps(config.to_dict())).items() if k != "redis_url"}


def test_a_url_without_a_password_or_no_url_is_kept():
    assert config_record(BenchConfig(redis_url="redis://localhost:6379/0"))["redis_url"] == \
        "redis://localhost:6379/0"
    assert config_record(BenchConfig())["redis_url"] is None
