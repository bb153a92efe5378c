"""DeformConv attribute arithmetic: the normalised attributes every backend takes, and the output size."""
from typing import NamedTuple, Tuple

import numpy as np


class DeformParams(NamedTuple):
    """Normalised DeformConv attributes; tuples have one entry per spatial axis."""
    kernel_shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    pads_begin: Tuple[int, ...]  # the ends only set out_spatial
    dilations: Tuple[int, ...]
    group: int
    offset_group: int
    out_spatial: Tuple[int, ...]

    @property
    def nd(self):
        return len(self.kernel_shape)

    @property
    def K(self):
        return int(np.prod(self.kernel_shape, dtype=np.int64))


def out_size(size, begin, end, k, dil, stride):
    """ONNX output length: floor((D + begin + end - ((k - 1) * dil + 1)) / stride) + 1."""
    return (size + begin + end - ((k - 1) * dil + 1)) // stride + 1
