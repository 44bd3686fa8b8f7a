"""`kvtier inspect PATH`: what a disk tier directory holds, without opening a store.

Exit 0 with the report; 2 when PATH is not a disk tier directory; 1 when the index cannot
be read (damaged) or, with --verify, when any block fails its checksum (the report is
still printed, and one line on stderr says how many).
"""
from __future__ import annotations

import argparse
import errno
import os
import time
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, KvtierError

HELP = "show what a disk tier directory holds (blocks, bytes, layout, namespace, age)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the disk tier's directory (the one holding index.lmdb and slab.bin)")
    p.add_argument("--verify", action="store_true",
                   help="also read every block and check its checksum (reads the whole slab); "
                        "exit 1 if any block is corrupt")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def read_index(path: str) -> tuple[dict[str, Any], list[tuple[bytes, list]]]:
    """kvtier.tiers.disk_dir.read_directory with every failure as one clear error: ConfigError
    (exit 2) when `path` is not a disk tier directory, KvtierError (exit 1) when its index
    is damaged, saying what a store does with it and what to do."""
    import lmdb

    from kvtier.tiers.disk_dir import read_directory
    from kvtier.tiers.disk_dir import salvageable
    from kvtier.tiers.lmdb_check import shortfall

    if not os.path.exists(path):
        raise ConfigError(f"{path} does not exist: give the directory of a disk tier (the path given to "
                          "DiskTier or --disk)")
    if not os.path.isdir(path):
        raise ConfigError(f"{path} is a file, not a disk tier directory: give the directory that holds "
                          "index.lmdb and slab.bin")
    index = os.path.join(path, "index.lmdb")
    if not os.path.exists(index):
        _refer_to_subfolders(path)
    try:
        return read_directory(path)
    except ConfigError:
        raise                 # not a disk tier directory: read_directory says so
    except lmdb.Error as e:
        data = os.path.join(index, "data.mdb")
        if os.path.isdir(index) and not os.path.exists(data):
            raise KvtierError(f"the disk tier index {index} holds no data.mdb (removed?): without it the blocks "
                              f"in {path}/slab.bin cannot be found; a store opened on {path} starts the tier "
                              "empty") from None
        if os.path.isfile(data) and os.path.getsize(data) == 0:       # (LMDB says "Bad file descriptor")
            raise KvtierError(f"the disk tier index {index} is empty (data.mdb is 0 bytes: cut?): without its "
                              f"records the blocks in {path}/slab.bin cannot be found; opening a store on {path} "
                              "moves it aside (index.lmdb.damaged-TIME) and starts the tier empty") from None
        short = shortfall(Path(index))
        cut = f"; data.mdb is {short[0]} bytes, its newest transaction uses {short[1]}: cut short" if short else ""
        what = f"the disk tier index {index} is damaged ({e}{cut})"
        kept = salvageable(Path(index)) if short is None else None   # (a short one: rebuilt once extended)
        if kept is not None:
            raise KvtierError(f"{what}: opening a store on {path} rebuilds it from the "
                              f"{len(kept[0].get(b'blocks', []))} records still readable and moves the "
                              "damaged one aside (index.lmdb.damaged-TIME)") from None
        if _store_recovers(index):
            raise KvtierError(f"{what}: opening a store on {path} moves it aside (index.lmdb.damaged-TIME) "
                              "and starts the tier empty") from None
        raise KvtierError(f"{what}, so a store cannot open it either: move it aside "
                          f"(mv {index} {index}.damaged) and the next store opened on {path} starts "
                          "the tier empty") from None
    except ValueError as e:   # msgpack: a record that is not what kvtier wrote
        raise KvtierError(f"the disk tier index {index} holds a damaged record ({type(e).__name__}: {e}); "
                          f"if a store refuses to open {path} too, move the index aside "
                          f"(mv {index} {index}.damaged) and the tier starts empty") from None


def _refer_to_subfolders(path: str) -> None:
    """A ConfigError naming the disk tiers in `path`'s subfolders, if any: `kvtier serve --disk`
    and the vLLM connector make one per namespace (model, revision, layout, rank) under the
    folder the user gave, and inspecting that folder said only "no index.lmdb there"."""
    try:
        tiers = sorted(e.name for e in os.scandir(path)
                       if e.is_dir() and os.path.isdir(os.path.join(e.path, "index.lmdb")))
    except OSError:
        return
    if tiers:
        more = f" (and {', '.join(tiers[1:4])}{' ...' if len(tiers) > 4 else ''})" if len(tiers) > 1 else ""
        raise ConfigError(f"{path} holds no disk tier itself, but {len(tiers)} in its subfolders, one per "
                          f"model and layout: kvtier inspect {os.path.join(path, tiers[0])}{more}")


def _store_recovers(index: str) -> bool:
    """Whether a store opening this index would set it aside by itself: DiskTier does so
    when opening the LMDB environment fails with one of the errors it counts as damage, and
    when the environment opens but a page it reads is damaged; not when the environment
    cannot be opened for another reason (then the store's open fails too)."""
    import lmdb

    from kvtier.tiers.disk import _CORRUPT
    from kvtier.tiers.lmdb_check import shortfall

    if shortfall(Path(index)) is not None:       # a store rewrites a short index: damage fails that
        return True
    try:
        env = lmdb.open(index, readonly=True, lock=False, max_dbs=4, subdir=True)
    except _CORRUPT:
        return True
    except lmdb.Error:
        return False
    env.close()
    return True


def _valid(record: Any) -> bool:
    return (isinstance(record, (list, tuple)) and len(record) == 4 and all(isinstance(v, int) for v in record[:2])
            and all(isinstance(v, (int, float)) for v in record[2:]))


def verify(path: str, meta: dict[str, Any], records: list[tuple[bytes, list]], show: bool) -> int:
    """How many of `records` fail their checksum (or lie past the slab's end), reading the
    slab in slot order, with a progress bar when `show` and on a terminal."""
    from kvtier.checksum import block_checksum

    from kvtier.progress import progress
    from kvtier.units import format_bytes

    slab = os.path.join(path, "slab.bin")
    sb, bb = meta["slot_bytes"], meta["block_bytes"]
    if not os.path.exists(slab):
        return len(records)           # no bytes at all: a store reads every block as a miss
    try:
        if not os.path.isfile(slab):     # before opening: a FIFO's open would wait for a writer
            raise IsADirectoryError(errno.EISDIR, "not a regular file")
        fd = os.open(slab, os.O_RDONLY)
    except OSError as e:
        raise KvtierError(f"cannot read the slab file {slab}: {e.strerror}; a store cannot open this tier "
                          "either: move the directory aside") from None

    def good(rec: list) -> bool:
        data = os.pread(fd, bb, rec[0] * sb)
        return len(data) == bb and block_checksum(data) == rec[1]

    bad: list[tuple[bytes, list]] = []
    try:
        with progress(f"verifying {len(records)} blocks ({format_bytes(len(records) * bb)})", len(records),
                      enabled=show) as bar:
            for key, rec in sorted(records, key=lambda kr: kr[1][0]):   # slot order
                if not good(rec):
                    bad.append((key, rec))
                bar.advance()
        # A store writing the tier meanwhile reuses slots: its new bytes land before the old
        # block's record goes. A failure counts only if the block's record, read again after
        # a pause, still names the same bytes and they still fail (a live engine's evictions
        # were reported as corruption).
        for _ in range(RECHECKS):
            if not bad:
                break
            time.sleep(RECHECK_PAUSE_S)
            try:
                current = dict(read_index(path)[1])
            except KvtierError:           # the live store is renaming its index (compaction): next round
                continue
            bad = [(k, current[k]) for k, _ in bad if k in current and _valid(current[k]) and not good(current[k])]
    finally:
        os.close(fd)
    return len(bad)


RECHECKS = 3              # times a failed block's record is read again (inspect --verify on a live tier)
RECHECK_PAUSE_S = 0.2


def run(args: argparse.Namespace) -> int:
    import json
    import sys

    from kvtier.layout import KVLayout
    from kvtier.progress import progress

    # A spinner while the index is read: 2M records (a 2 TiB tier of 1 MiB blocks) take
    # about 10 s, which looked like a hang.
    with progress(f"reading the index of {args.path}", enabled=not args.json):
        meta, raw_records = read_index(args.path)
    for field in ("block_bytes", "slot_bytes", "capacity_blocks"):
        if not isinstance(meta.get(field), int):
            raise KvtierError(f"the index in {args.path} has no {field} in its meta record: it was written by "
                              "another kvtier version or is damaged")
    records = [(k, v) for k, v in raw_records if _valid(v)]
    damaged = len(raw_records) - len(records)
    layout = KVLayout.from_dict(meta["layout"]) if "layout" in meta else None
    slab = os.path.join(args.path, "slab.bin")
    size = os.path.getsize(slab) if os.path.exists(slab) else 0
    now = time.time()
    last = [v[3] for _, v in records]
    report = {
        "path": os.path.abspath(args.path), "format": meta.get("format"),
        "layout": layout.describe() if layout else None, "namespace": meta.get("namespace"),
        "hash": meta.get("hash"), "block_bytes": meta["block_bytes"], "slot_bytes": meta["slot_bytes"],
        "capacity_blocks": meta["capacity_blocks"], "blocks": len(records),
        "bytes": len(records) * meta["block_bytes"], "slab_bytes": size, "damaged_records": damaged,
        "created_age_s": round(now - meta["created"], 1) if "created" in meta else None,
        "newest_access_age_s": round(now - max(last), 1) if last else None,
        "oldest_access_age_s": round(now - min(last), 1) if last else None,
    }
    if args.verify:
        report["corrupt_blocks"] = verify(args.path, meta, records, show=not args.json)
    if args.json:
        print(json.dumps(report), flush=True)
    else:
        _print(report, bool(last))
    corrupt = report.get("corrupt_blocks", 0)
    if corrupt:
        why = " (its slab.bin is missing)" if not os.path.exists(slab) else ""
        print(f"kvtier: error: {corrupt} of {len(records)} blocks in {args.path} failed verification{why}: a store "
              "reads each as a miss (never as wrong KV) and the engine recomputes it", file=sys.stderr)
        return 1
    return 0


def _print(report: dict[str, Any], accessed: bool) -> None:
    from kvtier.units import format_bytes

    ns = report["namespace"] or {}
    print(f"disk tier {report['path']}")
    print(f"  layout     {report['layout']}")
    print(f"  namespace  model={ns.get('model')!r} revision={ns.get('revision')!r} shard={ns.get('shard')!r} "
          f"hash={report['hash']}")
    print(f"  blocks     {report['blocks']} of {report['capacity_blocks']} "
          f"({format_bytes(report['bytes'])} of {format_bytes(report['capacity_blocks'] * report['block_bytes'])})")
    if report["damaged_records"]:
        print(f"  damaged    {report['damaged_records']} records (a store drops them when it opens the tier)")
    if report["blocks"] and not report["slab_bytes"]:
        print("  slab       slab.bin is missing or empty: none of these blocks can be read (a store opened "
              "on the directory drops their records)")
    if accessed:
        print(f"  accessed   newest {report['newest_access_age_s']} s ago, oldest {report['oldest_access_age_s']} s ago")
    if "corrupt_blocks" in report:
        print(f"  verified   {report['blocks'] - report['corrupt_blocks']} good, {report['corrupt_blocks']} corrupt")
