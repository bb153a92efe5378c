"""GridSample's mode and padding codes, as the kernels take them (``grid_sample``'s ``mode`` and ``padding_mode``).

Plain constants in a module of their own, so that the front ends read them without
importing numba (``import numba_ops`` compiles and loads nothing)."""

NEAREST, LINEAR, CUBIC = 0, 1, 2
ZEROS, BORDER, REFLECTION = 0, 1, 2
#: the public attribute values -> the kernels' codes
MODES = {"linear": LINEAR, "nearest": NEAREST, "cubic": CUBIC}
PADDING_MODES = {"zeros": ZEROS, "border": BORDER, "reflection": REFLECTION}
#: taps per axis, by mode code
TAPS = (1, 2, 4)
