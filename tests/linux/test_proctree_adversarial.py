"""An adversary's tests of tree membership and the kill (docs/design/workers.md W3, W5).

Real processes; every wait bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import os
import signal
from typing import Final

import trio
import trio.lowlevel

from runtime._linux._proc import current_identity, identity_of, is_alive
from runtime._linux._proctree import (
    TreeProof,
    find_members,
    kill_tree,
    new_nonce,
    proc_table,
    trio_managed,
)

LIMIT: Final = 20.0


async def test_w5_a_root_that_is_the_runtime_itself_brings_none_of_its_children_in() -> None:
    """W5: the runtime itself, its ancestors and PID 1 are never signalled — nor, through
    them, anything else: a record whose identity is the runtime's own (or an ancestor's)
    makes none of the runtime's other children (another epoch's worker, a process Trio
    waits for) a member by descent. Before, the descent from such a root took in every
    child of the runtime, and the kill signalled them."""
    bystander = await trio.lowlevel.open_process(["sleep", "300"])
    with trio_managed(bystander.pid), trio.fail_after(LIMIT):
        try:
            me = current_identity()
            parent = identity_of(os.getppid())
            assert parent is not None
            for root in (me, parent):
                proof = TreeProof(nonce=new_nonce(), roots=(root,))
                scan = find_members(proof, proc_table())
                assert bystander.pid not in scan.members
                report = await kill_tree(proof, give_up_after=2)
                assert report.killed == ()
                assert report.clean
            bystander_identity = identity_of(bystander.pid)
            assert bystander_identity is not None
            assert is_alive(bystander_identity)
        finally:
            bystander.send_signal(signal.SIGKILL)
            await bystander.wait()
