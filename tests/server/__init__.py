"""Tests of ``runtime/_server/`` (the server and the wire protocol)."""
