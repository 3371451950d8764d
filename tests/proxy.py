"""A TCP proxy that can freeze its connections, to simulate a network that silently drops."""

from __future__ import annotations

import socket
import threading


class FreezableProxy:
    """Forwards 127.0.0.1:port to a target; `freeze()` blackholes every open connection
    (bytes are read and dropped, nothing is closed), while new connections work."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._frozen: set[int] = set()
        self._generation = 0
        self._lock = threading.Lock()
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        with self._lock:
            self._frozen.add(self._generation)
            self._generation += 1

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                generation = self._generation
                self._sockets += [client, upstream]
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
        for s in self._sockets:
            try:
                s.close()
            except OSError:
                pass
