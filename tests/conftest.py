"""Test session set-up: a private redis-server, real worker processes, object stores."""

pytest_plugins = ["tests.plugins.cluster", "tests.plugins.object_stores", "tests.plugins.users"]
