"""Helpers of the fault-injection suite (tests/test_faults.py)."""
