"""Lesson 6 — a small TensorRT-style inference engine: graph, optimisation passes, plan, runtime.

Used by notebooks/06_inference_engine.ipynb, benchmarks/inference_engine.py and the tests. The path of a
trained network through the engine:

    Keras model --graph_from_keras--> Graph of primitive ops (Conv, BiasAdd, BatchNorm, Relu, ...)
      --fold_batchnorm, fuse_vertical, fuse_horizontal, eliminate_concat--> optimised Graph
      --build_plan (buffers, precision and INT8 calibration, auto-tuning)--> Plan --save/load_plan--> file
      --Engine--> logits, with the CUDA C kernels of kernels/cuda/inference_engine.cu on a GPU, NumPy on a CPU

TensorFlow is needed only to train and export the model (``train_and_export``); the exported model file
(kernels/inference_engine/digits_inception.npz: graph, weights, held-out digits, Keras's own logits) is what the engine
reads, so it runs where TensorFlow is not installed. Also here: the fused conv + bias + ReLU ("CBR") kernel
in numba (``cbr_direct``) with its NumPy spec, batch-norm folding, and INT8 calibration (min-max, percentile,
entropy) with quantise / dequantise.

Its rooms follow the lesson's story, each a floor above those it imports (a test checks there is no cycle):
    catalog    the kernels inference_engine.cu offers for a convolution, and the auto-tuner's candidates
    graph      the graph IR and the Keras import
    model      the trained digits network and its file
    specs      NumPy specs of every op, and the reference run_graph
    passes     batch-norm folding, vertical and horizontal fusion, concat elimination; optimize
    precision  FP16 / INT8 / FP8 storage, INT8 and FP8 calibration, quantise / dequantise, e4m3 codes
    plan       the plan file: its format, checksum and the check that it runs here
    network    the digits network in one kernel: the pattern, its plan step, its NumPy arithmetic, its weights
    executor   Engine: running a plan (CUDA C kernels one by one or as one CUDA graph; NumPy on a CPU)
    tuning     which kernels fit a step, and timing them to keep the fastest
    build      build_plan: a graph to a plan
    fused      the numba CBR kernel learners write
    resnet     ResNet-50 as a graph built with NumPy, its batch-norm calibration, and what each layer costs
    mixed      per-layer precision chosen: each part's sensitivity, and the parts an INT8 / FP8 plan keeps in FP16
"""
from __future__ import annotations

from .catalog import CANDIDATES, CONV_KERNELS, DEFAULT_KERNEL, DIRECT, SIMT, SOURCE, THREADS, VECTOR, WG
from .graph import conv_geometry, Graph, graph_from_keras, Node, SUPPORTED_LAYERS
from .model import (build_keras_model, dataset, digits_images, load_model_file, MODEL_FILE, save_model_file,
                    train_and_export)
from .specs import (avgpool_spec, batchnorm_spec, cbr_spec, conv_spec, fold_bn_weights, im2col, maxpool_spec,
                    node_spec, run_graph, softmax_spec)
from .passes import eliminate_concat, fold_batchnorm, fold_padding, fuse_horizontal, fuse_vertical, optimize, PASSES
from .precision import (ALL_PRECISIONS, calibrate, CALIBRATIONS, dequantize, DTYPES, E4M3_MAX, entropy_scale, from_e4m3,
                        minmax_scale, percentile_scale, PRECISIONS, Q, quantize, SCALE_METHODS, SUFFIX, to_e4m3)
from .plan import check_target, load_plan, Plan, PLAN_FORMAT, PLAN_MAGIC, this_target
from .executor import accuracy, Engine, predict
from .tuning import autotune, candidates, kernel_fits, plain, wg_fits
from .build import build_plan
from .fused import cbr_direct, cbr_numba
from .resnet import calibrate_batchnorm, floors, layer_costs, resnet50
from .mixed import agreement, fp16_share, keep_fp16_for, reference_logits, sensitivity, units
from . import (build, catalog, executor, fused, graph, mixed, model, network, passes, plan, precision,  # noqa: F401
               resnet, specs, tuning)  # the rooms
