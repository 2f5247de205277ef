"""Shared fixtures: tiny seeded HF models (tests/tiny_models.py) and a real Redis (tests/redis_server.py)."""

pytest_plugins = ["tests.tiny_models", "tests.redis_server"]
