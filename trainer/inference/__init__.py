"""Big-model inference: build on meta, place modules per a device map, offload to CPU or disk
without copies (memory-mapped safetensors), keep tied weights together. Knows no training loop.

    with init_empty_weights():
        model = build_model()
    model = load_checkpoint_and_dispatch(model, "ckpt/", device_map="auto",
                                         max_memory={0: "10GiB", "cpu": "30GiB"}, offload_folder="off/")
"""

from trainforge.strategies.meta import init_empty_weights, materialize, retie, tie_groups
from trainforge.trainer.inference.device_map import compute_module_sizes, get_max_memory, infer_auto_device_map
from trainforge.trainer.inference.dispatch import (
    cpu_offload,
    disk_offload,
    dispatch_model,
    load_checkpoint_and_dispatch,
    remove_dispatch,
)

__all__ = [
    "compute_module_sizes",
    "cpu_offload",
    "disk_offload",
    "dispatch_model",
    "get_max_memory",
    "infer_auto_device_map",
    "init_empty_weights",
    "load_checkpoint_and_dispatch",
    "materialize",
    "remove_dispatch",
    "retie",
    "tie_groups",
]
