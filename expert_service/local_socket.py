"""A worker's same-host door: Forward over a UNIX socket, as framed protobuf messages (colibri_common/frames.py).

A router on the same host (a `colibri serve` fleet) sends each MoE layer here instead of through a gRPC stream:
the same ForwardRequest bytes, without HTTP/2 framing, flow control and gRPC's polling threads, which on a
2-core machine took a third of a one-stream decode step. gRPC stays the control plane (Describe, health,
reflection) and the path between hosts.

The socket lives in a directory only the fleet's user can enter (the launcher makes it, mode 0700) and is
itself mode 0600. Each connection gets a thread that answers its frames in order and one that reads them in
meanwhile (so both directions flow at once); a frame over the size limit or broken framing closes that
connection alone. At most `max_connections` are served at once (beyond, a new
connection is answered RESOURCE_EXHAUSTED and closed).

With a native door (expert_service/door.py) a connection has one thread, which stays in native code: it reads each
frame, answers the plain calls itself, and writes their replies while it reads what the router writes meanwhile;
it hands Python only the frames it does not answer, and writes Python's reply the same way. What that saves is the
Python of every call and the hand-over between two threads (~0.1 ms a layer on the 2-core VMs).
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import grpc

from colibri_common.errors import ColibriError
from colibri_common.frames import FrameError, over_limit, recv_frame, send_frame
from kernels import native_door

log = logging.getLogger("colibri.expert")
Answer = Callable[[bytes | bytearray], tuple[int, bytes | memoryview]]   # request payload -> (status, reply or message)


class LocalServer:
    def __init__(self, path: str | Path, answer: Answer, limit: int, max_connections: int,
                 door: native_door.Door | None = None) -> None:
        self.path = Path(path)
        self.answer, self.limit, self.max_connections = answer, limit, max_connections
        self.door = door
        self._open = 0
        self._lock = threading.Lock()
        self._closed = threading.Event()
        if self.path.is_socket():                         # a restarted worker's old socket
            self.path.unlink()
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)                             # created 0600: only this user connects
        try:
            self.sock.bind(str(self.path))
        except OSError as exc:                            # no such directory, no permission: one line at start
            self.sock.close()
            raise ColibriError(f"--local-socket {self.path}: {exc.strerror or exc}") from None
        finally:
            os.umask(old)
        self.sock.listen(16)
        threading.Thread(target=self._accept, name="local-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return                                    # closed
            with self._lock:
                full = self._open >= self.max_connections
                self._open += not full
            if full:
                try:
                    send_frame(conn, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
                               f"this worker serves {self.max_connections} connections at most".encode())
                finally:
                    conn.close()
                continue
            threading.Thread(target=self._serve if self.door is None else self._serve_door, args=(conn,),
                             name="local-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        """Answer the connection's frames in order, while a reader thread takes the next ones in: a router with
        two micro-batches in flight writes a layer's request while this thread writes the other's reply, and
        neither side may wait for the other to read (megabytes each way fill both sockets' buffers)."""
        frames: queue.SimpleQueue[bytes | bytearray | None] = queue.SimpleQueue()     # at most a router's micro-batches
        threading.Thread(target=self._read, args=(conn, frames), name="local-read", daemon=True).start()
        try:
            while (payload := frames.get()) is not None:
                status, reply = self.answer(payload)
                send_frame(conn, status, reply)
        except OSError:
            pass                                          # the router went away mid-write
        finally:
            self._end(conn)                               # shut: the reader's recv returns, it ends too

    def _serve_door(self, conn: socket.socket) -> None:
        """The connection in the native door: Python answers the frames it returns, until the connection ends."""
        door, fd = self.door, conn.fileno()
        assert door is not None
        try:
            while True:
                code, size, payload = door.serve(fd, self.limit)
                if code < 0:
                    if code == native_door.FRAME_OVER:
                        log.warning("local connection dropped: %s", over_limit(size, self.limit))
                    elif code not in (native_door.FRAME_CLOSED, native_door.FRAME_CUT):
                        log.debug("local connection dropped: %s", os.strerror(-code))
                    return
                status, reply = self.answer(bytearray(payload.numpy()))    # writable: read in place after
                door.write(fd, status, reply)
        except OSError:
            pass                                          # the router went away mid-write
        finally:
            door.forget(fd)
            self._end(conn)

    def _end(self, conn: socket.socket) -> None:
        try:
            conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        conn.close()
        with self._lock:
            self._open -= 1

    def _read(self, conn: socket.socket, frames: queue.SimpleQueue[bytes | bytearray | None]) -> None:
        try:
            while True:
                frames.put(recv_frame(conn, self.limit)[1])
        except FrameError as exc:
            if "closed" not in str(exc):
                log.warning("local connection dropped: %s", exc)
        except OSError:
            pass                                          # closed under it
        frames.put(None)

    @property
    def open_connections(self) -> int:
        return self._open

    def close(self) -> None:
        self._closed.set()
        self.sock.close()
        try:
            self.path.unlink()
        except OSError:
            pass
