"""_rooms: see docs/design/index.md (Layout)."""
