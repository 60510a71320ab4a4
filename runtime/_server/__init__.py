"""_server: see docs/design/index.md (Layout)."""
