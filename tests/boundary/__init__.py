"""Tests of ``runtime/_boundary/`` (the worker boundaries)."""
