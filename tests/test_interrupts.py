"""kvtier.interrupts: SIGTERM/SIGHUP as Ctrl-C, and a Ctrl-C held until a store operation is done."""
import os
import signal

import pytest

from kvtier.interrupts import as_interrupts, deferred


def test_a_held_ctrl_c_is_raised_at_the_end_and_the_handlers_come_back():
    ran = []
    with as_interrupts():
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        with pytest.raises(KeyboardInterrupt, match="SIGINT"):
            with deferred():
                os.kill(os.getpid(), signal.SIGINT)
                ran.append("the rest of the block")
        assert ran == ["the rest of the block"]
        assert {s: signal.getsignal(s) for s in before} == before


def test_a_second_signal_raises_at_once():
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
            pytest.fail("the second Ctrl-C did not raise")


def test_a_ctrl_c_while_the_handlers_are_put_back_leaves_none_behind(monkeypatch):
    """A Ctrl-C landing as deferred() put the handlers back was raised from within that loop,
    and SIGTERM and SIGHUP stayed bound to the block's `hold` for the rest of the process (a
    later SIGTERM swallowed). Every handler is put back, then the interrupt raised (also where
    the signal reaches another thread first, as in a process with I/O threads)."""
    real = signal.signal
    sent = []

    def signalled(sig, handler):
        old = real(sig, handler)
        if sig == signal.SIGINT and handler is signal.default_int_handler and not sent:
            sent.append(sig)
            os.kill(os.getpid(), signal.SIGINT)       # lands midway through putting them back
        return old

    with as_interrupts():
        before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        monkeypatch.setattr(signal, "signal", signalled)
        with pytest.raises(KeyboardInterrupt):
            with deferred():
                pass
        monkeypatch.undo()
        assert {s: signal.getsignal(s) for s in before} == before
