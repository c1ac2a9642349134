"""A Ctrl-C landing between two bytecode instructions, raised deterministically through a trace function."""
import sys


def cut_before_opcode(code, k: int, call) -> bool:
    """Run ``call`` raising KeyboardInterrupt before the ``k``-th instruction executed in frames of
    ``code`` (a pending Ctrl-C lands between two instructions); whether it was raised."""
    seen = 0

    def local(frame, event, arg):
        nonlocal seen
        if event == "opcode":
            seen += 1
            if seen == k:
                raise KeyboardInterrupt
        return local

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None
        frame.f_trace_opcodes, frame.f_trace = True, local  # both: 3.13 ignores the flag alone
        return local

    previous, here = sys.gettrace(), sys._getframe()
    sys.settrace(tracer)
    here.f_trace_opcodes = True  # CPython 3.12 gives opcode events only once a running frame asked
    try:
        call()
    except KeyboardInterrupt:
        return True
    finally:
        sys.settrace(previous)
        here.f_trace_opcodes = False
    return False
