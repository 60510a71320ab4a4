"""Tests of ``runtime/_tasks/`` (task lanes)."""
