"""Tests of ``runtime/_linux/`` (process trees)."""
