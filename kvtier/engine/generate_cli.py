"""`kvtier generate`: run the reference engine on a prompt and show what the cache did."""
from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvtier.config import SettingSources, StoreConfig

HELP = "generate text with the reference Kimi-class engine (MLA + MoE) over a kvtier store"

DTYPES = ("float32", "bfloat16", "float16")   # what the engine computes in


def dtype_arg(text: str) -> str:
    """argparse type: a compute dtype name (float32, bfloat16, float16, or an alias like bf16)."""
    from kvtier.errors import ConfigError
    from kvtier.layout import dtype_from_name

    try:
        dtype_from_name(text, DTYPES)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def top_p_arg(text: str) -> float:
    """argparse type: a probability in (0, 1]."""
    from kvtier.argtypes import positive_float

    value = positive_float(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not in (0, 1]")
    return value


def size_or_none(text: str) -> int:
    """argparse type: a size such as 1GiB, or 0 / none for no tier (0)."""
    from kvtier.argtypes import size

    if text.strip().lower() in ("0", "none"):
        return 0
    return size(text)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.config import StoreConfig
    from kvtier.argtypes import non_negative_float, positive_int, seed_arg, size
    from kvtier.engine.config import PRESET_RANDOM_WEIGHTS, preset_names

    real = [n for n in preset_names() if n not in PRESET_RANDOM_WEIGHTS]
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default=None, choices=preset_names(),
                     help=f"a preset: kimi-tiny has random weights and runs on a CPU (the default); kimi-small "
                          "and kimi-medium have random weights too, ~1 B and ~14.7 B parameters, for a GPU; "
                          f"{' and '.join(real)} ship no weights: pass their checkpoint with --model")
    src.add_argument("--model", default=None, metavar="DIR",
                     help="a Hugging Face checkpoint folder (config.json + safetensors)")
    p.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="prompt text; repeat for several (they run as one batch); this or --prompt-ids is required")
    p.add_argument("--prompt-ids", default=None, metavar="IDS",
                   help="a prompt as comma-separated token ids (with --prompt too: one more prompt in the batch)")
    p.add_argument("--max-tokens", type=positive_int, default=32, metavar="N", help="tokens to generate per prompt")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T",
                   help="sampling temperature, >= 0; 0 (the default) is greedy")
    p.add_argument("--top-p", type=top_p_arg, default=1.0, metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to this probability, in (0, 1]")
    p.add_argument("--seed", type=seed_arg, default=None, metavar="N",
                   help="sampling seed (default: a fresh one each run)")
    p.add_argument("--weights-seed", type=seed_arg, default=0, metavar="N",
                   help="seed of a preset's random weights (default 0)")
    p.add_argument("--session", default=None, metavar="ID",
                   help="pin this session's prefix in the store for pin_ttl seconds (600 unless --config says otherwise) (default: no pinning)")
    p.add_argument("--device", default=None, help="cuda:0 or cpu (default: cuda when present)")
    p.add_argument("--dtype", type=dtype_arg, default=None,
                   help=f"compute dtype: {', '.join(DTYPES)} (default: the model's; float32 for kimi-tiny)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run decode steps eagerly instead of replaying them as CUDA graphs")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a kvtier store config (JSON or TOML, see docs/config.md); the flags below override it "
                        "(default: the defaults of kvtier.StoreConfig)")
    p.add_argument("--kv-cache", type=size, default=None, metavar="SIZE",
                   help=f"device tier: the engine's KV pages (default: device_capacity, {StoreConfig.shown_default('device_capacity')})")
    p.add_argument("--host-cache", type=size_or_none, default=None, metavar="SIZE",
                   help=f"host-memory tier below it; 0 or none for none (default: host_capacity, {StoreConfig.shown_default('host_capacity')})")
    p.add_argument("--disk", default=None, metavar="DIR",
                   help="a folder for a disk tier below host memory, kept across runs (default: disk_path, none)")
    p.add_argument("--disk-cache", type=size, default=None, metavar="SIZE",
                   help=f"size of the disk tier, allocated up front; a smaller size shrinks an existing one "
                        f"(default: disk_capacity, {StoreConfig.shown_default('disk_capacity')})")
    p.add_argument("--block-tokens", type=positive_int, default=None, metavar="N",
                   help=f"tokens per block and page (default: block_tokens, {StoreConfig.shown_default('block_tokens')})")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as in vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' (n-gram prompt lookup), \'{"method": "draft_model", "model": '
                        '"kimi-tiny", "num_speculative_tokens": 4}\' (a draft model with the same tokenizer), '
                        '\'{"method": "mtp", "num_speculative_tokens": 2}\' (the checkpoint\'s MTP layer; default: off)')
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt")


def model_config(source: str, option: str = "--model"):
    """The ModelConfig of a preset name or a checkpoint folder (its config.json)."""
    from pathlib import Path

    from kvtier.engine.config import ModelConfig, preset, preset_names
    from kvtier.errors import ConfigError

    if source in preset_names():
        return preset(source)
    path = Path(source)
    if not path.is_dir():
        why = "is a file, not a folder" if path.exists() else "does not exist"
        raise ConfigError(f"{option} {source!r} is neither a model preset ({', '.join(preset_names())}) nor a "
                          f"checkpoint folder: that path {why}")
    return ModelConfig.from_hf(path)


def kv_block_bytes(config, dtype: str | None, block_tokens: int) -> int:
    """Bytes of one KV block (one page) of this model, to size or check the cache tiers."""
    from kvtier.engine.model.loader import compute_dtype
    from kvtier.layout import KVLayout

    c = config
    return KVLayout.mla(c.num_hidden_layers, c.kv_lora_rank, c.qk_rope_head_dim, block_tokens,
                        compute_dtype(dtype, c)).block_bytes


CACHE_FLAGS = {"block_tokens": "--block-tokens", "device_capacity": "--kv-cache", "host_capacity": "--host-cache",
               "disk_path": "--disk", "disk_capacity": "--disk-cache"}   # StoreConfig field -> its flag here


def cache_config(args: argparse.Namespace, **more: tuple[str, Any]) -> tuple[StoreConfig, SettingSources]:
    """The store config of `generate` or `serve`: --config's file (or the defaults) under the
    cache flags given (--host-cache 0 / none: no host tier), and where each setting came from."""
    from kvtier.config import StoreConfig

    from kvtier.errors import ConfigError

    flags = {name: (flag, getattr(args, flag[2:].replace("-", "_"))) for name, flag in CACHE_FLAGS.items()}
    config, sources = StoreConfig.from_command(args.config, {**flags, **more})
    if args.disk_cache is not None and not config.disk_path:
        raise ConfigError("--disk-cache sizes a disk tier but there is none: give --disk DIR too (or disk_path "
                          "in the --config file)")
    return config, sources


def check_capacities(cache: StoreConfig, block_bytes: int, sources: SettingSources | None = None,
                     device: bool = True) -> None:
    """Each cache tier holds at least one block of this model (the device tier's only with
    `device`). `sources` (a SettingSources) names each setting as the user gave it: a flag, a
    key of their config file, a default."""
    from kvtier.config import SettingSources
    from kvtier.errors import ConfigError
    from kvtier.tiers.disk_dir import ALIGN, disk_slot_bytes
    from kvtier.units import format_bytes, parse_bytes

    sources = sources or SettingSources(CACHE_FLAGS, frozenset(CACHE_FLAGS))
    for name, value in (("device_capacity", cache.device_capacity if device else None),
                        ("host_capacity", cache.host_capacity),
                        ("disk_capacity", cache.disk_capacity if cache.disk_path else None)):
        need = disk_slot_bytes(block_bytes) if name == "disk_capacity" else block_bytes
        what = "KV block" if need == block_bytes else f"disk slot ({block_bytes}-byte blocks rounded up to {ALIGN})"
        if value is not None and parse_bytes(value) < need:
            raise ConfigError(f"{sources.describe(name, format_bytes(parse_bytes(value)))} is smaller than one {what} "
                              f"of this model ({need} bytes = {format_bytes(need)} at "
                              f"{sources.describe('block_tokens', str(cache.block_tokens))}): give "
                              f"{sources.setter(name)} at least that much, or fewer tokens per block")


def run(args: argparse.Namespace) -> int:
    from kvtier.engine import LLM, SamplingParams
    from kvtier.errors import ConfigError
    from kvtier.progress import progress

    if args.prompt is None and args.prompt_ids is None:
        raise ConfigError("give --prompt TEXT (or --prompt-ids 1,2,3)")
    prompts: list = list(args.prompt or [])
    if args.prompt_ids is not None:
        ids = []
        for t in (t.strip() for t in args.prompt_ids.split(",")):
            try:
                ids.append(int(t))          # an empty item ("1,,2") is refused: a token went missing
            except ValueError:
                raise ConfigError(f"--prompt-ids must be comma-separated integers, e.g. 1,2,3; got {t!r}") from None
        prompts.append(ids)
    if args.session is not None and not args.session.strip():
        raise ConfigError("--session needs a non-empty id, e.g. --session agent-42")
    source = args.model or args.preset or "kimi-tiny"
    spec = None
    if args.speculative_config is not None:
        from kvtier.engine.spec import SpeculativeConfig
        spec = SpeculativeConfig.from_json(args.speculative_config)
    cache, sources = cache_config(args)
    cfg = model_config(source, "--model" if args.model else "--preset")
    check_capacities(cache, kv_block_bytes(cfg, args.dtype, cache.block_tokens), sources)
    # What the engine would refuse once loaded, refused before the model loads (the engine's words)
    limit, vocab = cfg.max_position_embeddings, cfg.vocab_size
    if args.max_tokens >= limit:
        raise ConfigError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in the model's {limit} positions")
    for p in prompts:
        if isinstance(p, list) and p and (min(p) < 0 or max(p) >= vocab):
            raise ConfigError(f"prompt token ids must be ints in [0, {vocab}) for this model")
        if isinstance(p, list) and len(p) + args.max_tokens > limit:
            raise ConfigError(f"prompt ({len(p)} tokens) + max_tokens ({args.max_tokens}) exceeds the model's {limit} "
                              "positions")
    greedy_only = [f for f, given in (("--top-p", args.top_p != 1.0), ("--seed", args.seed is not None)) if given]
    if greedy_only and SamplingParams(temperature=args.temperature).greedy:
        raise ConfigError(f"{' and '.join(greedy_only)} {'shape' if len(greedy_only) > 1 else 'shapes'} sampling, "
                          "and a --temperature of 0 (the default; below 1e-5 too) is "
                          "greedy: give a --temperature of at least 1e-5 too, or leave them out")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    show = not args.json
    with progress(f"loading {source} and allocating the cache", enabled=show):
        llm = LLM(source, seed=args.weights_seed, dtype=args.dtype, device=args.device, cache=cache,
                  speculative=spec, cuda_graphs=False if args.enforce_eager else None)
    with llm:
        if not args.json:
            print(f"model: {llm.info.describe()}")
            from kvtier.engine.tokenizer import NoTokenizer
            text = not isinstance(llm.tokenizer, NoTokenizer)       # a checkpoint without tokenizer files
            if not text:
                print(f"note: {llm.tokenizer.name}: outputs are shown as token ids")
            if llm.info.random_weights:
                print("note: this preset's weights are random (made from a seed), so its text is noise; "
                      "it runs the whole engine and cache path. Pass --model CHECKPOINT_DIR for real output.")
        t0 = time.perf_counter()
        outs = _generate(llm, prompts, params, args.session, show)
        wall = time.perf_counter() - t0
        for o in outs:
            if args.json:
                print(json.dumps({"random_weights": llm.info.random_weights, "text": o.text, "token_ids": o.token_ids,
                                  "prompt_tokens": len(o.prompt_token_ids),
                                  "cached_tokens": o.cached_tokens, "cached_by_tier": o.cached_by_tier,
                                  "finish_reason": o.finish_reason, "ttft_s": o.ttft, "wall_s": wall,
                                  **({"spec": llm.stats()["spec"]} if spec is not None else {})}))
            else:
                where = ", ".join(f"{n} blocks from {t}" for t, n in o.cached_by_tier.items())
                shown = repr(o.text) if text else f"token ids {o.token_ids}"
                print(f"\n{shown}\n  {len(o.prompt_token_ids)} prompt tokens, {o.cached_tokens} of them from the "
                      f"cache{f' ({where})' if where else ''}; {len(o.token_ids)} generated ({o.finish_reason}); "
                      f"first token after {o.ttft * 1000:.1f} ms")
        if not args.json:
            n = sum(len(o.token_ids) for o in outs)
            print(f"\n{n} tokens in {wall:.2f} s")
            if spec is not None:
                st = llm.stats()["spec"]
                print(f"speculative ({spec.method}, k={spec.num_speculative_tokens}): {st['drafts']} drafts, "
                      f"{st['accepted_tokens']} of {st['draft_tokens']} draft tokens accepted, "
                      f"mean acceptance length {st['mean_acceptance_length']:.2f}")
    return 0


def _generate(llm, prompts: list, params, session: str | None, show: bool) -> list:
    """llm.generate(prompts), step by step so a person sees how far it got."""
    from kvtier.progress import progress

    ids = [llm.add_request(p, params, session) for p in prompts]
    done: dict = {}
    with progress(f"generating {len(ids)} prompt{'s' if len(ids) > 1 else ''}", enabled=show) as bar:
        step = 0
        while len(done) < len(ids):
            for o in llm.step():
                done[o.id] = o
            step += 1
            bar.describe(f"generating: step {step}, {len(done)} of {len(ids)} prompts finished")
    return [done[i] for i in ids]
