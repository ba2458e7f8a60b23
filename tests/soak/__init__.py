"""Fault soak of a whole run: python -m tests.soak (see tests/soak/soak.py)."""
