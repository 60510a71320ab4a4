"""Tests of ``runtime/_cli/`` (the command line)."""
