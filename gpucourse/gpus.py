"""Which GPU each kernel needs, in one place: the architectures the course supports, the hardware features
its kernels use with the compute capability each needs, and what every lesson step needs.

    gpus.supports("cp.async")                  # on this GPU (or the faked one); cc=(7, 5) to ask about another
    gpus.require("fp16-wmma", what="lesson 4's WMMA GEMM")   # CourseError naming this GPU and what it lacks
    gpus.step("04.wmma_tiled")                 # a launcher's check: raises, or notes a fallback once, or passes
    gpus.plan((7, 5))                          # every lesson step on a T4: runs / runs with a fallback / cannot

The compute capability asked about is the real GPU's, or GPUCOURSE_FAKE_CC (e.g. 7.5) where that is set: how
the tests check the gating without a GPU (``runtime.compute_capability``). Kernel modules may import this
module beside ``gpucourse.runtime``; it imports nothing else of the tooling.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from . import runtime

# The GPUs learners bring, by compute capability. Every CUDA C source compiles to machine code for each of
# these (tests/test_gpu_archs.py); sm_90a (the arch-specific Hopper target: wgmma, setmaxnreg) only for the
# sources that declare it with a line "// gpucourse-arch: sm_90a".
GPUS = {
    (7, 5): "Turing: T4, RTX 20xx",
    (8, 0): "Ampere: A100",
    (8, 6): "Ampere: RTX 30xx, A10, A40",
    (8, 9): "Ada: RTX 40xx, L4, L40",
    (9, 0): "Hopper: H100, H200",
}
# The most shared memory one block may ask for (the opt-in maximum, bytes) on each: a kernel whose tile needs more
# does not launch there (CUDA C Programming Guide, "Technical Specifications per Compute Capability").
SHARED_MEMORY_PER_BLOCK = {(7, 5): 64 * 1024, (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 9): 99 * 1024,
                           (9, 0): 227 * 1024}
PORTABLE_SHARED_MEMORY = 48 * 1024  # what every GPU gives a block without asking
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")  # what every source is compiled for
ARCH_SPECIFIC = ("sm_90a",)  # compiled only for sources that declare it
_DECLARED_ARCH = re.compile(r"^\s*//\s*gpucourse-arch:\s*(sm_\d+a?)\s*$", re.M)


@dataclass(frozen=True)
class Feature:
    name: str
    cc: tuple[int, int]  # the lowest compute capability that has it
    what: str  # one line: what it is
    arch_specific: bool = False  # sm_90a-style: only that exact architecture (code built for it runs nowhere else)

    @property
    def needs(self) -> str:
        cc = f"compute capability {self.cc[0]}.{self.cc[1]}"
        return f"sm_{self.cc[0]}{self.cc[1]}a ({cc} exactly)" if self.arch_specific else f"sm_{self.cc[0]}{self.cc[1]}+ ({cc} or higher)"


FEATURES = {f.name: f for f in (
    Feature("fp16-wmma", (7, 0), "FP16 tensor cores through WMMA: 16x16x16 half tiles, half or float sums"),
    Feature("int8-wmma", (7, 2), "INT8 tensor cores through WMMA: 8-bit integer tiles, int32 sums"),
    Feature("cp.async", (8, 0), "asynchronous 16-byte copies from global to shared memory that skip the "
                                "registers and let the copy of the next tile overlap the math (cp.async)"),
    Feature("bf16-wmma", (8, 0), "BF16 tensor cores through WMMA (bfloat16 tiles, float sums)"),
    Feature("tf32-wmma", (8, 0), "TF32 tensor cores through WMMA: float inputs rounded to 10-bit mantissas"),
    Feature("mma-m16n8k16", (8, 0), "warp-level tensor-core MMA on operands in registers, 16 x 8 x 16 FP16 tiles "
                                    "with float sums (mma.sync.m16n8k16; sm_75 has only the m16n8k8 shape)"),
    Feature("fp8", (8, 9), "FP8 (e4m3, e5m2) tensor-core math"),
    Feature("clusters", (9, 0), "thread-block clusters and distributed shared memory"),
    Feature("tma", (9, 0), "the Tensor Memory Accelerator: bulk tensor copies global <-> shared "
                           "(cp.async.bulk.tensor)"),
    Feature("wgmma", (9, 0), "warpgroup MMA (wgmma.mma_async): four warps issue one asynchronous tensor-core "
                             "op reading shared memory", arch_specific=True),
)}


@dataclass(frozen=True)
class Step:
    key: str  # "04.wmma_tiled": lesson number and step
    what: str  # what the step is, as a learner would name it
    needs: tuple[str, ...] = ()  # features it cannot run without
    prefers: tuple[str, ...] = ()  # features it uses where the GPU has them ...
    fallback: str = ""  # ... and what it does instead where it does not

    @property
    def lesson(self) -> str:
        return self.key.split(".")[0]


# Every lesson step that needs more than the oldest supported GPU (sm_75). Steps not named here (numba kernels,
# SIMT CUDA C, cuBLAS and cuDNN calls) run on every GPU in GPUS. Most steps run everywhere, some with a fallback;
# the wgmma steps need Hopper, and lesson 10's mma.sync step needs sm_80+ (no fallback: its shape of mma.sync and
# the shared memory its tiles take are not on a T4).
STEPS = {s.key: s for s in (
    Step("04.wmma", "lesson 4's WMMA GEMM, one warp per tile", needs=("fp16-wmma",)),
    Step("04.wmma_tiled", "lesson 4's tiled, pipelined WMMA GEMM", needs=("fp16-wmma",), prefers=("cp.async",),
         fallback="copies tiles to shared memory with ordinary loads, synchronously (no overlap)"),
    Step("05.igemm_wmma", "lesson 5's tensor-core convolution (implicit GEMM, NHWC)", needs=("fp16-wmma",),
         prefers=("cp.async",),
         fallback="copies tiles to shared memory with ordinary loads, synchronously (no overlap)"),
    Step("06.wmma", "lesson 6's FP16 tensor-core convolutions (WMMA)", needs=("fp16-wmma",)),
    Step("06.tc", "lesson 6's pipelined tensor-core convolutions, FP16 and INT8 (integer tensor cores)",
         needs=("fp16-wmma", "int8-wmma"), prefers=("cp.async",),
         fallback="copies tiles to shared memory with ordinary loads, synchronously (no overlap)"),
    # Hopper's own path: sm_90a machine code runs on compute capability 9.0 only
    Step("04.wgmma", "lesson 4's Hopper GEMM (wgmma fed by the TMA)", needs=("wgmma",)),
    Step("04.wgmma_fp8", "lesson 4's FP8 GEMM on Hopper (e4m3 wgmma fed by the TMA)", needs=("wgmma",)),
    Step("05.wgmma", "lesson 5's Hopper convolution (wgmma, image tiles gathered by the TMA)", needs=("wgmma",)),
    Step("06.wgmma", "lesson 6's engine's Hopper convolutions (lesson 5's wgmma kernel with the engine's epilogue)",
         needs=("wgmma",)),
    Step("10.wmma", "lesson 10's FlashAttention on the tensor cores (WMMA)", needs=("fp16-wmma",),
         prefers=("cp.async",), fallback="copies the K and V tiles with ordinary loads, synchronously (no overlap)"),
    Step("10.mma", "lesson 10's FlashAttention-2 on the tensor cores (mma.sync from registers, ldmatrix, cp.async)",
         needs=("mma-m16n8k16",)),
    Step("10.wgmma", "lesson 10's FlashAttention on Hopper (wgmma fed by the TMA, warp-specialised)", needs=("wgmma",)),
    Step("10.wgmma_fp8", "lesson 10's FlashAttention in FP8 on Hopper (e4m3 wgmma)", needs=("wgmma",)),
    Step("10.wgmma_bwd", "lesson 10's backward pass on Hopper (wgmma fed by the TMA)", needs=("wgmma",)),
)}

LESSONS = {
    "01": "vector multiply", "02": "warp divergence", "03": "memory", "04": "tensor cores", "05": "convolution",
    "06": "inference engine", "07": "collectives",
    "08": "feeding the GPU",
    "09": "training on GPUs",
    "10": "attention",
}


def feature(name: str) -> Feature:
    try:
        return FEATURES[name]
    except KeyError:
        raise runtime.CourseInputError(f"no GPU feature named {name!r}; known: {', '.join(FEATURES)}") from None


def _cc(cc) -> tuple[int, int]:
    if cc is not None:
        return runtime.parse_cc(cc)
    here = runtime.compute_capability()
    if here is None:
        raise runtime.CourseError(
            f"there is no GPU here to ask about; give a compute capability (cc=(7, 5)) or set "
            f"{runtime.FAKE_CC_VARIABLE}=7.5")
    return here


def gpu_name(cc=None) -> str:
    """'this GPU, Tesla T4 (compute capability 7.5),' or 'a GPU of compute capability 7.5 (T4, ...)'."""
    major, minor = _cc(cc)
    rt = runtime.get()
    if cc is None and rt.gpu and not os.environ.get(runtime.FAKE_CC_VARIABLE):
        return f"this GPU, {rt.device['name']} (compute capability {major}.{minor}),"
    kinds = GPUS.get((major, minor))
    return f"a GPU of compute capability {major}.{minor}" + (f" ({kinds})" if kinds else "")


def supports(name: str, cc=None) -> bool:
    """Whether a GPU of compute capability ``cc`` (default: this GPU, or GPUCOURSE_FAKE_CC) has feature ``name``."""
    f, have = feature(name), _cc(cc)
    return have == f.cc if f.arch_specific else have >= f.cc


def shared_memory_per_block(cc=None) -> int:
    """Bytes of shared memory one block may use (the opt-in maximum) on a GPU of compute capability ``cc``
    (default: this GPU, or GPUCOURSE_FAKE_CC where that is set, so that a faked T4 refuses what a T4 would). A GPU
    of a capability the course does not list gets the portable 48 KiB."""
    if cc is None and not os.environ.get(runtime.FAKE_CC_VARIABLE) and runtime.is_gpu():
        cp = runtime.cupy()
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        return int(props.get("sharedMemPerBlockOptin", 0)) or PORTABLE_SHARED_MEMORY
    return SHARED_MEMORY_PER_BLOCK.get(_cc(cc), PORTABLE_SHARED_MEMORY)


def shared_memory_missing(needs: int, *, what: str, cc=None) -> str | None:
    """None where a block of ``what`` that needs ``needs`` bytes of shared memory fits the GPU, else one line
    saying what needs how much and what the GPU gives."""
    have = shared_memory_per_block(cc)
    if needs <= have:
        return None
    return (f"{what} needs {needs:,} bytes of shared memory a block; {gpu_name(cc)} gives a block at most "
            f"{have:,}")


def missing(name: str, cc=None, *, what: str | None = None) -> str | None:
    """None where the GPU has feature ``name``, else one line saying what lacks what."""
    if supports(name, cc):
        return None
    f = feature(name)
    return (f"{what or 'this step'} needs {f.name} ({f.what}), which needs {f.needs}; "
            f"{gpu_name(cc)} does not have it")


def require(name: str, *, what: str, cc=None) -> None:
    """Raise CourseError (one line naming the GPU and the feature it lacks) unless the GPU has ``name``."""
    msg = missing(name, cc, what=what)
    if msg:
        raise runtime.CourseError(msg)


@dataclass
class StepStatus:
    step: Step
    cc: tuple[int, int]
    lacking: list = field(default_factory=list)  # features in step.needs this GPU lacks: the step cannot run
    falls_back: list = field(default_factory=list)  # features in step.prefers it lacks: the step uses its fallback

    @property
    def runs(self) -> bool:
        return not self.lacking

    def line(self) -> str:
        s = self.step
        if self.lacking:
            return "; ".join(missing(f, self.cc, what=s.what) for f in self.lacking)
        if self.falls_back:
            why = ", ".join(f"{f} needs {feature(f).needs.split(' (')[0]}" for f in self.falls_back)
            return f"{s.what} {s.fallback} ({why})"
        return f"{s.what}: runs as written"


def status(key: str, cc=None) -> StepStatus:
    try:
        s = STEPS[key]
    except KeyError:
        raise runtime.CourseInputError(f"no lesson step {key!r} in gpus.STEPS; known: {', '.join(STEPS)}") from None
    have = _cc(cc)
    return StepStatus(s, have, [f for f in s.needs if not supports(f, have)],
                      [f for f in s.prefers if not supports(f, have)])


_noted: set = set()


def step(key: str, cc=None) -> StepStatus:
    """What a launcher calls before it runs lesson step ``key``: raises CourseError if the GPU cannot run it,
    prints one line (once per process) if it runs with its fallback, else passes quietly."""
    st = status(key, cc)
    if not st.runs:
        raise runtime.CourseError(st.line())
    if st.falls_back and key not in _noted:
        _noted.add(key)
        print(f"note: {st.line()}.")
    return st


def plan(cc=None) -> dict:
    """{lesson number: [StepStatus, ...]} for every lesson: what a GPU of compute capability ``cc`` runs."""
    have = _cc(cc)
    out = {lesson: [] for lesson in LESSONS}
    for key in STEPS:
        out[STEPS[key].lesson].append(status(key, have))
    return out


def source_archs(code: str) -> list[str]:
    """The architectures a CUDA C source is compiled for: ARCHS, plus any it declares
    ("// gpucourse-arch: sm_90a") for features of one architecture only."""
    extra = [a for a in _DECLARED_ARCH.findall(code) if a not in ARCHS]
    unknown = [a for a in extra if a not in ARCH_SPECIFIC]
    if unknown:
        raise runtime.CourseInputError(f"unknown architecture {', '.join(unknown)}; the course supports "
                                       f"{', '.join(ARCHS + ARCH_SPECIFIC)}")
    return list(ARCHS) + extra


def summary(cc=None) -> str:
    """What a GPU runs, lesson by lesson (``python -m gpucourse probe`` prints it)."""
    have = _cc(cc)
    head = gpu_name(cc).rstrip(",")
    lines = [f"{head[0].upper()}{head[1:]} runs:"]
    for lesson, steps in plan(have).items():
        notes = [st.line() for st in steps if not st.runs or st.falls_back]
        cannot = [st for st in steps if not st.runs]
        first = "all steps" if not cannot else f"all steps but {len(cannot)}"
        lines.append(f"  lesson {int(lesson)} ({LESSONS[lesson]}): " + "; ".join([first, *notes]))
    return "\n".join(lines)
