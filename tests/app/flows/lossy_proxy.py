"""A loopback HTTP proxy in front of the test session's Prefect server that loses chosen
responses: the server handles the request, the client never hears back, and retries.

That is what a loaded server or a network hiccup does to a run's final state change: the
server records the new state, the answer is lost, Prefect's client sends the same request
again (same `transition_id`), and the server rejects it as a repeat, answering with the
state it stored. A flow that hands its result back through that state must still finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit

__all__ = ["LossyProxy", "final_state_changes"]

_SET_STATE = re.compile(rb"^POST /api/flow_runs/([0-9a-f-]{36})/set_state ")


def final_state_changes() -> Callable[[bytes, bytes], bool]:
    """A rule that loses the answer to the first request moving each flow run to Completed or
    Failed. (Task runs report their states as events here, not through `set_state`.)"""
    seen: set[bytes] = set()

    def lose(head: bytes, body: bytes) -> bool:
        match = _SET_STATE.match(head)
        if not match or match[1] in seen:
            return False
        if b'"type":"COMPLETED"' not in body and b'"type":"FAILED"' not in body:
            return False
        seen.add(match[1])
        return True

    return lose


class LossyProxy:
    """Forwards every connection to `upstream`; for a request `lose(head, body)` picks, the
    request reaches the server, and once the server starts answering, the client's connection
    is closed instead. `lost` counts the answers lost."""

    def __init__(self, upstream: str, lose: Callable[[bytes, bytes], bool]) -> None:
        parts = urlsplit(upstream)
        assert parts.hostname and parts.port, upstream
        self._upstream = (parts.hostname, parts.port)
        self._path = parts.path
        self._lose = lose
        self.lost = 0
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self._path}"

    @contextmanager
    def running(self) -> Iterator[LossyProxy]:
        loop = asyncio.new_event_loop()
        started = threading.Event()
        stop: asyncio.Event | None = None

        async def serve() -> None:
            nonlocal stop
            stop = asyncio.Event()
            server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            started.set()
            async with server:
                await stop.wait()

        thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
        thread.start()
        assert started.wait(10), "the proxy did not start"
        try:
            yield self
        finally:
            assert stop is not None
            loop.call_soon_threadsafe(stop.set)
            thread.join(10)

    async def _connection(
        self, client_in: asyncio.StreamReader, client_out: asyncio.StreamWriter
    ) -> None:
        try:
            server_in, server_out = await asyncio.open_connection(*self._upstream)
        except OSError:
            client_out.close()
            return
        try:
            await self._requests(client_in, client_out, server_in, server_out)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            client_out.close()
            server_out.close()

    async def _requests(
        self,
        client_in: asyncio.StreamReader,
        client_out: asyncio.StreamWriter,
        server_in: asyncio.StreamReader,
        server_out: asyncio.StreamWriter,
    ) -> None:
        """One HTTP/1.1 request at a time (Prefect's client does not pipeline); an upgraded
        connection (the events websocket) is piped both ways untouched."""
        answer = asyncio.ensure_future(_pipe(server_in, client_out))
        try:
            while True:
                head = await client_in.readuntil(b"\r\n\r\n")
                length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
                body = await client_in.readexactly(int(length[1])) if length else b""
                if re.search(rb"(?im)^upgrade:", head):
                    server_out.write(head + body)
                    await _pipe(client_in, server_out)
                    return
                if self._lose(head, body):
                    answer.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await answer
                    server_out.write(head + body)
                    await server_out.drain()
                    await server_in.read(1)  # the server has handled it and is answering
                    self.lost += 1
                    return
                server_out.write(head + body)
                await server_out.drain()
        finally:
            answer.cancel()


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    while data := await source.read(1 << 16):
        sink.write(data)
        await sink.drain()
    sink.close()
