"""Tests of ``runtime/_rooms/`` (room lanes)."""
