"""Code the tests share that is not a test or a fixture (imported as ``tests.support``; pytest puts the repository
root on ``sys.path``, ``pythonpath`` in pyproject.toml)."""
