"""_journal: see docs/design/index.md (Layout)."""
