from tests.server.conftest import tiny_llm, tiny_path  # noqa: F401 - the server tests' tiny checkpoint and engine
