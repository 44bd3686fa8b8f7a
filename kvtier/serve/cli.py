"""`kvtier serve`: the reference engine behind an OpenAI-compatible HTTP API.

Every option is checked, and the port bound, before the model loads, so a typo or a busy
port is one `kvtier: error:` line at once. The HTTP server answers from the moment it
listens (/health says 503 "starting" until the model is loaded). SIGTERM or Ctrl-C drains:
new requests get 503, those in flight finish (up to --shutdown-timeout seconds, then they
end with an error), the store is flushed and closed, and the process exits 0. A second
SIGTERM or Ctrl-C while draining ends the requests in flight at once (as the timeout would).
"""
from __future__ import annotations

import argparse
import contextlib
import errno
from typing import Any

from kvtier.errors import ConfigError
from kvtier.progress import say

HELP = "serve the reference engine over an OpenAI-compatible HTTP API (completions, chat, SSE, /metrics)"


def port_arg(text: str) -> int:
    """argparse type: a TCP port, 0 (any free port) to 65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0 picks a free port)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535; 0 picks a free port)")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.argtypes import positive_float, positive_int, seed_arg, size
    from kvtier.engine.generate_cli import dtype_arg, size_or_none
    from kvtier.node_cli import _address, _checked, _peers, _redis_url
    from kvtier.serve.http import READ_TIMEOUT_S

    p.add_argument("--model", default="kimi-tiny", metavar="PRESET_OR_DIR",
                   help="a preset (kimi-tiny: random weights, runs on a CPU) or a Hugging Face checkpoint folder")
    p.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: the preset name, or the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=port_arg, default=8000, help="port to listen on; 0 picks a free one")
    p.add_argument("--shutdown-timeout", type=positive_float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may run on before they end with an error "
                        "(a second SIGTERM or Ctrl-C ends them at once)")
    p.add_argument("--max-batched-tokens", type=positive_int, default=1024, metavar="N",
                   help="tokens one engine step computes at most (chunked prefill)")
    p.add_argument("--max-seqs", type=positive_int, default=64, metavar="N", help="requests in one batch at most")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as in vLLM: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                        "(n-gram prompt lookup); method draft_model (with \"model\") or mtp as in kvtier generate; "
                        "default: off")
    p.add_argument("--max-body-size", type=size, default=4 << 20, metavar="SIZE",
                   help="largest request body accepted (413 above it)")
    p.add_argument("--max-connections", type=positive_int, default=1024, metavar="N",
                   help="concurrent client connections at most (503 past it): clients cannot exhaust file "
                        "descriptors or memory")
    p.add_argument("--read-timeout", type=positive_float, default=READ_TIMEOUT_S, metavar="SECONDS",
                   help="a client silent this long while sending its request (headers or body) is disconnected, "
                        "so idle connections cannot fill --max-connections; answers are never cut by it")
    p.add_argument("--weights-seed", type=seed_arg, default=0, metavar="N",
                   help="seed of a preset's random weights")
    p.add_argument("--device", default=None, help="cuda:0 or cpu (default: cuda when present)")
    p.add_argument("--dtype", type=dtype_arg, default=None, help="compute dtype (default: the model's)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run decode steps eagerly instead of replaying them as CUDA graphs")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a kvtier store config (JSON or TOML, see docs/config.md); the flags below override it")
    p.add_argument("--kv-cache", type=size, default=None, metavar="SIZE",
                   help="device tier: the engine's KV pages (default: device_capacity)")
    p.add_argument("--host-cache", type=size_or_none, default=None, metavar="SIZE",
                   help="host-memory tier; 0 or none for none (default: host_capacity)")
    p.add_argument("--disk", default=None, metavar="DIR", help="a folder for a disk tier (default: disk_path, none)")
    p.add_argument("--disk-cache", type=size, default=None, metavar="SIZE",
                   help="size of the disk tier; a smaller size shrinks an existing one (default: disk_capacity)")
    p.add_argument("--block-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens per block and page (default: block_tokens)")
    p.add_argument("--pin-ttl", type=positive_float, default=None, metavar="SECONDS",
                   help="how long an x-session-affinity session's prefix stays pinned after its turn "
                        "(default: pin_ttl)")
    p.add_argument("--role", default="both", choices=("both", "prefill", "decode"),
                   help="prefill/decode disaggregation behind `kvtier router` (docs/disaggregation.md): prefill "
                        "computes prompts' KV and hands it over, decode pulls it and generates; both does all")
    p.add_argument("--handoff-ttl", type=positive_float, default=30.0, metavar="SECONDS",
                   help="--role prefill: how long a prompt's blocks stay pinned in memory for the decode worker "
                        "to pull them (released then, or at once when pushed whole)")
    cluster = p.add_argument_group("cluster mode: share blocks with other servers and nodes")
    cluster.add_argument("--peers", default=[], type=_checked(_peers, "peers"), metavar="HOST:PORT,...",
                         help="kvtier nodes (or servers' --kv-listen addresses) to fetch blocks from")
    cluster.add_argument("--directory", default=None, metavar="URL", type=_checked(_redis_url, "url"),
                         help="Redis directory (redis://HOST:PORT[/DB]): publish and find blocks")
    cluster.add_argument("--secret-file", default=None, metavar="FILE",
                         help="the cluster's shared secret, at least 16 bytes (default: $KVTIER_SECRET)")
    cluster.add_argument("--node-listen", "--kv-listen", dest="kv_listen", default=None, metavar="HOST:PORT",
                         type=_checked(_address, "address"),
                         help="serve this server's blocks to peers (its kvtier node) here; alone, it only serves "
                              "(default with --role prefill/decode: --host and --port + 1000, a free port with "
                              "--port 0; with --peers/--directory: 127.0.0.1:0)")
    cluster.add_argument("--advertise", default=None, metavar="HOST:PORT", type=_checked(_address, "address"),
                         help="with --directory or --role prefill/decode: the address peers use to reach "
                              "--kv-listen (default for a role: the node's, its wildcard host as the router reached "
                              "this server)")


def _served_name(args: argparse.Namespace) -> str:
    from pathlib import Path
    if args.served_model_name is not None:
        if not args.served_model_name.strip():
            raise ConfigError("--served-model-name must not be empty")
        return args.served_model_name
    from kvtier.engine.config import preset_names
    return args.model if args.model in preset_names() else Path(args.model).resolve().name


def _need_serve_extra() -> None:
    missing = []
    for module in ("starlette", "uvicorn", "orjson", "prometheus_client"):
        try:
            __import__(module)
        except ImportError:
            missing.append(module)
    if missing:
        raise ConfigError(f"kvtier serve needs {', '.join(missing)}: pip install 'kvtier[serve]'")


def _listen(host: str, port: int) -> Any:
    import socket

    from kvtier.net.address import listen_infos
    try:
        infos = listen_infos(host, port)
    except ValueError as why:
        raise ConfigError(f"--host {host!r} is not an address this machine can listen on: {why}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRNOTAVAIL:     # the host is not one of this machine's addresses
            raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; give --host one of this machine's "
                              "addresses (127.0.0.1, or 0.0.0.0 for all of them)") from None
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror or e}; pick another --port "
                          "(0 picks a free one)") from None
    sock.set_inheritable(True)
    return sock


def _cluster(args: argparse.Namespace) -> dict[str, Any] | None:
    """Checked cluster settings, or None for a lone `both` server without --peers/--directory."""
    disagg = args.role != "both"
    if not disagg and not args.peers and not args.directory and not args.kv_listen:
        if args.advertise:
            raise ConfigError("--advertise is for cluster mode: add --directory")
        if args.secret_file is not None:
            raise ConfigError("--secret-file is for cluster mode (--peers, --directory, --kv-listen or --role "
                              "prefill/decode): add one, or leave --secret-file out")
        return None
    from kvtier.node_cli import read_secret
    if args.peers and args.directory:
        raise ConfigError("give --peers or --directory, not both")
    if args.advertise and not args.directory and not disagg:
        raise ConfigError("--advertise is for --directory or --role prefill/decode (peers listed with --peers are "
                          "reached as listed)")
    if disagg:
        from kvtier.serve.roles import node_listen_default, role_secret
        secret = role_secret(args.secret_file)
        listen = args.kv_listen or node_listen_default(args.host, args.port)
    else:
        secret, listen = read_secret(args.secret_file), args.kv_listen or "127.0.0.1:0"
    from kvtier.net.address import parse_address
    from kvtier.net.node import check_advertised
    check_advertised(parse_address(listen)[0], bool(args.directory), args.advertise)   # before the model loads
    return {"secret": secret, "peers": args.peers, "directory": args.directory,
            "listen": listen, "advertise": args.advertise, "role": args.role}


def _make_llm(args: argparse.Namespace, cache: Any, cluster: dict[str, Any] | None,
              nodes: list[Any], disagg: Any = None) -> Any:
    """What the engine thread runs first: the model, its store, and in cluster mode a node
    serving that store to peers (appended to `nodes`, to stop before the store closes).
    A decode worker's store fetches through a HandoffDirectory: the prefill answers' hints
    first, then --peers/--directory."""
    def make() -> Any:
        from kvtier.engine import LLM
        remote = directory = None
        if cluster is not None:
            from kvtier.net.directory import PeerList
            from kvtier.serve.disagg import TimedRemote
            if cluster["directory"]:
                from kvtier.net import RedisDirectory
                directory = RedisDirectory(cluster["directory"])
            base = directory if directory is not None else PeerList(cluster["peers"]) if cluster["peers"] else None
            if cluster["role"] == "decode":
                from kvtier.net.handoff import HandoffDirectory
                disagg.handoff = HandoffDirectory(base)
                remote = disagg.remote = TimedRemote(directory=disagg.handoff, secret=cluster["secret"])
            elif base is not None:
                remote = TimedRemote(directory=base, secret=cluster["secret"])
            if cluster["role"] == "prefill":
                from kvtier.net.push import Pusher
                disagg.pusher = Pusher(cluster["secret"])
        llm = LLM(args.model, seed=args.weights_seed, dtype=args.dtype, device=args.device, cache=cache,
                  max_batched_tokens=args.max_batched_tokens, max_seqs=args.max_seqs, remote=remote,
                  speculative=getattr(args, "speculative", None), cuda_graphs=False if args.enforce_eager else None)
        if cluster is not None:
            from kvtier.net import Node
            try:
                node = Node(llm.store, cluster["listen"], cluster["secret"], directory=directory,
                            advertise=cluster["advertise"]).start()
            except BaseException:
                llm.close()
                raise
            nodes.append(node)
            if disagg is not None:
                disagg.node = cluster["advertise"] or node.address
            say(f"kvtier serve: serving blocks to peers on {node.address}")
        return llm
    return make


class _QuietSignals:
    """A uvicorn.Server that leaves SIGTERM and SIGINT to kvtier (drain first, then exit)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


def run(args: argparse.Namespace) -> int:
    from kvtier.engine.generate_cli import cache_config, check_capacities, kv_block_bytes, model_config

    _need_serve_extra()
    name = _served_name(args)
    cache, sources = cache_config(args, pin_ttl=("--pin-ttl", args.pin_ttl))
    check_capacities(cache, kv_block_bytes(model_config(args.model), args.dtype, cache.block_tokens), sources)
    if args.speculative_config is not None:           # a bad config fails here, before the model loads
        from kvtier.engine.spec import SpeculativeConfig
        args.speculative = SpeculativeConfig.from_json(args.speculative_config)
    _check_before_listening(args, cache, sources)
    cluster = _cluster(args)
    sock = _listen(args.host, args.port)
    if cluster is not None and args.role != "both":
        from kvtier.serve.roles import check_node_listen
        try:
            cluster["listen"] = check_node_listen(cluster["listen"], sock.getsockname()[1])
        except BaseException:
            sock.close()
            raise
    try:
        return _serve(args, name, cache, cluster, sock)
    finally:
        sock.close()


def _check_before_listening(args: argparse.Namespace, cache: Any, sources: Any) -> None:
    """What would make the engine fail after `listening on` is printed, found before: the
    device, a --disk that is a file, memory tiers larger than this machine's (or the GPU's)
    memory."""
    from pathlib import Path

    from kvtier.tiers.device import resolve_device
    from kvtier.tiers.memory import too_large
    from kvtier.units import parse_bytes

    try:
        device = resolve_device(args.device)
    except ConfigError as e:
        raise ConfigError(f"--device {args.device}: {e}") from None
    if cache.disk_path is not None and Path(cache.disk_path).exists() and not Path(cache.disk_path).is_dir():
        raise ConfigError(f"the disk tier path {cache.disk_path} is a file: give a directory (it is created if "
                          "missing)")
    from kvtier.units import format_bytes

    memory = [("host_capacity", cache.host_capacity)] + ([("device_capacity", cache.device_capacity)]
                                                          if device.type == "cpu" else [])
    for name, value in memory:                      # named as the user gave it: a flag, a file's key
        err = too_large(sources.describe(name, format_bytes(parse_bytes(value))), parse_bytes(value)) \
            if value is not None else None
        if err is not None:
            raise err
    if device.type == "cuda" and cache.device_capacity is not None:   # the device tier in GPU memory
        from kvtier.tiers.device import gpu_too_large
        need = parse_bytes(cache.device_capacity)
        err = gpu_too_large(sources.describe("device_capacity", format_bytes(need)), need, device)
        if err is not None:
            raise err


def _serve(args: argparse.Namespace, name: str, cache: Any, cluster: dict | None, sock: Any) -> int:
    import asyncio
    import signal

    import uvicorn

    from kvtier.serve.app import Service, build_app
    from kvtier.serve.engine_loop import EngineLoop
    from kvtier.serve.http import uvicorn_config
    from kvtier.serve.metrics import ServeMetrics

    from kvtier.serve.disagg import Disagg
    from kvtier.serve.roles import signing_key

    metrics = ServeMetrics(name)
    nodes: list[Any] = []
    disagg = Disagg(args.role, pin_ttl=args.handoff_ttl, key=signing_key(cluster["secret"])) \
        if cluster is not None else None
    engine = EngineLoop(_make_llm(args, cache, cluster, nodes, disagg), metrics,
                        before_close=lambda: [n.stop() for n in nodes])
    metrics.attach(engine)
    svc = Service(engine, metrics, name, max_body_bytes=args.max_body_size, disagg=disagg)
    config = uvicorn_config(build_app(svc), max_connections=args.max_connections, shutdown_timeout=5,
                            read_timeout=args.read_timeout)
    server = type("KvtierUvicorn", (_QuietSignals, uvicorn.Server), {})(config)
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"

    async def main() -> None:
        loop = asyncio.get_running_loop()
        stopping = asyncio.Event()

        async def shutdown() -> None:
            say(f"kvtier serve: draining ({svc.inflight} request{'s' * (svc.inflight != 1)} in flight, "
                f"up to {args.shutdown_timeout:g} s)")
            await svc.drain(args.shutdown_timeout)
            server.should_exit = True

        def on_signal() -> None:
            if stopping.is_set():                 # a second signal: stop waiting, as uvicorn and vLLM do
                say(f"kvtier serve: stopping now: ending the {svc.inflight} request{'s' * (svc.inflight != 1)} in flight")
                svc.cut()
                return
            stopping.set()
            asyncio.ensure_future(shutdown())

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)

        async def announce() -> None:
            await loop.run_in_executor(None, engine.ready.wait)
            if engine.error is not None:
                server.should_exit = True
            elif not stopping.is_set():
                say(f"kvtier serve: ready: {name!r} on {url} (OpenAI API at {url}/v1)")

        say(f"kvtier serve: listening on {url}, loading {args.model}")
        engine.start()
        watcher = asyncio.ensure_future(announce())
        try:
            await server.serve(sockets=[sock])
        finally:
            watcher.cancel()

    try:
        if _has("uvloop"):
            import uvloop
            uvloop.run(main())
        else:
            asyncio.run(main())
    finally:
        engine.stop()
    if engine.error is not None:
        raise engine.error
    say("kvtier serve: stopped (store flushed and closed)")
    return 0


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None

