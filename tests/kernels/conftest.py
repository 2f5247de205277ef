"""The kernel tests share the session's ``cpu_ops`` fixture (tests/conftest.py)."""
