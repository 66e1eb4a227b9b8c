"""A TCP relay on loopback that breaks the next message crossing it, on real sockets.

    prefill's sender ──▶ FaultyLink (127.0.0.1:port) ──▶ decode's KV listener (target port)

The decode side advertises the relay's port (`kv_transfer.advertise_port`), so every KV push
crosses it. `arm(mode)` breaks the next burst of bytes from a sender (the start of the next
KV message): half of it is forwarded, then
    reset     both connections are closed with an RST (SO_LINGER 0)
    truncate  both connections are closed cleanly (FIN) mid-message
    stall     the rest is held for `hold_s`, then forwarded and relaying goes on
`broken` is set once the fault has happened (`released`, `released_at` once a stall is over).
"""

from __future__ import annotations

import socket
import struct
import threading
import time


class FaultyLink:
    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self._server = socket.create_server((host, 0))
        self.port = self._server.getsockname()[1]
        self._lock = threading.Lock()
        self._mode: str | None = None
        self._hold_s = 0.0
        self.broken = threading.Event()
        self.released = threading.Event()
        self.released_at = 0.0  # wall time a stall ended
        self._closed = False
        threading.Thread(target=self._accept_forever, daemon=True).start()

    def arm(self, mode: str, hold_s: float = 0.0) -> None:
        assert mode in ("reset", "truncate", "stall"), mode
        with self._lock:
            self._mode, self._hold_s = mode, hold_s
            self.broken.clear()
            self.released.clear()

    def close(self) -> None:
        self._closed = True
        self._server.close()

    def _accept_forever(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _take_fault(self) -> tuple[str | None, float]:
        with self._lock:
            mode, self._mode = self._mode, None
            return mode, self._hold_s

    def _pump(self, src: socket.socket, dst: socket.socket, outbound: bool) -> None:
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                mode, hold_s = self._take_fault() if outbound else (None, 0.0)
                if mode is None:
                    dst.sendall(data)
                    continue
                dst.sendall(data[: len(data) // 2])
                if mode == "stall":
                    self.broken.set()
                    time.sleep(hold_s)
                    self.released_at = time.time()
                    dst.sendall(data[len(data) // 2:])
                    self.released.set()
                    continue
                if mode == "reset":
                    for s in (src, dst):
                        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.broken.set()
                break
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass
