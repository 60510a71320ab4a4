"""_tasks: see docs/design/index.md (Layout)."""
