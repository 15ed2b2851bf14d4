"""Headroom: what a memory limit must keep free beyond a predicted peak for a step to run.

The cost model predicts the bytes of live tensors (plus, once calibrated, library
workspaces and operator scratch). A caching allocator needs more than that to serve
them: it rounds blocks up and fragments, so that ``torch.cuda.max_memory_reserved``
runs above ``max_memory_allocated`` (by 0.7% to 15.9% at the largest batches that fit under
an 8 GiB cap: ``benchmarks/RESULTS.md``, "Max batch on the GPU"), and a batch whose predicted
peak equals the device's memory runs out of it. A :class:`Headroom` states what is kept:

* ``workspace_bytes``: library workspace not in the cost model (zero when the costs
  were calibrated: it is in their static bytes);
* ``fraction``: the allocator's overhead as a share of the peak (reserved against
  allocated), measured on the device when it can be, else a stated default;
* ``checkpointed_fraction``: the same for a plan that checkpoints, whose recomputation
  allocates and frees blocks of many sizes between the backward's: the default allocator
  fragments more there (``benchmarks/gpu_max_batch.py``; ``benchmarks/RESULTS.md``, "Max batch on
  the GPU").
  Its expandable segments (``PYTORCH_ALLOC_CONF=expandable_segments:True``) map memory
  to blocks as needed and keep the overhead small either way.

On the CPU there is no caching allocator: no headroom. Every figure here is either
measured on the device in use or labelled as a default (``docs/design.md`` §9).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

__all__ = ["Headroom", "CUDA_DEFAULT_FRACTION", "CUDA_CHECKPOINTED_FRACTION", "CUDA_EXPANDABLE_FRACTION",
           "CUDA_DEFAULT_WORKSPACE", "expandable_segments", "default_headroom", "default_calibrate",
           "device_free_memory", "device_budget", "measure_cuda_workspace", "measure_allocator_overhead"]

#: The allocator overhead assumed on CUDA when none was measured: above the largest
#: reserved/allocated excess measured without checkpointing under the default allocator: +6.4% on
#: an H100 (GPT, batch 7: 8.16 GB reserved for 7.67 GB allocated), 3.4-7.2% at the largest batch that
#: fit under an 8 GiB cap on an H200 (``benchmarks/gpu_max_batch.py``; RESULTS.md, "Max batch on the GPU").
CUDA_DEFAULT_FRACTION = 0.10

#: The overhead assumed for a checkpointed plan under the default allocator: above the 12.4% a
#: ResNet-50's optimal plan needed at the largest batch that fit under an 8 GiB cap on an H200 (its
#: 10%-headroom answer ran out of memory; ``benchmarks/gpu_max_batch.py``).
CUDA_CHECKPOINTED_FRACTION = 0.15

#: The overhead assumed with expandable segments (no checkpointing or checkpointed): above the
#: 1.2-2.3% measured at the largest fitting batch of four cases on an H200 (gpu_max_batch.py).
CUDA_EXPANDABLE_FRACTION = 0.05

#: The library workspace assumed on CUDA when it cannot be measured (planning for a GPU this
#: machine does not have): the fixed per-process workspace seen on an H100 once the first matrix
#: product ran, 65-70 MB on every model with a Linear layer (``docs/gpu.md``); the upper end.
CUDA_DEFAULT_WORKSPACE = 70_000_000


def cuda_here() -> bool:
    """Whether this process can run on CUDA (a CUDA build and a device)."""
    import torch

    return bool(torch.cuda.is_available())


def default_calibrate(device: str, model_device: str) -> bool:
    """Calibrate by default when the step runs on CUDA and the model is there to run layers on:
    a model elsewhere (a CPU or meta model planned for a GPU) is planned from its tensors alone."""
    return str(device).startswith("cuda") and str(model_device).startswith("cuda") and cuda_here()


def check_calibrate(calibrate: bool, device: str, model_device: str) -> None:
    """``calibrate=True`` runs each layer on ``device``: the model must be there."""
    if calibrate and str(device).split(":")[0] != str(model_device).split(":")[0]:
        move = (f"materialize it there first (model.to_empty(device={str(device)!r}) and load its weights)"
                if str(model_device) == "meta" else f"move it there first (model.to({str(device)!r}))")
        raise ValueError(f"calibrate=True runs each layer on {device}, but the model is on {model_device}: "
                         f"{move}, or plan without calibration (calibrate=False, --no-calibrate)")


@dataclass(frozen=True)
class Headroom:
    """Bytes kept free below a memory limit: ``workspace_bytes + fraction * peak``."""

    workspace_bytes: int = 0
    fraction: float = 0.0
    #: where the figures come from ("none: no caching allocator on cpu", "measured on cuda:0",
    #: "default ...", "given")
    source: str = "none"
    #: ``fraction`` for a plan that checkpoints (None: ``fraction``)
    checkpointed_fraction: float | None = None

    def __post_init__(self):
        fractions = (self.fraction, self.fraction if self.checkpointed_fraction is None else self.checkpointed_fraction)
        if self.workspace_bytes < 0 or not all(0.0 <= f < 1.0 for f in fractions):
            raise ValueError(f"a headroom needs workspace_bytes >= 0 and fractions in [0, 1), got {self}")

    def fraction_for(self, checkpointed: bool = False) -> float:
        """The allocator's share kept for a plan with (``checkpointed``) or without checkpoints."""
        return self.checkpointed_fraction if checkpointed and self.checkpointed_fraction is not None else self.fraction

    def needed(self, peak: int, checkpointed: bool = False) -> int:
        """The memory a step of predicted ``peak`` needs with this headroom."""
        return int(peak) + self.workspace_bytes + math.ceil(self.fraction_for(checkpointed) * int(peak))

    def usable(self, memory: int, checkpointed: bool = False) -> int:
        """The largest predicted peak that fits in ``memory`` with this headroom (0 if none)."""
        p = math.floor((int(memory) - self.workspace_bytes) / (1.0 + self.fraction_for(checkpointed)))
        while p > 0 and self.needed(p, checkpointed) > memory:
            p -= 1
        return max(0, p)

    def without_workspace(self) -> "Headroom":
        """The same allocator shares without the workspace (calibrated costs hold it already)."""
        return Headroom(0, self.fraction, self.source, self.checkpointed_fraction)

    def describe(self) -> str:
        if not self.workspace_bytes and not self.fraction and not self.checkpointed_fraction:
            return f"no headroom kept ({self.source})"
        from ..units import format_bytes

        shares = f"{100 * self.fraction:.1f}%"
        if self.checkpointed_fraction is not None and self.checkpointed_fraction != self.fraction:
            shares += f" ({100 * self.checkpointed_fraction:.1f}% with checkpoints)"
        return (f"headroom kept: {format_bytes(self.workspace_bytes)} library workspace + "
                f"{shares} of the peak for the caching allocator ({self.source})")

    def to_dict(self) -> dict:
        return asdict(self)


def expandable_segments() -> bool:
    """Whether PyTorch's CUDA allocator maps expandable segments (``PYTORCH_ALLOC_CONF`` or
    ``PYTORCH_CUDA_ALLOC_CONF`` ``expandable_segments:True``, or set at run time)."""
    import torch

    get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    confs = [get()] if get is not None else []
    confs += [os.environ.get(k, "") for k in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")]
    for conf in confs:
        for item in str(conf or "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "expandable_segments":
                return value.strip().lower() in ("true", "1")
    return False


#: What a max-batch report says when the default allocator is in use on CUDA.
EXPANDABLE_HINT = ("PYTORCH_ALLOC_CONF=expandable_segments:True (set before CUDA starts) keeps the allocator's "
                   f"overhead near {CUDA_EXPANDABLE_FRACTION:.0%} instead of {CUDA_DEFAULT_FRACTION:.0%}-"
                   f"{CUDA_CHECKPOINTED_FRACTION:.0%}: a larger batch fits. Without it a checkpointed plan's answer "
                   "can still run out of memory where single tensors are large against the limit (measured: "
                   "fp32 logits of an eighth of it)")


def _allocator_shares() -> tuple[float, float | None, str]:
    if expandable_segments():
        return (CUDA_EXPANDABLE_FRACTION, None,
                f"allocator overhead {CUDA_EXPANDABLE_FRACTION:.0%} by default with expandable segments")
    return (CUDA_DEFAULT_FRACTION, CUDA_CHECKPOINTED_FRACTION,
            f"allocator overhead {CUDA_DEFAULT_FRACTION:.0%}, {CUDA_CHECKPOINTED_FRACTION:.0%} with checkpoints, "
            "by default (default allocator; expandable segments keep less)")


def default_headroom(device: str, calibrated: bool = False) -> Headroom:
    """The headroom used when none is given: none on the CPU; on CUDA the library workspace
    (measured now, unless the costs are calibrated and hold it already) and the allocator
    overhead: :data:`CUDA_DEFAULT_FRACTION` (:data:`CUDA_CHECKPOINTED_FRACTION` for a plan that
    checkpoints) with the default allocator, :data:`CUDA_EXPANDABLE_FRACTION` with expandable
    segments."""
    if not str(device).startswith("cuda"):
        return Headroom(0, 0.0, f"none: no caching allocator on {device}")
    fraction, checkpointed, shares = _allocator_shares()
    if not calibrated and not cuda_here():
        return Headroom(CUDA_DEFAULT_WORKSPACE, fraction,
                        "assumed, not measured: no CUDA device here; library workspace as measured on an H100 "
                        f"(65-70 MB), {shares}", checkpointed)
    workspace = 0 if calibrated else measure_cuda_workspace(device)
    return Headroom(workspace, fraction, f"workspace measured on {device}; {shares}", checkpointed)


def measure_cuda_workspace(device: str = "cuda") -> int:
    """Bytes cuBLAS keeps after a matrix product on ``device``, measured from a cleared state."""
    import torch

    dev = torch.device(device)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.synchronize(dev)
    a = torch.ones(64, 64, device=dev)
    before = torch.cuda.memory_allocated(dev)
    b = a @ a
    torch.cuda.synchronize(dev)
    after = torch.cuda.memory_allocated(dev)
    return max(0, int(after - before - b.untyped_storage().nbytes()))


def measure_allocator_overhead(model, example_inputs, loss_fn=None) -> float:
    """The caching allocator's overhead on one real step of ``model`` (CUDA): peak reserved over
    peak allocated, minus one. 0.0 on a device without a caching allocator."""
    from ..measure import measure_peak_detailed

    m = measure_peak_detailed(model, example_inputs, loss_fn)
    if m.reserved_bytes is None or not m.peak_bytes:
        return 0.0
    return max(0.0, m.reserved_bytes / m.peak_bytes - 1.0)


def device_free_memory(device: str) -> int:
    """Bytes free on ``device``: ``torch.cuda.mem_get_info`` on CUDA, the system's available
    memory (``/proc/meminfo``) on the CPU.

    Raises
    ------
    ValueError
        Where it cannot be told; pass a number of bytes instead.
    """
    if str(device).startswith("cuda"):
        import torch

        if not cuda_here():
            raise ValueError(f"there is no CUDA device here to ask how much memory {device} has free: give the "
                             "GPU's memory (memory='80GB', --memory 80GB)")
        return int(torch.cuda.mem_get_info(torch.device(device))[0])
    if os.path.exists("/proc/meminfo"):
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    raise ValueError(f"cannot tell how much memory {device} has free; pass the memory in bytes (e.g. '8GiB')")


def device_budget(device, calibrated: bool = False, headroom: Headroom | None = None) -> int:
    """The peak a plan may reach on ``device``: its free memory less the headroom (a checkpointed plan's)."""
    hr = headroom or default_headroom(str(device), calibrated=calibrated)
    usable = hr.usable(device_free_memory(str(device)), checkpointed=True)
    if usable <= 0:
        raise ValueError(f"{device} has no memory free beyond the headroom ({hr.describe()})")
    return usable
