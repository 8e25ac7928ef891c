"""Test doubles and contract suites for people testing their own agents with touba."""
