"""The worktree progress stamp's bound (W-S1…W-S5 of ``docs/design/worktree.md``; WD1 of
``docs/design/watchdog.md``): a scan stops at its bound without listing the rest of a
directory, and what it hashes never depends on the order the file system lists names in.

The bound is made small through ``worktree_stamp``'s ``limit``; what a scan costs is counted
as the directory entries it pulled from ``os.scandir`` (a wrapper), never timed."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from runtime._tasks._worktree import STAMP_LIMIT, WorktreeStamp, worktree_stamp

LIMIT = 10


class _Listing:
    """One ``os.scandir`` iterator, counting the entries pulled from it (optionally in
    reversed order: every entry is read first then, as a file system free to list names in
    any order might)."""

    def __init__(
        self, real: Any, counter: Scandirs, reverse: bool, closed: Callable[[], object]
    ) -> None:
        self._real = real
        self._counter = counter
        self._closed = closed
        self._it: Iterator[os.DirEntry[Any]] = (
            iter(list(reversed(list(real)))) if reverse else iter(real)
        )

    def __enter__(self) -> _Listing:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._real.close()
        self._closed()

    def __iter__(self) -> _Listing:
        return self

    def __next__(self) -> os.DirEntry[Any]:
        entry = next(self._it)
        self._counter.read += 1
        return entry


class Scandirs:
    """``os.scandir`` wrapped: how many entries every scan pulled, in all."""

    def __init__(
        self,
        monkeypatch: pytest.MonkeyPatch,
        *,
        reverse: bool = False,
        closed: Callable[[Any], object] = lambda path: None,
    ) -> None:
        self.read = 0
        real = os.scandir

        def scandir(path: Any = ".") -> _Listing:
            return _Listing(real(path), self, reverse, lambda: closed(path))

        monkeypatch.setattr(os, "scandir", scandir)


def stamp(root: Path, limit: int = LIMIT) -> WorktreeStamp:
    found = worktree_stamp(root, limit=limit)
    assert found is not None
    return found


def flat(root: Path, n: int) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"f{i:04}").write_text("x")
    return root


def test_ws3_a_directory_past_the_bound_is_not_listed_to_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A directory of 1,000 entries under a bound of 10: the scan pulls at most 11 entries
    (one more than the bound, to learn it is past it), looks at none of them and says it
    was truncated. (Before, it listed and sorted all 1,000 and hashed the first 10.)"""
    root = flat(tmp_path / "tree", 1000)
    scandirs = Scandirs(monkeypatch)
    found = stamp(root)
    assert scandirs.read <= LIMIT + 1, scandirs.read
    assert (found.entries, found.truncated) == (0, True)


def test_ws3_the_bound_is_on_the_whole_scan_not_per_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Directories that fit are looked at whole; the one that does not fit in what is left
    of the bound ends the scan, after at most one entry more than the bound in all."""
    root = tmp_path / "tree"
    flat(root / "a", 4)
    flat(root / "b", 500)
    flat(root / "c", 3)
    scandirs = Scandirs(monkeypatch)
    found = stamp(root)
    # the root's a, b, c and a's 4 files are looked at; b's 500 do not fit in the 3 left,
    # so the scan reads 4 of them and ends there (c's files are never listed)
    assert scandirs.read <= LIMIT + 1, scandirs.read
    assert (found.entries, found.truncated) == (3 + 4, True)


def test_ws3_a_tree_of_exactly_the_bound_is_whole_and_one_more_is_not(tmp_path: Path) -> None:
    """The bound counts the entries looked at, ``.git`` never among them."""
    ten = flat(tmp_path / "ten", LIMIT)
    (ten / ".git").mkdir()
    assert (stamp(ten).entries, stamp(ten).truncated) == (LIMIT, False)
    eleven = stamp(flat(tmp_path / "eleven", LIMIT + 1))
    assert (eleven.entries, eleven.truncated) == (0, True)
    nested = tmp_path / "nested"
    flat(nested / "d", LIMIT - 1)  # d and its 9 files: exactly the bound
    assert (stamp(nested).entries, stamp(nested).truncated) == (LIMIT, False)
    (nested / "d" / "one-more").write_text("")
    assert (stamp(nested).entries, stamp(nested).truncated) == (1, True)  # d alone


@pytest.mark.parametrize("files", [LIMIT - 2, 1000])
def test_ws2_the_stamp_does_not_depend_on_the_listing_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: int
) -> None:
    """The same tree gives the same stamp whatever order the file system lists names in,
    within the bound (each directory sorted) and past it (nothing of the directory that did
    not fit is hashed but its own path and stat line)."""
    root = tmp_path / "tree"
    flat(root / "sub", files)
    (root / "top").write_text("y")
    as_listed = stamp(root)
    Scandirs(monkeypatch, reverse=True)
    assert stamp(root) == as_listed


def test_ws4_past_the_bound_names_made_or_removed_in_the_directory_still_change_the_stamp(
    tmp_path: Path,
) -> None:
    """What a stamp past the bound still sees: the entries looked at before the directory
    that did not fit, and a name created, removed or renamed in that directory (its own
    modification time); not a write to a file inside it."""
    root = tmp_path / "tree"
    (root / "a").mkdir(parents=True)
    (root / "a" / "early").write_text("seen")
    big = flat(root / "b", 100)
    os.utime(big, ns=(1, 1))  # never the same as a change made now, whatever the clock's grain
    before = stamp(root)
    assert before.truncated
    (big / "f0050").write_text("a write inside is not seen")
    assert stamp(root) == before
    (root / "a" / "early").write_text("looked at before the bound: seen")
    after_write = stamp(root)
    assert after_write.digest != before.digest
    changes: list[Callable[[], object]] = [
        lambda: (big / "new").write_text(""),  # created
        lambda: (big / "new").rename(big / "renamed"),  # renamed
        lambda: (big / "renamed").unlink(),  # removed
    ]
    seen = {after_write.digest}
    for change in changes:
        os.utime(big, ns=(1, 1))
        previous = stamp(root).digest
        change()
        digest = stamp(root).digest
        assert digest != previous, change
        assert digest not in seen
        seen.add(digest)


def test_ws5_an_entry_that_vanished_after_its_listing_still_counts_toward_the_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An entry removed between the listing and its look is not looked at, but its listing
    was read: the bound is on what is read, so the scan still stops at it."""
    root = flat(tmp_path / "tree", 5)  # f0000…f0004 and d: 6 listed
    flat(root / "d", 5)  # 5 more: 11 in all
    gone = root / "f0000"

    def removed(path: Any) -> None:
        if os.fsdecode(path) == str(root):
            gone.unlink(missing_ok=True)  # after the root's listing, before the looks

    scandirs = Scandirs(monkeypatch, closed=removed)
    found = stamp(root)
    assert scandirs.read <= LIMIT + 1, scandirs.read
    assert (found.entries, found.truncated) == (5, True)  # f0001…f0004 and d


def test_ws5_the_root_past_the_bound_and_an_unreadable_root(tmp_path: Path) -> None:
    root = flat(tmp_path / "tree", 50)
    os.utime(root, ns=(1, 1))
    before = stamp(root)
    assert (before.entries, before.truncated) == (0, True)
    (root / "f0049").write_text("past the bound")
    assert stamp(root) == before
    (root / "f0050").write_text("")
    assert stamp(root) != before
    assert worktree_stamp(tmp_path / "gone") is None


def test_the_production_bound_is_still_twenty_thousand() -> None:
    assert STAMP_LIMIT == 20_000
