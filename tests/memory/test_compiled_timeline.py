"""``spdsl.memory.compiled.timeline``: the live bytes of one graph from Inductor's buffer list."""

from spdsl.memory.compiled import timeline


def test_forward_inputs_live_outside_and_outputs_stay():
    bufs = [("x", 100, 0, 1, True),          # an input: the caller holds it, not counted
            ("a", 10, 0, 1, False),          # freed after step 1
            ("b", 20, 1, 2, False),
            ("out", 5, 2, -1, False)]        # an output: never freed
    peak, end, held = timeline(bufs, inputs_freed=False)
    assert (peak, end, held) == (30, 5, 0)


def test_backward_inputs_are_freed_after_their_last_read():
    bufs = [("saved0", 100, 0, 0, True),     # last read by the first kernel
            ("saved1", 50, 0, 2, True),
            ("g", 40, 1, -1, False)]         # a gradient, kept
    peak, end, held = timeline(bufs, inputs_freed=True)
    # step 0: 150 live; step 1: saved1 + g = 90; after step 2: g only
    assert (peak, end, held) == (150, 40, 150)
