"""Ctrl-C between engine steps, never inside one.

A step moves sequences between queues, block lists and output tables one assignment at a time.
An exception the step raises itself is handled where it is raised, but a KeyboardInterrupt can
land between any two bytecodes: a sequence then sits in no queue, or a block in no free list.
`deferred_interrupts` holds SIGINT back until the step is done and raises it then, so Ctrl-C in a
notebook stops `generate` after the current step, with the engine whole. A second Ctrl-C during
the same step is not held back: a step that never ends (a student's part in an endless loop) can
still be stopped, at the price of the engine's state. Only the main thread receives signals;
elsewhere (the server's engine thread) it changes nothing.
"""

import signal
import threading
from contextlib import contextmanager


@contextmanager
def deferred_interrupts(undo=lambda: None):
    """Run the block with SIGINT held back; if one came, call `undo()` (what the block handed out that
    the caller will not receive) and raise KeyboardInterrupt once the block is done."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def hold_back(number, frame):
        if received:  # the second Ctrl-C: stop now
            raise KeyboardInterrupt
        received.append(number)

    previous = signal.signal(signal.SIGINT, hold_back)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        undo()
        raise KeyboardInterrupt
