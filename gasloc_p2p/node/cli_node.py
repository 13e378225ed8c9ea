"""``gasloc-node join`` and ``gasloc-node status``: parsers and entry points.

``gasloc_p2p/cli.py`` adds these subcommands and configures logging. ``join`` builds a
:class:`NodeConfig` (flags > ``GASLOC_*`` > ``--config`` TOML > defaults), runs a :class:`Node`
under uvloop until SIGINT/SIGTERM or a step/time limit, and exits 0 (clean), 1 (runtime
failure) or 2 (bad configuration, one actionable line on stderr).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from gasloc_p2p.data.corpus import DataError
from gasloc_p2p.node.config import ConfigError, NetworkConfig, NodeConfig
from gasloc_p2p.node.config_network import check_bootstrap_peers
from gasloc_p2p.node.settings import add_config_flags, build_config

log = logging.getLogger(__name__)
_EXECUTOR_THREADS = 32  # to_thread work: encodes, commits, DHT calls, checkpoints


def add_join_parser(sub: Any) -> None:
    p = sub.add_parser(
        "join", help="start a node: join a swarm (--peers) or start a new one",
        description="Run a gasloc node: discover peers through the hivemind DHT, train with "
                    "AdamW inner steps, gossip quantized parameters over gRPC (GASLoC, "
                    "docs/algorithm.md section 2). Every option is also a GASLOC_* "
                    "environment variable and a key of the --config TOML file; tuning "
                    "(timeouts, guard thresholds, limits) is settable there only: "
                    "docs/configuration.md lists every setting.")
    p.add_argument("--check", action="store_true",
                   help="validate the configuration, print what the node would run, and exit "
                        "(starts nothing, downloads nothing)")
    p.add_argument("--manifest", metavar="FILE", default=argparse.SUPPRESS,
                   help="train by this run manifest (`gasloc-node init`); without it, a node "
                        "that joins with --peers trains by the manifest its peer serves")
    add_config_flags(p)
    p.set_defaults(func=run_join)


def add_status_parser(sub: Any) -> None:
    p = sub.add_parser("status", help="show one node's Info and the swarm from the DHT",
                       description="Query a node (--endpoint host:port) and/or list the "
                                   "swarm of a run through the DHT (--peers MADDR...).")
    p.add_argument("--endpoint", help="a node's gRPC host:port, or its DHT multiaddr "
                                      "(/ip4/.../p2p/ID, as printed at its start)")
    p.add_argument("--peers", nargs="+", default=[], metavar="MADDR",
                   help="bootstrap multiaddrs of the swarm's DHT")
    p.add_argument("--run-id", default="", help="run to list (default: the run of the node "
                                                "--peers names, from its manifest, else "
                                                f"{NodeConfig().discovery.run_id!r})")
    p.add_argument("--timeout-s", type=float, default=15.0, help="overall deadline, seconds")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--swarm-key", default="", metavar="FILE",
                   help="the swarm's secret (--swarm-key of its nodes): without it a keyed "
                        "swarm shows health only and no peer list")
    p.add_argument("--invitation", default="", metavar="FILE",
                   help="a closed swarm: your invitation (without it or --owner-key, nodes "
                        "answer health only)")
    p.add_argument("--owner-key", default="", metavar="FILE",
                   help="a closed swarm: its owner key")
    p.set_defaults(func=run_status, exit_at_once=True)


def _fail_config(command: str, exc: Exception) -> int:
    print(f"gasloc-node {command}: error: {exc}", file=sys.stderr)
    return 2


def run_join(args: argparse.Namespace) -> int:
    """Entry point of ``gasloc-node join``; returns the exit code."""
    check = bool(getattr(args, "check", False))
    if hasattr(args, "check"):
        del args.check  # not a config field
    argv = args.__dict__.pop("launch_argv", None)  # not a config field either
    from gasloc_p2p.node.runtime.ranks import distributed_env

    try:
        ranks = distributed_env()
    except ValueError as exc:
        return _fail_config("join", exc)
    if ranks is not None and ranks[0] > 0:  # a rank > 0 takes everything from rank 0
        return 0 if check else _run_rank(*ranks)  # --check: rank 0 prints the summary
    try:
        from gasloc_p2p.node.cli_run import resolve

        check_bootstrap_peers(tuple(getattr(args, "peers", None) or ()))  # before dialing
        if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # imports done (cli.main)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        manifest = resolve(args, fetch=not check)  # --check downloads nothing
        cfg = build_config(args, run=manifest.rule() if manifest is not None else None)
        check_bootstrap_peers(cfg.discovery.peers)
        _check_ports(cfg)
    except (ConfigError, OSError, TimeoutError) as exc:
        return _fail_config("join", exc)
    world = cfg.train.nproc_per_node
    if ranks is None and world == 1 and cfg.train.sharding == "fsdp":
        log.warning("--sharding fsdp: a node of one rank holds the whole model (nothing to "
                    "shard); add --nproc-per-node K to shard it over K GPUs")
    if check:
        print(check_summary(cfg))
        return 0
    if ranks is None and world > 1:
        from gasloc_p2p.node.launch import launch

        if argv is None:
            return _fail_config("join", ConfigError("--nproc-per-node: no command line to "
                                                    "start the ranks with"))
        return launch(argv, world)
    if ranks is not None and world not in (1, ranks[1]):
        return _fail_config("join", ConfigError(
            f"--nproc-per-node={world} but torchrun started WORLD_SIZE={ranks[1]} ranks"))
    if ranks is not None:
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                 nproc_per_node=ranks[1]))
        try:
            cfg.validate()
        except ConfigError as exc:
            return _fail_config("join", exc)
    try:  # a persistent identity by default: the peer id survives restarts
        from gasloc_p2p.node.state_dir import default_identity

        identity = default_identity(cfg)
        if identity != cfg.network.identity_file:
            cfg = dataclasses.replace(cfg, network=dataclasses.replace(
                cfg.network, identity_file=identity))
    except OSError as exc:
        return _fail_config("join", exc)
    import uvloop

    # `kill -USR1 PID` writes every thread's stack to stderr (a node that seems stuck)
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    from gasloc_p2p.node.runtime import allocator

    tuned = allocator.tune()  # before the executor, gRPC and torch start their threads
    log.info("allocator: arena_max %s, mmap threshold %s%s", tuned.arena_max or "default",
             tuned.mmap_threshold or "default", f" ({tuned.reason})" if tuned.reason else "")

    executor = BoundedExecutor(_EXECUTOR_THREADS, "gasloc-io")
    group = None
    if ranks is not None:
        from gasloc_p2p.node.runtime.ranks import RankGroup

        group = RankGroup(*ranks)  # waits for the other ranks to be there
    code = int(uvloop.run(_join(cfg, executor, manifest, group)))
    # Everything the node opened is closed by now: skip the interpreter's own teardown. Its
    # final garbage collection runs native finalizers, and one of them blocked a stopped node
    # for over 30 s (the SIGTERM hang, twice in about 100 stops on a loaded machine: one thread
    # left, "Garbage-collecting", no Python frame); it would also join worker threads still
    # blocked (see BoundedExecutor) for as long as they block.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_rank(rank: int, world: int, local_rank: int) -> int:
    """A rank > 0 of a multi-rank node: no network, no identity, no checkpoints; it trains
    beside rank 0 until rank 0 stops it (Ctrl-C and SIGTERM are rank 0's to act on)."""
    from gasloc_p2p.node.runtime.ranks import RankGroup, follow
    from gasloc_p2p.node.runtime.trainer import follower_replica

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    group = RankGroup(rank, world, local_rank)
    code = follow(group, follower_replica)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as rank 0: nothing left to tear down but the process group


def check_summary(cfg: NodeConfig) -> str:
    """What ``join --check`` prints: the configuration's gist, one line each."""
    t, o, g = cfg.train, cfg.outer, cfg.gossip
    algo = (f"{o.algorithm} (eta {o.eta:g}, gamma {o.gamma:g}, {g.codec} payloads, "
            f"{g.exchanges_per_round:g} exchanges per round)" if o.algorithm == "gasloc" else
            f"{o.algorithm} (Nesterov {cfg.diloco.diloco_eta:g}/{cfg.diloco.diloco_gamma:g}, "
            f"{cfg.diloco.diloco_codec} all-reduce)")
    peers = " ".join(cfg.discovery.peers) or "none: a new swarm"
    return "\n".join([
        "configuration ok",
        f"  run       {cfg.discovery.run_id}",
        f"  model     {t.model}, seed {t.seed}, {t.precision} on {t.device}"
        + (f", {t.nproc_per_node} ranks ({t.sharding.upper()})" if t.nproc_per_node > 1
           else ""),
        f"  data      {t.data or 'Shakespeare (downloaded)'}, tokenizer {t.tokenizer}",
        f"  training  batch {t.batch_size} x {t.seq_len} tokens, H {t.inner_steps}, lr {t.lr:g}",
        f"  outer     {algo}",
        f"  peers     {peers}",
        f"  network   {cfg.network.host}:{cfg.network.port or 'any'}, DHT port "
        f"{cfg.discovery.dht_port or 'any'}" + (", client mode" if cfg.network.client_mode
                                                else ""),
        f"  security  {_membership_summary(cfg)}, identity {_identity_summary(cfg)}"])


def _identity_summary(cfg: NodeConfig) -> str:
    net = cfg.network
    if net.invitation and not net.identity_file:
        from gasloc_p2p.protocol.membership import read_invitation

        if read_invitation(net.invitation)[1]:
            return f"the key in {net.invitation}"
    return net.identity_file or "new at each start"


def _membership_summary(cfg: NodeConfig) -> str:
    net = cfg.network
    if net.invitation:
        return f"closed swarm, member by {net.invitation}"
    if net.owner_key or not (net.swarm_key or cfg.discovery.peers or net.open_swarm):
        from gasloc_p2p.node.runtime.identity import default_owner_key_path

        return f"closed swarm owned by {net.owner_key or default_owner_key_path()}"
    return "keyed swarm (--swarm-key)" if net.swarm_key else "OPEN swarm (--open)"


class BoundedExecutor(ThreadPoolExecutor):
    """The node's ``to_thread`` pool; ``shutdown(wait=True)`` waits at most ``limit_s``.

    A worker blocked on a dead DHT process or peer (its own timeout still running) must not
    hold the process after SIGTERM: the event loop's exit would wait for it (``run_join`` then
    exits with ``os._exit``, everything else being closed, which the interpreter never joins).
    """

    limit_s = 3.0

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        super().shutdown(wait=False, cancel_futures=cancel_futures)
        if not wait:
            return
        deadline = time.monotonic() + self.limit_s
        for thread in list(self._threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.stuck():
            log.info("exiting with %d worker thread(s) still blocked after %g s",
                     len(self.stuck()), self.limit_s)

    def stuck(self) -> list[str]:
        return [t.name for t in self._threads if t.is_alive()]


def _check_ports(cfg: NodeConfig) -> None:
    """Fail at once, naming the flag, if a fixed port is taken (before the DHT starts)."""
    from gasloc_p2p.node.transport.service import check_bindable

    net, m = cfg.network, cfg.metrics
    if net.port:
        check_bindable(net.host, net.port, "--port", "the gRPC port")
    if cfg.discovery.dht_port:
        check_bindable(net.host, cfg.discovery.dht_port, "--dht-port", "the DHT")
    if m.metrics_port > 0:
        check_bindable(m.metrics_host or net.host, m.metrics_port, "--metrics-port", "/metrics")


async def _join(cfg: NodeConfig, executor: ThreadPoolExecutor, manifest: Any = None,
                ranks: Any = None) -> int:
    from gasloc_p2p.node.daemon import Node

    loop = asyncio.get_running_loop()
    loop.set_default_executor(executor)
    try:  # its files: the invitation, the keys
        node = Node(cfg, manifest=manifest, ranks=ranks)
    except (OSError, ValueError) as exc:
        print(f"gasloc-node join: error: {exc}", file=sys.stderr, flush=True)
        return 2
    signals, starting, up = 0, asyncio.current_task(), False
    deadline = _StopDeadline(cfg.network.stop_deadline_s)

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:  # a second Ctrl-C: give up on a clean stop (the DHT watchdog reaps)
            os._exit(130)
        log.info("stopping (signal received; again to force)")
        deadline.arm()
        node.request_stop()
        if not up and starting is not None:  # the start (a DHT, a model build) ends at once
            starting.cancel()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    try:
        async with node:
            up = True
            addrs = await node.discovery.visible_addrs()
            print(startup_block(node, addrs), flush=True)
            await node.wait()
            deadline.arm()  # also when a step or time limit ends the run
    except asyncio.CancelledError:
        if up or not signals:
            raise
        log.info("stopped while starting")
        return 130
    except (DataError, ConfigError) as exc:  # the data flags cannot be read, --compile
        print(f"gasloc-node join: error: {exc}", file=sys.stderr, flush=True)  # cannot build
        return 2
    except Exception as exc:
        if type(exc).__name__ == "OutOfMemoryError":  # the model or its batch is too big
            from gasloc_p2p.node.config_train import out_of_memory

            print(f"gasloc-node join: error: {out_of_memory(cfg.train, exc, 'at start')}",
                  file=sys.stderr, flush=True)
            return 2
        log.error("node failed: %s: %s", type(exc).__name__, exc)
        log.debug("details", exc_info=True)
        return 1
    if node.checkpoint_problem:  # the run went on, but a restart would lose all of it
        log.error("%s", node.checkpoint_problem)
        return 1
    return 1 if node.error else 0


class _StopDeadline:
    """Once armed, the process ends within ``seconds`` whatever blocks its stop (SIGTERM never
    hangs; its bounded steps add up to about 20 s): a watchdog thread then writes every
    thread's stack to stderr, which shows where it hung, and exits 1. ``seconds`` 0: never.

    The watchdog reads the stacks holding the GIL (``sys._current_frames``): faulthandler's
    dump, taken without it, crashed the process (SIGSEGV) once in a test when a thread
    ended during the dump. faulthandler stays as the backstop, ``BACKSTOP_S`` later, for a
    thread that never gives the GIL back."""

    BACKSTOP_S = 10.0

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.armed = False

    def arm(self) -> None:
        if self.seconds > 0 and not self.armed:
            self.armed = True
            threading.Thread(target=self._expire, name="stop-deadline", daemon=True).start()
            faulthandler.dump_traceback_later(self.seconds + self.BACKSTOP_S, exit=True)

    def _expire(self) -> None:
        time.sleep(self.seconds)
        names = {t.ident: t.name for t in threading.enumerate()}
        out = [f"the stop outlasted --stop-deadline-s {self.seconds:g}; every thread's stack "
               "(most recent call last):"]
        for ident, frame in sys._current_frames().items():
            out.append(f"Thread 0x{ident:x} ({names.get(ident, '?')}):")
            out += [line.rstrip("\n") for line in traceback.format_stack(frame)]
        with contextlib.suppress(Exception):
            sys.stderr.write("\n".join(out) + "\n")
            sys.stderr.flush()
        os._exit(1)


def startup_block(node: Any, addrs: list[str]) -> str:
    """What a user needs from a node that just started, in one block: its gRPC endpoint (for
    ``status --endpoint``), its DHT multiaddrs (for ``join --peers``), its metrics URL, and the
    line other nodes paste."""
    client = node.cfg.network.client_mode  # not dialable: never a bootstrap peer
    hint = node.join_hint(list(node.cfg.discovery.peers) if client else addrs)
    lines = [f"node {node.discovery.peer_id} is up ({node.cfg.outer.algorithm}, run "
             f"{node.cfg.discovery.run_id!r})",
             f"  grpc     {node.endpoint}",
             *(["  dht      client mode: dials out only (not a bootstrap peer)"] if client else
               [f"  dht      {a}" for a in addrs[:3]]),
             f"  metrics  {node.metrics.url or 'off (--metrics-port -1)'}",
             *_rank_lines(node),
             f"  status   gasloc-node status --endpoint {node.endpoint}",
             f"  identity {node.signer.peer_id} "
             f"({node.cfg.network.identity_file or 'the key in the invitation'}, kept across "
             "restarts)",
             *node.membership_lines(), *_run_lines(node), *_checkpoint_lines(node)]
    if not node.cfg.discovery.peers:
        lines += ["new swarm; other nodes join with:", f"  {hint}"]
    elif client:
        lines += ["joined; other nodes join through the peers this node joined:", f"  {hint}"]
    else:
        lines += ["joined; other nodes may also join with:", f"  {hint}"]
    return "\n".join(lines)


def _checkpoint_lines(node: Any) -> list[str]:
    """Where the node checkpoints, how often, and whether it resumed (none without)."""
    cp = node.cfg.checkpoint
    if not cp.checkpoint_dir:
        return []
    step = getattr(node, "resumed_at", None)
    return [f"  ckpt     {cp.checkpoint_dir} (every {cp.checkpoint_interval_s:g} s and at stop; "
            + (f"resumed at step {step})" if step is not None else
               "a restart resumes from it)")]


def _rank_lines(node: Any) -> list[str]:
    """A node of several ranks: how many, on what (none for one rank)."""
    ranks = getattr(node, "ranks", None)
    if ranks is None or node.trainer is None:
        return []
    how = ("FSDP2: each rank 1/K of the model; rank 0 keeps its full copy on the host"
           if node.trainer.sharded is not None else "DDP")
    return [f"  ranks    {ranks.world} on {node.trainer.device.type} ({how}; this process is "
            "rank 0, the node's only network side)"]


def _run_lines(node: Any) -> list[str]:
    """The run a node trains by its manifest: name, model, data, shape (none without)."""
    m = node.manifest
    if m is None:
        return []
    s, t = m.settings, node.cfg.train
    return [f"  run      {m.run_id} ({m.name}): model {s['model']}, data "
            f"{t.data or 'Shakespeare'}, batch {t.batch_size} x {t.grad_accum} x {s['seq_len']} "
            f"tokens, H {s['inner_steps']}, {s['algorithm']}, {s['codec']} payloads"]


def run_status(args: argparse.Namespace) -> int:
    """Entry point of ``gasloc-node status``; returns the exit code."""
    if not args.endpoint and not args.peers:
        return _fail_config("status", ValueError("give --endpoint HOST:PORT or --peers MADDR"))
    if args.timeout_s <= 0:
        return _fail_config("status", ValueError("--timeout-s must be > 0"))
    if args.endpoint and args.endpoint.startswith("/"):  # a multiaddr: find it via the DHT
        args.peers = [*args.peers, args.endpoint]
        args.node_id = args.endpoint.rsplit("/p2p/", 1)[-1]
        args.endpoint = None
    try:
        check_bootstrap_peers(tuple(args.peers))
        NetworkConfig(swarm_key=args.swarm_key, invitation=args.invitation,
                      owner_key=args.owner_key).validate()
        if args.owner_key and not os.path.exists(args.owner_key):
            raise ConfigError(f"--owner-key={args.owner_key}: no such file")
    except ConfigError as exc:
        return _fail_config("status", exc)
    import uvloop

    try:
        report = uvloop.run(asyncio.wait_for(_status(args), args.timeout_s))
    except Exception as exc:
        print(f"gasloc-node status: error: {_one_line(exc, args)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(report, sort_keys=True))
    else:
        _print_report(report)
    return 0


def _one_line(exc: BaseException, args: argparse.Namespace) -> str:
    """A failure of ``status`` as one line that says what to check."""
    import grpc

    if isinstance(exc, grpc.aio.AioRpcError | grpc.RpcError) and hasattr(exc, "code"):
        details = (exc.details() or "").splitlines()[0] if exc.details() else ""
        return (f"no gasloc node answered at {args.endpoint} ({exc.code().name}: {details}); "
                "check --endpoint: the node's gRPC host:port, printed when it starts")
    if isinstance(exc, TimeoutError):
        return (f"no answer within --timeout-s={args.timeout_s:g}; check --endpoint/--peers "
                "and that the node is running")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if isinstance(exc, OSError) and args.endpoint:  # no TLS answer (its certificate first)
        return (f"no gasloc node answered at {args.endpoint} ({exc.strerror or exc}); check "
                "--endpoint: the node's gRPC host:port, printed when it starts")
    if isinstance(exc, LookupError | ConnectionError):  # its own line names --peers
        return text
    return f"{type(exc).__name__}: {text}"


async def _status(args: argparse.Namespace) -> dict[str, Any]:
    from gasloc_p2p.node.discovery.dht import HivemindDiscovery
    from gasloc_p2p.node.runtime.identity import build_membership
    from gasloc_p2p.node.transport.service import PeerChannels, fetch_info

    report: dict[str, Any] = {"swarm": [], "info": None}
    endpoint, cert, info = args.endpoint, b"", None
    # a throwaway key: enough for an open swarm; a keyed swarm also needs its secret, a closed
    # one an invitation (or the owner key, which invites the throwaway key)
    signer = build_membership(NetworkConfig(
        swarm_key=args.swarm_key, invitation=args.invitation, owner_key=args.owner_key),
        joining=True).signer
    if args.peers:
        dht = HivemindDiscovery(args.run_id, "127.0.0.1", 0, args.peers, args.timeout_s / 2,
                                args.timeout_s, client_mode=True)
        dht.use_identity(signer, 3600.0)  # only reads: records are checked with the secret
        await dht.start()
        try:
            if not args.run_id:  # the run of the node asked, from the manifest it serves
                args.run_id = await _run_of(dht, args.peers) or NodeConfig().discovery.run_id
                dht.use_run(args.run_id)
            peers = await dht.peers()
        finally:
            await dht.stop()
        report["swarm"] = [{k: v for k, v in vars(p).items() if k != "cert"}
                           | {"codecs": list(p.codecs)} for p in peers]
        wanted = getattr(args, "node_id", None)
        if wanted:  # the multiaddr names the node's DHT id: ask each listed node for its own
            endpoint, cert, info = await _endpoint_of_dht_id(peers, wanted, signer, args)
        elif endpoint is None:  # the header describes the node asked: the first of --peers
            asked = args.peers[0].rsplit("/p2p/", 1)[-1]
            try:
                endpoint, cert, info = await _endpoint_of_dht_id(peers, asked, signer, args)
            except LookupError as exc:  # a bare DHT peer, or a node not announced yet
                report["note"] = f"no node header: {exc}"
        else:
            cert = next((p.cert for p in peers if p.endpoint == endpoint), b"")
    if endpoint and info is None:
        from gasloc_p2p.node.transport.tls import fetch_certificate

        if not cert:  # --endpoint alone: trust the certificate the node presents
            cert = await asyncio.to_thread(fetch_certificate, endpoint, args.timeout_s / 2)
        channels = PeerChannels(NetworkConfig())
        try:
            info = await fetch_info(channels.stub(endpoint, cert), args.timeout_s / 2, signer)
        finally:
            await channels.close()
    if info is not None:
        from google.protobuf.json_format import MessageToDict

        report["info"] = MessageToDict(info, preserving_proto_field_name=True,
                                       always_print_fields_with_no_presence=True)
        for field in ("probe_ok", "punch_endpoint"):  # only meaningful in a reachability
            report["info"].pop(field, None)  # probe or a hole punch
    return report


async def _run_of(dht: Any, peers: list[str]) -> str:
    """The run id of the manifest the first of ``peers`` serves ("" if none)."""
    from gasloc_p2p.node.cli_run import served_manifest

    manifest = await served_manifest(dht, peers[0])
    return manifest.run_id if manifest is not None else ""


async def _endpoint_of_dht_id(peers: list[Any], wanted: str, signer: Any,
                              args: argparse.Namespace) -> tuple[str, bytes, Any]:
    """The gRPC endpoint, certificate and Info of the listed node whose DHT id is
    ``wanted``."""
    from gasloc_p2p.node.transport.service import PeerChannels, fetch_info

    channels = PeerChannels(NetworkConfig())
    try:
        for p in peers:
            try:
                info = await fetch_info(channels.stub(p.endpoint, p.cert), args.timeout_s / 4,
                                        signer)
            except Exception:  # noqa: BLE001 - an unreachable node is simply not the one
                continue
            if info.dht_peer_id == wanted:
                return str(p.endpoint), p.cert, info
    finally:
        await channels.close()
    raise LookupError(f"no node with DHT id {wanted} announces itself in run {args.run_id!r} "
                      "(check --run-id; a node appears a few seconds after it starts)")


def _print_report(report: dict[str, Any]) -> None:
    info = report["info"]
    if info is not None and info.get("ok") and not info.get("authenticated"):  # health only
        print(f"node {info['peer_id']} (run {info['run_id']}, v{info['software_version']}) is "
              "up and answered health only: its swarm is closed or keyed; pass your "
              "--invitation, its --owner-key or --swarm-key to see its state")
        info = None
    if info is not None:
        loss = info.get("val_loss", math.nan)
        print(f"node {info['peer_id']} at {info['endpoint']} (run {info['run_id']}, "
              f"v{info['software_version']}): step {info['step']}, rounds {info['rounds']}, "
              f"{float(info['tokens_per_s']):.0f} tok/s, val loss {float(loss):.4f}, exchanges "
              f"{info['exchanges_ok_initiator']} out / {info['exchanges_ok_responder']} in / "
              f"{info['exchanges_failed']} failed, {len(info['peers'])} peers")
        if info.get("algorithm") in ("diloco", "streaming-diloco"):
            print(f"  {info['algorithm']} epoch {info['outer_epoch']}: averaged rounds "
                  f"{info['averaging_rounds_ok']} ok / {info['averaging_rounds_failed']} failed / "
                  f"{info['averaging_rounds_solo']} solo, last group {info['last_group_size']}, "
                  f"last averaging {float(info['last_averaging_s']):.2f} s, resyncs "
                  f"{info['resyncs']}")
        for f in info.get("fragment_syncs", []):
            print(f"    fragment {f.get('index', 0)} at offset {f.get('offset', 0)}: syncs "
                  f"{f.get('syncs_ok', 0)} ok / {f.get('syncs_failed', 0)} failed / "
                  f"{f.get('syncs_solo', 0)} solo, epoch {f.get('epoch', 0)}, "
                  f"{int(f.get('bytes_sent', 0)):,} B sent, stalled "
                  f"{float(f.get('wait_s', 0.0)):.2f} s, resyncs {f.get('resyncs', 0)}")
    if report.get("note"):
        print(report["note"])
    if report["swarm"]:
        print(f"swarm ({len(report['swarm'])} nodes):")
        for p in sorted(report["swarm"], key=lambda p: p["peer_id"]):
            print(f"  {p['peer_id']}  {p['endpoint']:<21}  step {p['step']:>7}  "
                  f"{p['tokens_per_s']:>7.0f} tok/s  {'reachable' if p['reachable'] else 'NAT'}")
