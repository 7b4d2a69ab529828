"""The repository's tools, a package so that its modules are imported by qualified name.

Run each from the repository root as ``python -m tools.NAME``; the Makefile does.
"""
