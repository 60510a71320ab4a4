"""Tests of ``runtime/_journal/`` (the durable store)."""
