"""What each mode runs: models and sizes, strategies, sweeps, repeats.

``quick`` is sized for a 2-core CPU (under 10 minutes, real tensors); ``full``
uses paper-like sizes (batch 32-128, 224x224) and is meant for a GPU (on a CPU
it measures peaks on fake tensors and skips the step-time table); ``tiny`` is
the smoke test's configuration.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: Table 1 columns, in order (dp2 finds the same optimum as dp and appears in Table 2).
STRATEGIES = ("none", "sqrt", "chen-greedy", "dp", "linear")
#: Solvers timed in Table 2.
TIMED_SOLVERS = ("dp", "dp2", "linear")
#: Plans drawn in figure (a); "optimal" is dp's plan.
TIMELINE_PLANS = ("none", "sqrt", "dp")


@dataclass(frozen=True)
class ModelConfig:
    """One row of Tables 1-3: a zoo model and the ``zoo.get`` keyword arguments."""

    label: str
    zoo_name: str
    kwargs: dict
    kind: str = "CNN"

    def describe(self) -> str:
        kw = dict(self.kwargs)
        b = kw.pop("batch_size", None)
        s = kw.pop("input_size", None)
        if self.zoo_name == "gpt":
            return f"batch {b}, seq {s}, " + ", ".join(f"{k} {v}" for k, v in kw.items() if k != "vocab")
        if self.zoo_name == "mlp":
            return f"batch {b}, " + ", ".join(f"{k} {v}" for k, v in kw.items())
        return f"batch {b}, {s}x{s}" + "".join(f", {k} {v}" for k, v in kw.items())


@dataclass(frozen=True)
class ModeConfig:
    """Everything one mode runs."""

    name: str
    models: tuple[ModelConfig, ...]
    measure: str  # "real" (run the step) or "fake" (fake tensors, same bytes, nothing allocated)
    timing_rounds: int  # interleaved rounds per plan for Table 3 (0: skip the table)
    solver_repeats: int  # runs per solver for Table 2 (median)
    timeline_model: ModelConfig
    sweep_model: str
    sweep_kwargs: dict
    sweep_batches: tuple[int, ...]
    scaling_sizes: dict = field(default_factory=dict)
    scaling_repeats: int = 3


def _cnn(label, name, batch, size):
    return ModelConfig(label, name, dict(batch_size=batch, input_size=size))


_CNN_NAMES = (("VGG-16", "vgg16"), ("VGG-19", "vgg19"), ("ResNet-50", "resnet50"), ("ResNet-101", "resnet101"),
              ("ResNet-152", "resnet152"), ("DenseNet-121", "densenet121"), ("MobileNetV2", "mobilenet_v2"))

QUICK = ModeConfig(
    name="quick",
    models=tuple(_cnn(lbl, nm, 4, 64) for lbl, nm in _CNN_NAMES) + (
        ModelConfig("GPT decoder", "gpt", dict(batch_size=4, input_size=128, depth=4, width=128, heads=4,
                                               seq_len=128, vocab=1000), kind="transformer"),),
    measure="real",
    timing_rounds=3,
    solver_repeats=5,
    timeline_model=_cnn("ResNet-50", "resnet50", 4, 64),
    sweep_model="resnet50",
    sweep_kwargs=dict(input_size=64),
    sweep_batches=(2, 4, 8, 16),
    scaling_sizes={"dp": [50, 100, 200, 400], "dp2": [100, 300, 1000, 3000],
                   "linear": [1000, 10_000, 100_000, 1_000_000]},
)

FULL = ModeConfig(
    name="full",
    models=(
        _cnn("VGG-16", "vgg16", 64, 224), _cnn("VGG-19", "vgg19", 64, 224),
        _cnn("ResNet-50", "resnet50", 64, 224), _cnn("ResNet-101", "resnet101", 64, 224),
        _cnn("ResNet-152", "resnet152", 32, 224), _cnn("DenseNet-121", "densenet121", 64, 224),
        _cnn("MobileNetV2", "mobilenet_v2", 128, 224),
        ModelConfig("GPT decoder", "gpt", dict(batch_size=8, input_size=1024, depth=12, width=768, heads=12,
                                               seq_len=1024), kind="transformer"),
    ),
    measure="real",
    timing_rounds=5,
    solver_repeats=7,
    timeline_model=_cnn("ResNet-50", "resnet50", 32, 224),
    sweep_model="resnet50",
    sweep_kwargs=dict(input_size=224),
    sweep_batches=(16, 32, 64, 128),
    scaling_sizes={"dp": [100, 200, 500, 1000, 2000], "dp2": [300, 1000, 3000, 10_000, 20_000],
                   "linear": [1000, 10_000, 100_000, 1_000_000, 3_000_000]},
)

_TINY_MLP = ModelConfig("MLP", "mlp", dict(batch_size=512, input_size=32, width=128, depth=6), kind="MLP")

TINY = ModeConfig(
    name="tiny",
    models=(_TINY_MLP,),
    measure="real",
    timing_rounds=1,
    solver_repeats=1,
    timeline_model=_TINY_MLP,
    sweep_model="mlp",
    sweep_kwargs=dict(input_size=32, width=128, depth=6),
    sweep_batches=(256, 512),
    scaling_sizes={"dp": [20, 40], "dp2": [20, 40], "linear": [20, 40]},
    scaling_repeats=1,
)

MODES = {"quick": QUICK, "full": FULL, "tiny": TINY}
