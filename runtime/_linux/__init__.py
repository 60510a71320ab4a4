"""_linux: see docs/design/index.md (Layout)."""
