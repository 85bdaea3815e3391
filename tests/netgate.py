"""A TCP forwarder a test puts in front of a server to cut its HTTP side: up, down (connections refused,
open ones cut) or frozen (connections accepted, never answered). The server behind it keeps its state."""

from __future__ import annotations

import asyncio


class NetGate:
    """``await NetGate.open(target_port)``; ``.url``; ``await .down()`` / ``await .up()``; ``.freeze()`` /
    ``.thaw()``; ``await .close()``. ``accepted`` counts connections accepted while up."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self.accepted = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._thawed = asyncio.Event()
        self._thawed.set()

    @classmethod
    async def open(cls, target_port: int) -> "NetGate":
        g = cls(target_port)
        await g.up()
        return g

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def up(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    async def down(self) -> None:
        """Stop listening and cut every open connection (kept-alive ones too)."""
        if self._server is not None:
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            await self._server.wait_closed()
            self._server = None
        self._writers.clear()

    def freeze(self) -> None:
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    async def close(self) -> None:
        self.thaw()
        await self.down()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            if not self._thawed.is_set():  # frozen: hold the connection, answer nothing, then drop it
                await self._thawed.wait()
                return
            self.accepted += 1
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port)
            self._writers.add(up_w)
            try:
                await asyncio.gather(_pipe(reader, up_w), _pipe(up_r, writer))
            finally:
                self._writers.discard(up_w)
                up_w.close()
        except (ConnectionError, OSError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


async def _pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    try:
        while True:
            data = await r.read(65536)
            if not data:
                break
            w.write(data)
            await w.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        try:
            w.write_eof()
        except (OSError, RuntimeError, AttributeError):
            pass
