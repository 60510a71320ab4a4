"""Fake-Pi's launch settings: config values resolved the way Pi resolves them."""

from __future__ import annotations

import pytest

from fake_pi._app import _resolve_config_value, session_file_name


def test_api_key_names_an_environment_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pi's ``$NAME`` / ``${NAME}`` config values read the environment (so no key on disk)."""
    monkeypatch.setenv("FAKE_PI_TEST_KEY", "sk-from-env")
    assert _resolve_config_value("$FAKE_PI_TEST_KEY") == "sk-from-env"
    assert _resolve_config_value("${FAKE_PI_TEST_KEY}") == "sk-from-env"
    assert _resolve_config_value("literal-key") == "literal-key"
    assert _resolve_config_value("$FAKE_PI_TEST_MISSING") is None
    assert _resolve_config_value(None) is None


def test_session_file_name_is_pis() -> None:
    """pi-observed.md §5: ``<ISO time with : and . as ->_<session id>.jsonl``."""
    name = session_file_name("01a228a6-4d63-774d-9fad-6c7d005d3481", 1795978317155)
    assert name == "2026-11-29T18-51-57-155Z_01a228a6-4d63-774d-9fad-6c7d005d3481.jsonl"
