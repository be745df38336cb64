"""The kernels kernels/cuda/inference_engine.cu offers for a convolution, with their tiles, and the candidates the
auto-tuner tries for each precision.
"""
from __future__ import annotations


SOURCE = "inference_engine"  # kernels/cuda/inference_engine.cu
# Convolution kernels of inference_engine.cu: name -> (pixels per block, channels per block, threads)
CONV_KERNELS = {"simt_64x64": (64, 64, 256), "simt_64x32": (64, 32, 256), "simt_32x32": (32, 32, 256),
                "wmma_64x64": (64, 64, 128), "wmma_64x32": (64, 32, 128), "wmma_128x32": (128, 32, 128),
                "wmmav_64x32": (64, 32, 128), "wmmav_128x32": (128, 32, 128), "wmmav_64x16": (64, 16, 128),
                "wmmav_128x16": (128, 16, 128), "simtv_128x64": (128, 64, 256), "simtv_128x32": (128, 32, 256),
                "simtv_64x32": (64, 32, 256), "simtv_128x16": (128, 16, 256), "simtv_64x16": (64, 16, 256)}
# The direct convolutions (inference_engine.cu 1a''): name -> (kernel size, tile rows TH, tile columns TW, channels BN,
# pixels per thread TM, channels per thread TN). A block computes a TH x TW tile of one image x BN channels,
# with TH (TW / TM) (BN / TN) threads; they run only the KS x KS convolutions they are compiled for.
DIRECT = {f"direct{ks}_{th}x{tw}x{bn}_{tm}x{tn}": (ks, th, tw, bn, tm, tn)
          for ks, th, tw, bn, tm, tn in [(3, 16, 16, 32, 8, 4), (3, 8, 16, 32, 8, 4), (3, 8, 16, 32, 4, 4),
                                         (3, 4, 16, 32, 4, 4), (3, 16, 16, 16, 4, 4), (5, 16, 16, 16, 8, 4),
                                         (5, 16, 16, 16, 4, 4), (5, 8, 16, 16, 4, 4), (5, 8, 16, 32, 8, 4)]}
CONV_KERNELS.update({k: (th * tw, bn, th * (tw // tm) * (bn // tn)) for k, (_, th, tw, bn, tm, tn) in DIRECT.items()})
# The pipelined tensor-core kernels (inference_engine.cu 1d), FP16 and INT8 (integer tensor cores): copies of the next
# tiles in flight while the tensor cores work (cp.async), 16 bytes per load; and the one-pixel-a-thread
# kernels for a short reduction (1e: the stem, R = 9), any precision: 128 pixels a block, BN channels.
TC = ("tc_64x32", "tc_128x32", "tc_64x16", "tc_128x16", "tc_64x64", "tc_32x32")
CONV_KERNELS.update({k: (int(k[3:].split("x")[0]), int(k.split("x")[1]), 128) for k in TC})
# The direct convolutions on the tensor cores (1f), FP16 and INT8, for images at most 16 pixels wide: name ->
# (kernel size, rows of output per block TH, channels per block BN, most input channels CMAX); one block per
# TH rows of an image (16 columns) x BN channels, 128 threads.
TCD = {f"tcd{ks}_{th}x{bn}_c{cmax}": (ks, th, bn, cmax)
       for ks, th, bn, cmax in [(3, 8, 32, 32), (3, 4, 32, 32), (3, 8, 16, 32), (5, 8, 16, 16), (5, 4, 16, 16)]}
CONV_KERNELS.update({k: (th * 16, bn, 128) for k, (_, th, bn, _) in TCD.items()})
PIX = {"pix_32": 32, "pix_16": 16}  # name -> channels per thread
PIX_R = 64  # the longest reduction (KH KW C) they take: their weights tile in shared memory
CONV_KERNELS.update({k: (128, bn, 128) for k, bn in PIX.items()})
# Hopper (sm_90a, inference_engine_wgmma.cu): lesson 5's wgmma convolution with the engine's epilogue, in FP16 and
# (wgmma's 8-bit paths, rows of 64 bytes in the 64-byte swizzle) INT8 and FP8 e4m3: kernels conv_<name>_f16, _i8
# and _f8. name -> its tile: (im2col, BM, BN, stages), as lesson 5's (kernels/convolution.py, wgmma_conv_config), and
# two of its own with fewer stages, so that a 1 x 1 layer with few slices of 64 channels to reduce (nothing for more
# stages to overlap) fits two or three blocks on an SM, one's epilogue running while another's tiles load.
# "i2c" tiles are BM consecutive output pixels gathered in the TMA's im2col mode, the others boxes of one image.
# The "wgp" tiles are the same kernel made persistent (conv_wgmma.cuh, PERSIST): as many blocks as fit on the SMs,
# each taking tile after tile, its producer loading the next tile while its consumers store this one; name -> (im2col,
# BM, BN, stages, persistent).
WG_SOURCE = "inference_engine_wgmma"
# The "wgw" and "wgpw" tiles are wide 8-bit ones (INT8 and FP8 only): slices of 128 channels, rows of 128 bytes in
# the 128-byte swizzle as FP16's, for inputs of a multiple of 128 channels (conv_wgmma.cuh, BKC); the last field.
WG = {f"wg_{'i2c_' if i2c else ''}{bm}x{bn}_s{st}": (i2c, bm, bn, st, False, False, False, 1)
      for i2c, bm, bn, st in [(False, 128, 128, 4), (False, 128, 64, 4), (False, 64, 128, 4), (False, 64, 64, 6),
                              (True, 128, 128, 4), (True, 128, 64, 4), (True, 128, 256, 3), (True, 64, 128, 4),
                              (True, 64, 64, 6), (True, 64, 128, 2), (True, 64, 64, 3)]}
WG.update({f"wgp_i2c_{bm}x{bn}_s{st}": (True, bm, bn, st, True, False, False, 1)
           for bm, bn, st in [(128, 256, 3), (128, 128, 4), (128, 64, 4), (64, 128, 4), (64, 64, 4)]})
WG.update({f"wgw_i2c_{bm}x{bn}_s{st}": (True, bm, bn, st, False, True, False, 1)
           for bm, bn, st in [(128, 256, 3), (128, 128, 4), (128, 64, 4), (64, 128, 4), (64, 64, 6)]})
WG.update({f"wgpw_i2c_{bm}x{bn}_s{st}": (True, bm, bn, st, True, True, False, 1)
           for bm, bn, st in [(128, 256, 3), (128, 128, 4), (128, 64, 4)]})
# The "wgpt" and "wgptw" tiles: persistent ones (narrow and wide) whose epilogue goes through the TMA (conv_wgmma.cuh,
# TMA_OUT): the residual loaded into shared memory up to two tiles ahead, the results written there in place and
# stored by the TMA, for outputs of a multiple of BN channels. The wide ones and 128 x 256 with three stages in INT8
# and FP8 only; 128 x 128 in every precision; FP16 alone has 128 x 256 with two stages (its buffers are twice the
# 8-bit ones: three stages do not fit beside them) and 128 x 64 (a box of FP16 is 64 channels, an 8-bit one 128).
# The seventh field; WG_TMA_PRECISIONS says which precision has which.
WG.update({f"wgpt{'w' if wide else ''}_i2c_{bm}x{bn}_s{st}": (True, bm, bn, st, True, wide, True, 1)
           for wide in (False, True) for bm, bn, st in [(128, 256, 3), (128, 128, 4)]})
# FP16's own (bm, bn, stages); the last three are lesson 5's deeper rings (its race against cuDNN: 128x64_s8 on
# conv2_x's 3 x 3 layers, 64x128_s8 on conv5_x 1 x 1 2048->512, one block an SM), with as many stages as fit beside
# two buffers a consumer
_WGPT_FP16_ONLY = [(128, 256, 2), (128, 64, 4), (128, 64, 8), (64, 128, 8), (128, 128, 5)]
WG.update({f"wgpt_i2c_{bm}x{bn}_s{st}": (True, bm, bn, st, True, False, True, 1) for bm, bn, st in _WGPT_FP16_ONLY})
WG_TMA_PRECISIONS = {"wgpt_i2c_128x256_s3": ("int8", "fp8"), "wgpt_i2c_128x128_s4": ("fp16", "int8", "fp8"),
                     "wgptw_i2c_128x256_s3": ("int8", "fp8"), "wgptw_i2c_128x128_s4": ("int8", "fp8"),
                     **{f"wgpt_i2c_{bm}x{bn}_s{st}": ("fp16",) for bm, bn, st in _WGPT_FP16_ONLY}}
# The "wgs<k>" tiles: one-tile FP16 ones whose reduction is split over k blocks a tile (conv_wgmma.cuh's kb_lo ..
# kb_hi), each writing its partial sums to a workspace that a second kernel (split_reduce_f16) adds up and ends with
# the epilogue: for layers with a long reduction and few tiles, ResNet-50's last layers at batch 1 (8 to 32 tiles of
# 64 x 64 on 132 SMs). Kernel conv_wgs_i2c_<BM>x<BN>_s<stages>_f16 whatever k (a launch's grid.z); the last field.
WG.update({f"wgs{k}_i2c_{bm}x{bn}_s{st}": (True, bm, bn, st, False, False, False, k)
           for bm, bn, st, splits in [(64, 64, 6, (2, 4, 8)), (64, 128, 4, (2, 4))] for k in splits})
WG_WIDE_BK = 128  # channels a slice of a wide tile (the others: kernels/convolution.py's WGMMA_BK, 64)


def wg_function(kernel: str) -> str:
    """The name, less its precision's suffix, of the kernel in inference_engine_wgmma.cu that runs wg tile ``kernel``
    (the split tiles share one a shape: their split is the launch's)."""
    return f"conv_wgs_{kernel.split('_', 1)[1]}" if WG[kernel][7] > 1 else f"conv_{kernel}"


def wg_precisions(kernel: str) -> tuple:
    """The precisions wg tile ``kernel`` is compiled in: the wide ones INT8 and FP8, the split ones FP16, the
    TMA-epilogue ones as WG_TMA_PRECISIONS says, the others all three."""
    _, _, _, _, _, wide, tma, splits = WG[kernel]
    if tma:
        return WG_TMA_PRECISIONS[kernel]
    return ("int8", "fp8") if wide else ("fp16",) if splits > 1 else ("fp16", "int8", "fp8")


def wg_kernels(precision: str) -> tuple:
    """The wg tiles that run ``precision`` (wg_precisions)."""
    return tuple(k for k in WG if precision in wg_precisions(k))


WG_EPI_PIECES = 4  # a persistent tile's epilogue space: 64 rows x 32 floats a piece, per consumer (EPI_PIECES)
SIMT = ("simt_64x64", "simt_64x32", "simt_32x32", "simtv_128x64", "simtv_128x32", "simtv_64x32", "simtv_128x16",
        "simtv_64x16") + tuple(DIRECT)
CANDIDATES = {"fp32": SIMT + tuple(PIX),
              "fp16": ("wmma_64x64", "wmma_64x32", "wmma_128x32", "wmmav_64x32", "wmmav_128x32", "wmmav_64x16",
                       "wmmav_128x16") + TC + tuple(TCD) + SIMT + tuple(PIX) + wg_kernels("fp16"),
              "int8": TC + tuple(TCD) + SIMT + tuple(PIX) + wg_kernels("int8"),
              "fp8": wg_kernels("fp8")}  # FP8: wgmma's e4m3 path, Hopper only
DEFAULT_KERNEL = {"fp32": "simt_64x64", "fp16": "wmma_64x64", "int8": "simt_64x64", "fp8": "wg_i2c_128x128_s4"}
# a convolution of another geometry than "same" at stride 1, or with a residual (ResNet-50's): only the tc and wg
# kernels take those, and tc_64x64 is the default
GENERAL_DEFAULT = "tc_64x64"
THREADS = 256  # elementwise kernels
HEAD_O, HEAD_CHUNK = 16, 64  # the head kernel: outputs kept in registers; outputs a block of a wider layer (as in the .cu)
CLS_IMAGES = 8  # the classifier kernel: images a block (as in the .cu)
STEM_TAPS_PADDED = 160  # the fused stem's reduction, 7 x 7 x 3 = 147 taps padded to whole steps of 16 (STEM_KP in the .cuh)
VECTOR = 8  # the wmmav kernels load 8 halves (16 bytes) at a time
