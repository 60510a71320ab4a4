"""A "host" that launches a worker tree, writes its epoch record, then waits to be SIGKILLed.

``python tests/pi/worker_helpers/host.py RECORD WORK CONTAINMENT``: launches ``tree.sh`` as one
epoch (``CONTAINMENT`` is ``cgroup`` or ``subreaper``), waits for the tree to be ready, writes
the :class:`~runtime._records.EpochStarted` record to ``RECORD`` (JSON, renamed into place),
prints ``ready <daemon pid> <background pid>`` and sleeps until it is killed. Used by
``tests/pi/test_worker.py`` to prove that a new host can kill the old tree from the record alone.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import msgspec
import trio

from runtime._pi._worker import Containment, open_epoch, worker_environment

TREE = Path(__file__).with_name("tree.sh")


async def main(record_path: Path, work: Path, containment: Containment) -> None:
    env = worker_environment(home=work / "home", agent_dir=work / "home" / "agent", cwd=work)
    async with open_epoch(
        ["sh", str(TREE), str(work)], env=env, cwd=work, containment=containment
    ) as epoch:
        line = b""
        while not line.endswith(b"\n"):
            data = await epoch.stdout.receive_some(1)
            assert data, f"the tree ended early: {epoch.stderr_tail()!r}"
            line += data
        record = epoch.record(1, started_ms=0)
        temp = record_path.with_suffix(".tmp")
        temp.write_bytes(msgspec.json.encode(record))
        os.replace(temp, record_path)
        sys.stdout.buffer.write(line)
        sys.stdout.flush()
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, Path(sys.argv[1]), Path(sys.argv[2]), Containment(sys.argv[3]))
