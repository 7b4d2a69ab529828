"""The benchmarks, a package so that its modules are imported by qualified name.

Run each from the repository root as ``python -m bench.NAME`` (``python -m bench.gpu_check`` on a
GPU machine): a script run by its path puts its own folder first on ``sys.path``, where its
neighbours' names would stand in front of installed libraries' (tests/test_shadowing.py).
"""
