"""Fake-Pi: a credential-free stand-in for the Pi coding agent (arrives with issue #3)."""
