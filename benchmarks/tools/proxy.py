"""An on-path TCP relay: records what crosses it and can change bytes (tamper tests)."""

from __future__ import annotations

import asyncio
import contextlib


class Proxy:
    """A TCP relay to ``target`` (host, port). It records both directions in ``seen`` and,
    from byte ``tamper_after`` of a direction on (-1: never), flips one byte in every 4 KiB
    (``flip_up``: the client's bytes, else the server's)."""

    def __init__(self, target: tuple[str, int], tamper_after: int = -1,
                 flip_up: bool = False) -> None:
        self.target, self.tamper_after, self.flip_up = target, tamper_after, flip_up
        self.seen = bytearray()
        self.up: list[bytearray] = []  # the client's bytes, per connection
        self.flipped = 0
        self.server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1") -> str:
        self.server = await asyncio.start_server(self._relay, host, 0)
        return f"{host}:{self.server.sockets[0].getsockname()[1]}"

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(*self.target)
        self.up.append(bytearray())

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
            passed = 0
            try:
                while data := await src.read(65536):
                    self.seen += data
                    if up:
                        self.up[-1] += data
                    if up == self.flip_up and self.tamper_after >= 0:
                        data = self._tamper(bytearray(data), passed)
                    passed += len(data)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                dst.close()

        with contextlib.suppress(asyncio.CancelledError):  # the relay closes: they end
            await asyncio.gather(pump(reader, up_w, True), pump(up_r, writer, False))

    def _tamper(self, data: bytearray, offset: int) -> bytes:
        for i in range(len(data)):
            if offset + i >= self.tamper_after and (offset + i) % 4096 == 0:
                data[i] ^= 0x5A
                self.flipped += 1
        return bytes(data)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def replay(target: tuple[str, int], data: bytes, wait_s: float = 3.0) -> bytes:
    """Send recorded bytes to ``target`` on a new connection; what comes back within
    ``wait_s``."""
    reader, writer = await asyncio.open_connection(*target)
    writer.write(data)
    await writer.drain()
    got = bytearray()
    try:
        async with asyncio.timeout(wait_s):
            while chunk := await reader.read(65536):
                got += chunk
    except (TimeoutError, ConnectionError):
        pass
    writer.close()
    return bytes(got)
