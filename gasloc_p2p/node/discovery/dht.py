"""Discovery over a hivemind DHT run in a child process (with its p2pd)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from gasloc_p2p.node.discovery.base import Discovery, PeerInfo, revocation_key, run_key
from gasloc_p2p.node.discovery.records import make_validator, signed_value, verify_record
from gasloc_p2p.protocol.membership import RevocationList

log = logging.getLogger(__name__)
# hivemind's default (3 s) is often too short for a clean DHT + p2pd stop on a loaded machine.
DHT_SHUTDOWN_GRACE_S = 6.0
REJOIN_S = 15.0  # alone in the DHT: ping the --peers again at most this often
REJOIN_WAIT_S = 5.0  # for their answers


def _default_signals_in_child() -> None:
    """After a fork: SIGTERM back to its default, SIGINT ignored, no wakeup fd.

    The node's event loop routes these signals to a wakeup fd with no-op handlers; a forked
    child (the DHT process) would inherit that and silently ignore SIGTERM, so neither
    ``DHT.shutdown``'s terminate nor a group kill could stop it. SIGINT is ignored: a
    terminal's Ctrl+C reaches the whole foreground process group, and the node stops its DHT
    (and the DHT its p2pd, which inherits the ignored SIGINT) in order; interrupted at once,
    they would log p2pd's accept errors and hivemind's "terminating it the hard way".
    """
    with contextlib.suppress(ValueError, OSError):
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)


_FORK_HOOK = threading.Lock()
_fork_hook_installed = False


def _install_fork_hook() -> None:
    global _fork_hook_installed
    with _FORK_HOOK:
        if not _fork_hook_installed:
            os.register_at_fork(after_in_child=_default_signals_in_child)
            _fork_hook_installed = True


def _ended(code: int) -> str:
    """``signal SIGSEGV`` or ``exit code 3``: how the DHT process ended (its exit code)."""
    names = {-s.value: s.name for s in signal.Signals}
    return f"signal {names[code]}" if code in names else f"exit code {code}"


def _descendants(pid: int) -> list[int]:
    """Live descendants of ``pid`` (children first), from /proc."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (not gone, not a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


async def _install_parent_watchdog(_dht: Any, node: Any, parent_pid: int,
                                   period_s: float) -> None:
    """Runs inside the DHT process: if the node process dies (even by SIGKILL), shut the DHT
    and its p2pd down instead of leaving orphans. Module level: it is pickled by name. (The
    node's pid, not the DHT's parent: a DHT started through a fork server has the server as
    its parent.)"""

    async def watch() -> None:
        while process_alive(parent_pid):
            await asyncio.sleep(period_s)
        try:
            await asyncio.wait_for(node.shutdown(), 5.0)
        finally:
            os._exit(0)

    node._gasloc_watchdog = asyncio.get_running_loop().create_task(watch())


START_METHOD = "GASLOC_DHT_START"  # "forkserver": DHT processes from a clean fork server
# the start method when the variable is not set: the tests' processes set "forkserver" here
# (in-process nodes of a threaded test runner); node processes they start, single-threaded
# when their DHT starts, keep the plain fork (a fork server costs a node 2-3 s to start)
DEFAULT_START = "fork"


def dht_class(hivemind: Any) -> Any:
    """hivemind's DHT, or with ``GASLOC_DHT_START=forkserver`` one started by a fork server:
    hivemind forks its DHT process from the node's, and a fork of a process with threads
    (the test runner's, after hundreds of tests) can inherit a lock held by another thread
    and crash (seen as SIGSEGV in CI). The server is a fresh interpreter that has imported
    hivemind and started no thread; the tests' own processes use it (:data:`DEFAULT_START`;
    the node's own start forks before its threads do work)."""
    if (os.environ.get(START_METHOD) or DEFAULT_START) != "forkserver":
        return hivemind.DHT
    import multiprocessing

    multiprocessing.set_forkserver_preload(["hivemind"])  # (once the server runs: no effect)
    return __getattr__("ServedDHT")


_SERVED: list[Any] = []


def __getattr__(name: str) -> Any:
    """``ServedDHT``, made on first use (it subclasses hivemind's DHT, imported lazily) and
    found by this name when a fork server's child unpickles it."""
    if name != "ServedDHT":
        raise AttributeError(name)
    if not _SERVED:
        from multiprocessing.context import ForkServerProcess

        import hivemind

        class ServedDHT(hivemind.DHT):
            @staticmethod
            def _Popen(process_obj: Any) -> Any:
                return ForkServerProcess._Popen(process_obj)

        ServedDHT.__qualname__ = "ServedDHT"
        _SERVED.append(ServedDHT)
    return _SERVED[0]


class HivemindDiscovery(Discovery):
    """Discovery over a hivemind DHT started in a child process (with its p2pd)."""

    def __init__(self, run_id: str, host: str, port: int, initial_peers: Sequence[str],
                 timeout_s: float, start_timeout_s: float, client_mode: bool = False,
                 identity_path: str = "") -> None:
        """``identity_path``: the DHT's libp2p key file (made at the first start), so its
        peer id, and the multiaddrs others bootstrap from, survive restarts ("": a new key at
        each start)."""
        self.key = run_key(run_id)
        self.revoked_key = revocation_key(run_id)
        self.host, self.port = host, port
        self.initial_peers = list(initial_peers)
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self.client_mode = client_mode
        self.identity_path = identity_path
        self.peer_id = ""  # the node's key-derived id (use_identity), else the DHT's
        self.dht_peer_id = ""  # libp2p id of the DHT node (bootstrap multiaddrs)
        self._rejoined = -REJOIN_S  # when the --peers were last pinged again (monotonic)
        self._dht: Any = None
        self._pipe_lock = threading.Lock()  # the DHT's request pipe is not thread-safe

    def use_run(self, run_id: str) -> None:
        """Read and write ``run_id``'s records from now on (a one-shot command that learns
        the run after the start: ``status``, ``revoke``). The DHT process's validator keeps
        the start's run; records of other keys pass it, and their readers check them."""
        self.key, self.revoked_key = run_key(run_id), revocation_key(run_id)

    @property
    def dht(self) -> Any:
        """The running ``hivemind.DHT`` (None before start and after stop)."""
        return self._dht

    def averaging_backend(self) -> Any:
        """The running DHT: hivemind averaging runs on it rather than on a second DHT."""
        if self._dht is None:
            raise RuntimeError("the DHT is not running (start the discovery first)")
        return self._dht

    async def start(self) -> None:
        # the thread bounds each attempt itself; the grace covers shutting a hung one down
        starting = asyncio.ensure_future(asyncio.wait_for(
            asyncio.to_thread(self._start), self.start_timeout_s + 2 * DHT_SHUTDOWN_GRACE_S + 5.0))
        try:
            await asyncio.shield(starting)
        except asyncio.CancelledError:  # a stop while starting: the DHT process it forked
            with contextlib.suppress(BaseException):  # must not outlive this one
                await starting
            await self.stop()
            raise

    def _start(self) -> None:
        import hivemind  # heavy import, only where a DHT is used

        _install_fork_hook()
        # p2pd's own log (Go) is re-logged by hivemind; at a terminal's Ctrl+C p2pd gets the
        # SIGINT too (libuv resets the ignored disposition when it spawns it) and reports its
        # closed socket at ERROR. The node stops the DHT itself: keep p2pd to fatal errors
        # unless the user asked for its logs (GOLOG_LOG_LEVEL) or for hivemind's debug output.
        if os.environ.get("HIVEMIND_LOGLEVEL", "").upper() != "DEBUG":
            os.environ.setdefault("GOLOG_LOG_LEVEL", "fatal")
        if self.identity_path and not os.path.exists(self.identity_path):  # made here: quiet
            from hivemind.p2p import P2P

            P2P.generate_identity(self.identity_path)
        maddr = f"/ip{6 if ':' in self.host else 4}/{self.host}/tcp/{self.port}"
        # our records are checked inside the DHT too: honest DHT nodes refuse to store a forged
        # or overwriting record, and drop one that another DHT node returns
        validator = make_validator(self.key, self.verifier, self.max_ttl_s, self.revoked_key)
        # A DHT process that is not ready within an attempt is shut down (killed with its
        # p2pd if need be) and started again: on a loaded machine a start was seen to hang
        # for the whole timeout (tests/test_node_security.py, 2026-11-27, load 3.6), where
        # starts take seconds.
        deadline = time.monotonic() + self.start_timeout_s
        # (attempts of 20 s at least, a quarter of the timeout: a DHT that starts takes 1-3 s
        # here even loaded; two hangs in a row were seen with attempts of half the timeout)
        attempt = min(self.start_timeout_s, max(20.0, self.start_timeout_s / 4))
        while True:
            wait = min(attempt, deadline - time.monotonic())
            try:
                self._start_once(hivemind, maddr, validator, wait)
                break
            except TimeoutError:
                if deadline - time.monotonic() < 5.0:
                    raise
                log.warning("the DHT was not ready after %.0f s; starting it again", wait)
            except ChildProcessError as exc:
                # seen once in a loaded test run: the forked DHT process died (SIGSEGV) before it
                # was ready; a fresh fork starts normally
                if deadline - time.monotonic() < 5.0:
                    raise TimeoutError(f"the DHT could not start: {exc}") from None
                log.warning("%s; starting it again", exc)
        self.dht_peer_id = self._dht.peer_id.to_base58()
        self.peer_id = self.peer_id or self.dht_peer_id
        watchdog = partial(_install_parent_watchdog, parent_pid=os.getpid(), period_s=1.0)
        self._call(lambda: self._dht.run_coroutine(watchdog, return_future=True))

    def _start_once(self, hivemind: Any, maddr: str, validator: Any, wait_s: float) -> None:
        """One DHT process, ready within ``wait_s`` (else shut down: TimeoutError)."""
        # hivemind's check that a kept identity is not in use elsewhere starts a second p2pd
        # and dials the swarm at every start: one node holds its key file (state_dir's lock)
        identity = ({"identity_path": self.identity_path, "check_if_identity_free": False}
                    if self.identity_path else {})
        self._dht = dht_class(hivemind)(initial_peers=self.initial_peers or None,
                                        host_maddrs=[maddr],
                                 client_mode=self.client_mode, start=True, await_ready=False,
                                 shutdown_timeout=DHT_SHUTDOWN_GRACE_S,
                                 record_validators=[validator], **identity)
        try:
            # in slices: a DHT process that dies before it is ready never answers, and waiting
            # out the attempt for it would spend half the start timeout on a corpse
            until = time.monotonic() + wait_s
            while True:
                try:
                    self._dht.wait_until_ready(timeout=min(0.5, max(until - time.monotonic(), 0)))
                    break
                except TimeoutError:
                    code = self._dht.exitcode
                    if code is not None:
                        raise ChildProcessError(
                            f"the DHT process exited while starting ({_ended(code)})") from None
                    if time.monotonic() >= until:
                        raise
        except BaseException as exc:
            dht, self._dht = self._dht, None  # a later stop has nothing left to stop
            self._shutdown(dht)
            if "failed to connect to bootstrap peers" in str(exc):
                raise ConnectionError(
                    f"no bootstrap peer answered (--peers {' '.join(self.initial_peers)}): "
                    "check that the node there is running, that its DHT address and port are "
                    "reachable from here (firewall, its --host/--dht-port), and that you pasted "
                    "the multiaddr it printed") from None
            raise

    def _call(self, submit: Any) -> Any:
        """Submit a DHT request (serialised) and wait for it with the timeout; in a thread."""
        with self._pipe_lock:
            future = submit()
        return future.result(timeout=self.timeout_s)

    async def announce(self, info: PeerInfo, ttl_s: float) -> None:
        from hivemind.utils import get_dht_time

        assert self.signer is not None, "use_identity first: records are signed"
        expiration = get_dht_time() + ttl_s
        value = signed_value(self.key, info, self.signer, expiration)
        ok = await asyncio.to_thread(self._call, lambda: self._dht.store(
            self.key, value, expiration, subkey=info.peer_id, return_future=True))
        if not ok:
            log.debug("DHT store of this node's announcement was not accepted")

    async def peers(self) -> list[PeerInfo]:
        from hivemind.utils import get_dht_time

        try:
            found = await asyncio.to_thread(self._call, lambda: self._dht.get(
                self.key, latest=True, return_future=True))
        except Exception:  # a lookup that times out: alone, perhaps
            await self._rejoin_if_alone([])
            raise
        if found is None or not isinstance(found.value, dict):
            await self._rejoin_if_alone([])
            return []
        out, now = [], get_dht_time()
        for subkey, item in found.value.items():  # checked again: the validator is per node
            info = verify_record(self.key, subkey, getattr(item, "value", None),
                                 getattr(item, "expiration_time", None), self.verifier, now,
                                 self.max_ttl_s)
            if info is not None:
                out.append(info)
        await self._rejoin_if_alone(out)
        return out

    async def _rejoin_if_alone(self, found: list[PeerInfo]) -> None:
        """Alone in the DHT (no record but our own, or no DHT peer known: records cached here
        outlive the peers that stored them): ping the ``--peers`` again. Checked at most every
        :data:`REJOIN_S`. The DHT bootstraps from them once, at its start; a member whose only
        bootstrap peer restarted (an owner's node, often the one reachable peer) stayed alone
        for good (peers 0 on both sides minutes after the restart)."""
        if not self.initial_peers or time.monotonic() - self._rejoined < REJOIN_S:
            return
        self._rejoined = time.monotonic()
        try:
            if any(p.peer_id != self.peer_id for p in found) and await asyncio.to_thread(
                    self._call, lambda: self._dht.run_coroutine(_known_peers,
                                                                return_future=True)):
                return
            rejoin = partial(_rejoin, maddrs=list(self.initial_peers), timeout_s=REJOIN_WAIT_S)
            answered = await asyncio.to_thread(self._call, lambda: self._dht.run_coroutine(
                rejoin, return_future=True))
        except Exception as exc:  # noqa: BLE001 - a failed rejoin is tried again later
            log.info("no peer in the DHT; pinging the --peers again failed: %s", exc)
            return
        log.info("no peer in the DHT: pinged the --peers again, %d of %d answered", answered,
                 len(self.initial_peers))

    async def revocations(self) -> RevocationList | None:
        admission = self.verifier.admission
        if admission is None:
            return None
        found = await asyncio.to_thread(self._call, lambda: self._dht.get(
            self.revoked_key, latest=True, return_future=True))
        if found is None or not isinstance(found.value, dict):
            return None
        item = found.value.get(admission.owner.hex())
        return RevocationList.from_value(getattr(item, "value", None), admission.owner,
                                         getattr(item, "expiration_time", None))

    async def publish_revocations(self, rl: RevocationList) -> None:
        await asyncio.to_thread(self._call, lambda: self._dht.store(
            self.revoked_key, rl.to_value(), rl.expires, subkey=rl.owner.hex(),
            return_future=True))

    async def serve_manifest(self, text: str) -> None:
        """Answer other nodes' manifest requests (over this DHT's libp2p host) with ``text``."""
        await asyncio.to_thread(self._call, lambda: self._dht.run_coroutine(
            partial(_serve_manifest, text=text), return_future=True))

    async def ask_manifest(self, dht_peer_id: str) -> str:
        """The manifest the node with libp2p id ``dht_peer_id`` serves ("" if none); libp2p
        authenticates that id, so it is that very node's answer."""
        return str(await asyncio.to_thread(self._call, lambda: self._dht.run_coroutine(
            partial(_ask_manifest, peer_id=dht_peer_id, timeout_s=self.timeout_s / 2),
            return_future=True)))

    async def visible_addrs(self) -> list[str]:
        addrs = await asyncio.to_thread(self._call, lambda: self._dht.run_coroutine(
            partial(_visible_maddrs), return_future=True))
        return [str(a) for a in addrs]

    async def stop(self) -> None:
        dht, self._dht = self._dht, None
        if dht is not None:
            await asyncio.to_thread(self._shutdown, dht)

    @staticmethod
    def _shutdown(dht: Any) -> None:
        """Graceful DHT shutdown; if it hangs, kill the DHT process and its p2pd."""
        hivemind_log = logging.getLogger("hivemind.dht.dht")
        level, started = hivemind_log.level, time.monotonic()
        hivemind_log.setLevel(logging.ERROR)  # its "terminating it the hard way": said below
        try:
            dht.shutdown()
        except OSError:  # its control pipe is closed already: the kill below still applies
            pass
        finally:
            hivemind_log.setLevel(level)
        dht.join(2.0)
        if time.monotonic() - started > DHT_SHUTDOWN_GRACE_S:
            log.info("the DHT took %.1f s to stop and was terminated", time.monotonic() - started)
        if dht.is_alive():
            log.warning("DHT process %s ignored shutdown; killing it and its p2pd", dht.pid)
            for pid in [*_descendants(dht.pid), dht.pid]:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            dht.join(5.0)


MANIFEST_HANDLER = "gasloc.v1.manifest"
MAX_MANIFEST_CHARS = 16 * 1024


async def _serve_manifest(_dht: Any, node: Any, text: str) -> None:
    """Runs inside the DHT process: answer manifest requests over libp2p with ``text``."""
    from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb

    async def handler(_request: Any, _context: Any) -> Any:
        return pb.ManifestReply(manifest_json=text)

    await node.p2p.add_protobuf_handler(MANIFEST_HANDLER, handler, pb.ManifestRequest)


async def _ask_manifest(_dht: Any, node: Any, peer_id: str, timeout_s: float) -> str:
    """Runs inside the DHT process: the manifest the peer with libp2p id ``peer_id`` serves
    ("" if it serves none or does not answer in time)."""
    from hivemind.p2p import PeerID

    from gasloc_p2p.proto_gen.gasloc.v1 import gasloc_pb2 as pb

    try:
        reply = await asyncio.wait_for(node.p2p.call_protobuf_handler(
            PeerID.from_base58(peer_id), MANIFEST_HANDLER, pb.ManifestRequest(),
            pb.ManifestReply), timeout_s)
    except Exception:  # noqa: BLE001 - no handler, gone, slow: no manifest from it
        return ""
    return str(reply.manifest_json)[:MAX_MANIFEST_CHARS + 1]


async def _known_peers(_dht: Any, node: Any) -> int:
    """Runs inside the DHT process: how many DHT peers its routing table holds."""
    return len(node.protocol.routing_table.uid_to_peer_id)


async def _rejoin(_dht: Any, node: Any, maddrs: list[str], timeout_s: float) -> int:
    """Runs inside the DHT process: dial and ping each bootstrap multiaddr (what the DHT
    does once at its start); how many answered within ``timeout_s``."""
    from hivemind.p2p import PeerID
    from hivemind.utils.multiaddr import Multiaddr

    async def one(text: str) -> bool:
        ma = Multiaddr(text)
        peer = PeerID.from_base58(ma["p2p"])
        with contextlib.suppress(Exception):  # known already, or gone: the ping says
            await node.p2p._client.connect(peer, [ma.decapsulate(Multiaddr(f"/p2p/{ma['p2p']}"))])
        return await node.protocol.call_ping(peer) is not None

    try:
        done = await asyncio.wait_for(asyncio.gather(*(one(m) for m in maddrs),
                                                     return_exceptions=True), timeout_s)
    except TimeoutError:
        return 0
    return sum(d is True for d in done)


async def _visible_maddrs(_dht: Any, node: Any) -> list[Any]:
    """Runs inside the DHT process (module level: pickled by name)."""
    return list(await node.get_visible_maddrs())
