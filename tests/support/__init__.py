"""Helpers shared by the test suites (importable as ``support``)."""
