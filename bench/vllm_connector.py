"""Time to first token in vLLM for prompts sharing a long prefix: with kvtier's connector
(the prefix's KV loaded from kvtier's host tier, or from its disk tier in a fresh vLLM
instance) against vLLM without it (the prefix recomputed), in the same run.

    python bench/vllm_connector.py                      # 4096-token prefixes, 3 of them
    python bench/vllm_connector.py --prefix 2048 --layers 8 --hidden 512 --json

Needs vLLM (pip install 'kvtier[vllm]'). Runs on the CPU with a random-weight Llama-like
checkpoint written to a temporary directory (tests/vllm_models.py), each engine in its own
process (tests/vllm_run.py), vLLM's own prefix cache off so that only the connector can
supply a prefix. Each prompt is a prefix plus a fresh 64-token tail; TTFT is the wall time
of a 1-token generate() (prefill + one decode step), median over the prefixes.

    vLLM alone            the whole prompt is prefilled (what a new instance does today)
    kvtier miss           the same, plus the connector's lookup and save (its overhead)
    kvtier host hit       same instance, another tail: the prefix comes from host memory
    kvtier disk hit       a new instance on the same disk tier: the prefix comes from disk
    vLLM prefix cache     reference: vLLM's own in-memory prefix cache (same instance)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def engine(tmp: Path, job: dict) -> dict:
    path = tmp / f"job-{os.urandom(4).hex()}.json"
    path.write_text(json.dumps(job))
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(REPO / "tests" / "vllm_run.py"), str(path)], capture_output=True,
                       text=True, env=env)
    lines = [l for l in p.stdout.splitlines() if l.startswith("{")]
    if p.returncode != 0 or not lines:
        sys.exit(f"vLLM engine failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=4096, help="shared prefix tokens (default 4096)")
    ap.add_argument("--prefixes", type=int, default=3, help="how many different prefixes (default 3)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--disk", default=None, help="directory for the disk tier (default: a temporary one)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    import importlib.util
    if importlib.util.find_spec("vllm") is None:
        venv = REPO / ".venv" / "vllm" / "bin" / "python"
        hint = f"run it with {venv.relative_to(REPO)}" if venv.exists() else "pip install 'kvtier[vllm]' (in a venv of its own)"
        sys.exit(f"kvtier: error: this benchmark needs vLLM, which {sys.executable} lacks: {hint}")

    from vllm_models import prompt_ids, write_model

    tail = 64
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as td:
        tmp = Path(td)
        max_len = args.prefix + 2 * tail
        model = write_model(tmp / "model", "llama", layers=args.layers, hidden=args.hidden, heads=args.heads,
                            kv_heads=args.kv_heads, max_len=max_len + 64)
        kv_token = args.layers * 2 * args.kv_heads * (args.hidden // args.heads) * 4      # fp32 K and V
        prefix_bytes = kv_token * args.prefix
        prefixes = [prompt_ids(args.prefix, 1000 + i) for i in range(args.prefixes)]
        tails = [[prompt_ids(tail, 2000 + 10 * i + j, prefix=p) for j in range(3)] for i, p in enumerate(prefixes)]
        disk = Path(args.disk) if args.disk else tmp / "disk"
        conn = {"host_capacity": max(256 << 20, 2 * prefix_bytes * args.prefixes),
                "disk_path": str(disk), "disk_capacity": max(512 << 20, 2 * prefix_bytes * args.prefixes)}
        base = {"model": str(model), "ttft": True, "max_model_len": max_len + 64,
                "kv_cache_bytes": max(256 << 20, 4 * kv_token * max_len), "warmup": prompt_ids(300, 7)}

        # 1. vLLM alone, prefix cache off: every prompt prefilled in full.
        alone = engine(tmp, {**base, "prompts": [t[0] for t in tails], "prefix_caching": False})
        # 2. vLLM's own prefix cache (reference): second prompt of each prefix.
        own = engine(tmp, {**base, "prompts": [x for t in tails for x in t[:2]], "prefix_caching": True})
        # 3. kvtier: a miss (computed, saved), then a host-tier hit with another tail.
        kv1 = engine(tmp, {**base, "prompts": [x for t in tails for x in t[:2]], "prefix_caching": False,
                           "connector": conn})
        # 4. kvtier in a new instance on the same disk tier: the host tier starts empty.
        kv2 = engine(tmp, {**base, "prompts": [t[2] for t in tails], "prefix_caching": False, "connector": conn})

    def med(outs: list[dict]) -> float:
        return statistics.median(o["ttft"] for o in outs)

    rows = {
        "vllm_alone": (med(alone["outputs"]), alone["outputs"]),
        "kvtier_miss": (med(kv1["outputs"][0::2]), kv1["outputs"][0::2]),
        "kvtier_host_hit": (med(kv1["outputs"][1::2]), kv1["outputs"][1::2]),
        "kvtier_disk_hit": (med(kv2["outputs"]), kv2["outputs"]),
        "vllm_prefix_cache": (med(own["outputs"][1::2]), own["outputs"][1::2]),
    }
    ref = rows["vllm_alone"][0]
    same = all(a["tokens"] == b["tokens"] for a, b in zip(alone["outputs"], kv1["outputs"][0::2]))
    result = {
        "prefix_tokens": args.prefix, "prompt_tokens": args.prefix + tail, "prefixes": args.prefixes,
        "model": f"llama-like {args.layers}L hidden {args.hidden} {args.heads}h/{args.kv_heads}kv fp32, CPU",
        "prefix_kv_bytes": prefix_bytes,
        "ttft_s": {k: round(v[0], 4) for k, v in rows.items()},
        "speedup_vs_vllm_alone": {k: round(ref / v[0], 2) for k, v in rows.items()},
        "cached_tokens": {k: [o["cached"] for o in v[1]] for k, v in rows.items()},
        "miss_outputs_equal_vllm_alone": same,
        "kvtier_counters": {"first_instance": kv1.get("kvtier"), "second_instance": kv2.get("kvtier")},
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"TTFT, {result['model']}, {args.prefixes} prefixes of {args.prefix} tokens "
          f"({prefix_bytes / 2**20:.0f} MiB of KV each) + {tail}-token tails; median of {args.prefixes}")
    print(f"{'':22s} {'TTFT':>9s} {'vs vLLM alone':>14s}  cached tokens")
    for k, (v, outs) in rows.items():
        print(f"{k:22s} {v * 1e3:7.1f}ms {ref / v:13.2f}x  {[o['cached'] for o in outs]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
