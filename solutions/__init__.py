"""Reference solutions to the exercises, one module per chapter (tests/test_exercises.py)."""
