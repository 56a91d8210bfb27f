"""Request and response models of the planner (POST /v1/plans, and a job's ``model`` block and plan).

The limits keep every figure the planner computes finite (docs/planner.md, "Limits"): no input
inside them makes it fail.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainyard.protocol.layout import Layout

Precision = Literal["bf16-mixed", "fp16-mixed", "fp32", "bf16"]
Optimizer = Literal["adamw", "adam", "sgd-momentum", "sgd"]
IntraLink = Literal["nvlink3", "nvlink4", "nvlink5", "pcie4", "pcie5", "loopback"]
InterLink = Literal["infiniband", "roce", "ethernet", "loopback"]

PLAN_EXAMPLE: dict[str, Any] = {
    "model": {"layers": 32, "hidden": 4096, "vocab": 32000, "heads": 32, "seq_len": 4096,
              "global_batch": 512, "micro_batch": 2, "activation_checkpointing": True},
    "gpu_kind": "h100",
    "gpus_per_node": 8,
    "gpu_counts": [8, 16, 32, 64, 128],
}


class BytesPerParamIn(BaseModel):
    """Bytes per parameter, overriding what precision and optimizer imply."""

    model_config = ConfigDict(extra="forbid")

    weights: float = Field(ge=0, le=64, description="Bytes per parameter of the weights, 0 to 64.")
    grads: float = Field(ge=0, le=64, description="Bytes per parameter of the gradients, 0 to 64.")
    optimizer: float = Field(ge=0, le=256, description=(
        "Bytes per parameter of the optimizer states plus fp32 master weights, 0 to 256."))
    master: float | None = Field(default=None, ge=0, le=64, description=(
        "Bytes per parameter, 0 to 64, of optimizer's: the fp32 master weights: DDP's gradients (buckets, "
        "wire) are this wide, and it adds "
        "autocast's copies of the weights."))

    @model_validator(mode="after")
    def _master(self) -> BytesPerParamIn:
        if self.master is not None and self.master > self.optimizer:
            raise ValueError("master weights are part of the optimizer bytes: master <= optimizer")
        return self


class ModelIn(BaseModel):
    """What is trained: ``params`` or the transformer shape (layers, hidden, vocab), the precision
    and optimizer, and the batch."""

    model_config = ConfigDict(extra="forbid")

    params: float | None = Field(default=None, ge=1, le=1e15,
                                 description="Parameters, 1 to 1e15; default: from the shape.")
    layers: int | None = Field(default=None, ge=1, le=100_000, description="Transformer layers, 1 to 100,000.")
    hidden: int | None = Field(default=None, ge=1, le=1_000_000, description="Hidden size, 1 to 1,000,000.")
    vocab: int | None = Field(default=None, ge=0, le=100_000_000, description="Vocabulary size, 0 to 100,000,000.")
    heads: int | None = Field(default=None, ge=1, le=100_000,
                              description="Attention heads, 1 to 100,000; default: hidden / 128.")
    seq_len: int = Field(ge=1, le=10_000_000, description="Tokens per sample, 1 to 10,000,000.")
    precision: Precision = "bf16-mixed"
    optimizer: Optimizer = "adamw"
    bytes_per_param: BytesPerParamIn | None = None
    activation_bytes_per_sample: float | None = Field(
        default=None, ge=0, le=1e15,
        description="Measured activation memory of one sample in bytes, 0 to 1e15; default: estimated from the shape.")
    activation_checkpointing: bool = Field(default=False, description="Recompute activations in backward.")
    flash_attention: bool = Field(default=True, description="No s x s attention scores kept (SDPA/flash).")
    micro_batch: int | None = Field(
        default=None, ge=1, le=1_000_000, description="Samples per GPU per forward/backward, 1 to 1,000,000; "
        "default: the whole per-replica share of the global batch (no gradient accumulation).")
    mfu: float = Field(default=0.4, ge=0.001, le=1,
                       description="Model FLOPs utilisation of the compute alone, 0.001 to 1.")

    @model_validator(mode="after")
    def _size(self) -> ModelIn:
        if self.params is None and (self.layers is None or self.hidden is None or self.vocab is None):
            raise ValueError("give params, or layers, hidden and vocab to derive it")
        if self.activation_bytes_per_sample is None and (self.layers is None or self.hidden is None):
            raise ValueError("give activation_bytes_per_sample, or layers and hidden to estimate it")
        return self


class PlanModelIn(ModelIn):
    global_batch: int = Field(ge=1, le=100_000_000, description="Samples per optimizer step, 1 to 100,000,000.")


class HardwareIn(BaseModel):
    """Figures that win over node labels and the catalog (docs/planner.md, "Defaults"). Bandwidths
    are nominal: the link's efficiency applies unless ``link_efficiency`` is set (1 for measured)."""

    model_config = ConfigDict(extra="forbid")

    gpu_memory_gib: float | None = Field(default=None, ge=0.001, le=100_000,
                                         description="Memory of one GPU, GiB, 0.001 to 100,000.")
    peak_tflops: float | None = Field(default=None, ge=1e-6, le=1e6,
                                      description="Dense 16-bit peak of one GPU, TFLOP/s, 1e-6 to 1e6.")
    intra_link: IntraLink | None = None
    intra_gbytes_per_s: float | None = Field(default=None, ge=0.001, le=100_000,
                                             description="Per GPU and direction, GB/s, 0.001 to 100,000.")
    intra_latency_us: float | None = Field(default=None, ge=0, le=1_000_000,
                                           description="Latency inside a node, microseconds, 0 to 1,000,000.")
    inter_link: InterLink | None = None
    inter_gbits_per_s: float | None = Field(default=None, ge=0.001, le=10_000_000,
                                            description="All the node's NICs together, Gbit/s, 0.001 to 10,000,000.")
    inter_latency_us: float | None = Field(default=None, ge=0, le=1_000_000,
                                           description="Latency between nodes, microseconds, 0 to 1,000,000.")
    link_efficiency: float | None = Field(default=None, ge=0.01, le=1,
                                          description="Share of nominal bandwidth reached, 0.01 to 1 (1: measured).")
    memory_reserve: float | None = Field(default=None, ge=0, le=0.99,
                                         description="Share of GPU memory left to CUDA, NCCL, fragmentation, "
                                         "0 to 0.99.")


class JobModelIn(ModelIn):
    """A job's ``model`` block: the batch follows from micro_batch, the layout's grad_accum_steps and
    the job's GPUs when global_batch is not given (and must agree with them when it is)."""

    global_batch: int | None = Field(default=None, ge=1, le=100_000_000,
                                     description="Samples per optimizer step, 1 to 100,000,000; default: derived.")
    hardware: HardwareIn | None = None


class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [PLAN_EXAMPLE]})

    model: PlanModelIn
    gpu_kind: str = Field(min_length=1, max_length=128, description=(
        "A catalog kind (h100, h200, a100-sxm, l40s, ...) or a kind the cluster's nodes report: their "
        "labels then set the link figures."))
    gpus_per_node: int = Field(ge=1, le=64, description="GPUs per node, 1 to 64.")
    gpu_counts: list[Annotated[int, Field(ge=1, le=1_000_000)]] | None = Field(
        default=None, min_length=1, max_length=64, description="Default: 1, 2, 4, ... 64 whole nodes.")
    layouts: list[Layout] | None = Field(default=None, min_length=1, max_length=16,
                                         description="Default: ddp, fsdp, hsdp, tp_dp (tensor parallel over a node).")
    hardware: HardwareIn | None = None
    min_efficiency: float | None = Field(default=None, ge=0, le=1, description=(
        "Scaling efficiency the recommendation keeps at least; default: the server's setting."))


class MemoryOut(BaseModel):
    model_state_bytes: int = Field(description="This GPU's share of weights, gradients, optimizer state.")
    buffers_bytes: int = Field(description="DDP buckets; FSDP gathered units; gradients accumulated unsharded.")
    activations_bytes: int
    total_bytes: int
    usable_bytes: int = Field(description="GPU memory less the reserve.")
    fits: bool


class TrafficOut(BaseModel):
    """What one GPU sends per optimizer step."""

    intra_node_bytes: int
    inter_node_bytes: int
    collectives: int


class PlanRowOut(BaseModel):
    layout: Layout = Field(description="As the runtime would apply it (grad_accum_steps derived from the batch).")
    gpus: int
    nodes: int
    gpus_per_node: int
    data_parallel: int
    micro_batch: int | None
    memory: MemoryOut | None
    traffic: TrafficOut | None
    compute_s: float | None
    comm_s: float | None = Field(description="Every collective one after the other.")
    exposed_comm_s: float | None = Field(description="What overlap with compute leaves.")
    step_s_no_overlap: float | None
    step_s: float | None
    tokens_per_s: float | None
    tokens_per_s_per_gpu: float | None
    scaling_efficiency: float | None = Field(description="Tokens/s per GPU against this layout's smallest "
                                             "count that runs.")
    feasible: bool
    problem: str | None = Field(description="Why this layout cannot run on this count.")


class LinkOut(BaseModel):
    name: str
    gbytes_per_s: float = Field(description="Achieved, per GPU and direction (inter-node: the GPU's share).")
    latency_us: float


class HardwareOut(BaseModel):
    gpu_kind: str
    memory_bytes: int
    usable_memory_bytes: int
    peak_tflops: float
    gpus_per_node: int
    intra_node: LinkOut
    inter_node: LinkOut
    sources: dict[str, str] = Field(description="Where each figure came from.")
    cluster_nodes: int = Field(description="Nodes of the cluster with this GPU kind whose labels were read.")


class ModelOut(BaseModel):
    params: float
    bytes_per_param: dict[str, float]
    model_state_bytes: int
    activation_bytes_per_sample: float
    tokens_per_step: float
    flops_per_token: float


class RecommendationOut(BaseModel):
    layout: Layout | None
    gpus: int | None
    tokens_per_s: float | None
    reason: str


class PlanOut(BaseModel):
    model: ModelOut
    hardware: HardwareOut
    rows: list[PlanRowOut]
    recommendation: RecommendationOut
    min_efficiency: float
    notes: list[str] = Field(description="Labels ignored, assumptions made.")


class JobWarningOut(BaseModel):
    kind: str = Field(description="efficiency | throughput")
    message: str
    better_gpus: int


class JobPlanOut(BaseModel):
    """The plan stored with a job: its layout over the counts it is compared with."""

    model: ModelOut
    hardware: HardwareOut
    row: PlanRowOut = Field(description="The job's own count.")
    rows: list[PlanRowOut]
    warnings: list[JobWarningOut]
    min_efficiency: float
    notes: list[str]
