"""Run one vLLM engine (CPU, offline) on token-id prompts and print a JSON result line.

A child process of tests/test_vllm_connector.py and bench/vllm_connector.py: each engine
gets a process of its own (vLLM keeps global state, and a kvtier disk tier belongs to one
process at a time), so two runs in sequence are two vLLM instances sharing the tier.

    python tests/vllm_run.py JOB.json      # -> last stdout line: {"outputs": [...], ...}

JOB: {"model": path, "prompts": [[ids...], ...], "max_tokens": 8, "connector": {extra config} | null,
      "multiprocess": false, "max_model_len": 2048, "kv_params": [{...} | null per prompt],
      "ttft": false, "warmup": [ids...] | null, "prefix_caching": true, "kv_cache_bytes": 64 << 20,
      "hold": path | null, "lag": false, "stats": false}
With "hold" the engine stays up after its result line (its kvtier node serving peers) until
that file exists (at most 10 minutes). With "lag" the connector's scheduler sees each
request's tokens one step late, as under vLLM's asynchronous scheduling (a GPU's default;
vLLM turns it off on a CPU): single-process mode only. With "stats" vLLM's statistics are on
and the result has "hit_sources": its Prometheus counter vllm:prompt_tokens_cached_by_source
(tokens by the tier that supplied them: device = vLLM's own prefix cache, host, disk, p2p,
external_unspecified) and "external_hits" (vllm:external_prefix_cache_hits).
Each output: {"tokens": [...], "cached": vLLM's num_cached_tokens, "ttft": seconds (with "ttft")}.
"""
from __future__ import annotations

import json
import os
import sys
import time


def main(path: str) -> None:
    job = json.loads(open(path).read())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if job.get("multiprocess") else "0"
    import torch

    torch.set_num_threads(1)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = None
    if job.get("lag"):
        from kvtier.integrations.vllm.scheduler import SchedulerSide

        SchedulerSide._known = lambda self, request: list(request.all_token_ids)[:-1]
    if job.get("connector") is not None:
        kv = KVTransferConfig(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                              kv_role="kv_both", kv_connector_extra_config=job["connector"])
    t0 = time.perf_counter()
    llm = LLM(model=job["model"], tokenizer=job["model"], dtype="float32", enforce_eager=True,
              max_model_len=job.get("max_model_len", 2048), max_num_batched_tokens=job.get("max_model_len", 2048),
              kv_cache_memory_bytes=job.get("kv_cache_bytes", 64 << 20), kv_transfer_config=kv, seed=0,
              enable_prefix_caching=job.get("prefix_caching", True), disable_log_stats=not job.get("stats"))
    startup = time.perf_counter() - t0
    if job.get("warmup"):       # one short request first: timings then exclude first-call costs
        llm.generate([{"prompt_token_ids": job["warmup"]}], SamplingParams(max_tokens=2, temperature=0.0),
                     use_tqdm=False)
    params = job.get("kv_params") or [None] * len(job["prompts"])
    outs = []
    for ids, p in zip(job["prompts"], params):       # one at a time: the second may hit the first's blocks
        sp = SamplingParams(max_tokens=job.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                            extra_args={"kv_transfer_params": p} if p else None)
        t = time.perf_counter()
        if job.get("ttft"):
            first = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0.0,
                                 ignore_eos=True, extra_args=sp.extra_args), use_tqdm=False)[0]
            outs.append({"tokens": list(first.outputs[0].token_ids), "cached": first.num_cached_tokens,
                         "ttft": time.perf_counter() - t})
        else:
            o = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
            outs.append({"tokens": list(o.outputs[0].token_ids), "cached": o.num_cached_tokens,
                         "seconds": time.perf_counter() - t})
        if job.get("drain", True) and kv is not None:     # saves done before the next prompt looks
            _drain()
    result = {"outputs": outs, "startup_s": startup, "pid": os.getpid(), "kvtier": _stats()}
    if job.get("stats"):
        result.update(_hit_metrics(llm))
    print(json.dumps(result), flush=True)
    if job.get("hold"):
        until = time.monotonic() + 600
        while not os.path.exists(job["hold"]) and time.monotonic() < until:
            time.sleep(0.1)
    del llm


def _stats() -> dict | None:
    """The connector's counters and store stats (single-process mode: the worker is here)."""
    from kvtier.integrations.vllm.worker import LOCAL

    for w in list(LOCAL.values()):
        w.drain()
        st = w.store.stats()
        return {**w.counters, "recovered": st.recovered_blocks, "pinned_sessions": st.pinned_sessions,
                "corrupt_blocks": st.counters.corrupt_blocks, "namespace": w.store.namespace.revision,
                "layout": w.store.layout.describe()}
    return None


def _hit_metrics(llm) -> dict:
    """vLLM's cache-hit counters (its Prometheus metrics, as `/metrics` serves them)."""
    by_source: dict[str, int] = {}
    external = 0
    for m in llm.get_metrics():
        if m.name == "vllm:prompt_tokens_cached_by_source" and m.value:
            by_source[m.labels["source"]] = by_source.get(m.labels["source"], 0) + int(m.value)
        elif m.name == "vllm:external_prefix_cache_hits":
            external += int(m.value)
    return {"hit_sources": by_source, "external_hits": external}


def _drain() -> None:
    """Wait for this process's connector saves (single-process mode) before the next prompt."""
    from kvtier.integrations.vllm.worker import LOCAL

    for w in list(LOCAL.values()):
        w.drain()


if __name__ == "__main__":
    main(sys.argv[1])
