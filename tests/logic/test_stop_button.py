"""The stop button while a cell waits (``ipydist.notebook.stop_button``), with real SIGINTs in
this process's main thread: a press is a flag raised where the wait loop looks, never a
KeyboardInterrupt inside the lock code that ipyparallel's client shares with its thread."""

from __future__ import annotations

import _thread
import os
import signal
import threading
import time

import pytest

from ipydist.notebook.stop_button import StopButton


def _press_and_let_it_arrive() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(0.05)  # the handler runs at the main thread's next look


def test_a_press_is_raised_where_the_loop_looks_and_not_before():
    with pytest.raises(KeyboardInterrupt), StopButton() as button:
        _press_and_let_it_arrive()
        assert button.pressed, "the press was taken as a flag, not raised on arrival"
        button.check()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_presses_while_locks_are_taken_never_land_inside_them():
    condition = threading.Condition()
    done = threading.Event()

    def presses():
        while not done.is_set():
            _thread.interrupt_main()  # as the tests' stop button does
            time.sleep(0.001)

    presser = threading.Thread(target=presses)
    rounds = 0
    with StopButton() as button:
        presser.start()
        try:
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                with condition:  # a KeyboardInterrupt here could leave it held for ever
                    condition.wait(0.0001)
                rounds += 1
        finally:
            done.set()
            presser.join(10)
        assert button.pressed
        button.pressed = False  # looked at: nothing raised on leaving
    assert rounds > 100
    assert condition.acquire(blocking=False), "the lock was left held"
    condition.release()


def test_a_press_not_yet_looked_at_is_raised_on_leaving():
    with pytest.raises(KeyboardInterrupt), StopButton():
        _press_and_let_it_arrive()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_as_before_a_press_is_python_s_keyboard_interrupt_again():
    with StopButton() as button:
        with pytest.raises(KeyboardInterrupt), button.as_before():
            _press_and_let_it_arrive()
            pytest.fail("the press was not raised at once")
        assert not button.pressed
        _press_and_let_it_arrive()
        assert button.pressed, "back to a flag after the prompt"
        button.pressed = False


def test_outside_the_main_thread_nothing_changes():
    seen = []

    def in_a_thread():
        with StopButton() as button:
            seen.append((signal.getsignal(signal.SIGINT), button.pressed))

    thread = threading.Thread(target=in_a_thread)
    thread.start()
    thread.join(10)
    assert seen == [(signal.default_int_handler, False)]


def test_an_ignored_sigint_stays_ignored():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with StopButton():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
