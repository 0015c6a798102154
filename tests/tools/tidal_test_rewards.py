"""A reward the tiny model can learn in a few steps, for the fast quickstart test (`module:function`)."""


def starts_with_seven(trajectory, text: str) -> float:
    return float(text.startswith("7"))


_calls = 0


def starts_with_seven_until_interrupted(trajectory, text: str) -> float:
    """`starts_with_seven`; when TIDAL_TEST_INTERRUPT_AFTER=N is set, the N+1st call sends
    this process SIGINT, as Ctrl-C does."""
    import os
    import signal

    global _calls
    _calls += 1
    if _calls == int(os.environ.get("TIDAL_TEST_INTERRUPT_AFTER", "-1")) + 1:
        os.kill(os.getpid(), signal.SIGINT)
    return starts_with_seven(trajectory, text)


frozen_counts: list[int] = []
"""`gc.get_freeze_count()` at each call of `records_gc_freeze`."""


def records_gc_freeze(trajectory, text: str) -> float:
    """`starts_with_seven`, noting how many objects the cyclic GC has frozen meanwhile."""
    import gc

    frozen_counts.append(gc.get_freeze_count())
    return starts_with_seven(trajectory, text)


def first_token_even(trajectory, text: str) -> float:
    """1.0 when the response's first token id is even: half of a random model's samples at
    first, and a preference any tokenizer's model can learn in a few steps (the hf fixture's)."""
    return float(bool(trajectory.tokens) and trajectory.tokens[0] % 2 == 0)


def first_token_even_or_hangs(trajectory, text: str) -> float:
    """`first_token_even`, except that it never returns (sleeps an hour) when the response's
    first token id is a multiple of 3: about a third of a random model's samples (the
    held-out evaluation's greedy answers too)."""
    import time

    if trajectory.tokens and trajectory.tokens[0] % 3 == 0:
        time.sleep(3600)
    return first_token_even(trajectory, text)


def hangs(trajectory, text: str) -> float:
    """Never returns (sleeps an hour)."""
    import time

    time.sleep(3600)
    return 1.0
