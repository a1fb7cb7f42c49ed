pytest_plugins = ["shared.testing.fixtures"]
