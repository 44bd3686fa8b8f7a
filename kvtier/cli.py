"""The `kvtier` command: demo, benchmarks and tools.

Each command is a module exposing HELP, add_arguments(parser) and run(args) -> exit code;
list it in COMMANDS or BENCHES. Modules import heavy things inside run(), so
`kvtier --help` stays fast.

Exit codes: 0 success, 1 a failure while running (out of memory, a file that cannot be
written, a damaged store), 2 bad usage (an option or input that can never work). Every
error is one line `kvtier: error: ...`; `--log-level debug` adds the traceback.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import sys
from typing import Any, NoReturn

from kvtier.errors import ConfigError, KvtierError, LayoutError
from kvtier.interrupts import as_interrupts

BENCHES: dict[str, str] = {
    "lookup": "kvtier.bench.lookup",
    "tiers": "kvtier.bench.tiers",
    "hit-ratio": "kvtier.bench.hit_ratio",
    "cluster": "kvtier.bench.cluster",
    "transport": "kvtier.bench.transport",
    "engine": "kvtier.bench.engine",
    "adapter": "kvtier.bench.adapter",
    "serve": "kvtier.bench.serve",
    "disagg": "kvtier.bench.disagg",
}
COMMANDS: dict[str, str] = {
    "demo": "kvtier.demo",
    "inspect": "kvtier.inspect",
    "node": "kvtier.node_cli",
    "generate": "kvtier.engine.generate_cli",
    "serve": "kvtier.serve.cli",
    "router": "kvtier.router.cli",
    "vllm-check": "kvtier.integrations.vllm.check",
}
LOG_LEVELS = ("debug", "info", "warning", "error")
EXIT_FAILURE = 1
EXIT_USAGE = 2


class Parser(argparse.ArgumentParser):
    """argparse with kvtier's one-line errors (`kvtier: error: ...`, exit 2) instead of a
    usage dump; subcommand parsers inherit it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # A value that starts with a minus and a digit (`--kv-cache -5GiB`) is a value, so it gets
        # its own check's message; argparse takes only plain negative numbers for values and
        # said "expected one argument". (No kvtier option looks like a negative number.)
        self._negative_number_matcher = re.compile(r"^-\.?\d")

    def error(self, message: str) -> NoReturn:
        print(f"kvtier: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        raise SystemExit(EXIT_USAGE)


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default unless its help text already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        said = any(w in text for w in ("%(default)", "(default", "default:", "; default ", "the default"))
        none = action.default is None or action.default is False or action.default is argparse.SUPPRESS
        if said or none or not action.option_strings:
            return text
        return f"{text} (default: {_shown_default(action)})"


def _shown_default(action: argparse.Action) -> str:
    """A default as the user would type it: sizes in units (6MiB, not 6291456), lists comma-
    separated; escaped for argparse's %-formatting of help texts."""
    from kvtier.argtypes import size
    from kvtier.units import format_bytes

    d = action.default
    if action.type is size and isinstance(d, int):
        text = format_bytes(d).replace(".00 ", "").replace(" ", "")
    elif isinstance(d, (list, tuple)):
        text = ",".join(str(x) for x in d) or "none"
    else:
        text = str(d)
    return text.replace("%", "%%")


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name == module:
            return None   # a command not built yet in this checkout
        raise


def _common() -> argparse.ArgumentParser:
    """Options every command takes (after its name, too)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS,
                        help="how much kvtier logs to stderr; debug also prints tracebacks "
                             "(default: $KVTIER_LOG_LEVEL or warning)")
    return common


def _add_modules(sub: argparse._SubParsersAction, modules: dict[str, str], parents: list) -> None:
    for name, module in modules.items():
        mod = _load(module)
        if mod is not None:
            p = sub.add_parser(name, help=mod.HELP, description=mod.HELP, parents=parents,
                               formatter_class=_DefaultsHelp)
            mod.add_arguments(p)
            p.set_defaults(run=mod.run, _prog=p.prog)


def build_parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    common = _common()
    parser = Parser(prog="kvtier", description="A tiered KV-cache store for LLM inference.",
                    parents=[common], formatter_class=_DefaultsHelp)
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_modules(sub, COMMANDS, [common])
    bench = sub.add_parser("bench", help="benchmarks, each against a raw baseline in the same run",
                           parents=[common])
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH")
    _add_modules(bsub, BENCHES, [common])
    bench.set_defaults(run=lambda _args: _missing(bench, "give a benchmark, e.g. `kvtier bench hit-ratio`"))
    return parser


def setup_logging(level: str | None) -> None:
    """Log to stderr at `level`, else $KVTIER_LOG_LEVEL, else warning."""
    name = (level or os.environ.get("KVTIER_LOG_LEVEL") or "warning").lower()
    if name not in LOG_LEVELS:
        raise ConfigError(f"KVTIER_LOG_LEVEL={name!r} is not a log level: use one of {', '.join(LOG_LEVELS)}")
    logging.basicConfig(level=getattr(logging, name.upper()), stream=sys.stderr,
                        format="kvtier: %(levelname)s %(name)s: %(message)s")


def _missing(parser: argparse.ArgumentParser, message: str) -> int:
    """No (sub)command given: what there is (the help, on stderr), then one error line."""
    parser.print_help(sys.stderr)
    return _fail(message, EXIT_USAGE)


def _fail(message: str, code: int) -> int:
    if logging.getLogger().isEnabledFor(logging.DEBUG):
        import traceback
        traceback.print_exc(file=sys.stderr)
    print(f"kvtier: error: {message}", file=sys.stderr)
    return code


def _broken_pipe() -> int:
    """The reader of stdout went away (`kvtier ... | head`): stop quietly, as `cat` does."""
    from kvtier.progress import detach_stdout

    detach_stdout()   # so the interpreter's final flush cannot fail again
    return 128 + 13   # as if killed by SIGPIPE, like other Unix tools in a pipe


def _interrupted() -> int:
    print("kvtier: interrupted", file=sys.stderr)
    return 130


def main(argv: list[str] | None = None) -> int:
    try:                        # option types import what they check: Ctrl-C can land in there
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
    except KeyboardInterrupt:
        return _interrupted()
    if extra:                   # named by the command they were given to, whose --help lists its options
        Parser(prog=getattr(args, "_prog", "kvtier")).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        setup_logging(getattr(args, "log_level", None))
    except ConfigError as e:
        return _fail(str(e), EXIT_USAGE)
    if not hasattr(args, "run"):
        return _missing(parser, "give a command, e.g. `kvtier bench hit-ratio`")
    try:
        with as_interrupts():           # SIGTERM and SIGHUP clean up as Ctrl-C does
            code = int(args.run(args) or 0)
            sys.stdout.flush()
        return code
    except (ConfigError, LayoutError) as e:
        return _fail(str(e), EXIT_USAGE)
    except KvtierError as e:
        return _fail(str(e), EXIT_FAILURE)
    except BrokenPipeError:
        return _broken_pipe()
    except KeyboardInterrupt:
        return _interrupted()
    except MemoryError:
        return _fail("out of memory: give a smaller --capacity (or free memory) and run again", EXIT_FAILURE)
    except OSError as e:
        where = f" ({e.filename})" if e.filename else ""
        return _fail(f"{e.strerror or e}{where}", EXIT_FAILURE)
    except Exception as e:   # a bug: one line for the user, the traceback with --log-level debug
        return _fail(f"unexpected {type(e).__name__}: {e} (run with --log-level debug for the traceback, "
                     "and please report it)", EXIT_FAILURE)


if __name__ == "__main__":
    sys.exit(main())
