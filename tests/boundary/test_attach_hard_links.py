"""``attach`` and hard links (attachments.md A5): a file with more than one name may be reached
by a name outside the working directory — a hard link crosses no directory boundary the path
rules could see — so it is refused ``attachment_outside_workdir``, and nothing is stored."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from runtime._errors import ReasonCode

from .test_attach import PNG, attach, text, tool


async def test_a5_a_file_with_another_name_is_refused_and_nothing_is_stored(
    tmp_path: Path,
) -> None:
    """A5: ``secret.png`` lies outside the working directory; the agent's shell makes a hard
    link to it inside (same user, same file system) and attaches that. Refused
    ``attachment_outside_workdir`` — today its bytes are stored and attached. Two hard links
    both inside are refused the same way (which names a file has elsewhere cannot be told);
    the last name left, after the other is removed, attaches."""
    work = tmp_path / "work"
    work.mkdir()
    root = tmp_path / "state" / "attachments"
    secret = tmp_path / "secret.png"
    secret.write_bytes(PNG)
    os.link(secret, work / "innocent.png")
    (work / "a.png").write_bytes(PNG + b"a")
    os.link(work / "a.png", work / "b.png")
    t = tool(root, work)
    with trio.fail_after(10):
        outside = await attach(t, "innocent.png")
        inside = await attach(t, "b.png")
        assert outside.is_error
        assert inside.is_error
        assert f"({ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR})" in text(outside)
        assert f"({ReasonCode.ATTACHMENT_OUTSIDE_WORKDIR})" in text(inside)
        assert outside.attachments == inside.attachments == ()
        assert not root.exists() or os.listdir(root) == []
        (work / "a.png").unlink()
        alone = await attach(t, "b.png")
    assert not alone.is_error
    assert [a.size for a in alone.attachments] == [len(PNG) + 1]
