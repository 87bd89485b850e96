"""`colibri serve`'s main thread, which forks the children and runs the other threads' calls (`Fleet.serve_calls`),
must see a stop signal whatever moment it lands: a handler that ran past the queue's poll timeout turned CPython
3.11's SimpleQueue.get(timeout) into a wait without end, and serve logged "received SIGTERM" and never stopped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import signal, threading, time
from colibri.fleet import Fleet
fleet, until = Fleet(), threading.Event()
def on_signal(signum, frame):
    time.sleep(0.1)             # a handler slower than the 50 ms poll (a loaded or throttled host)
    until.set()
signal.signal(signal.SIGTERM, on_signal)
print("ready", flush=True)
fleet.serve_calls(until)
print("stopped", flush=True)
"""


def test_serve_calls_ends_on_a_signal_whose_handler_outlasts_the_poll():
    root = Path(__file__).resolve().parents[1]
    for i in range(6):
        p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, cwd=root)
        try:
            assert p.stdout.readline() == "ready\n"
            time.sleep(0.013 * i)                    # land anywhere in the poll's 50 ms
            p.send_signal(signal.SIGTERM)
            out, _ = p.communicate(timeout=5)
            assert out == "stopped\n" and p.returncode == 0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()


SERVICE_CHILD = """
import time
from colibri_common.serving import Service
service = Service("colibri.v1.Test", 2)
service.ready("127.0.0.1", 1)
time.sleep(1.0)                 # a main thread slow to reach run_until_signal (a loaded host)
service.run_until_signal(on_stop=lambda: print("drained", flush=True))
print("stopped", flush=True)
"""


def test_a_service_signalled_right_after_its_ready_line_drains_rather_than_dies():
    """The handlers were installed by run_until_signal, after the ready line: a SIGTERM between the two killed the
    process by the default action (a worker left its socket behind, no drain), which a loaded run of the suite hit."""
    root = Path(__file__).resolve().parents[1]
    p = subprocess.Popen([sys.executable, "-c", SERVICE_CHILD], stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        assert p.stdout.readline().startswith("ready ")
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 0 and out.split() == ["drained", "stopped"], (p.returncode, out)
