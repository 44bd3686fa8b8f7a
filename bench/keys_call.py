"""The router's per-request `POST /kvtier/keys` against the request's TTFT, on one worker.

For each prompt size, an agentic chat (a system prompt, then user, assistant and tool
messages up to the size) is sent to one `kvtier serve --model kimi-tiny` worker as the
router sends it: first `POST /kvtier/keys` with the body (the router waits for it before
routing), then the streamed request itself (max_tokens 1), whose TTFT is timed; a
`GET /kvtier/load` before each gives the bare HTTP round trip for scale. Each round
appends a new user message to the history, so the request's TTFT is a follow-up turn's (the
history cached, the new message computed): the common agentic case and the shortest TTFT
the keys call is added to. A few rounds with a new system prompt give the uncached TTFT.

    python bench/keys_call.py [--tokens 2000 4000 8000] [--rounds 20] [--json]

kimi-tiny's tokenizer is bytes (1 token per byte): a BPE tokenizer (Kimi K2's tiktoken)
costs the worker more per call than measured here.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx
import orjson

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))       # this checkout's kvtier (its workers run it too: KvtierProcess)
from kvtier.bench.children import Children  # noqa: E402
from kvtier.bench.serve import KvtierProcess  # noqa: E402
from kvtier.errors import KvtierError  # noqa: E402

SYSTEM = ("You are a coding agent. Read the repository, call the tools you need, and answer the user's "
          "question with a short plan, the files to change and the tests to run. ") * 8
TOOL = ("def handler(request):\n    body = request.json()\n    if not body.get('id'):\n        raise ValueError('no id')\n"
        "    return store.get(body['id'])\n")


def conversation(tokens: int, nonce: str) -> list[dict]:
    """An agentic chat of at most about `tokens` bytes (kimi-tiny: tokens): tool results and replies."""
    msgs = [{"role": "system", "content": nonce + SYSTEM}, {"role": "user", "content": "Fix the failing test."}]
    for i in range(tokens):
        turn = [{"role": "assistant", "content": f"Step {i}: reading handlers/{i}.py"},
                {"role": "user", "content": f"[tool output {i}]\n" + TOOL * 3}]
        if sum(len(m["content"]) + 16 for m in msgs + turn) > tokens:     # ~16 template bytes per message
            return msgs
        msgs += turn
    return msgs


def serve(children: Children, kv: str, host: str) -> str:
    """A kimi-tiny worker on a free port (one torch thread), owned by `children`: its URL."""
    return KvtierProcess(children, ["serve", "--model", "kimi-tiny", "--port", "0", "--kv-cache", kv,
                                    "--host-cache", host]).url


def keys_call(client: httpx.Client, body: dict) -> tuple[float, int]:
    """What Router._keys does: dump, POST, parse the keys into bytes. (seconds, keys)."""
    t0 = time.perf_counter()
    r = client.post("/kvtier/keys", content=orjson.dumps({"api": "chat", "request": body}),
                    headers={"content-type": "application/json"})
    data = r.json()
    keys = [bytes.fromhex(k) for k in data["keys"]]
    return time.perf_counter() - t0, len(keys)


def ttft(client: httpx.Client, body: dict) -> tuple[float, dict]:
    """Seconds to the first token's chunk of a streamed chat request, and its usage."""
    t0, first, usage = time.perf_counter(), None, {}
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True,
                                                             "stream_options": {"include_usage": True}}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                c = chunk["choices"][0] if chunk["choices"] else None     # the first is the role's, empty
                if first is None and c is not None and (c["delta"].get("content") or c.get("finish_reason")):
                    first = time.perf_counter() - t0
                usage = chunk.get("usage") or usage
    return first if first is not None else time.perf_counter() - t0, usage


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2000, 4000, 8000],
                    help="prompt sizes (kimi-tiny's context is 8,192 tokens)")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--uncached", type=int, default=3, help="rounds with a new system prompt (all computed)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with Children() as children:      # Ctrl-C, SIGTERM or an error: no worker outlives the bench
        url = serve(children, "48MiB", "96MiB")
        with httpx.Client(base_url=url, timeout=600) as client:
            run(client, args)


def run(client: httpx.Client, args: argparse.Namespace) -> None:
    """Every --tokens size: the keys call's time against a follow-up's and an uncached request's TTFT."""
    for size in args.tokens:
        history = conversation(size, "session A. ")
        base = {"model": "kimi-tiny", "max_tokens": 1, "temperature": 0}
        ttft(client, {**base, "messages": history})                       # the history is cached now
        keys_s, follow, http_s, blocks, tokens, cached = [], [], [], 0, 0, 0
        for i in range(args.rounds):
            body = {**base, "messages": history + [{"role": "user", "content": f"Now run test {i}, please."}]}
            t0 = time.perf_counter()
            client.get("/kvtier/load").json()                                # an HTTP round trip, for scale
            http_s.append(time.perf_counter() - t0)
            s, blocks = keys_call(client, body)
            t, usage = ttft(client, body)
            keys_s.append(s)
            follow.append(t)
            tokens, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
        cold = []
        for i in range(args.uncached):
            body = {**base, "messages": conversation(size, f"session {size}-{i}. ")}
            keys_call(client, body)
            cold.append(ttft(client, body)[0])
        share = [k / (k + f) for k, f in zip(keys_s, follow)]
        row = {"prompt_tokens": tokens, "keys": blocks, "rounds": args.rounds,
               "keys_ms_p50": round(1e3 * statistics.median(keys_s), 2), "keys_ms_p90": round(1e3 * pct(keys_s, 0.9), 2),
               "load_get_ms_p50": round(1e3 * statistics.median(http_s), 2),
               "followup_cached_tokens": cached,
               "followup_ttft_ms_p50": round(1e3 * statistics.median(follow), 1),
               "followup_ttft_ms_p90": round(1e3 * pct(follow, 0.9), 1),
               "share_of_followup_ttft_p50": round(statistics.median(share), 3),
               "uncached_ttft_ms_p50": round(1e3 * statistics.median(cold), 1)}
        print(json.dumps(row) if args.json else
              f"{tokens:6d} tokens ({blocks} keys): keys call p50 {row['keys_ms_p50']} ms p90 {row['keys_ms_p90']} ms "
              f"(GET /kvtier/load p50 {row['load_get_ms_p50']} ms); "
              f"follow-up TTFT ({cached} cached) p50 {row['followup_ttft_ms_p50']} ms p90 "
              f"{row['followup_ttft_ms_p90']} ms; keys share of it p50 {row['share_of_followup_ttft_p50']:.1%}; "
              f"uncached TTFT p50 {row['uncached_ttft_ms_p50']} ms", flush=True)


if __name__ == "__main__":
    try:
        main()
    except KvtierError as e:            # the worker's own one-line error, e.g. a missing extra
        sys.exit(f"keys_call: error: {e}")
    except KeyboardInterrupt:           # Ctrl-C, or SIGTERM/SIGHUP (Children): the workers are stopped
        print("keys_call: interrupted", file=sys.stderr)
        sys.exit(130)
