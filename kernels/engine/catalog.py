"""The kernels kernels/cuda/engine.cu offers for a convolution, with their tiles, and the candidates the
auto-tuner tries for each precision.
"""
from __future__ import annotations


SOURCE = "engine"  # kernels/cuda/engine.cu
# Convolution kernels of engine.cu: name -> (pixels per block, channels per block, threads)
CONV_KERNELS = {"simt_64x64": (64, 64, 256), "simt_64x32": (64, 32, 256), "simt_32x32": (32, 32, 256),
                "wmma_64x64": (64, 64, 128), "wmma_64x32": (64, 32, 128), "wmma_128x32": (128, 32, 128),
                "wmmav_64x32": (64, 32, 128), "wmmav_128x32": (128, 32, 128), "wmmav_64x16": (64, 16, 128),
                "wmmav_128x16": (128, 16, 128), "simtv_128x64": (128, 64, 256), "simtv_128x32": (128, 32, 256),
                "simtv_64x32": (64, 32, 256), "simtv_128x16": (128, 16, 256), "simtv_64x16": (64, 16, 256)}
# The direct convolutions (engine.cu 1a''): name -> (kernel size, tile rows TH, tile columns TW, channels BN,
# pixels per thread TM, channels per thread TN). A block computes a TH x TW tile of one image x BN channels,
# with TH (TW / TM) (BN / TN) threads; they run only the KS x KS convolutions they are compiled for.
DIRECT = {f"direct{ks}_{th}x{tw}x{bn}_{tm}x{tn}": (ks, th, tw, bn, tm, tn)
          for ks, th, tw, bn, tm, tn in [(3, 16, 16, 32, 8, 4), (3, 8, 16, 32, 8, 4), (3, 8, 16, 32, 4, 4),
                                         (3, 4, 16, 32, 4, 4), (3, 16, 16, 16, 4, 4), (5, 16, 16, 16, 8, 4),
                                         (5, 16, 16, 16, 4, 4), (5, 8, 16, 16, 4, 4), (5, 8, 16, 32, 8, 4)]}
CONV_KERNELS.update({k: (th * tw, bn, th * (tw // tm) * (bn // tn)) for k, (_, th, tw, bn, tm, tn) in DIRECT.items()})
SIMT = ("simt_64x64", "simt_64x32", "simt_32x32", "simtv_128x64", "simtv_128x32", "simtv_64x32", "simtv_128x16",
        "simtv_64x16") + tuple(DIRECT)
CANDIDATES = {"fp32": SIMT,
              "fp16": ("wmma_64x64", "wmma_64x32", "wmma_128x32", "wmmav_64x32", "wmmav_128x32", "wmmav_64x16",
                       "wmmav_128x16") + SIMT,
              "int8": SIMT}
DEFAULT_KERNEL = {"fp32": "simt_64x64", "fp16": "wmma_64x64", "int8": "simt_64x64"}
THREADS = 256  # elementwise kernels
VECTOR = 8  # the wmmav kernels load 8 halves (16 bytes) at a time
