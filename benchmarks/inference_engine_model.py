"""What every lesson-6 benchmark shares: the lesson's model (``load``: the imported digits network, its optimisation
stages and its data) and the engines the benchmarks run it as, with the goals they are measured against.

benchmarks/inference_engine.py (the lesson's figures), inference_engine_network_phases.py (where a call of the
one-kernel network goes), inference_engine_network_sweep.py and inference_engine_pytorch.py import these names from
here, and none of them imports another for them: the lesson's figures module imports the phases module, never the
other way round.
"""
from __future__ import annotations

from kernels import inference_engine as E

LESSON = "06_inference_engine"
ENGINES = {  # name -> (passes applied, precision, CUDA graphs)
    "layer by layer, FP32": (False, "fp32", False),
    "layer by layer + graph, FP32": (False, "fp32", True),
    "fused, FP32": (True, "fp32", False),
    "fused + graph, FP32": (True, "fp32", True),
    "layer by layer, FP16": (False, "fp16", False),
    "layer by layer + graph, FP16": (False, "fp16", True),
    "fused, FP16": (True, "fp16", False),
    "fused + graph, FP16": (True, "fp16", True),
    "fused + graph, INT8": (True, "int8", True),
    # the fused graph's whole network as one kernel (build_plan(fuse_network=True), network.py), replayed as a graph
    "one kernel (the network), FP32": (True, "fp32", True),
    "one kernel (the network), FP16": (True, "fp16", True),
    "one kernel (the network), INT8": (True, "int8", True),
}
OPTIMISED = "fused + graph"  # the engine the targets are about, against "layer by layer" (eager)
NETWORK = "one kernel (the network)"  # rows of ENGINES whose plan is one step; records made before them have none
TARGETS = {"optimised_vs_layer": 2.0, "fp16_vs_fp32": 1.5}  # the lesson's goals for the engines (ratios)
NETWORK_GOALS = {"vs_pytorch": 1.2, "int8_vs_fp16_batch": 1.3}  # the goals for the one-kernel network


def load() -> tuple:
    """(imported graph, optimisation stages, data) of the lesson's model file."""
    g, data = E.load_model_file()
    return g, E.optimize(g), E.dataset(data)
