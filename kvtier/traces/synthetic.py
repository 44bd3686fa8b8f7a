"""A deterministic generator of agentic request traces.

What agent traffic looks like to a prefix cache: a few system prompts and tool-definition
sets shared by every session (Zipf-popular), then multi-turn sessions whose conversation
grows each turn (user message, often a tool result, and the previous reply appended), so
turn k+1 reuses all of turn k's prompt. Sessions arrive as a Poisson process and think
between turns, so sessions interleave in time. Everything is drawn from one seeded
numpy Generator: the same config gives the same tokens, keys and file on every machine.

`python -m kvtier.traces.synthetic OUT.jsonl [--format tokens|mooncake]` writes a trace
in either JSONL format ('-' for stdout); docs/traces.md describes both formats.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import secrets
import stat
import sys
from dataclasses import dataclass, fields
from typing import Iterator, TextIO

import numpy as np
import xxhash

from kvtier.errors import ConfigError
from kvtier.interrupts import as_interrupts
from kvtier.keys import chain_keys, token_bytes
from kvtier.traces.model import Request, Trace
from kvtier.traces.mooncake import MOONCAKE_BLOCK_TOKENS, mooncake_record
from kvtier.traces.tokens import TRACE_SEED, token_record
from kvtier.units import format_bytes


@dataclass(frozen=True)
class AgenticConfig:
    """Knobs of the agentic generator (defaults: ~1,460 requests in 200 sessions, ~5,100 unique 512-token blocks)."""

    seed: int = 0
    sessions: int = 200
    system_prompts: int = 4          # distinct system prompts (shared by all sessions)
    tool_sets: int = 6               # distinct tool-definition sets
    mean_turns: float = 8.0          # turns per session (geometric)
    max_context: int = 65_536        # a session ends when its prompt would exceed this
    session_rate: float = 0.4        # session arrivals per second (Poisson)
    think_s: float = 15.0            # mean seconds between a reply and the next turn
    tool_prob: float = 0.6           # chance a turn carries a tool result
    vocab: int = 100_000
    block_tokens: int = 512

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name != "seed" and not v > 0 and f.name != "tool_prob":
                raise ConfigError(f"AgenticConfig.{f.name} must be positive, got {v}")
        if not 0.0 <= self.tool_prob <= 1.0:
            raise ConfigError(f"AgenticConfig.tool_prob is a probability in [0, 1], got {self.tool_prob}")


@dataclass(slots=True)
class SyntheticRequest:
    timestamp: float                 # ms
    session: str
    tokens: np.ndarray               # uint32 prompt (a view of the session's history)
    output_length: int


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, rng.lognormal(np.log(median), sigma))))


def _memory_room() -> float:
    """Bytes of prompts generate() may hold: half the memory available now (the replay that
    reads them needs its share), or no bound where the machine does not say."""
    from kvtier.tiers.memory import memory_available

    avail, _ = memory_available()
    return float("inf") if avail is None else avail / 2


def generate(cfg: AgenticConfig = AgenticConfig()) -> list[SyntheticRequest]:
    """Every request of the trace, in timestamp order (ties keep session order)."""
    rng = np.random.default_rng(cfg.seed)
    words = lambda n: rng.integers(0, cfg.vocab, size=n, dtype=np.uint32)  # noqa: E731
    systems = [words(_lognormal(rng, 1500, 0.5, 200, 6000)) for _ in range(cfg.system_prompts)]
    tools = [words(_lognormal(rng, 2500, 0.6, 300, 12000)) for _ in range(cfg.tool_sets)]
    zipf = lambda k: np.arange(1, k + 1) ** -1.1 / np.sum(np.arange(1, k + 1) ** -1.1)  # noqa: E731
    p_sys, p_tool = zipf(cfg.system_prompts), zipf(cfg.tool_sets)
    out: list[SyntheticRequest] = []
    t0 = 0.0
    held, room = 0, _memory_room()
    for s in range(cfg.sessions):
        # Every prompt is kept: a huge `sessions` must not eat the machine. The first 256
        # sessions tell how much the rest will hold; past that the count is exact.
        if held > room or (s == 256 and held / s * cfg.sessions > room):
            raise ConfigError(f"the generated trace would hold about {format_bytes(held / s * cfg.sessions)} of "
                              f"prompts ({format_bytes(held)} for the first {s:,} of {cfg.sessions:,} sessions), "
                              f"more than half of the {format_bytes(2 * room)} of memory available: generate "
                              "fewer sessions")
        t0 += rng.exponential(1000.0 / cfg.session_rate)
        sid = f"s{cfg.seed}-{s}"
        parts = [systems[rng.choice(cfg.system_prompts, p=p_sys)], tools[rng.choice(cfg.tool_sets, p=p_tool)]]
        turns = int(rng.geometric(1.0 / cfg.mean_turns))
        t = t0
        for _ in range(turns):
            parts.append(words(_lognormal(rng, 150, 1.0, 5, 4000)))             # user message
            if rng.random() < cfg.tool_prob:
                parts.append(words(_lognormal(rng, 1200, 1.0, 20, 16000)))      # tool result
            prompt = np.concatenate(parts)
            if len(prompt) > cfg.max_context:
                break
            reply = _lognormal(rng, 250, 0.8, 1, 4000)
            out.append(SyntheticRequest(t, sid, prompt, reply))
            held += prompt.nbytes
            parts = [prompt, words(reply)]                                      # reply joins the history
            t += reply * 20.0 + rng.exponential(cfg.think_s * 1000.0)           # ~50 tok/s decode + think
    out.sort(key=lambda r: r.timestamp)  # stable: equal times keep generation order
    return out


def synthetic_name(cfg: AgenticConfig) -> str:
    """The generated trace's name in tables and JSON rows: 'agentic-seed0'."""
    return f"agentic-seed{cfg.seed}"


def synthetic_trace(cfg: AgenticConfig = AgenticConfig(), name: str | None = None) -> Trace:
    """The generated trace keyed like a token-level trace file (full blocks, kvtier keys)."""
    reqs = [Request(keys=list(chain_keys(r.tokens, cfg.block_tokens, TRACE_SEED)), input_length=len(r.tokens),
                    output_length=r.output_length, timestamp=r.timestamp, session=r.session)
            for r in generate(cfg)]
    return Trace(name=name or synthetic_name(cfg), requests=reqs,
                 block_tokens=cfg.block_tokens, format="synthetic")


def mooncake_requests(reqs: list[SyntheticRequest], block_tokens: int) -> Iterator[Request]:
    """Requests with Mooncake-style dense ids: one per block, the partial last one included."""
    ids: dict[bytes, int] = {}
    for r in reqs:
        keys = list(chain_keys(r.tokens, block_tokens, TRACE_SEED))
        rem = len(r.tokens) % block_tokens
        if rem:  # the partial tail gets an id too, chained like any block
            tail = token_bytes(r.tokens[len(r.tokens) - rem:])
            keys.append(xxhash.xxh3_128_digest((keys[-1] if keys else TRACE_SEED) + tail))
        hids = [ids.setdefault(k, len(ids)) for k in keys]
        yield Request(keys=hids, input_length=len(r.tokens), output_length=r.output_length,
                      timestamp=r.timestamp, session=r.session, last_tokens=rem or None)


FORMATS = ("tokens", "mooncake")


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ConfigError(f"unknown trace format {fmt!r}: choose 'tokens' or 'mooncake'")


def _lines(reqs: list[SyntheticRequest], cfg: AgenticConfig, fmt: str) -> Iterator[str]:
    """The trace's JSONL lines, one request each, made as they are written (the default
    token-level trace is ~180 MB of text)."""
    if fmt == "tokens":
        for r in reqs:
            yield json.dumps(token_record(r.tokens, r.timestamp, r.output_length, r.session)) + "\n"
    else:
        for m in mooncake_requests(reqs, cfg.block_tokens):
            yield json.dumps(mooncake_record(m)) + "\n"


def write_jsonl(f: TextIO, cfg: AgenticConfig = AgenticConfig(), fmt: str = "tokens") -> int:
    """Write a generated trace to an open text stream (stdout, say); returns the request count."""
    _check_format(fmt)
    reqs = generate(cfg)
    f.writelines(_lines(reqs, cfg, fmt))
    return len(reqs)


def _create_beside(path: str) -> tuple[int, str]:
    """A new, empty hidden file in `path`'s folder (so renaming it onto `path` is atomic),
    with the mode any new file gets (the umask applied, not mkstemp's 0600)."""
    folder, base = os.path.split(os.path.abspath(path))
    while True:
        tmp = os.path.join(folder, f".{base}.{secrets.token_hex(4)}.part")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue


def write_trace(path: str, cfg: AgenticConfig = AgenticConfig(), fmt: str = "tokens") -> int:
    """Write a generated trace as JSONL ("tokens" or "mooncake"); returns the request count.

    The trace goes to a temporary file beside `path`, renamed onto it only when complete:
    an error or an interrupt leaves no partial file, which would replay as a shorter trace.
    A folder that cannot be written fails before the trace is generated. A symbolic link's
    target is written, and a path that is not a regular file (/dev/null, a named pipe) is
    written straight into: a rename would replace the device or pipe with a file."""
    _check_format(fmt)
    path = os.path.realpath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
    if os.path.exists(path) and not stat.S_ISREG(os.stat(path).st_mode):
        with open(path, "w", encoding="utf-8") as f:
            return write_jsonl(f, cfg, fmt)
    fd, tmp = _create_beside(path)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            n = write_jsonl(f, cfg, fmt)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return n


def _parser() -> argparse.ArgumentParser:
    """The command line, with kvtier's one-line usage errors (exit 2)."""
    from kvtier.argtypes import non_negative_int, positive_int
    from kvtier.cli import Parser

    p = Parser(prog="python -m kvtier.traces.synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("out", metavar="OUT", help="JSONL file to write, or '-' for stdout; written to a temporary "
                   "file beside it and renamed when complete, so an interrupt leaves no partial trace")
    p.add_argument("--format", choices=FORMATS, default="tokens",
                   help="tokens: each prompt's token ids (the default: about 180 MB at 200 sessions); "
                        "mooncake: one hash id per 512-token block (about 0.4 MB) (default: %(default)s)")
    p.add_argument("--seed", type=non_negative_int, default=0,
                   help="seed of the generator: the same seed and sessions give the same file on every "
                        "machine (default: %(default)s)")
    p.add_argument("--sessions", type=positive_int, default=AgenticConfig.sessions,
                   help="conversations (sessions) to generate, about 7 requests each "
                        "(default: %(default)s)")
    return p


def _write(out: str, cfg: AgenticConfig, fmt: str) -> int:
    """Write the trace to `out`, or to stdout for '-'; the request count."""
    if out != "-":
        return write_trace(out, cfg, fmt)
    n = write_jsonl(sys.stdout, cfg, fmt)
    sys.stdout.flush()
    return n


def main(argv: list[str] | None = None) -> int:
    """Write a generated trace. Errors are one `kvtier: error:` line (exit 2 for bad input,
    1 for a file that cannot be written); Ctrl-C is `kvtier: interrupted` (exit 130)."""
    a = _parser().parse_args(argv)
    # The Mooncake format's hash ids are per 512-token block (its traces' and kvtier's
    # reader's): a --block-tokens option here wrote traces the reader then refused.
    try:
        with as_interrupts():           # SIGTERM too: it left a 46 MB .part file beside OUT
            n = _write(a.out, AgenticConfig(seed=a.seed, sessions=a.sessions, block_tokens=MOONCAKE_BLOCK_TOKENS),
                       a.format)
    except ConfigError as e:
        print(f"kvtier: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvtier: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:            # `... - | head`: stop quietly, as kvtier does
        from kvtier.progress import detach_stdout
        detach_stdout()
        return 128 + 13
    except OSError as e:
        print(f"kvtier: error: cannot write {a.out}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"wrote {n} requests to {'stdout' if a.out == '-' else a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
