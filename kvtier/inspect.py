"""`kvtier inspect PATH`: what a disk tier directory holds, without opening a store."""
from __future__ import annotations

import argparse

HELP = "show what a disk tier directory holds (blocks, bytes, layout, namespace, age)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="the disk tier's directory")
    p.add_argument("--verify", action="store_true", help="read every block and check its checksum")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    import json
    import os
    import time

    import xxhash

    from kvtier.layout import KVLayout
    from kvtier.tiers.disk import read_directory
    from kvtier.units import format_bytes

    meta, records = read_directory(args.path)
    layout = KVLayout.from_dict(meta["layout"]) if "layout" in meta else None
    slab = os.path.join(args.path, "slab.bin")
    size = os.path.getsize(slab) if os.path.exists(slab) else 0
    now = time.time()
    last = [v[3] for _, v in records]
    report = {
        "path": os.path.abspath(args.path), "format": meta.get("format"),
        "layout": layout.describe() if layout else None, "namespace": meta.get("namespace"),
        "hash": meta.get("hash"), "block_bytes": meta.get("block_bytes"), "slot_bytes": meta.get("slot_bytes"),
        "capacity_blocks": meta.get("capacity_blocks"), "blocks": len(records),
        "bytes": len(records) * meta.get("block_bytes", 0), "slab_bytes": size,
        "created_age_s": round(now - meta["created"], 1) if "created" in meta else None,
        "newest_access_age_s": round(now - max(last), 1) if last else None,
        "oldest_access_age_s": round(now - min(last), 1) if last else None,
    }
    if args.verify:
        bad = 0
        sb, bb = meta["slot_bytes"], meta["block_bytes"]
        with open(slab, "rb") as f:
            for _, (slot, checksum, _c, _a) in records:
                f.seek(slot * sb)
                data = f.read(bb)
                bad += len(data) != bb or xxhash.xxh3_64_intdigest(data) != checksum
        report["corrupt_blocks"] = bad
    if args.json:
        print(json.dumps(report))
        return 0
    ns = report["namespace"] or {}
    print(f"disk tier {report['path']}")
    print(f"  layout     {report['layout']}")
    print(f"  namespace  model={ns.get('model')!r} revision={ns.get('revision')!r} shard={ns.get('shard')!r} "
          f"hash={report['hash']}")
    print(f"  blocks     {report['blocks']} of {report['capacity_blocks']} "
          f"({format_bytes(report['bytes'])} of {format_bytes(report['capacity_blocks'] * report['block_bytes'])})")
    if last:
        print(f"  accessed   newest {report['newest_access_age_s']} s ago, oldest {report['oldest_access_age_s']} s ago")
    if args.verify:
        print(f"  verified   {len(records) - report['corrupt_blocks']} good, {report['corrupt_blocks']} corrupt")
    return 0
