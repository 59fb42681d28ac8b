"""Training jobs: spec, data, metrics, checkpoints, the local reference trainer, sampling, export."""

from fusionnode.train.checkpoint import Checkpoint, CheckpointError, load_checkpoint, save_checkpoint
from fusionnode.train.data import (
    VOCAB_SIZE,
    BatchSource,
    Corpus,
    decode,
    encode,
    load_corpus,
    loss_scale,
    shard_ranges,
)
from fusionnode.train.export import export_checkpoint, load_model_from_checkpoint
from fusionnode.train.generate import generate
from fusionnode.train.local import (
    DivergenceError,
    LocalResult,
    build_job_model,
    evaluate,
    lm_loss,
    make_optimizer,
    train_local,
    train_step,
)
from fusionnode.train.metrics import MetricsWriter, read_metrics
from fusionnode.train.spec import JobSpec, lr_at, resolve_seq_len, weight_decay_for

__all__ = [
    "VOCAB_SIZE",
    "BatchSource",
    "Checkpoint",
    "CheckpointError",
    "Corpus",
    "DivergenceError",
    "JobSpec",
    "LocalResult",
    "MetricsWriter",
    "build_job_model",
    "decode",
    "encode",
    "evaluate",
    "export_checkpoint",
    "generate",
    "lm_loss",
    "load_checkpoint",
    "load_corpus",
    "load_model_from_checkpoint",
    "loss_scale",
    "lr_at",
    "make_optimizer",
    "read_metrics",
    "resolve_seq_len",
    "save_checkpoint",
    "shard_ranges",
    "train_local",
    "train_step",
    "weight_decay_for",
]
