"""Tests of ``runtime/_pi/`` (talking to Pi)."""
