"""Run a deformable layer exported from PyTorch as an ONNX model on numba_ops.

A small PyTorch module (a convolution that predicts offsets and masks, then
torchvision's DeformConv2d: the DCNv2 layer) is exported to ONNX. Its graph holds
a Conv and a DeformConv node; ``onnx.reference.ReferenceEvaluator`` runs it with
numba_ops' DeformConv kernel in place of onnx's own, and the result is checked
against PyTorch's. When ``numba_ops.onnx.session`` is available (extra
``onnxruntime``), the same model also runs in an onnxruntime InferenceSession
whose DeformConv nodes are numba_ops' kernels.

torchvision's ``deform_conv2d`` has no ONNX export of its own: this script
registers one (``DeformConv``, opset 19), which is all a user needs to do.

    python examples/onnx_deformable_layer.py

Needs torch, torchvision and onnx; without torch or torchvision it says so and
exits 0.
"""
import io
import sys
import warnings

import numpy as np


def main():
    try:
        import torch
        import torchvision
    except ImportError as exc:
        print(f"skipped: this example needs torch and torchvision ({exc})")
        return 0
    import onnx
    from onnx.reference import ReferenceEvaluator
    from torch.onnx import register_custom_op_symbolic
    from torch.onnx.symbolic_helper import parse_args

    import numba_ops.onnx

    @parse_args("v", "v", "v", "v", "v", "i", "i", "i", "i", "i", "i", "i", "i", "b")
    def deform_conv2d(g, x, w, offset, mask, b, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w,
                      groups, offset_groups, use_mask):
        # torchvision's offset and mask layouts are ONNX's: (g*K + k)*2 + axis, g*K + k
        inputs = [x, w, offset, b] + ([mask] if use_mask else [])
        return g.op("DeformConv", *inputs, strides_i=[stride_h, stride_w],
                    pads_i=[pad_h, pad_w, pad_h, pad_w], dilations_i=[dil_h, dil_w],
                    group_i=groups, offset_group_i=offset_groups)

    register_custom_op_symbolic("torchvision::deform_conv2d", deform_conv2d, 19)

    class DeformableLayer(torch.nn.Module):
        """DCNv2: a 3x3 convolution predicts 2 offsets and a mask per kernel point."""

        def __init__(self, cin, cout):
            super().__init__()
            self.offset_mask = torch.nn.Conv2d(cin, 3 * 9, 3, padding=1)
            torch.nn.init.normal_(self.offset_mask.weight, std=0.1)
            self.deform = torchvision.ops.DeformConv2d(cin, cout, 3, padding=1)

        def forward(self, x):
            om = self.offset_mask(x)
            offset, mask = om[:, :18], torch.sigmoid(om[:, 18:])
            return self.deform(x, offset, mask)

    torch.manual_seed(0)
    layer = DeformableLayer(8, 16).eval()
    x = torch.randn(2, 8, 12, 12)
    buf = io.BytesIO()
    with warnings.catch_warnings():  # the TorchScript exporter is the one that takes custom symbolics
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(layer, (x,), buf, opset_version=19, dynamo=False,
                          input_names=["x"], output_names=["y"])
    model = onnx.load_from_string(buf.getvalue())
    print("exported graph:", " -> ".join(n.op_type for n in model.graph.node if n.op_type != "Constant"))

    with torch.no_grad():
        expected = layer(x).numpy()
    feeds = {"x": x.numpy()}
    sess = ReferenceEvaluator(model, new_ops=numba_ops.onnx.ops())
    (y,) = sess.run(None, feeds)
    err = float(np.max(np.abs(y - expected)))
    print(f"ReferenceEvaluator with numba_ops' DeformConv: y {y.shape}, max |numba_ops - torch| = {err:.2e}")
    assert err < 1e-4, err

    if hasattr(numba_ops.onnx, "session"):
        try:
            ort_sess = numba_ops.onnx.session(model)
        except ImportError as exc:
            print(f"onnxruntime session skipped ({exc})")
        else:
            (y2,) = ort_sess.run(None, feeds)
            err = float(np.max(np.abs(y2 - expected)))
            print(f"onnxruntime session with numba_ops' DeformConv: max |numba_ops - torch| = {err:.2e}")
            assert err < 1e-4, err
    return 0


if __name__ == "__main__":
    sys.exit(main())
