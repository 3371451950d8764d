"""A TCP proxy that can freeze or cut its connections, to simulate a network that silently
drops packets, or one that breaks connections."""

from __future__ import annotations

import socket
import struct
import threading


class FreezableProxy:
    """Forwards 127.0.0.1:port to a target; new connections always work.

    `freeze()` blackholes every open connection (bytes are read and dropped, nothing
    is closed); `cut()` resets every open connection (both ends see it broken)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._frozen: set[int] = set()
        self._generation = 0
        self._lock = threading.Lock()
        self._closed = False
        self._sockets: dict[int, list[socket.socket]] = {}
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        with self._lock:
            self._frozen.add(self._generation)
            self._generation += 1

    def cut(self) -> None:
        with self._lock:
            generation = self._generation
            self._generation += 1
            sockets = self._sockets.pop(generation, [])
        for s in sockets:
            _reset(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                _reset(client)
                continue
            with self._lock:
                generation = self._generation
                self._sockets.setdefault(generation, []).extend((client, upstream))
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(src, dst, generation), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, generation: int) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if generation in self._frozen:
                    continue  # blackholed
                dst.sendall(data)
        except OSError:
            pass
        finally:
            if generation not in self._frozen:
                for s in (src, dst):
                    try:
                        s.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            sockets = [s for group in self._sockets.values() for s in group]
            self._sockets.clear()
        for s in sockets:
            _reset(s)


def _reset(s: socket.socket) -> None:
    """Close with a TCP reset, as a broken network path or a dying middlebox would."""
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.shutdown(socket.SHUT_RD)  # wakes the pump blocked reading it, sends nothing
    except OSError:
        pass
    try:
        s.close()  # with linger 0: a reset
    except OSError:
        pass
