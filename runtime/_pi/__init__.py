"""_pi: see docs/design/index.md (Layout)."""
