"""_boundary: see docs/design/index.md (Layout)."""
