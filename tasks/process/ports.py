"""A free TCP port, for the processes a run starts: inference servers and the trainer
ranks' rendezvous.

Its own module so that the trainer-rank modules need not import the embedded server's.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
