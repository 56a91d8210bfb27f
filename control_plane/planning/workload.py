"""What is trained: parameters, bytes per parameter, activations per sample, batch. Pure: standard
library only. The formulas are derived in docs/planner.md, "Model"."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from control_plane.planning.errors import PlanningError

PRECISIONS: Final[dict[str, tuple[float, float, float, float]]] = {
    # weights, gradients, fp32 master weights, bytes per optimizer state
    "bf16-mixed": (2, 2, 4, 4),
    "fp16-mixed": (2, 2, 4, 4),
    "fp32": (4, 4, 0, 4),
    "bf16": (2, 2, 0, 2),
}
"""Bytes per parameter by precision. Mixed precision (ZeRO's accounting): 16-bit weights and
gradients for compute and communication, fp32 master weights and fp32 optimizer states."""

OPTIMIZER_STATES: Final[dict[str, int]] = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}
"""Optimizer states per parameter (Adam: first and second moments)."""

LIMITS: Final[dict[str, tuple[float, float]]] = {
    "params": (1, 1e15), "seq_len": (1, 1e7), "global_batch": (1, 1e8), "micro_batch": (1, 1e6),
    "bytes_per_param": (0, 256), "activation_bytes_per_sample": (0, 1e15), "mfu": (1e-3, 1),
    "layers": (1, 1e5), "hidden": (1, 1e6), "vocab": (0, 1e8), "heads": (1, 1e5),
}
"""What the planner accepts (the API's schema says the same): inside these, every figure it computes
is finite."""

DEFAULT_UNITS: Final = 32
"""FSDP units (wrapped blocks) assumed when the shape is not given: the largest unit is 1/32 of
the parameters."""
DEFAULT_HEAD_DIM: Final = 128
"""heads = hidden / 128 when the shape gives no head count."""


@dataclass(frozen=True, kw_only=True)
class BytesPerParam:
    weights: float
    grads: float
    optimizer: float
    """Optimizer states plus fp32 master weights, if any."""
    master: float = 0.0
    """Of ``optimizer``, the fp32 master weights of mixed precision. DDP runs mixed precision under
    autocast: its parameters are the master copy, so its gradients are that wide (in the reducer's
    buckets and on the wire), and autocast's 16-bit copies of the weights live from forward to
    backward (measured: docs/planner.md, "Checked on a GPU")."""

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def replicated_grads(self) -> float:
        """Bytes of one gradient under DDP (and the data-parallel part of tp_dp)."""
        return self.master or self.grads

    @property
    def autocast_copies(self) -> float:
        """Bytes per parameter of the 16-bit weight copies autocast keeps for backward under DDP."""
        return self.weights if self.master else 0.0


def bytes_per_param(precision: str, optimizer: str) -> BytesPerParam:
    """Mixed-precision Adam: 2 + 2 + (4 master + 4 + 4 moments) = 16 bytes per parameter."""
    if precision not in PRECISIONS:
        raise PlanningError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}", field="precision")
    if optimizer not in OPTIMIZER_STATES:
        raise PlanningError(f"optimizer {optimizer!r} is not one of {', '.join(OPTIMIZER_STATES)}",
                            field="optimizer")
    weights, grads, master, state = PRECISIONS[precision]
    return BytesPerParam(weights=weights, grads=grads, optimizer=master + OPTIMIZER_STATES[optimizer] * state,
                         master=master)


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """A GPT-style decoder: per layer attention (4h^2 + 4h) and a 4h MLP (8h^2 + 5h) plus two layer
    norms (4h); token embeddings tied with the output layer; no learned positions (rotary)."""

    layers: int
    hidden: int
    vocab: int = 0
    heads: int | None = None

    @property
    def layer_params(self) -> float:
        return 12.0 * self.hidden**2 + 13.0 * self.hidden

    @property
    def embedding_params(self) -> float:
        return float(self.vocab) * self.hidden

    @property
    def params(self) -> float:
        return self.layers * self.layer_params + self.embedding_params

    @property
    def head_count(self) -> int:
        return self.heads or max(1, self.hidden // DEFAULT_HEAD_DIM)


def layer_activation_bytes(shape: TransformerShape, seq_len: int, *, tp: int, flash: bool) -> float:
    """Bytes one layer keeps for backward per sample, 16-bit activations (Korthikanti et al., 2022,
    "Reducing Activation Recomputation in Large Transformer Models", eq. 1 and 2):
    s*h*(34 + 5*a*s/h) without tensor parallelism, s*h*(10 + 24/t + 5*a*s/(h*t)) with degree t
    (no sequence parallelism). Flash attention keeps no s x s score matrices: the a*s term drops."""
    s, h = float(seq_len), float(shape.hidden)
    scores = 0.0 if flash else 5.0 * shape.head_count * s * s / tp
    return s * h * (10.0 + 24.0 / tp) + scores


@dataclass(frozen=True, kw_only=True)
class Workload:
    """One training run's model and batch, as the planner needs it."""

    params: float
    bytes: BytesPerParam
    seq_len: int
    global_batch: int
    """Samples (sequences) per optimizer step."""
    micro_batch: int | None = None
    """Samples per GPU per forward/backward; None: the whole per-replica share (no accumulation)."""
    shape: TransformerShape | None = None
    activation_bytes_per_sample: float | None = None
    """Measured activation memory of one sample (used as is); None: estimated from the shape."""
    activation_checkpointing: bool = False
    flash_attention: bool = True
    activation_dtype_bytes: int = 2
    mfu: float = 0.4
    """Model FLOPs utilisation of the compute alone (communication is added on top)."""

    def __post_init__(self) -> None:
        shape = self.shape
        for name, value in (
            ("params", self.params), ("seq_len", self.seq_len), ("global_batch", self.global_batch),
            ("micro_batch", self.micro_batch), ("activation_bytes_per_sample", self.activation_bytes_per_sample),
            ("mfu", self.mfu), ("bytes_per_param", self.bytes.weights), ("bytes_per_param", self.bytes.grads),
            ("bytes_per_param", self.bytes.optimizer), ("bytes_per_param", self.bytes.master),
            ("layers", shape.layers if shape else None),
            ("hidden", shape.hidden if shape else None), ("vocab", shape.vocab if shape else None),
            ("heads", shape.heads if shape else None),
        ):
            low, high = LIMITS[name]
            if value is not None and not low <= value <= high:  # NaN fails too
                raise PlanningError(f"{name} must be in [{low:g}, {high:g}], got {value:g}", field=name)
        if self.bytes.master > self.bytes.optimizer:
            raise PlanningError("master weights are part of the optimizer bytes: master <= optimizer",
                                field="bytes_per_param")
        if self.activation_bytes_per_sample is None and self.shape is None:
            raise PlanningError("give activation_bytes_per_sample, or the transformer shape (layers and hidden) "
                                "to estimate it", field="activation_bytes_per_sample")
        if self.shape is not None and self.shape.heads and self.shape.hidden % self.shape.heads:
            raise PlanningError(f"hidden {self.shape.hidden} is not a multiple of heads {self.shape.heads}",
                                field="heads", hidden=self.shape.hidden, heads=self.shape.heads)

    @property
    def tokens_per_step(self) -> float:
        return float(self.global_batch) * self.seq_len

    @property
    def flops_per_token(self) -> float:
        """6 x params (forward 2, backward 4); 8 x params when activations are recomputed in backward."""
        return (8.0 if self.activation_checkpointing else 6.0) * self.params

    @property
    def backward_share(self) -> float:
        """Share of compute in backward (recomputation included), the window DDP overlaps into."""
        return 6.0 / 8.0 if self.activation_checkpointing else 4.0 / 6.0

    @property
    def model_state_bytes(self) -> float:
        return self.params * self.bytes.total

    @property
    def units(self) -> int:
        """FSDP units: one per layer plus the root (embeddings) when the shape is known."""
        return self.shape.layers + 1 if self.shape else DEFAULT_UNITS

    @property
    def root_params(self) -> float:
        """Parameters of the root unit (the embeddings), which FSDP2 keeps gathered from its forward
        through its backward. Without a shape the model is taken as blocks only; a parameter count
        given beside a shape bounds it."""
        return min(self.shape.embedding_params, self.params) if self.shape else 0.0

    @property
    def largest_unit_params(self) -> float:
        if self.shape is None:
            return self.params / DEFAULT_UNITS
        return max(self.shape.layer_params, self.shape.embedding_params)

    def activations_per_sample(self, tp: int = 1) -> float:
        """Peak activation bytes of one sample on one GPU. A measured figure is scaled under tensor
        parallelism by the shape-free part of Korthikanti's ratio, (10 + 24/t) / 34."""
        if self.activation_bytes_per_sample is not None:
            return self.activation_bytes_per_sample * (10.0 + 24.0 / tp) / 34.0
        shape = self.shape
        assert shape is not None  # __post_init__
        scale = self.activation_dtype_bytes / 2.0
        layer = layer_activation_bytes(shape, self.seq_len, tp=tp, flash=self.flash_attention) * scale
        # fp32 logits for the loss, split over the vocabulary under tensor parallelism.
        logits = 4.0 * self.seq_len * shape.vocab / tp
        if self.activation_checkpointing:
            # Each layer's input is kept; one layer's activations live again while it is recomputed.
            inputs = shape.layers * self.seq_len * shape.hidden * float(self.activation_dtype_bytes)
            return inputs + layer + logits
        return shape.layers * layer + logits
