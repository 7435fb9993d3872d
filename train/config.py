"""Training recipes: one frozen dataclass for everything a run needs, and the named presets."""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, Optional

from jaxllm.config import BYTE_VOCAB, PRESETS, ModelConfig, RopeScaling
from jaxllm.positions import check_positions


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. Defaults are the Pythia optimiser recipe (docs/METHODS.md §2): AdamW
    (0.9, 0.95, 1e-8), lr 6e-4, 1% linear warm-up, cosine to 10% of peak, weight decay 0.1 off
    biases and norms, gradient clipping at 1.0, bfloat16 compute over float32 master weights."""

    model: ModelConfig
    # The sink variant is the model's (ModelConfig.sink); a value here sets it (the CLI's
    # --sink, a recipe's sink=...), None keeps it. Afterwards ``sink`` reads the model's.
    sink: Optional[Literal["none", "learnable", "zero"]] = None
    seq_len: int = 2048  # tokens per sample, the sink token included
    batch_size: int = 256  # sequences per optimizer step (all devices, all micro-batches)
    grad_accum: int = 1  # micro-batches per step
    steps: int = 143_000
    lr: float = 6e-4
    warmup_frac: float = 0.01
    final_lr_frac: float = 0.1
    weight_decay: float = 0.1
    clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    # The training step's compute dtype (mixed precision; master weights stay float32). Not a
    # copy of model.dtype: that is the saved model's compute dtype for inference, which the
    # evaluations run in (float32 for every recipe here), whatever the step computed in.
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    # Rows (tokens) of logits made at once by the loss (train.step.chunked_cross_entropy): the
    # [tokens, vocabulary] logits and their softmax exist a chunk at a time, forward and
    # backward; 0: all at once.
    loss_chunk: int = 2048
    # Recompute each block's activations in the backward pass (ModelConfig.remat): a step
    # holds one block's activations instead of every layer's, for about a third more compute.
    remat: bool = False
    # The blocks' parameters stacked along a leading layer axis and the forward a scan over
    # them (jaxllm.model.stack_layers; MaxText's scan_layers): one block traced and compiled
    # whatever the depth. Without remat the scan keeps each block's matmul outputs and
    # recomputes the rest. Checkpoints keep the stacked form; the exported model is per layer.
    scan_layers: bool = False
    seed: int = 0
    data: str = "builtin"  # see train.data.SOURCES
    tokenizer: str = "byte"
    holdout: float = 0.01  # share of samples kept out of training (evaluation)
    mesh_data: int = 0  # devices on the "data" axis; 0: all that fsdp leaves
    mesh_fsdp: int = 1  # devices on the "fsdp" axis (parameters and optimizer state sharded)
    log_every: int = 10
    ckpt_every: int = 500
    keep: int = 3  # checkpoints kept
    sink_eval_every: int = 0  # >0: sink metric and window/streaming ppl on held-out text
    peak_tflops: float = 0.0  # per device, for MFU; 0: look the device up (unknown -> no MFU)
    # PoSE (train.pose_sampling): > 0 trains seq_len-token samples whose position ids skip up to this
    # target length; each sample is drawn from pose_span x seq_len tokens of text (the
    # authors' 5 x Lc).
    pose_target: int = 0
    pose_span: int = 5
    # Fine-tuning: start from this model directory's weights instead of random ones (a new
    # learnable sink's embedding row keeps its random init); the optimiser starts fresh.
    init_from: str = ""
    # The finished model's files: its weights' dtype, and files of at most this many MiB (0:
    # one file), e.g. bfloat16 in 16 MiB files to come back from a lent GPU machine.
    export_dtype: Literal["float32", "bfloat16"] = "float32"
    export_shard_mib: int = 0

    def __post_init__(self):
        if self.sink not in (None, "none", "learnable", "zero"):
            raise ValueError(f"unknown sink {self.sink!r}; choose none, learnable or zero")
        if self.export_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"export_dtype must be float32 or bfloat16, got "
                             f"{self.export_dtype!r}")
        if self.export_shard_mib < 0:
            raise ValueError(f"export_shard_mib must be >= 0 (0: one file), got "
                             f"{self.export_shard_mib}")
        for name in ("seq_len", "batch_size", "grad_accum", "steps", "log_every", "ckpt_every",
                     "keep", "mesh_fsdp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size {self.batch_size} must be a multiple of grad_accum "
                             f"{self.grad_accum} (equal micro-batches)")
        if not 0 <= self.holdout < 1:
            raise ValueError(f"holdout must lie in [0, 1), got {self.holdout}")
        for name, ok, what in (("lr", self.lr > 0, "> 0"), ("clip", self.clip > 0, "> 0"),
                               ("eps", self.eps > 0, "> 0"),
                               ("weight_decay", self.weight_decay >= 0, ">= 0"),
                               ("warmup_frac", 0 <= self.warmup_frac <= 1, "in [0, 1]"),
                               ("final_lr_frac", 0 <= self.final_lr_frac <= 1, "in [0, 1]"),
                               ("b1", 0 <= self.b1 < 1, "in [0, 1)"),
                               ("b2", 0 <= self.b2 < 1, "in [0, 1)")):
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)}")
        check_positions(self.model, self.seq_len)  # a training sample is one dense pass
        if self.pose_target:
            if self.pose_target <= self.seq_len:
                raise ValueError(f"pose_target (LT) {self.pose_target} must exceed seq_len (Lc) "
                                 f"{self.seq_len}")
            if self.pose_span < 1:
                raise ValueError(f"pose_span must be >= 1, got {self.pose_span}")
            check_positions(self.model, self.pose_target)
        # The model records its sink variant, so streaming and saving use it (ModelConfig.sink):
        # one setting, which ``sink`` reads back.
        if self.sink is not None and self.model.sink != self.sink:
            object.__setattr__(self, "model", dataclasses.replace(self.model, sink=self.sink))
        object.__setattr__(self, "sink", self.model.sink)

    @property
    def warmup_steps(self) -> int:
        return max(1, round(self.warmup_frac * self.steps))

    @property
    def tokens_per_step(self) -> int:
        return self.batch_size * self.seq_len

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["model"] = self.model.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TrainConfig fields {unknown}; known: {sorted(known)}")
        d["model"] = ModelConfig.from_dict(d["model"])
        return cls(**d)

    def override(self, assignments: list[str]) -> "TrainConfig":
        """``["lr=1e-3", "model.hidden_size=256", ...]`` applied to a copy (values parsed as
        the field's type)."""
        top, model = {}, {}
        for a in assignments:
            key, sep, value = a.partition("=")
            if not sep:
                raise ValueError(f"override {a!r} is not KEY=VALUE (e.g. lr=3e-4 or "
                                 f"model.num_layers=4)")
            if key.startswith("model."):
                model[key[6:]] = _parse(ModelConfig, key[6:], value)
            else:
                top[key] = _parse(TrainConfig, key, value)
        if "model" in top:
            raise ValueError("set model fields one by one: model.FIELD=VALUE")
        cfg = dataclasses.replace(self.model, **_rederive(self.model, model)) if model else \
            self.model
        top.setdefault("sink", None)  # the (new) model's, unless sink=... is given
        return dataclasses.replace(self, model=cfg, **top)


def _rederive(old: ModelConfig, new: dict) -> dict:
    """Fields derived from others follow them unless set too: head_dim (hidden / heads),
    num_kv_heads (= num_heads for multi-head attention) and intermediate_size (4 x hidden), each
    only where the old value was the derived one (an explicit GQA ratio or MLP width stays)."""
    out = dict(new)
    hidden, heads = out.get("hidden_size", old.hidden_size), out.get("num_heads", old.num_heads)
    if "head_dim" not in out and old.head_dim == old.hidden_size // old.num_heads:
        out["head_dim"] = 0  # derived again in ModelConfig.__post_init__
    if "num_kv_heads" not in out and old.num_kv_heads == old.num_heads:
        out["num_kv_heads"] = heads
    if "intermediate_size" not in out and old.intermediate_size == 4 * old.hidden_size:
        out["intermediate_size"] = 4 * hidden
    return out


def parse_rope_scaling(value: str) -> Optional[RopeScaling]:
    """``none`` or ``KIND:FACTOR[:ORIGINAL_LEN]``, e.g. ``yarn:8:128`` (``--set
    model.rope_scaling=...``)."""
    if value.lower() == "none":
        return None
    kind, _, rest = value.partition(":")
    factor, _, original = rest.partition(":")
    try:
        return RopeScaling(kind, float(factor), original_max_len=int(original or 0))
    except ValueError as e:
        if "could not convert" in str(e) or "invalid literal" in str(e):
            raise ValueError(f"model.rope_scaling takes none or KIND:FACTOR[:ORIGINAL_LEN] "
                             f"(e.g. yarn:8:128), got {value!r}") from None
        raise


def _parse(cls, name: str, value: str) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if name not in fields:
        raise ValueError(f"{cls.__name__} has no field {name!r}; fields: {', '.join(fields)}")
    current = getattr(RECIPES["tiny"] if cls is TrainConfig else RECIPES["tiny"].model, name)
    if cls is ModelConfig and name == "rope_scaling":
        return parse_rope_scaling(value)
    if isinstance(current, bool):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"{name} takes true or false, got {value!r}")
        return value.lower() in ("true", "1")
    for typ in (int, float):
        if isinstance(current, typ):
            try:
                return typ(value)
            except ValueError:
                raise ValueError(f"{name} takes a{'n integer' if typ is int else ' number'}, got "
                                 f"{value!r}") from None
    return value


_TINY = ModelConfig.gpt_neox(vocab_size=BYTE_VOCAB, hidden_size=64, num_layers=2, num_heads=4,
                             max_seq_len=128)
RECIPES: dict[str, TrainConfig] = {
    # The paper's setting: Pythia-160M, the Pythia recipe, the StreamingLLM authors' batch 256.
    "pythia-160m": TrainConfig(model=PRESETS["pythia-160m"], tokenizer="byte", data="stdlib"),
    # CPU-sized: the pythia-14m shapes on bytes (~1.2M parameters).
    "pythia-14m": TrainConfig(model=dataclasses.replace(PRESETS["pythia-14m"], max_seq_len=512),
                              seq_len=512, batch_size=32, steps=3000, lr=2e-3, data="stdlib",
                              dtype="float32", ckpt_every=500, log_every=20),
    # The embedded default model (jaxllm/models/): ~1.9M parameters, byte-level, trained on the
    # standard library's source on the 2-core CPU in ~25 minutes per variant.
    "embedded": TrainConfig(model=ModelConfig.gpt_neox(vocab_size=BYTE_VOCAB, hidden_size=192,
                                                       num_layers=4, num_heads=4,
                                                       max_seq_len=256),
                            seq_len=256, batch_size=16, steps=1200, lr=2e-3, data="stdlib",
                            dtype="float32", ckpt_every=100, log_every=10, sink_eval_every=200),
    # One GPU: the scale at which attention sinks are probed (the sink-emergence issue). A
    # ~6.4M-parameter byte-level GPT-NeoX (8 layers, hidden 256, 4 heads of 64, rotary on 25%)
    # on 512-byte samples of the `site` corpus; 32K tokens per step, many steps (sinks follow
    # optimisation steps as much as tokens, docs/METHODS.md §2). `steps` is set per run by the
    # device time at hand (docs/RESULTS.md records the value used).
    "gpu-6m": TrainConfig(model=ModelConfig.gpt_neox(vocab_size=BYTE_VOCAB, hidden_size=256,
                                                     num_layers=8, num_heads=4,
                                                     max_seq_len=512),
                          seq_len=512, batch_size=64, steps=8000, lr=2e-3, warmup_frac=0.02,
                          data="site", dtype="bfloat16", ckpt_every=1000, log_every=100,
                          sink_eval_every=1000),
    # The sink-emergence recipe: a 10.9M-parameter byte-level GPT-NeoX (6 layers, hidden 384,
    # 6 heads of 64) on 1,024-byte samples of the `site` corpus, 262K tokens a step: 3,815 steps
    # are 1B tokens (78.5 MFLOPs a token: 16 minutes per variant at 25% of an H100's 989 TFLOPs,
    # so a 15-minute session trains part of it; docs/RESULTS.md). Sinks grow with the learning
    # rate, weight decay and tokens ("When Attention Sink Emerges in Language Models", Gu et al.
    # 2024, Section 5): both at the high end of stable. XLA:CPU counts 50 GiB for the step
    # (benchmarks/train_memory.py; bfloat16 on a GPU needs less), so one micro-batch. The weights
    # come back from the lent machine in bfloat16, in files of at most 15 MiB.
    "gpu-sinks": TrainConfig(model=ModelConfig.gpt_neox(vocab_size=BYTE_VOCAB, hidden_size=384,
                                                        num_layers=6, num_heads=6,
                                                        max_seq_len=1024),
                             seq_len=1024, batch_size=256, steps=3815, lr=1e-3,
                             warmup_frac=0.02, weight_decay=0.1, data="site",
                             dtype="bfloat16", ckpt_every=500, log_every=50,
                             sink_eval_every=500, export_dtype="bfloat16",
                             export_shard_mib=15),
    # Seconds per run: tests and smoke checks.
    "tiny": TrainConfig(model=_TINY, seq_len=128, batch_size=8, steps=200, lr=3e-3,
                        dtype="float32", ckpt_every=100),
}


def recipe(name: str, overrides: list[str] = ()) -> TrainConfig:
    if name not in RECIPES:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(RECIPES)}")
    return RECIPES[name].override(list(overrides))
