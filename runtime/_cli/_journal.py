"""``journal verify`` and ``journal show``: read-only checks of a state directory's logs."""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import trio

from .._clock import Clocks
from .._config import load_config
from .._journal._inspect import (
    delivery_records,
    delivery_records_in_database,
    verify_database,
    verify_journal,
)
from .._journal._store import require_journal
from .._retention import offline_settings
from .._rooms._retention import compact_journals
from .._tasks._retention import retain_offline
from ._base import (
    EXIT_FAILED,
    EXIT_OK,
    JSON,
    Commands,
    logger,
    offline_target,
    state_dir_option,
    store_option,
)


def register(commands: Commands) -> None:
    journal = commands.group("journal", "check or show the durable journal", "Inspect the journal.")
    verify = journal.add(
        "verify",
        "check every log's frames and checksums",
        "Read every log of the state directory (admissions, results, deliveries, lanes) and "
        "check its frames, checksums, sequence and records. Prints each problem; exit "
        "status 1 if there is any. Read-only; safe while a server runs.",
        _journal_verify,
    )
    state_dir_option(verify)
    store_option(verify, STORE_HELP)
    verify.add_argument(
        "--config",
        type=Path,
        help="the TOML configuration file: its [attachments] root is checked (default: the "
        "state directory's attachments/)",
    )
    compact = journal.add(
        "compact",
        "remove what retention lets go, and compact the shared logs",
        "Remove the step journal of every delivery whose result was acknowledged and "
        "published more than [retention] journal_days ago, keep only an idempotency record "
        "of each, expire those older than [retention] idempotency_days, and rewrite the "
        "admission and result logs with what is left (docs/design/retention.md), as serve "
        "does every [retention] sweep_hours and compact_hours. Refused while a server holds "
        "the state directory (state_dir_locked). File store only.",
        _journal_compact,
    )
    state_dir_option(compact, with_config=True)
    compact.add_argument(
        "--config",
        type=Path,
        help="the configuration the server runs with (its state_dir, [retention] and "
        "work_root; default: the settings the server recorded in the state directory, "
        "retention.json; refused retention_mismatch when they differ)",
    )
    show = journal.add(
        "show",
        "print one delivery's records",
        "Print a delivery's journal records in order, one JSON object per line.",
        _journal_show,
    )
    show.add_argument("delivery_id", metavar="DELIVERY_ID", help="the client's delivery id")
    state_dir_option(show)
    store_option(show, STORE_HELP)


STORE_HELP = (
    "read the journal of this PostgreSQL database (several hosts' deployment; no password in "
    "it: PGPASSWORD, ~/.pgpass or a service file) instead of --state-dir"
)


def _journal_verify(args: argparse.Namespace) -> int:
    if args.store:
        checked, findings = trio.run(verify_database, args.store)
    else:
        root = load_config(args.config).attachment_root() if args.config else None
        checked, findings = verify_journal(args.state_dir, root)
    for finding in findings:
        code = f"{finding.code}: " if finding.code else ""
        kind = "problem" if finding.problem else "note"
        print(f"{kind}: {finding.rel}: {code}{finding.message}")
    problems = sum(f.problem for f in findings)
    print(f"checked {checked} logs: {problems} problem{'s' if problems != 1 else ''}")
    return EXIT_FAILED if problems else EXIT_OK


def _journal_compact(args: argparse.Namespace) -> int:
    state_dir, given = offline_target(args.state_dir, args.config)
    settings = offline_settings(state_dir, given)  # RT14
    retention = settings.retention
    removed, plan = trio.run(
        functools.partial(compact_journals, state_dir, settings=settings, clocks=Clocks.system())
    )
    tasks = trio.run(
        functools.partial(retain_offline, state_dir, settings=settings, clocks=Clocks.system())
    )
    days = retention.journal_days
    print(f"removed {removed} step journal{'s' if removed != 1 else ''} older than {days:g} days")
    print(
        f"slimmed {len(tasks.slimmed)} ended task{'s' if len(tasks.slimmed) != 1 else ''} to "
        f"their idempotency record; expired {len(tasks.expired)} older than "
        f"{retention.idempotency_days:g} days (a resubmission of one is task_expired)"
    )
    for task_id, why in tasks.left:
        print(f"left task {task_id} as it is (the next pass tries again): {why}")
    settled, expired = len(plan.settled), len(plan.expired)
    print(
        f"kept {settled} idempotency record{'s' if settled != 1 else ''} in place of admissions; "
        f"expired {expired} deliver{'ies' if expired != 1 else 'y'} older than "
        f"{retention.idempotency_days:g} days (a duplicate of one is delivery_expired)"
    )
    for room, why in plan.left:  # RT18
        print(f"left room {room} as it is (the next pass tries again): {why}")
    return EXIT_OK


def _journal_show(args: argparse.Namespace) -> int:
    if args.store:
        records, note = trio.run(delivery_records_in_database, args.store, args.delivery_id)
    else:
        require_journal(args.state_dir)  # a typo or a file is state_dir_invalid
        records, note = delivery_records(args.state_dir, args.delivery_id)
    if note is not None:
        logger.info("%s", note)
    for record in records:
        print(JSON.encode(record).decode())
    return EXIT_OK
