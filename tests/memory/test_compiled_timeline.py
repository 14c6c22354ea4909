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


# a generated program in the shape Inductor writes it (torch 2.13, CPU), cut down: the replay
# must follow Python's references, not the buffer names
PROGRAM = '''
class Runner:
    def call(self, args):
        primals_1, saved_1, saved_2, tangents_1 = args
        args.clear()
        buf0 = empty_strided_cpu((4, 8), (8, 1), torch.float32)
        kernel(saved_1, buf0)
        del saved_1
        buf1 = buf0; del buf0  # reuse
        buf9 = empty_strided_cpu((16, ), (1, ), torch.float32)
        buf5 = reinterpret_tensor(buf9, (8, ), (1, ), 0)  # alias
        buf2 = torch.ops.aten.some_backward.default(buf1, saved_2, primals_1)
        del saved_2
        buf3 = buf2[0]
        buf4 = buf2[1]
        del buf2
        kernel(buf3, buf4, buf1, buf5)
        del buf1
        del buf3
        del buf5
        buf6 = empty_strided_cpu((2, 2), (1, 4), torch.float64)
        kernel(buf4, buf6)
        buf4 = reinterpret_tensor(buf4, (3, ), (1, ), 0)
        del buf4
        return (reinterpret_tensor(buf9, (4, 4), (4, 1), 0), buf6, )
'''


def test_program_replay_follows_references():
    from spdsl.memory.compiled import program_storages
    sizes = {"primals_1": 64, "saved_1": 40, "saved_2": 24, "tangents_1": 4,
             "buf3": 100, "buf4": 12}
    rows = program_storages(PROGRAM, sizes, {"primals_1", "tangents_1"},
                            scratch={"buf2": 1000})
    got = {r[0]: r[1:] for r in rows}
    # statements: 0 unpack, 1 clear, 2 buf0, 3 kernel, 4 del saved_1, 5 reuse, 6 del buf0,
    # 7 buf9, 8 buf5, 9 extern call, 10 del saved_2, 11 buf3, 12 buf4, 13 del buf2, 14 kernel,
    # 15 del buf1, 16 del buf3, 17 del buf5, 18 buf6, 19 kernel, 20 buf4 rebound to a view of
    # itself, 21 del buf4, 22 return
    assert got == {
        "saved_1": (40, 0, 3, True),              # freed by its del, the caller keeps no ref
        "saved_2": (24, 0, 9, True),
        "buf0": (128, 2, 14, False),              # renamed buf1 by the reuse, freed with it
        "buf9": (64, 7, -1, False),               # returned through a view: stays
        "buf2 (kernel scratch)": (1000, 9, 9, False),
        "buf3": (100, 9, 15, False),              # both outputs allocated by the call
        "buf4": (12, 9, 20, False),               # the rebinding keeps it until the del
        "buf6": (8 * (1 + 1 * 1 + 1 * 4), 18, -1, False),   # the strided extent, float64
    }
    peak, end, held = timeline(rows, inputs_freed=True)
    # statement 9: saved_2 24 + buf0 128 + buf9 64 + scratch 1000 + buf3 100 + buf4 12
    assert (peak, end, held) == (1328, 64 + 48, 24)
