"""Request and reply frames to a sandboxed function server, with a deadline on every wait.

The parent talks to the child only through the child's stdin and stdout (for a
container, the attach socket that carries both). `Channel.exchange` writes one request
frame and returns the next whole reply frame; while it waits it also drains the child's
stderr (where the child's own prints go), so a chatty child cannot stall on a full pipe.
Every wait polls with the time left to the caller's deadline: a child that stops
answering costs `TimeoutError` at the deadline, one that exits `ChannelClosed`, one
that sends a frame over the size limit or too much stderr `ChannelBroken`.
"""

from __future__ import annotations

import os
import select
import struct
import subprocess
import time

from sluice.engines.env.wire import FrameBuffer, WireError

MAX_STDERR_BYTES = 1 << 20
"""The child's stderr kept (its prints and tracebacks); more stops the conversation."""
_EVENTS_IN = select.POLLIN | select.POLLHUP | select.POLLERR


class ChannelClosed(Exception):
    """The child's side ended (it exited, or was killed) before replying."""


class ChannelBroken(Exception):
    """The child sent something the protocol refuses (an oversized frame, too much stderr)."""


class Channel:
    """Frames over file descriptors: requests to `write_fd`, replies from `read_fds`
    (`_route` says which bytes are frames and which are stderr)."""

    def __init__(self, write_fd: int, read_fds: list[int]) -> None:
        self._write_fd = write_fd
        self._open = set(read_fds)
        self._frames = FrameBuffer()
        self.stderr = bytearray()
        self.ended = False
        os.set_blocking(write_fd, False)

    def _route(self, fd: int, data: bytes) -> None:
        raise NotImplementedError

    def _frame_bytes(self, data: bytes) -> None:
        try:
            self._frames.feed(data)
        except WireError as exc:
            raise ChannelBroken(str(exc)) from None

    def _stderr_bytes(self, data: bytes) -> None:
        room = MAX_STDERR_BYTES - len(self.stderr)
        self.stderr += data[: max(room, 0)]
        if len(data) > room:
            raise ChannelBroken(f"more than {MAX_STDERR_BYTES} bytes of output")

    def exchange(self, request: bytes, deadline: float) -> bytes:
        """Send `request` (a whole frame), then return the body of the next frame."""
        pending = memoryview(request)
        while True:
            if not pending:
                body = self._frames.next()
                if body is not None:
                    return body
                if self.ended:
                    raise ChannelClosed("the sandboxed process ended")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the sandboxed call ran past its deadline")
            masks = {fd: _EVENTS_IN for fd in self._open}
            if pending:
                masks[self._write_fd] = masks.get(self._write_fd, 0) | select.POLLOUT
            if not masks:
                raise ChannelClosed("the sandboxed process ended")
            poller = select.poll()
            for fd, mask in masks.items():
                poller.register(fd, mask)
            for fd, event in poller.poll(max(1, int(remaining * 1000))):
                if pending and fd == self._write_fd and event & (select.POLLOUT | select.POLLERR):
                    pending = pending[self._write(pending) :]
                if fd in self._open and event & _EVENTS_IN:
                    self._read(fd)

    def _write(self, data: memoryview) -> int:
        try:
            return os.write(self._write_fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # a broken pipe or reset socket: the child is gone
            self.ended = True
            raise ChannelClosed("the sandboxed process ended") from None

    def _read(self, fd: int) -> None:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self._route(fd, data)
        else:
            self._open.discard(fd)
            self._on_eof(fd)

    def _on_eof(self, fd: int) -> None:
        self.ended = True


class PipeChannel(Channel):
    """A child process's stdin, stdout (frames) and stderr pipes."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        assert process.stdin and process.stdout and process.stderr
        self._stdout, self._stderr_fd = process.stdout.fileno(), process.stderr.fileno()
        super().__init__(process.stdin.fileno(), [self._stdout, self._stderr_fd])

    def _route(self, fd: int, data: bytes) -> None:
        if fd == self._stdout:
            self._frame_bytes(data)
        else:
            self._stderr_bytes(data)

    def _on_eof(self, fd: int) -> None:
        self.ended = self.ended or fd == self._stdout


_STREAM_HEADER = struct.Struct(">BxxxI")


class MultiplexedChannel(Channel):
    """A container's attach socket: stdin written as is; stdout and stderr come back
    in Docker's stream frames (one byte naming the stream, three zero bytes, a 4-byte
    length), which are taken apart here."""

    def __init__(self, fd: int) -> None:
        super().__init__(fd, [fd])
        self._raw = bytearray()

    def _route(self, fd: int, data: bytes) -> None:
        self._raw += data
        while len(self._raw) >= _STREAM_HEADER.size:
            stream, size = _STREAM_HEADER.unpack_from(self._raw)
            end = _STREAM_HEADER.size + size
            if len(self._raw) < end:
                return
            chunk = bytes(self._raw[_STREAM_HEADER.size : end])
            del self._raw[:end]
            if stream == 1:
                self._frame_bytes(chunk)
            else:
                self._stderr_bytes(chunk)
